"""Loading a trained model back from its run directory: the one road for generate, eval and quickstart.

    loaded = load_pretrained("runs/tiny")            # newest verified checkpoint
    loaded = load_pretrained("runs/tiny", step=400)  # exactly step 400, or a CheckpointError

A run directory (`training.checkpoint_dir`) holds `model_step_N.safetensors`, `optim_step_N.pt` and
`meta_step_N.json` per step; the meta carries the whole resolved config and the identity of the data the
model was trained on (tokenizer name, vocabulary hash, vocab size, EOS id). From those this module
rebuilds `Mamba3Transformer(config.model)` with the verified weights (`RunDir.load`, the one road from
a step to a model: the step is verified once, its files against the sha256 the meta records) and the
tokenizer the model was trained with. The optimizer file is not read.
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

from mamba3lite.checkpoint.run_dir import RunDir
from mamba3lite.data_identity import DataIdentity, resolve_name
from mamba3lite.errors import CheckpointError, ConfigError


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
    explicit `step` loads exactly that step or raises. `RunDir.load` verifies the step once (weights
    against the meta's sha256) and builds the model; this puts it on `device` and adds the tokenizer.
    """
    run = RunDir(run_dir)
    got = run.load(step, torch.float32)
    model = got.model.to(device).eval()
    notes = list(got.notes)
    if got.weights != "trained":
        notes.append(f"weights: the run's {got.weights}, not the trained weights of step {got.step}")
    notes += bind_scan(model, got.config.model.scan_impl, torch.device(device))
    where = f"the meta of step {got.step} in {run.path}"
    data = DataIdentity.from_dict(got.meta.get("data"), run.path, where=where, error=CheckpointError)
    return Pretrained(
        model=model,
        config=got.config,
        step=got.step,
        meta=got.meta,
        run_dir=run.path,
        tokenizer_name=data.tokenizer if data else resolve_name(None, run.path),
        vocab_hash=data.vocab_hash if data else None,
        notes=notes,
        weights=got.weights,
    )
