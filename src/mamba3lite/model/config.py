"""ModelConfig: the shape and switches of a Mamba-3 language model (docs/model.md §1, §5).

Every field documents itself in `metadata["help"]` (the config reference, docs/reference/config.md, is
generated from it).
Values are validated on creation; a bad value raises `ConfigError` naming the field (`model.<name>`).
Derived sizes (d_inner, nheads, n_angles, ...) are properties, never stored.

Defaults are the paper's 180M SISO shape (12 layers, d_model 768, MLP 1500 -> 1536) with the GPT-2
vocabulary of this project (50,257 tokens, eos 50,256): 126,946,368 parameters with tied embeddings.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field, fields
from typing import Any

from mamba3lite.errors import ConfigError, did_you_mean_hint

A_ACTIVATIONS = ("heavy_tail", "softplus")
# Layer kinds (model/layer_kinds.py): Mamba-3 everywhere except the indices in attn_layer_idx.
MAMBA3_KIND = "mamba3"
ATTENTION_KIND = "attention"
# The keywords of the official attention layer (mamba_ssm's MHA) that `attn_cfg` may hold, with that
# layer's defaults (num_heads has none: it is required). `layer_idx` and `causal` are set per layer.
ATTN_CFG_DEFAULTS: dict[str, Any] = {
    "num_heads": None,
    "num_heads_kv": None,  # None: num_heads (multi-head); fewer: grouped- or multi-query attention
    "head_dim": None,  # None: d_model // num_heads
    "rotary_emb_dim": 0,
    "rotary_emb_base": 10000.0,
    "rotary_emb_interleaved": False,
    "qkv_proj_bias": True,
    "out_proj_bias": True,
    "softmax_scale": None,  # None: 1 / sqrt(head_dim)
    "d_conv": 0,
    "mlp_dim": 0,
}
_ATTN_INTS = ("num_heads", "num_heads_kv", "head_dim", "rotary_emb_dim", "d_conv", "mlp_dim")
_ATTN_FLOATS = ("rotary_emb_base", "softmax_scale")
_ATTN_BOOLS = ("rotary_emb_interleaved", "qkv_proj_bias", "out_proj_bias")
# The official MHA rounds its gated-MLP width up to a multiple of this.
ATTN_MLP_MULTIPLE = 256
# Scan backends (model/scan_backend.py): all compute the same function, so these are how, not what.
SCAN_IMPLS = ("auto", "chunked", "sequential", "triton")
# Fields that choose how the model is computed, not what it computes: a checkpoint resumes and loads
# under another value (a run trained with the Triton scan on a GPU evaluates with the chunked one on a CPU).
EXECUTION_FIELDS = frozenset({"scan_impl"})


def check_scan_impl(name: object, where: str = "model.scan_impl") -> str:
    """`name` if it is a scan backend, else a ConfigError naming `where`, the choices and the closest one."""
    if isinstance(name, str) and name in SCAN_IMPLS:
        return name
    hint = did_you_mean_hint(str(name), SCAN_IMPLS)
    raise ConfigError(f"{where} must be one of {', '.join(SCAN_IMPLS)}, got {name!r}{hint}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_attention_shape(a: dict[str, Any], d_model: int, where: str) -> None:
    """The official MHA's rules on its keywords `a` (attn_cfg's names; absent = the layer's default) at
    width `d_model`: heads, widths and rotary add up, or one ConfigError naming `where` + the keyword
    ("model.attn_cfg." from a config, "MHA " from the layer's own arguments) and the fix. Written once,
    here without torch: the config checks it at load time, model/attention.py's MHA when it is built."""
    heads = a.get("num_heads")
    if heads is None:
        raise ConfigError(
            f"{where}num_heads is required for an attention layer (the official MHA has no default), "
            "e.g. attn_cfg: {num_heads: 12}"
        )
    for key in ("num_heads", "num_heads_kv", "head_dim"):  # None: the default (heads; d_model / heads)
        if a.get(key) is not None and not (_is_int(a[key]) and a[key] >= 1):
            raise ConfigError(f"{where}{key} must be an integer >= 1 (got {a[key]!r})")
    for key in ("rotary_emb_dim", "d_conv", "mlp_dim"):
        if not (_is_int(a.get(key, 0)) and a.get(key, 0) >= 0):
            raise ConfigError(f"{where}{key} must be an integer >= 0, 0 for off (got {a[key]!r})")
    kv = heads if a.get("num_heads_kv") is None else a["num_heads_kv"]
    if heads % kv:
        raise ConfigError(
            f"{where}num_heads = {heads} is not divisible by num_heads_kv = {kv}: each key/value head "
            "serves the same number of query heads (grouped-query attention)"
        )
    if a.get("head_dim") is None and d_model % heads:
        raise ConfigError(
            f"{where}num_heads: the width does not add up: d_model (embed_dim) = {d_model} is not "
            f"divisible by num_heads = {heads}; set head_dim, or a num_heads that divides d_model"
        )
    rot, hd = a.get("rotary_emb_dim", 0), a.get("head_dim") or d_model // heads
    if rot % 2:
        raise ConfigError(
            f"{where}rotary_emb_dim must be even: the rotary embedding turns dimensions in pairs (got {rot})"
        )
    if rot > hd:
        raise ConfigError(
            f"{where}rotary_emb_dim = {rot} is larger than the head dimension {hd}: it must be at most "
            "head_dim (rotary covers the first rotary_emb_dim dimensions of q and k)"
        )
    scale = a.get("softmax_scale")
    if scale is not None and not (isinstance(scale, (int, float)) and scale > 0):
        raise ConfigError(f"{where}softmax_scale must be > 0, or None for 1/sqrt(head_dim) (got {scale!r})")
    base = a.get("rotary_emb_base", 1.0)
    if not (isinstance(base, (int, float)) and base > 0):
        raise ConfigError(f"{where}rotary_emb_base must be > 0 (got {base!r})")


@dataclass
class ModelConfig:
    """Shape and switches of `Mamba3Transformer`. Field names follow the official Mamba-3 layer."""

    vocab_size: int = field(
        default=50257, metadata={"help": "vocabulary size V (GPT-2: 50,257); rows of the tied embedding"}
    )
    d_model: int = field(default=768, metadata={"help": "residual stream width D"})
    n_layers: int = field(
        default=12, metadata={"help": "number of layers, each = Mamba-3 mixer block + SwiGLU MLP block"}
    )
    d_intermediate: int = field(
        default=1500,
        metadata={
            "help": "SwiGLU hidden width F before rounding; the real width is rounded up to a multiple "
            "of mlp_multiple_of (as the official GatedMLP); 0 = no MLP blocks"
        },
    )
    mlp_multiple_of: int = field(
        default=128, metadata={"help": "the MLP width is rounded up to a multiple of this"}
    )
    d_state: int = field(default=128, metadata={"help": "SSM state size N per head (state is P x N)"})
    expand: int = field(default=2, metadata={"help": "mixer inner width d_inner = expand * d_model"})
    headdim: int = field(default=64, metadata={"help": "head dimension P; nheads = d_inner / headdim"})
    ngroups: int = field(
        default=1, metadata={"help": "number of B/C groups G, each shared by nheads/G heads (num_bc_heads)"}
    )
    rope_fraction: float = field(
        default=0.5,
        metadata={"help": "fraction of the d_state channels rotated by the data-dependent RoPE: 0.5 or 1.0"},
    )
    A_floor: float = field(
        default=1e-4, metadata={"help": "lower bound on -A (decay rate per unit of Δ), keeps A strictly < 0"}
    )
    a_activation: str = field(
        default="heavy_tail",
        metadata={
            "help": "A = -max(f(a), A_floor) with f = 'heavy_tail' (official HEAD: 1+a for a>=0, "
            "1/(1-a) for a<0) or 'softplus' (paper release)"
        },
    )
    dt_min: float = field(default=1e-3, metadata={"help": "lower end of the log-uniform Δ initialisation"})
    dt_max: float = field(default=0.1, metadata={"help": "upper end of the log-uniform Δ initialisation"})
    dt_init_floor: float = field(default=1e-4, metadata={"help": "floor applied to the initial Δ samples"})
    is_outproj_norm: bool = field(
        default=False,
        metadata={"help": "pre-gate grouped (per-head) RMSNorm on the mixer output (the paper's hybrids)"},
    )
    is_mimo: bool = field(default=False, metadata={"help": "multi-input multi-output SSM of rank mimo_rank"})
    mimo_rank: int = field(
        default=4, metadata={"help": "MIMO rank R; ignored (treated as 1) when is_mimo is false, as official"}
    )
    chunk_size: int = field(
        default=64,
        metadata={"help": "tokens per chunk of the parallel scan (official: 64 SISO, 64/R for MIMO)"},
    )
    trapezoid: bool = field(
        default=True,
        metadata={
            "help": "exponential-trapezoidal discretisation with learned λ; false = λ≡1, "
            "exponential-Euler as Mamba-2 (ablation)"
        },
    )
    rope: bool = field(
        default=True, metadata={"help": "data-dependent rotation of B and C; false = no rotation (ablation)"}
    )
    scan_impl: str = field(
        default="auto",
        metadata={
            "help": "scan backend, all computing the same function: 'chunked' (pure PyTorch, any "
            "device), 'sequential' (the reference recurrence, slow), 'triton' (fused kernels: CUDA, "
            "or CPU under TRITON_INTERPRET=1), 'auto' (today 'chunked' everywhere, see "
            "docs/guides/gpus-and-scan-backends.md)"
        },
    )
    tie_embeddings: bool = field(
        default=True, metadata={"help": "LM head shares its weight with the token embedding"}
    )
    norm_eps: float = field(default=1e-5, metadata={"help": "epsilon of the model's RMSNorms"})
    reset_at_eos: bool = field(
        default=False,
        metadata={
            "help": "a token whose previous input token is eos_id starts from a fresh state, so packed "
            "documents behave as if each ran alone"
        },
    )
    eos_id: int = field(default=50256, metadata={"help": "end-of-document token id (GPT-2: 50,256)"})
    init_std: float = field(default=0.02, metadata={"help": "standard deviation of the embedding init"})
    attn_layer_idx: tuple[int, ...] = field(
        default=(),
        metadata={
            "help": "indices of the layers whose mixer is attention (the official MHA, from attn_cfg) "
            "instead of Mamba-3, as mamba_ssm's MambaConfig; empty = a pure Mamba-3 model"
        },
    )
    attn_cfg: dict[str, Any] = field(
        default_factory=dict,
        metadata={
            "help": "keywords of the attention layers, as mamba_ssm's MambaConfig: num_heads (required), "
            "num_heads_kv, head_dim, rotary_emb_dim, rotary_emb_base, rotary_emb_interleaved, "
            "qkv_proj_bias, out_proj_bias, softmax_scale, d_conv, mlp_dim"
        },
    )

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ConfigError:
            return ConfigError(f"model.{name} {why} (got {getattr(self, name)!r})")

        self._check_layer_kinds_types()
        # Types first: YAML gives strings/floats where ints are meant only when the user made a typo.
        for f in fields(self):
            if f.name in ("attn_layer_idx", "attn_cfg"):
                continue  # checked above
            value = getattr(self, f.name)
            want = type(f.default)
            if want is float and isinstance(value, (int, str)) and not isinstance(value, bool):
                # YAML 1.1 reads "1e-4" as a string and "1" as an int; both mean a float here.
                try:
                    setattr(self, f.name, float(value))
                except ValueError:
                    raise bad(f.name, "must be a number") from None
            elif not isinstance(value, want) or (want is int and isinstance(value, bool)):
                raise bad(f.name, f"must be of type {want.__name__}")

        for name in ("vocab_size", "d_model", "n_layers", "d_state", "expand", "headdim", "ngroups"):
            if getattr(self, name) < 1:
                raise bad(name, "must be >= 1")
        if self.d_intermediate < 0:
            raise bad("d_intermediate", "must be >= 0 (0 = no MLP)")
        if self.mlp_multiple_of < 1:
            raise bad("mlp_multiple_of", "must be >= 1")
        if self.chunk_size < 1:
            raise bad("chunk_size", "must be >= 1")
        if self.d_inner % self.headdim:
            raise bad("headdim", f"must divide d_inner = expand * d_model = {self.d_inner}")
        if self.nheads % self.ngroups:
            raise bad("ngroups", f"must divide nheads = {self.nheads}")
        if self.rope_fraction not in (0.5, 1.0):
            raise bad("rope_fraction", "must be 0.5 or 1.0")
        if self.rope and self.n_angles < 1:
            raise bad("d_state", "is too small: int(d_state * rope_fraction) must be >= 2")
        if self.rope and self.d_state % 2:
            raise bad("d_state", "must be even (the rotation turns channels in pairs)")
        if self.a_activation not in A_ACTIVATIONS:
            raise bad("a_activation", f"must be one of {', '.join(A_ACTIVATIONS)}")
        check_scan_impl(self.scan_impl)
        if not self.A_floor >= 0:
            raise bad("A_floor", "must be >= 0")
        if not 0 < self.dt_min <= self.dt_max:
            raise bad("dt_min", f"must satisfy 0 < dt_min <= dt_max = {self.dt_max}")
        if not self.dt_init_floor > 0:
            raise bad("dt_init_floor", "must be > 0")
        if self.is_mimo and self.mimo_rank < 1:
            raise bad("mimo_rank", "must be >= 1")
        if not self.norm_eps > 0:
            raise bad("norm_eps", "must be > 0")
        if not self.init_std > 0:
            raise bad("init_std", "must be > 0")
        if not 0 <= self.eos_id < self.vocab_size:
            raise bad("eos_id", f"must be a token id in [0, vocab_size = {self.vocab_size})")
        for name in ("rope_fraction", "A_floor", "dt_min", "dt_max", "norm_eps", "init_std"):
            if not math.isfinite(getattr(self, name)):
                raise bad(name, "must be finite")
        self._check_attention()

    def _check_layer_kinds_types(self) -> None:
        """attn_layer_idx as a tuple of ints (JSON and YAML give a list), attn_cfg a mapping of known
        keys with values of the official layer's types (YAML's "1e4" read as the number it means)."""
        idx = self.attn_layer_idx
        if not isinstance(idx, (list, tuple)) or any(
            isinstance(i, bool) or not isinstance(i, int) for i in idx
        ):
            raise ConfigError(f"model.attn_layer_idx must be a list of layer indices (got {idx!r})")
        self.attn_layer_idx = tuple(idx)
        if not isinstance(self.attn_cfg, dict):
            raise ConfigError(
                f"model.attn_cfg must be a mapping of attention keywords, e.g. {{num_heads: 12}} "
                f"(got {self.attn_cfg!r})"
            )
        out: dict[str, Any] = {}
        for key, value in self.attn_cfg.items():
            where = f"model.attn_cfg.{key}"
            if key not in ATTN_CFG_DEFAULTS:
                hint = did_you_mean_hint(
                    str(key), ATTN_CFG_DEFAULTS, otherwise=f"; known: {', '.join(ATTN_CFG_DEFAULTS)}"
                )
                raise ConfigError(f"model.attn_cfg: unknown key `{key}`{hint}")
            if value is None and ATTN_CFG_DEFAULTS[key] is None:
                out[key] = None
            elif key in _ATTN_BOOLS:
                if not isinstance(value, bool):
                    raise ConfigError(f"{where} must be true or false (got {value!r})")
                out[key] = value
            elif key in _ATTN_INTS:
                if isinstance(value, bool) or not isinstance(value, int):
                    raise ConfigError(f"{where} must be an integer (got {value!r})")
                out[key] = value
            else:
                assert key in _ATTN_FLOATS, key
                try:
                    number = float(value) if not isinstance(value, bool) else math.nan
                except (TypeError, ValueError):
                    number = math.nan
                if not math.isfinite(number):
                    raise ConfigError(f"{where} must be a finite number (got {value!r})")
                out[key] = number
        self.attn_cfg = out

    def _check_attention(self) -> None:
        """The attention layers' placement and shape, with the official layer's own rules."""
        self._check_attention_placement()
        if self.attn_layer_idx:
            check_attention_shape(self.attn_cfg, self.d_model, "model.attn_cfg.")

    def _check_attention_placement(self) -> None:
        """Each index names a layer, once; attn_cfg only beside attention layers."""
        idx, n = self.attn_layer_idx, self.n_layers
        for i in idx:
            if not 0 <= i < n:
                raise ConfigError(
                    f"model.attn_layer_idx: layer {i} is out of range for n_layers = {n} "
                    f"(indices are 0 to {n - 1}) (got {list(idx)!r})"
                )
        repeated = sorted(i for i, count in Counter(idx).items() if count > 1)
        if repeated:
            raise ConfigError(
                f"model.attn_layer_idx names layer {repeated[0]} more than once; list each attention "
                f"layer once (got {list(idx)!r})"
            )
        if not idx and self.attn_cfg:
            raise ConfigError(
                "model.attn_cfg is set but model.attn_layer_idx is empty, so no layer would use it: "
                "name the attention layers (e.g. attn_layer_idx: [3, 7]) or drop attn_cfg"
            )

    def layer_kind(self, i: int) -> str:
        """The mixer kind of layer `i`: "attention" for the indices in attn_layer_idx, else "mamba3"."""
        assert 0 <= i < self.n_layers, i
        return ATTENTION_KIND if i in self.attn_layer_idx else MAMBA3_KIND

    # ---- derived sizes (docs/model.md §1.1) ----
    @property
    def d_inner(self) -> int:
        """Mixer inner width E = expand * d_model."""
        return self.expand * self.d_model

    @property
    def nheads(self) -> int:
        """Number of SSM heads H = d_inner / headdim."""
        return self.d_inner // self.headdim

    @property
    def rank(self) -> int:
        """Effective MIMO rank R: mimo_rank when is_mimo, else 1 (official behaviour)."""
        return self.mimo_rank if self.is_mimo else 1

    @property
    def n_angles(self) -> int:
        """Number of rotary angles S: split = int(N * rope_fraction) made even, S = split / 2."""
        split = int(self.d_state * self.rope_fraction)
        split -= split % 2
        return split // 2

    @property
    def d_mlp(self) -> int:
        """Real SwiGLU width F: d_intermediate rounded up to a multiple of mlp_multiple_of (0 = no MLP)."""
        m = self.mlp_multiple_of
        return (self.d_intermediate + m - 1) // m * m

    @property
    def d_in_proj(self) -> int:
        """Width of the mixer's in_proj: 2E + 2·N·G·R + 3H + S (official split order z,x,B,C,Δ,A,λ,θ);
        the ablations drop the λ columns (trapezoid off: H fewer) and the θ columns (rope off: S fewer)."""
        bc = 2 * self.d_state * self.ngroups * self.rank
        lam = self.nheads if self.trapezoid else 0
        theta = self.n_angles if self.rope else 0
        return 2 * self.d_inner + bc + 2 * self.nheads + lam + theta

    # ---- derived sizes of the attention layers (the official MHA's) ----
    @property
    def attn_num_heads_kv(self) -> int:
        """Key/value heads of an attention layer: attn_cfg.num_heads_kv, else num_heads."""
        kv = self.attn_cfg.get("num_heads_kv")
        return self.attn_cfg.get("num_heads", 1) if kv is None else kv

    @property
    def attn_head_dim(self) -> int:
        """Head dimension of an attention layer: attn_cfg.head_dim, else d_model // num_heads."""
        hd = self.attn_cfg.get("head_dim")
        return self.d_model // self.attn_cfg.get("num_heads", 1) if hd is None else hd

    @property
    def attn_mlp_dim(self) -> int:
        """The attention layer's in_proj MLP columns: mlp_dim rounded up to a multiple of 256 (official);
        half of them (after the gate) enter out_proj."""
        m = ATTN_MLP_MULTIPLE
        return (self.attn_cfg.get("mlp_dim", 0) + m - 1) // m * m

    @classmethod
    def field_help(cls) -> dict[str, str]:
        """Field name -> its documentation (the config reference, docs/reference/config.md, is made of it)."""
        return {f.name: f.metadata["help"] for f in fields(cls)}
