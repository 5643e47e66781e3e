"""The official `config.json` (mamba_ssm `MambaConfig`) translated to our `ModelConfig` and back.

The official file holds exactly the twelve fields of `MambaConfig` (`MambaLMHeadModel.from_pretrained`
passes them as `MambaConfig(**config)`, so an extra key makes it fail): d_model, d_intermediate,
n_layer, vocab_size, ssm_cfg, attn_layer_idx, attn_cfg, rms_norm, residual_in_fp32, fused_add_norm,
pad_vocab_size_multiple, tie_embeddings. `ssm_cfg` names the mixer (`"layer": "Mamba3"`) and holds its
constructor arguments, whose names are ours (docs/model.md §1.1). A missing key means the official default.

What the format does not record, the caller chooses: the A activation (heavy-tail since mid-2026,
softplus before), and the vocabulary the model is used with (the tokenizer's, which may be smaller than
the padded embedding: `OfficialVocab`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from mamba3lite.errors import CheckpointError, ConfigError
from mamba3lite.model.config import ModelConfig

# `MambaConfig`'s fields and defaults (mamba_ssm/models/config_mamba.py).
MAMBA_CONFIG_DEFAULTS: dict[str, Any] = {
    "d_model": 2560,
    "d_intermediate": 0,
    "n_layer": 64,
    "vocab_size": 50277,
    "ssm_cfg": {},
    "attn_layer_idx": [],
    "attn_cfg": {},
    "rms_norm": True,
    "residual_in_fp32": True,
    "fused_add_norm": True,
    "pad_vocab_size_multiple": 8,
    "tie_embeddings": True,
}
# The official Mamba3 constructor's modelling arguments and defaults (mamba_ssm/modules/mamba3.py);
# each has the same name and meaning in our ModelConfig.
MAMBA3_DEFAULTS: dict[str, Any] = {
    "d_state": 128,
    "expand": 2,
    "headdim": 64,
    "ngroups": 1,
    "rope_fraction": 0.5,
    "dt_min": 1e-3,
    "dt_max": 0.1,
    "dt_init_floor": 1e-4,
    "A_floor": 1e-4,
    "is_outproj_norm": False,
    "is_mimo": False,
    "mimo_rank": 4,
    "chunk_size": 64,
}
# ssm_cfg keys that choose kernels or are absorbed by the constructor: no effect on the function.
KERNEL_ONLY_SSM_KEYS = ("fuse_pregate_headwise_norm", "dropout", "layer_idx", "n_layer")
# The official GatedMLP rounds its hidden width up to this; so do we (`mlp_multiple_of`).
OFFICIAL_MLP_MULTIPLE = 128
# The official mixer's and LM's RMSNorm epsilon (not in config.json: fixed in the code).
OFFICIAL_NORM_EPS = 1e-5


@dataclass(frozen=True)
class OfficialVocab:
    """The official embedding's rows: config.json's `vocab_size`, padded up to a multiple of
    `pad_multiple` (`MambaLMHeadModel` does the padding). Our model keeps the first `used` rows (the
    tokenizer's vocabulary); the rest are padding that no token id reaches."""

    vocab_size: int
    pad_multiple: int

    @property
    def padded(self) -> int:
        m = self.pad_multiple
        return (self.vocab_size + m - 1) // m * m


def _unknown(keys, known, where: str) -> None:
    extra = sorted(set(keys) - set(known))
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise CheckpointError(
            f"{where}: unknown key {extra[0]!r}{more}; "
            "mamba3lite imports Mamba-3 language models of mamba_ssm's MambaConfig and cannot say what "
            "it means for the model"
        )


def model_config_from_official(
    raw: Any, *, vocab_size: int, eos_id: int, a_activation: str, where: str
) -> tuple[ModelConfig, OfficialVocab]:
    """Our ModelConfig for an official config.json (`raw`, parsed), used with a tokenizer of
    `vocab_size` ids and EOS `eos_id`. CheckpointError naming the key for what we cannot represent:
    attention layers, Mamba-1/2 mixers, LayerNorm, unknown keys, bad values."""
    if not isinstance(raw, dict):
        raise CheckpointError(f"{where}: not a JSON object (an official config.json is one)")
    _unknown(raw, MAMBA_CONFIG_DEFAULTS, where)
    c = {**MAMBA_CONFIG_DEFAULTS, **raw}
    if c["attn_layer_idx"]:
        raise CheckpointError(
            f"{where}: attn_layer_idx {c['attn_layer_idx']} puts attention layers in the model; mamba3lite "
            "models are pure Mamba-3 and cannot hold them"
        )
    if not isinstance(c["ssm_cfg"], dict):
        raise CheckpointError(f"{where}: ssm_cfg must be a JSON object, got {c['ssm_cfg']!r}")
    ssm = dict(c["ssm_cfg"])
    layer = ssm.pop("layer", "Mamba1")  # the official default mixer
    if layer != "Mamba3":
        absent = " (the default when absent)" if "layer" not in c["ssm_cfg"] else ""
        raise CheckpointError(
            f"{where}: ssm_cfg.layer is {layer!r}{absent}; mamba3lite implements only the Mamba3 mixer"
        )
    _unknown(ssm, [*MAMBA3_DEFAULTS, *KERNEL_ONLY_SSM_KEYS], f"{where} ssm_cfg")
    if c["rms_norm"] is not True:
        raise CheckpointError(
            f"{where}: rms_norm {c['rms_norm']!r} (LayerNorm) is not supported; only RMSNorm"
        )
    pad = c["pad_vocab_size_multiple"]
    if isinstance(pad, bool) or not isinstance(pad, int) or pad < 1:
        raise CheckpointError(f"{where}: pad_vocab_size_multiple must be an integer >= 1, got {pad!r}")
    official_vocab = c["vocab_size"]
    if isinstance(official_vocab, bool) or not isinstance(official_vocab, int) or official_vocab < 1:
        raise CheckpointError(f"{where}: vocab_size must be an integer >= 1, got {official_vocab!r}")
    vocab = OfficialVocab(official_vocab, pad)
    if vocab_size > vocab.padded:
        raise CheckpointError(
            f"the tokenizer has {vocab_size:,} token ids but the model's embedding ({where}: vocab_size "
            f"{official_vocab:,}, padded to {vocab.padded:,}) has only {vocab.padded:,} rows: it is not this "
            "model's tokenizer; pass the right one with --tokenizer"
        )
    mixer = {k: ssm.get(k, v) for k, v in MAMBA3_DEFAULTS.items()}
    try:
        cfg = ModelConfig(
            vocab_size=vocab_size,
            d_model=c["d_model"],
            n_layers=c["n_layer"],
            d_intermediate=c["d_intermediate"],
            mlp_multiple_of=OFFICIAL_MLP_MULTIPLE,
            **mixer,
            a_activation=a_activation,
            tie_embeddings=c["tie_embeddings"],
            norm_eps=OFFICIAL_NORM_EPS,
            eos_id=eos_id,
        )
    except ConfigError as e:
        raise CheckpointError(f"{where}: {e} (the value comes from config.json)") from None
    return cfg, vocab


def official_config_from_model(cfg: ModelConfig, vocab: OfficialVocab) -> dict[str, Any]:
    """config.json for our model `cfg` whose embedding, padded, has `vocab.padded` rows. ConfigError
    naming the field for what the official model cannot reproduce."""
    why = []
    if cfg.attn_layer_idx:
        why.append(
            f"model.attn_layer_idx={list(cfg.attn_layer_idx)} (attention layers: exporting a hybrid to the "
            "official format is not built yet)"
        )
    if not cfg.trapezoid:
        why.append("model.trapezoid=false (the official layer always learns λ)")
    if not cfg.rope:
        why.append("model.rope=false (the official layer always rotates)")
    if cfg.norm_eps != OFFICIAL_NORM_EPS:
        why.append(f"model.norm_eps={cfg.norm_eps:g} (official RMSNorms use {OFFICIAL_NORM_EPS:g})")
    if cfg.d_mlp % OFFICIAL_MLP_MULTIPLE:
        why.append(
            f"an MLP width of {cfg.d_mlp} (model.mlp_multiple_of={cfg.mlp_multiple_of}; the official "
            f"GatedMLP rounds up to a multiple of {OFFICIAL_MLP_MULTIPLE})"
        )
    if why:
        raise ConfigError(f"this model cannot be exported to the official format: {'; '.join(why)}")
    ssm: dict[str, Any] = {"layer": "Mamba3"}
    for k in MAMBA3_DEFAULTS:
        ssm[k] = getattr(cfg, k)
    return {
        "d_model": cfg.d_model,
        # The official GatedMLP rounds up as ours does with mlp_multiple_of 128: the unrounded width
        # then round-trips as written; otherwise the real width (a multiple of 128, checked above).
        "d_intermediate": cfg.d_intermediate if cfg.mlp_multiple_of == OFFICIAL_MLP_MULTIPLE else cfg.d_mlp,
        "n_layer": cfg.n_layers,
        "vocab_size": vocab.vocab_size,
        "ssm_cfg": ssm,
        "attn_layer_idx": [],
        "attn_cfg": {},
        "rms_norm": True,
        "residual_in_fp32": True,
        "fused_add_norm": True,
        "pad_vocab_size_multiple": vocab.pad_multiple,
        "tie_embeddings": cfg.tie_embeddings,
    }


def model_fields(cfg: ModelConfig) -> dict[str, Any]:
    """cfg as plain field values (for `Config.replace("model", **...)`)."""
    return asdict(cfg)
