"""`mamba3lite export`: a run's checkpoint -> a directory in the official mamba_ssm format.

    result = export_run("runs/tiny", "exported/tiny")            # newest verified step
    # then, with mamba_ssm:  MambaLMHeadModel.from_pretrained("exported/tiny")

The directory holds `config.json` (exactly MambaConfig's fields), `pytorch_model.bin` and
`model.safetensors` (official names, the checkpoint's dtypes), `tokenizer.json` (GPT-2 built offline
from the packaged vocabulary, or the run's own tokenizer file) and a `README.md` model card.

Vocabulary: a run trained here has exactly its tokenizer's rows and is written with
`pad_vocab_size_multiple: 1` (no padding rows, none needed). A run imported from an official model
gets its kept-aside padding rows back (`official_padding.safetensors`, checked against the sha256 its
meta records), so import -> export reproduces the official tensors.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from mamba3lite.atomicfile import sha256_file
from mamba3lite.checkpoint.loaded import LoadedStep
from mamba3lite.checkpoint.run_dir import RunDir
from mamba3lite.data_identity import DataIdentity
from mamba3lite.errors import CheckpointError
from mamba3lite.interop.names import EMBED_OFFICIAL, HEAD, to_official
from mamba3lite.interop.official_config import OfficialVocab, official_config_from_model
from mamba3lite.interop.source import CONFIG_NAME
from mamba3lite.rundir import TOKENIZER_NAME


@dataclass
class ExportResult:
    out: Path
    step: int
    n_params: int
    notes: list[str]


def _padding(p: Path, meta: dict, vocab_size: int, d_model: int, tied: bool) -> tuple[OfficialVocab, dict]:
    """The official vocabulary of an imported run and its kept-aside padding rows (official name ->
    rows); for any other run (or one whose vocabulary changed since), exactly its rows, no padding."""
    info = meta.get("imported_from") or {}
    official = info.get("official_config") or {}
    own = OfficialVocab(vocab_size, 1), {}
    if not isinstance(official.get("vocab_size"), int):
        return own
    vocab = OfficialVocab(official["vocab_size"], int(official.get("pad_vocab_size_multiple", 8)))
    rows: dict = {}
    name = info.get("padding_file")
    if isinstance(name, str):
        path = p / Path(name).name
        if not path.is_file() or sha256_file(path) != info.get("padding_sha256"):
            raise CheckpointError(
                f"{path}: the padded embedding rows of the imported model are missing or changed (sha256 "
                "differs from the meta); restore the file, or import the model again"
            )
        from safetensors.torch import load_file

        rows = load_file(str(path))
    n = rows[EMBED_OFFICIAL].shape[0] if rows else 0
    want = ({EMBED_OFFICIAL} | (set() if tied else {HEAD})) if n else set()
    if (
        vocab.padded != vocab_size + n
        or set(rows) != want
        or any(t.shape != (n, d_model) for t in rows.values())
    ):
        return own  # the model changed shape since the import
    return vocab, rows


def tokenizer_json(p: Path, meta: dict, vocab_size: int) -> tuple[bytes, str]:
    """(tokenizer.json bytes, a description) for the run's tokenizer."""
    from mamba3lite.interop.gpt2_tokenizer import gpt2_tokenizer_json
    from mamba3lite.tokenizer import GPT2_VOCAB_SIZE

    ident = DataIdentity.from_dict(meta.get("data"), p, where=f"the meta in {p}", error=CheckpointError)
    name = ident.tokenizer if ident is not None else "gpt2"
    if name == "gpt2":
        if vocab_size != GPT2_VOCAB_SIZE:
            raise CheckpointError(
                f"the model in {p} has vocab_size {vocab_size}, not GPT-2's {GPT2_VOCAB_SIZE} (trained on "
                "--dummy data?) and records no tokenizer: there is no tokenizer.json to ship with it"
            )
        return gpt2_tokenizer_json().encode("utf-8"), "GPT-2 BPE (50,257 ids, EOS 50,256)"
    raw = ident.verify(what="the model was trained on it", fix="put the original back", error=CheckpointError)
    if raw is None:
        raise CheckpointError(
            f"the model in {p} was trained with tokenizer {name!r}: no tokenizer.json to ship"
        )
    return raw, "the run's own (Hugging Face tokenizers)"


def export_run(run_dir: str | Path, out: str | Path, *, step: int | None = None) -> ExportResult:
    """Write the official-format directory `out` (absent or empty) for checkpoint `step` (default:
    the newest verified one) of run `run_dir`."""
    from mamba3lite.interop.model_card import model_card
    from mamba3lite.interop.outdir import check_out_dir, staged_dir
    from mamba3lite.interop.weights import write_official_weights
    from mamba3lite.model import count_parameters

    out = Path(out)
    check_out_dir(out)
    run, got, notes = exported_step(run_dir, step)
    p, step, meta, cfg = run.path, got.step, got.meta, got.config.model
    vocab, padding = _padding(p, meta, cfg.vocab_size, cfg.d_model, cfg.tie_embeddings)
    official_cfg = official_config_from_model(cfg, vocab)
    tok_bytes, tok_desc = tokenizer_json(p, meta, cfg.vocab_size)
    state = _official_state(got, padding)
    notes += _behaviour_notes(cfg)
    a_act = cfg.a_activation
    last_eval = meta.get("last_eval") if isinstance(meta.get("last_eval"), dict) else {}
    val_loss = last_eval.get("val_loss")
    n_params = count_parameters(cfg)
    card = model_card(
        title=f"{p.resolve().name} (step {step})",
        official_config=official_cfg,
        n_params=n_params + sum(t.numel() for t in padding.values()),
        a_activation=a_act,
        tokenizer=tok_desc,
        step=step,
        tokens_seen=int(meta.get("tokens_seen", 0)),
        manifest_sha256=(meta.get("data") or {}).get("manifest_sha256"),
        val_loss=float(val_loss) if isinstance(val_loss, (int, float)) and math.isfinite(val_loss) else None,
        notes=[
            *notes,
            *([(meta.get("imported_from") or {}).get("note")] if meta.get("imported_from") else []),
        ],
    )
    with staged_dir(out) as tmp:
        (tmp / CONFIG_NAME).write_text(json.dumps(official_cfg, indent=2) + "\n", encoding="utf-8")
        write_official_weights(tmp, state, cfg.tie_embeddings)
        (tmp / TOKENIZER_NAME).write_bytes(tok_bytes)
        (tmp / "README.md").write_text(card, encoding="utf-8")
    return ExportResult(out, step, n_params, notes)


def exported_step(run_dir: str | Path, step: int | None) -> tuple[RunDir, LoadedStep, list[str]]:
    """(the RunDir, its step `step` or the newest verified one loaded at the widest dtype it stores
    (`RunDir.load`: verified once, the average of a run that averaged, what eval and generate read), the
    export's notes): what every export format starts from."""
    run = RunDir(run_dir)
    got = run.load(step, None)
    notes = list(got.notes)
    if got.weights != "trained":
        notes.append(f"exported the run's {got.weights}, not the trained weights of step {got.step}")
    return run, got, notes


def checkpoint_state(got: LoadedStep) -> dict[str, torch.Tensor]:
    """The loaded step as our state_dict, every tensor in the dtype its file stores (the model holds the
    widest, so no value was rounded on the way). A tied head is the embedding's tensor."""
    dtypes = got.stored_dtypes
    state = {}
    for name, t in got.model.state_dict().items():
        widest = t.dtype
        dt = dtypes.get(name, dtypes.get("embed.weight", widest) if name == HEAD else widest)
        state[name] = t.to(dt)
    return state


def _official_state(got: LoadedStep, padding: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The loaded step as the official state_dict (`checkpoint_state`): renamed, the padding rows
    appended, a tied head dropped."""
    state = to_official(checkpoint_state(got))
    for name, rows in padding.items():
        state[name] = torch.cat([state[name], rows.to(state[name].dtype)])
    if got.config.model.tie_embeddings:
        state.pop(HEAD)
    return state


def _behaviour_notes(cfg) -> list[str]:
    """Where the official code computes another function of these weights than we do."""
    notes = []
    if cfg.a_activation != "heavy_tail":
        notes.append(
            f"the model uses the {cfg.a_activation} A activation; the official code since mid-2026 computes "
            "A with heavy-tail, so it gives other outputs for these weights (the model card says so)"
        )
    if cfg.reset_at_eos:
        notes.append(
            "the model was trained with reset_at_eos (state reset after each EOS); mamba_ssm does not "
            "reset, so text spanning documents gives other outputs there (one document gives the same)"
        )
    return notes
