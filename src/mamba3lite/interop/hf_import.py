"""`mamba3lite import` of a Hugging Face export (`export --format hf`) back into a run directory.

    if is_hf_export("exported/tiny-hf"):
        result = import_hf("exported/tiny-hf", "runs/tiny-again")

The model config is the one config.json carries under "mamba3lite"; the tensors are the HF names less
their "model." prefix, checked to be exactly the model's (names and shapes, a tied head equal to the
embedding, all finite) before anything is written: a missing or mismatched tensor is one
CheckpointError naming it, and no run directory appears. export -> import gives the same tensors.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from torch import Tensor

from mamba3lite import intake
from mamba3lite.errors import CheckpointError, ConfigError
from mamba3lite.interop.hf_export import HF_PREFIX, MODEL_TYPE
from mamba3lite.interop.import_ import (
    TOKENS_SEEN_NOTE,
    ImportResult,
    tokenizer_identity,
    write_imported_run,
)
from mamba3lite.interop.names import EMBED_OURS, HEAD
from mamba3lite.interop.source import CONFIG_NAME, download_hf, weight_files
from mamba3lite.interop.source import HF_PREFIX as HUB_PREFIX
from mamba3lite.interop.weights import read_official_weights
from mamba3lite.model.config import ModelConfig
from mamba3lite.rundir import TOKENIZER_NAME
from mamba3lite.tokenizer import without_document_start


def is_hf_export(root: str | Path) -> bool:
    """Whether directory `root` holds a config.json of model_type "mamba3lite" (an HF export)."""
    path = Path(root) / CONFIG_NAME
    if not path.is_file():
        return False
    try:
        config = intake.read_json(path, intake.OFFICIAL_CONFIG)
    except CheckpointError:
        return False  # the official reader reports it
    return config.get("model_type") == MODEL_TYPE


def local_root(src: str) -> Path:
    """The directory of `src`: a path, or hf:NAME downloaded (the model's files)."""
    return download_hf(src[len(HUB_PREFIX) :]) if src.startswith(HUB_PREFIX) else Path(src)


def _model_config(root: Path) -> ModelConfig:
    config = intake.read_json(root / CONFIG_NAME, intake.OFFICIAL_CONFIG)
    fields = config.get("mamba3lite")
    if not isinstance(fields, dict):
        raise CheckpointError(f'{root / CONFIG_NAME}: no "mamba3lite" object (the model\'s config)')
    try:
        return ModelConfig(**fields)
    except (ConfigError, TypeError) as e:
        raise CheckpointError(f"{root / CONFIG_NAME}: the model config is not valid ({e})") from None


def _our_state(raw: dict[str, Tensor], cfg: ModelConfig, files: str) -> dict[str, Tensor]:
    """The file's tensors under our names, checked against the model `cfg` describes."""
    from mamba3lite.model import Mamba3Transformer

    with torch.device("meta"):
        want = {k: tuple(v.shape) for k, v in Mamba3Transformer(cfg).state_dict().items()}
    state: dict[str, Tensor] = {}
    for name, t in raw.items():
        ours = name[len(HF_PREFIX) :] if name.startswith(HF_PREFIX) else None
        if ours not in want:
            raise CheckpointError(f"{files}: tensor {name!r} has no place in the model config.json describes")
        state[ours] = t
    tied_head = state.pop(HEAD) if cfg.tie_embeddings and HEAD in state else None
    if tied_head is not None and not torch.equal(tied_head, state.get(EMBED_OURS, torch.empty(0))):
        raise CheckpointError(f"{files}: {HF_PREFIX}{HEAD} differs from the tied embedding")
    for name, shape in want.items():
        if cfg.tie_embeddings and name == HEAD:
            continue
        if name not in state:
            raise CheckpointError(f"{files}: tensor {HF_PREFIX + name!r} is missing (an incomplete export)")
        if tuple(state[name].shape) != shape:
            raise CheckpointError(
                f"{files}: tensor {HF_PREFIX + name!r} has shape {tuple(state[name].shape)}, but config.json "
                f"implies {shape}; the weights and the config disagree"
            )
        if state[name].is_floating_point() and not bool(torch.isfinite(state[name]).all()):
            raise CheckpointError(f"{files}: tensor {HF_PREFIX + name!r} holds NaN or infinite values")
    return state


def import_hf(src: str | Path, out: str | Path, *, tokenizer: str | None = None) -> ImportResult:
    """Write the run directory `out` (absent or empty) for the HF export `src` (a directory or
    hf:NAME). `tokenizer`: "gpt2" or a tokenizer.json; default SRC/tokenizer.json."""
    from mamba3lite.interop.outdir import check_out_dir

    out = Path(out)
    check_out_dir(out)
    root = local_root(str(src))
    cfg = _model_config(root)
    files, index = weight_files(root, bin_ok=False)
    names = ", ".join(f.name for f in files)
    state = _our_state(read_official_weights(files, index), cfg, names)
    if tokenizer is None:
        if not (root / TOKENIZER_NAME).is_file():
            raise CheckpointError(f"{root} has no {TOKENIZER_NAME}; pass --tokenizer PATH (or gpt2)")
        tokenizer = str(root / TOKENIZER_NAME)
    with tempfile.TemporaryDirectory() as tmp:
        return _import(src, out, cfg, state, _run_tokenizer(tokenizer, cfg.eos_id, Path(tmp)))


def _run_tokenizer(tokenizer: str, eos_id: int, tmp: Path) -> str:
    """`tokenizer` as the run records it: an export's tokenizer.json less the EOS start the export put
    in (`tokenizer.without_document_start`: the run's own file again, its vocabulary hash with it; the
    start is the EOS either way), in `tmp`; a file that adds another start, or nothing, as it is."""
    if tokenizer == "gpt2" or not Path(tokenizer).is_file():
        return tokenizer  # (tokenizer_identity names a missing file)
    raw = intake.read_bytes_capped(Path(tokenizer), intake.TOKENIZER)
    if (restored := without_document_start(raw, eos_id)) == raw:
        return tokenizer
    (tmp / TOKENIZER_NAME).write_bytes(restored)
    return str(tmp / TOKENIZER_NAME)


def _import(src, out: Path, cfg: ModelConfig, state: dict, tokenizer: str) -> ImportResult:
    from mamba3lite.checkpoint import RunState
    from mamba3lite.model import Mamba3Transformer

    tok = tokenizer_identity(tokenizer)
    if tok.vocab_size != cfg.vocab_size or tok.eos_id != cfg.eos_id:
        raise CheckpointError(
            f"the tokenizer {tokenizer} (vocab {tok.vocab_size}, EOS {tok.eos_id}) does not fit the model "
            f"(vocab_size {cfg.vocab_size}, eos_id {cfg.eos_id})"
        )
    with torch.device("meta"):
        model = Mamba3Transformer(cfg)
    if cfg.tie_embeddings:
        state[HEAD] = state[EMBED_OURS]
    model.load_state_dict(state, strict=True, assign=True)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed.weight

    def run_state(config, tmp: Path) -> RunState:
        return RunState(
            step=0,
            config=config.to_dict(),
            data=tok.to_dict(),  # a tokenizer.json is recorded as the run's copy, "tokenizer.json"
            imported_from={"source": str(src), "format": "mamba3lite HF export", "note": TOKENS_SEEN_NOTE},
        )

    write_imported_run(out, model, tok, run_state)
    final_tok = str((out / TOKENIZER_NAME).resolve()) if tok.tokenizer_file is not None else "gpt2"
    return ImportResult(out, cfg, final_tok, [TOKENS_SEEN_NOTE])
