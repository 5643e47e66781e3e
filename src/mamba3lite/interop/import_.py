"""`mamba3lite import`: an official mamba_ssm Mamba-3 model -> a run directory like any other.

    result = import_official("path/or/hf:NAME", "runs/mamba3-187m")

The run directory gets one verified checkpoint (step 0: `model_step_0.safetensors`, an empty optimizer
file, `meta_step_0.json`), `config.yaml`, and the tokenizer: `generate`, `eval`, `inspect` and
`train --init-from` take it as they take a trained run. The meta records the source and its config.json
(`imported_from`), tokens_seen 0 (the official format does not say how many the model saw), and the
tokenizer's identity, as `prepare` records it in a dataset (so data prepared with
`--tokenizer RUN/tokenizer.json` is recognised as the model's).

Vocabulary: the model keeps the tokenizer's ids only. The official embedding is padded to a multiple
of `pad_vocab_size_multiple` with rows no token id reaches; those rows are kept aside in
`official_padding.safetensors`, so that `export` writes the official tensors back unchanged. A tokenizer
JSON that is our GPT-2 (an exported mamba3lite model) is recorded as "gpt2", so GPT-2 datasets match.

Tensors keep the dtypes of the file (bf16 stays bf16 on disk; `load_pretrained` widens to fp32).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from mamba3lite import intake
from mamba3lite.data_identity import DataIdentity
from mamba3lite.errors import CheckpointError, ConfigError
from mamba3lite.interop.names import EMBED_OURS, HEAD, official_name, our_name
from mamba3lite.interop.official_config import KERNEL_ONLY_SSM_KEYS, OfficialVocab, model_config_from_official
from mamba3lite.interop.source import OfficialSource, open_source
from mamba3lite.interop.weights import read_official_weights
from mamba3lite.model.config import A_ACTIVATIONS, ModelConfig
from mamba3lite.rundir import CONFIG_NAME, PADDING_NAME, TOKENIZER_NAME

DEFAULT_A_ACTIVATION = "heavy_tail"  # the official code's since mid-2026 (docs/model.md §1.3)
TOKENS_SEEN_NOTE = (
    "tokens_seen is 0 because the official format does not record how many tokens the model was trained on"
)


def tokenizer_identity(name_or_path: str) -> DataIdentity:
    """The identity (data_identity.py) of tokenizer "gpt2" or of a tokenizer.json (recognised as GPT-2
    when it is ours); its `tokenizer_file` is the file to copy, None for GPT-2."""
    from mamba3lite.interop.gpt2_tokenizer import is_gpt2_tokenizer_json
    from mamba3lite.tokenizer import load_tokenizer

    path = None
    if name_or_path != "gpt2":
        path = Path(name_or_path)
        if not path.is_file():
            raise ConfigError(
                f"tokenizer file not found: {path}; pass --tokenizer PATH/tokenizer.json or gpt2"
            )
        raw = intake.read_bytes_capped(path, intake.TOKENIZER)
        if is_gpt2_tokenizer_json(raw.decode("utf-8", errors="replace")):
            name_or_path, path = "gpt2", None
    tok = load_tokenizer(name_or_path if path is None else str(path))
    return DataIdentity(tok.name, tok.vocab_hash, tok.vocab_size, tok.eos_id)


@dataclass
class OfficialWeights:
    """An official model translated: `config` (ours), `state` (our names, the tokenizer's rows only,
    the file's dtypes), `padding` (official name -> the embedding/head rows beyond them)."""

    config: ModelConfig
    vocab: OfficialVocab
    state: dict[str, Tensor]
    padding: dict[str, Tensor]
    notes: list[str] = field(default_factory=list)


def _expected_shapes(cfg: ModelConfig, rows: int) -> dict[str, tuple[int, ...]]:
    """Our model's parameter shapes (no memory: built on the meta device), with `rows` embedding rows."""
    from mamba3lite.model import Mamba3Transformer

    with torch.device("meta"):
        model = Mamba3Transformer(cfg)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    for k in (EMBED_OURS, HEAD):
        shapes[k] = (rows, *shapes[k][1:])
    return shapes


def translate(source: OfficialSource, tok: DataIdentity, a_activation: str) -> OfficialWeights:
    """The official model at `source`, for tokenizer `tok`, in our names and config. CheckpointError
    naming the tensor (or key) when the weights and config.json disagree."""
    if a_activation not in A_ACTIVATIONS:
        raise ConfigError(f"--a-activation must be one of {', '.join(A_ACTIVATIONS)}, got {a_activation!r}")
    where = str(source.root / "config.json")
    cfg, vocab = model_config_from_official(
        source.config, vocab_size=tok.vocab_size, eos_id=tok.eos_id, a_activation=a_activation, where=where
    )
    files = ", ".join(p.name for p in source.weight_files)
    state = _our_names(read_official_weights(source.weight_files, source.index), files)
    _check_finite(state, files)
    # The layer count first: the expected shapes come from a model built (on the meta device) from the
    # config, and an n_layer of 10**9 would take hours to build before any shape could disagree.
    _check_layer_count(state, cfg.n_layers, files, where)
    tied_head = state.pop(HEAD, None) if cfg.tie_embeddings else None  # the model re-ties it
    _check_shapes(state, _expected_shapes(cfg, vocab.padded), files, where, tied=cfg.tie_embeddings)
    if tied_head is not None:
        _check_tied_head(tied_head, state[EMBED_OURS], files)
    padding = _split_padding(state, cfg.vocab_size)
    return OfficialWeights(cfg, vocab, state, padding, _notes(source, vocab, cfg.vocab_size, a_activation))


def _our_names(raw: dict[str, Tensor], files: str) -> dict[str, Tensor]:
    """The official tensors under our names; a tensor no MambaLMHeadModel has is a CheckpointError."""
    state: dict[str, Tensor] = {}
    for name, t in raw.items():
        ours = our_name(name)
        if ours is None:
            raise CheckpointError(f"{files}: tensor {name!r} is not part of a MambaLMHeadModel")
        state[ours] = t
    return state


def _check_finite(state: dict[str, Tensor], files: str) -> None:
    """`generate` and `eval` refuse a checkpoint whose weights are not finite: refuse to write one."""
    for name, t in state.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise CheckpointError(
                f"{files}: tensor {official_name(name)!r} holds NaN or infinite values; the model cannot "
                "be used (a run saved after it diverged?)"
            )


def _check_layer_count(state: dict[str, Tensor], n_layers: int, files: str, where: str) -> None:
    """The weights hold exactly the `n_layers` layers config.json says."""
    held = {int(k.split(".")[1]) for k in state if k.startswith("layers.") and k.split(".")[1].isdigit()}
    if len(held) != n_layers:
        raise CheckpointError(
            f"{files}: the weights hold {len(held)} layers, but {where} says n_layer {n_layers}; the "
            "weights and the config disagree"
        )


def _check_tied_head(head: Tensor, embedding: Tensor, files: str) -> None:
    """With tied embeddings, a file's lm_head.weight must be the embedding."""
    if not (head.shape == embedding.shape and torch.equal(head, embedding)):
        raise CheckpointError(
            f"{files}: lm_head.weight differs from the embedding, but config.json says tie_embeddings: "
            "true; the weights and the config disagree"
        )


def _check_shapes(
    state: dict[str, Tensor], want: dict[str, tuple[int, ...]], files: str, where: str, *, tied: bool
) -> None:
    """`state` holds exactly the tensors of `want` (the head not, when `tied`), with those shapes: one
    CheckpointError naming the first tensor missing, misshapen, or without a place."""
    if tied:
        want = {k: v for k, v in want.items() if k != HEAD}
    for name, shape in want.items():
        if name not in state:
            raise CheckpointError(
                f"{files}: tensor {official_name(name)!r} is missing; the weights and {where} disagree "
                "(another model's config?)"
            )
        if tuple(state[name].shape) != shape:
            raise CheckpointError(
                f"{files}: tensor {official_name(name)!r} has shape {tuple(state[name].shape)}, but {where} "
                f"implies {shape}; the weights and the config disagree"
            )
    extra = sorted(set(state) - set(want))
    if extra:
        raise CheckpointError(
            f"{files}: tensor {official_name(extra[0])!r} has no place in the model that {where} describes "
            "(the weights and the config disagree)"
        )


def _split_padding(state: dict[str, Tensor], vocab_size: int) -> dict[str, Tensor]:
    """Cut the embedding and head to the tokenizer's `vocab_size` rows, in place; the rows beyond them
    (the official padding), by official name."""
    padding = {}
    for name in (EMBED_OURS, HEAD):
        if name in state:
            padding[official_name(name)] = state[name][vocab_size:].clone()
            state[name] = state[name][:vocab_size].clone()
    return padding


def _notes(source: OfficialSource, vocab: OfficialVocab, vocab_size: int, a_activation: str) -> list[str]:
    """What the import chose or dropped, for the user: the A activation, padded rows, ignored keys."""
    notes = [f"A activation: {a_activation} (the official format does not record it; --a-activation chooses)"]
    if vocab.padded > vocab_size:
        extra = vocab.padded - vocab_size
        notes.append(f"{extra} padded embedding rows beyond the tokenizer's {vocab_size:,} ids kept aside")
    ignored = sorted(set(source.config.get("ssm_cfg") or {}) & set(KERNEL_ONLY_SSM_KEYS))
    if ignored:
        notes.append(f"kernel-only ssm_cfg keys ignored: {', '.join(ignored)}")
    return notes


def build_model(w: OfficialWeights):
    """A `Mamba3Transformer` holding exactly the translated tensors (dtypes kept; no init computed)."""
    from mamba3lite.model import Mamba3Transformer

    with torch.device("meta"):
        model = Mamba3Transformer(w.config)
    state = dict(w.state)
    if w.config.tie_embeddings:
        state[HEAD] = state[EMBED_OURS]
    model.load_state_dict(state, strict=True, assign=True)
    if w.config.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    return model


@dataclass
class ImportResult:
    out: Path
    config: ModelConfig
    tokenizer: str
    notes: list[str]


def import_official(
    src: str, out: str | Path, *, a_activation: str = DEFAULT_A_ACTIVATION, tokenizer: str | None = None
) -> ImportResult:
    """Write the run directory `out` (absent or empty) for the official model `src` (a directory or
    hf:NAME). `tokenizer`: "gpt2" or a tokenizer.json; default SRC/tokenizer.json."""
    from safetensors.torch import save_file

    from mamba3lite.interop.outdir import check_out_dir

    out = Path(out)
    check_out_dir(out)  # before a download
    source = open_source(src)
    if tokenizer is None:
        if source.tokenizer is None:
            raise CheckpointError(
                f"{source.root} has no {TOKENIZER_NAME}; pass the model's tokenizer with --tokenizer "
                "PATH/tokenizer.json (or gpt2)"
            )
        tokenizer = str(source.tokenizer)
    tok = tokenizer_identity(tokenizer)
    w = translate(source, tok, a_activation)
    model = build_model(w)

    def write_padding(tmp: Path) -> None:
        if any(t.numel() for t in w.padding.values()):
            save_file(w.padding, tmp / PADDING_NAME, metadata={"format": "pt"})

    def run_state(cfg, tmp: Path):
        return _import_state(cfg, tok, source, src, a_activation, tmp)

    write_imported_run(out, model, tok, run_state, write_padding)
    final_tok = str((out / TOKENIZER_NAME).resolve()) if tok.tokenizer_file is not None else "gpt2"
    return ImportResult(out, w.config, final_tok, [*w.notes, TOKENS_SEEN_NOTE])


def write_imported_run(out: Path, model, tok: DataIdentity, run_state, extra=None) -> None:
    """Write the run directory `out` (built aside, renamed in) holding `model` as its verified step 0,
    its config, and the tokenizer `tok`; `run_state(config, tmp)` gives the step's RunState, `extra(tmp)`
    writes any other file first."""
    from mamba3lite.checkpoint import CheckpointManager
    from mamba3lite.config import Config, write_resolved_config
    from mamba3lite.interop.outdir import staged_dir

    cfg = Config(model=model.cfg).replace("training", checkpoint_dir=str(out))
    with staged_dir(out) as tmp:
        if tok.tokenizer_file is not None:  # the bytes that hash to the identity recorded below
            data = tok.verify(what="it was read for this import", error=CheckpointError)
            (tmp / TOKENIZER_NAME).write_bytes(data)
        if extra is not None:
            extra(tmp)
        write_resolved_config(cfg, tmp / CONFIG_NAME)
        CheckpointManager(tmp).save(0, model, None, run_state(cfg, tmp))


def _import_state(cfg, tok: DataIdentity, source: OfficialSource, src: str, a_activation: str, tmp: Path):
    """The run state of the imported step 0: the config, the tokenizer and what the import came from.
    The tokenizer copy is recorded relative to the run directory, so the run can be moved
    (pretrained.recorded_tokenizer resolves it)."""
    from mamba3lite.atomicfile import sha256_file
    from mamba3lite.checkpoint import RunState

    padding = tmp / PADDING_NAME
    return RunState(
        step=0,
        config=cfg.to_dict(),
        data=tok.to_dict(),  # a tokenizer.json is recorded as the run's copy, "tokenizer.json"
        imported_from={
            "source": src,
            "format": "mamba_ssm MambaLMHeadModel",
            "official_config": source.config,
            "a_activation": a_activation,
            "padding_file": PADDING_NAME if padding.exists() else None,
            "padding_sha256": sha256_file(padding) if padding.exists() else None,
            "note": TOKENS_SEEN_NOTE,
        },
    )
