"""Loading a trained model back from its run directory: the one road for generate, eval and quickstart.

    loaded = load_pretrained("runs/tiny")            # newest verified checkpoint
    loaded = load_pretrained("runs/tiny", step=400)  # exactly step 400, or a CheckpointError

A run directory (`training.checkpoint_dir`) holds `model_step_N.safetensors`, `optim_step_N.pt` and
`meta_step_N.json` per step; the meta carries the whole resolved config and the identity of the data the
model was trained on (tokenizer name, vocabulary hash, vocab size, EOS id). From those this module
rebuilds `Mamba3Transformer(config.model)`, loads the verified weights (sha256 checked against the meta
by `CheckpointManager`) and the tokenizer the model was trained with. The optimizer file is not read.
A run that averaged its weights (training.ema_decay) gives the average (average_step_N.safetensors):
`Pretrained.weights` and a note say which weights were loaded.

Every problem a user can fix is a `CheckpointError` naming the directory or file and the fix: a
directory that does not exist, one without checkpoints, a step that is not there (the message lists the
loadable steps), a corrupt or truncated file, a meta whose config no longer validates.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mamba3lite.checkpoint.manager import has_average
from mamba3lite.checkpoint.run_dir import RunDir
from mamba3lite.data_identity import DataIdentity, resolve_name
from mamba3lite.errors import CheckpointError, ConfigError
from mamba3lite.rundir import checkpoint_files


def recorded_tokenizer(recorded: str | None, run_dir: Path) -> str:
    """What `load_tokenizer` takes for the tokenizer a checkpoint's meta records: "gpt2" (also when none
    is recorded) as is; a relative path joined to the run directory (imported runs, and trained runs whose
    data has a tokenizer.json, record the copy they hold as "tokenizer.json", so the run directory can be
    moved and the dataset deleted); an absolute path as is (runs trained before runs kept a copy). The
    rule is `data_identity.resolve_name`, the one a dataset's manifest is read by too."""
    return resolve_name(recorded, run_dir)


@dataclass
class Pretrained:
    """A model loaded from a checkpoint, with everything needed to use it.

    model: `Mamba3Transformer` in eval mode on `device` (fp32 weights).
    config: the run's resolved `Config` (as saved in the meta).
    step: the optimizer step of the checkpoint; meta: the parsed meta file.
    tokenizer_name: what `load_tokenizer` takes ("gpt2" or a tokenizer.json path); vocab_hash: the
    sha256 of the vocabulary the training data was tokenized with (None for dummy-data runs).
    notes: human-readable remarks (e.g. a newer damaged checkpoint that was skipped).
    weights: which weights `model` holds: "trained" (the optimizer's), or e.g. "averaged weights (EMA,
    decay 0.99, 400 steps)" for a run that averaged them (`weights_description`).
    """

    model: torch.nn.Module
    config: Any
    step: int
    meta: dict
    run_dir: Path
    tokenizer_name: str
    vocab_hash: str | None
    notes: list[str]
    weights: str = "trained"

    @property
    def tokens_seen(self) -> int:
        return int(self.meta.get("tokens_seen", 0))

    def load_tokenizer(self):
        """The tokenizer the model was trained with; CheckpointError if it cannot be the model's."""
        from mamba3lite.tokenizer import load_recorded_tokenizer

        return load_recorded_tokenizer(
            self.tokenizer_name,
            self.vocab_hash,
            self.config.model.vocab_size,
            subject=f"the model in {self.run_dir} was trained with",
            error=CheckpointError,
        )


def resolve_device(text: str) -> torch.device:
    """`auto` (cuda when available, else cpu), `cpu`, `cuda` or `cuda:N`; ConfigError otherwise or when
    CUDA is asked for and absent."""
    if not (text in ("auto", "cpu", "cuda") or (text.startswith("cuda:") and text[5:].isdigit())):
        raise ConfigError(f"--device must be auto, cpu, cuda or cuda:N, got {text!r}")
    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if text.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"--device {text}: CUDA is not available here; use --device cpu")
    return torch.device(text)


def bind_scan(model: torch.nn.Module, scan_impl: str, device: torch.device) -> list[str]:
    """Bind the run's scan backend to `device`; returns notes. The backend is how the model is computed,
    not what, so a run trained with `triton` (on a GPU) that cannot use it here (a CPU) runs `chunked`,
    with a note saying so, rather than refusing to generate or evaluate."""
    try:
        model.set_scan_impl(scan_impl, device)
    except ConfigError as e:
        model.set_scan_impl("chunked", device)
        return [f"{e}; this command uses the chunked scan (same results)"]
    return []


def load_pretrained(
    run_dir: str | Path, step: int | None = None, device: str | torch.device = "cpu"
) -> Pretrained:
    """Load the model of checkpoint `step` (default: the newest one that verifies) from `run_dir`.

    The newest-step search skips damaged newer checkpoints (each noted in `Pretrained.notes`); an
    explicit `step` loads exactly that step or raises. Weights are verified against the meta's sha256.
    """
    run = RunDir(run_dir).check()
    notes: list[str] = []
    # The step (`RunDir.resolve`); a training run writing into the directory may delete the newest step
    # (retention) between the choice and the load: then choose again.
    for attempt in range(1 if step is not None else 3):
        pick = run.resolve(step)
        notes += pick.notes
        try:
            meta, config, model = _load_step(run, pick.step)
            break
        except CheckpointError:
            if step is not None or attempt == 2 or pick.step in run.steps():
                raise
            notes.append(f"step {pick.step} was removed while loading it (a running training's retention?)")
    model.to(device).eval()
    weights = weights_description(meta)
    if weights != "trained":
        notes.append(f"weights: the run's {weights}, not the trained weights of step {pick.step}")
    notes += bind_scan(model, config.model.scan_impl, torch.device(device))
    where = f"the meta of step {pick.step} in {run.path}"
    data = DataIdentity.from_dict(meta.get("data"), run.path, where=where, error=CheckpointError)
    return Pretrained(
        model=model,
        config=config,
        step=pick.step,
        meta=meta,
        run_dir=run.path,
        tokenizer_name=data.tokenizer if data else resolve_name(None, run.path),
        vocab_hash=data.vocab_hash if data else None,
        notes=notes,
        weights=weights,
    )


def weights_description(meta: dict) -> str:
    """What the model of a checkpoint with `meta` is when loaded for use: "trained", or "averaged (EMA,
    decay D, N steps)" when the step holds averaged weights (the manager's `load(averaged=True)`)."""
    if not has_average(meta):
        return "trained"
    avg = meta.get("average") if isinstance(meta.get("average"), dict) else {}
    n = avg.get("updates", "?")
    return f"averaged weights (EMA, decay {avg.get('decay', '?')}, {n} step{'' if n == 1 else 's'})"


def verified_meta(run: RunDir, step: int) -> tuple[dict, Any]:
    """(meta, Config) of checkpoint `step` of `run`, its files verified (sizes, sha256) before the config
    is trusted: an edited meta could ask for any shape. CheckpointError if anything is wrong."""
    from mamba3lite.config import Config

    st = run.ckpt.status(step, need_optimizer=False)
    if not st.loadable:
        raise CheckpointError(
            f"checkpoint step {step} in {run.path} cannot be loaded: {'; '.join(st.problems)}"
        )
    meta = run.read_meta(step)
    meta_path = checkpoint_files(run.path, step)["meta"]
    raw_cfg = meta.get("config")
    if not isinstance(raw_cfg, dict) or "model" not in raw_cfg:
        raise CheckpointError(
            f"{meta_path} records no model config (a seed-format checkpoint?); "
            "mamba3lite cannot rebuild its model"
        )
    try:
        return meta, Config.from_dict(raw_cfg, source=str(meta_path))
    except ConfigError as e:
        raise CheckpointError(f"the config saved with step {step} does not validate: {e}") from None


def _load_step(run: RunDir, step: int):
    """(meta, config, model on the CPU) of checkpoint `step`, verified; CheckpointError if anything is
    wrong."""
    from mamba3lite.model import Mamba3Transformer

    meta, config = verified_meta(run, step)
    model = Mamba3Transformer(config.model)
    # verifies sizes and sha256 first; a run that averaged: its averaged weights
    run.ckpt.load(step, model, None, map_location="cpu", averaged=True)
    # The sha256 proves the file is what training wrote, not that training wrote numbers: a run saved
    # after it diverged gives `eval` a loss of nan and `generate` a sampling error, so refuse it here.
    for name, t in model.state_dict().items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise CheckpointError(
                f"{checkpoint_files(run.path, step)['model']} holds non-finite weights (NaN or inf, first "
                f"in {name}): the run diverged before this step was saved; load an earlier step with --step N"
            )
    return meta, config, model
