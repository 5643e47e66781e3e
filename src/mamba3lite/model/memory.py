"""Training memory of a config, by measurement: what autograd keeps per token and layer, times the batch.

Layers are counted by kind (model/layer_kinds.py): one block of each kind present is measured, and the
sum over the layers is the count of each kind times its block's bytes. A kind whose activations grow
with the length (attention) is measured at the run's window length, and its bytes per token there taken
from the growth over T/4, T/2 and T (a quadratic through three lengths: exact for what an O(T²) layer
keeps); a Mamba-3 block's are the same at every length and measured as below.

`activation_bytes_per_token` runs one `Block` forward on the CPU at the run's compute dtype (`compute`:
torch.bfloat16, under autocast as the trainer runs on accelerators, or None, no autocast: an fp32 run,
e.g. `training.dtype: auto` on a CPU without native bf16, keeps fp32 activations, ~1.8x the bytes) and
adds up the distinct storages saved for the backward pass, at two lengths: the growth per token leaves
out the weights and their copies. The callers pass what `training.dtype` resolves to on the run's
device (model/precision.py); bf16, the presets' accelerators', is the default. `training_memory_bytes`
scales that by micro batch × window × layers (or, with gradient checkpointing, keeps one fp32 layer input
per layer plus one layer's activations) and adds 16 bytes per parameter: fp32 weights, gradients and
AdamW's two moments (another optimizer's state: `optimizer_state_bytes`). On the H200
(benchmarks/RESULTS.md, GPU section) the measured eager peaks came out 4-7% below this estimate, for a layer
that kept 12.75 KiB per token more than it does now (in_proj's whole output, SiLU(z), out_proj's input); the
presets' micro batches are sized with it to fit an 80 GB accelerator.
The estimate measures the layer with the config's scan (`chunked` on the CPU);
benchmarks/activation_memory.py compares it with the Triton scan's and the Transformer's. Under
torch.compile (`training.compile`) the compiler picks what to save and the peaks were ~1.4x this
estimate.

Per rank (`per_rank_memory`): the fp32 weights, gradients and optimizer state (the registry's bytes per
parameter, mamba3lite/optimizers.py: AdamW 8; Muon 4 for its hidden matrices) are divided by the
processes that shard them (fsdp: the data-parallel size; hsdp: its shard groups; ddp and one process: 1),
plus what a sharded model gathers while a block computes (two blocks' weights, the one running and the one
prefetched, and one block's unsharded gradients; every block's weights from forward to backward when
`reshard_after_forward` is off); activations are those of T / C tokens of each window (C the
context-parallel size), each layer measured as the group's last rank runs it, so that what a kind gathers
from the other ranks and keeps (attention: the whole window's keys and values, a (T / C) × T mask) is
counted. Blocks run as the run runs them: with resets when `reset_at_eos` (attention's masked path keeps
the mask, as an additive one of the compute dtype). `check_model_fits` refuses what cannot fit even
sharded, and
`replicated_fits` is the question `parallelism: auto` asks. The autograd measurement runs at 256 tokens
at most: the bytes kept per token are the same at any length (the chunked scan's memory is linear in
T; tests/test_memory.py checks it), and a 7B layer forward at 2,048 tokens takes minutes on a CPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from mamba3lite.errors import ConfigError
from mamba3lite.model.config import ModelConfig
from mamba3lite.model.context_parallel import MeasuredRank
from mamba3lite.model.flops import block_parameters, count_parameters
from mamba3lite.model.layer_kinds import LAYER_KINDS, layers_by_kind
from mamba3lite.model.transformer import Block, Mamba3Transformer
from mamba3lite.optimizers import lookup

# Tokens of the autograd measurement: bytes per token do not depend on the length (module docstring).
PROBE_TOKENS = 256
# Of a device's memory, what training may plan to use: the CUDA context, the allocator's fragmentation
# and the collectives' buffers take the rest (the presets keep 72 of 80 GB).
USABLE_FRACTION = 0.9
_PER_TOKEN_CACHE: dict[tuple[str, str, int, torch.dtype | None], float] = {}
# Layers above this many parameters are measured on fake tensors (`saved_bytes`): from the 880M presets
# up (29M per layer), where one real bf16 measurement on a CPU without native bf16 costs as much as the
# fake one's start-up in a fresh process, and about 8x a fake one after it.
FAKE_ABOVE_PARAMETERS = 20_000_000
# A kind whose activations grow with the length is measured at the run's window, on fake tensors above this
# many tokens: real ones at the long-context table's 512K-token windows take tens of GB of the planning
# machine's memory (the 180M hybrid's attention block: ~37 KB a token, the same fake or real at 1-2K).
FAKE_ABOVE_TOKENS = 4096


def saved_bytes(
    layer: torch.nn.Module,
    d_model: int,
    seq_len: int,
    fake: bool = False,
    compute: torch.dtype | None = torch.bfloat16,
    resets: bool = False,
) -> int:
    """Bytes of the distinct storages autograd keeps for the backward of one forward of `layer` on
    (1, seq_len, d_model) on the CPU under autocast to `compute` (None: no autocast, fp32), weights and
    their autocast copies included. `resets`: the forward takes reset_BT as well (a `Block` of a
    `reset_at_eos` model, whose every window has them: the attention kind then takes its masked path),
    with a document starting halfway (what is kept depends on the resets' presence, not their places).

    `fake`: run the forward on fake tensors (FakeTensorMode: the same ops, autocast's casts and every
    storage's size, no arithmetic; tests/test_memory.py checks the count equals the real forward's).
    What is kept depends on shapes and dtypes only, and a big preset's layer in bf16 takes minutes on
    a CPU without native bf16; the fake forward costs a fixed few seconds instead (its first use in a
    process) plus a per-op overhead, more than a small layer's real forward. Under fake tensors a
    weight saved as itself (real) is counted as the fake copy the mode made of it, the storage its
    views saved beside it share (in fp32 nothing casts a weight, so both are saved)."""
    storages: dict[int, int] = {}
    kept: list[torch.Tensor] = []
    mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else None

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen = mode.from_tensor(t) if mode is not None and not isinstance(t, FakeTensor) else t
        kept.append(seen)  # alive to the end: a freed storage's identity may be reused
        st = seen.untyped_storage()
        storages[st._cdata] = st.nbytes()  # the storage's identity (a fake one has no data pointer)
        return t

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    cast = contextlib.nullcontext() if compute is None else torch.autocast("cpu", dtype=compute)
    with mode if mode is not None else contextlib.nullcontext():
        x = torch.randn(1, seq_len, d_model, requires_grad=True)
        extra = ()
        if resets:
            reset_BT = torch.zeros(1, seq_len, dtype=torch.bool)
            reset_BT[:, seq_len // 2] = True
            extra = (reset_BT,)
        with hooks, cast:
            layer(x, *extra)
    return sum(storages.values())


def model_saved_bytes(
    model: torch.nn.Module,
    x_BT: torch.Tensor,
    y_BT: torch.Tensor,
    compute: torch.dtype | None = torch.bfloat16,
) -> int:
    """Bytes of the distinct storages autograd keeps for the backward of one training forward of the
    whole `model` (`model(x_BT, y_BT)`: the loss included) under autocast to `compute` on the CPU (None:
    fp32), less the parameters' own storages; the check of the estimate (tests/test_memory_hybrid.py,
    benchmarks/activation_memory.py): the activations of a micro batch are what grows with it, the
    difference of two batch sizes (the weights' autocast copies stay the same)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}
    kept: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        kept.append(t)  # alive to the end: a freed storage's address may be reused
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            storages[st.data_ptr()] = st.nbytes()
        return t

    cast = contextlib.nullcontext() if compute is None else torch.autocast("cpu", dtype=compute)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), cast:
        model(x_BT, y_BT)
    return sum(storages.values())


def saved_bytes_per_token(
    layer: torch.nn.Module,
    d_model: int,
    seq_len: int = 2048,
    fake: bool = False,
    compute: torch.dtype | None = torch.bfloat16,
    resets: bool = False,
) -> float:
    """What `layer` keeps for its backward per token at compute dtype `compute`: the growth of
    `saved_bytes` from seq_len / 2 to seq_len tokens, so that the weights and their copies (the same at
    every length) drop out."""
    half = seq_len // 2
    grown = saved_bytes(layer, d_model, seq_len, fake, compute, resets) - saved_bytes(
        layer, d_model, half, fake, compute, resets
    )
    return grown / (seq_len - half)


def saved_bytes_per_token_growing(
    layer: torch.nn.Module,
    d_model: int,
    seq_len: int,
    fake: bool = False,
    compute: torch.dtype | None = torch.bfloat16,
    resets: bool = False,
) -> float:
    """What `layer` keeps for its backward per token at `seq_len` tokens when that grows with the length
    (attention's T × T weights on a path that keeps them): saved(t) = a·t² + b·t + w through t = T/4, T/2,
    T, and the bytes per token at T are a·T + b (the weights w drop out). Exact for a linear layer too
    (a = 0); below 4 tokens, `saved_bytes_per_token`."""
    t1, t2, t3 = seq_len // 4, seq_len // 2, seq_len
    if t1 < 1:
        return saved_bytes_per_token(layer, d_model, seq_len, fake, compute, resets)
    s1, s2, s3 = (saved_bytes(layer, d_model, t, fake, compute, resets) for t in (t1, t2, t3))
    d12, d23 = (s2 - s1) / (t2 - t1), (s3 - s2) / (t3 - t2)  # divided differences
    a = (d23 - d12) / (t3 - t1)
    b = d12 - a * (t1 + t2)
    return a * t3 + b


def layer_activation_bytes_per_token(
    cfg: ModelConfig,
    kind: str,
    seq_len: int = 2048,
    compute: torch.dtype | None = torch.bfloat16,
    context_parallel: int = 1,
) -> float:
    """Bytes saved for backward per token of a rank's piece by one block whose mixer is of `kind` (batch 1)
    at compute dtype `compute` (bf16 autocast, or None: fp32), in windows of `seq_len` tokens cut into
    `context_parallel` pieces; once per config, kind, length, dtype and C in a process; on fake tensors for
    a block of more than FAKE_ABOVE_PARAMETERS or a window of more than FAKE_ABOVE_TOKENS.

    The block runs as the run runs it: with resets when `cfg.reset_at_eos` (then every window has them,
    and attention takes its masked path), and, for C > 1, as the group's last rank (`MeasuredRank`, set
    through its kind's `set_context_parallel`), the one that keeps most: what its kind gathers from the
    other ranks (attention's keys and values of the whole window, and a (T/C) × T mask) does not shrink
    with C and is counted in its bytes per piece token. A kind whose bytes per token do not depend on the
    length is measured at min(T/C, PROBE_TOKENS) tokens; one whose bytes grow with it, at T/C
    (`saved_bytes_per_token_growing`: under C the gathered keys grow as C·t, the mask as C·t²)."""
    kind_of = LAYER_KINDS[kind]
    piece = max(2, seq_len // context_parallel)  # the growth needs two lengths (a window of C tokens: 1)
    probe = piece if kind_of.activations_grow_with_length else min(piece, PROBE_TOKENS)
    key = (repr(cfg), kind, probe, compute, context_parallel)
    if key not in _PER_TOKEN_CACHE:
        with torch.random.fork_rng(devices=[]):  # the layer's init draws on the CPU generator: restored after
            layer = Block(cfg, layers_by_kind(cfg)[kind][1])
            if context_parallel > 1:
                last = MeasuredRank(context_parallel - 1, context_parallel)
                kind_of.set_context_parallel(layer.mixer, last)
            fake = (
                sum(p.numel() for p in layer.parameters()) > FAKE_ABOVE_PARAMETERS
                or probe * context_parallel > FAKE_ABOVE_TOKENS
            )
            growing = kind_of.activations_grow_with_length
            measure = saved_bytes_per_token_growing if growing else saved_bytes_per_token
            _PER_TOKEN_CACHE[key] = measure(layer, cfg.d_model, probe, fake, compute, cfg.reset_at_eos)
    return _PER_TOKEN_CACHE[key]


def activation_bytes_per_token(
    cfg: ModelConfig,
    seq_len: int = 2048,
    compute: torch.dtype | None = torch.bfloat16,
    context_parallel: int = 1,
) -> float:
    """Bytes saved for backward per token (of a rank's piece) by one layer, on average over the layers
    (by kind: `layer_activation_bytes_per_token`); a pure model's every layer keeps this much."""
    kinds = layers_by_kind(cfg)
    total = sum(
        n * layer_activation_bytes_per_token(cfg, k, seq_len, compute, context_parallel)
        for k, (n, _) in kinds.items()
    )
    return total / cfg.n_layers


def activation_bytes(
    cfg: ModelConfig,
    micro_batch: int,
    seq_len: int,
    grad_checkpointing: bool = False,
    context_parallel: int = 1,
    compute: torch.dtype | None = torch.bfloat16,
) -> float:
    """Activations of one micro step on one rank at compute dtype `compute` (bf16 autocast, or None:
    fp32): micro_batch windows of seq_len / context_parallel tokens each, summed over the layers by
    kind, each measured as the run runs it (resets, the largest rank's piece:
    `layer_activation_bytes_per_token`). With gradient checkpointing each layer keeps its fp32 input and
    one layer's activations (the largest kind's) are live at a time."""
    tokens = micro_batch * seq_len / context_parallel
    per_kind = {
        k: (n, layer_activation_bytes_per_token(cfg, k, seq_len, compute, context_parallel) * tokens)
        for k, (n, _) in layers_by_kind(cfg).items()
    }
    if grad_checkpointing:
        return cfg.n_layers * 4 * cfg.d_model * tokens + max(b for _, b in per_kind.values())
    return sum(n * b for n, b in per_kind.values())


def training_memory_bytes(
    cfg: ModelConfig,
    micro_batch: int,
    seq_len: int,
    grad_checkpointing: bool = False,
    compute: torch.dtype | None = torch.bfloat16,
    optimizer: str = "adamw",
) -> float:
    """Estimated peak bytes of one training process holding the whole model: activations of a micro step
    at compute dtype `compute` + fp32 weights and gradients (8 bytes per parameter) + the optimizer's
    state (AdamW's: 8 more)."""
    activations = activation_bytes(cfg, micro_batch, seq_len, grad_checkpointing, compute=compute)
    return activations + 8 * count_parameters(cfg) + optimizer_state_bytes(cfg, optimizer)


def optimizer_state_bytes(cfg: ModelConfig, optimizer: str = "adamw") -> int:
    """Bytes of optimizer state for the whole model: the registered optimizer's `state_bytes` per element
    of each parameter (optimizers.py: AdamW's two fp32 moments; Muon's one momentum for the hidden matrices
    and AdamW's moments for the rest), counted over the model's own parameter names and shapes, so the
    rule of which parameter gets what is the optimizer's alone. Built on the meta device (shapes, no
    memory, no arithmetic): one block of each layer kind (its bytes times the layers of that kind:
    `layers_by_kind`, no loop over n_layers) and the rest of the model (embedding, final norm, an untied
    head). An unknown optimizer: ConfigError."""
    kind = lookup(optimizer)

    def state(module: torch.nn.Module, prefix: str = "") -> int:
        return sum(kind.state_bytes(prefix + name, p) * p.numel() for name, p in module.named_parameters())

    with torch.device("meta"):
        total = sum(n * state(Block(cfg, i), f"layers.{i}.") for n, i in layers_by_kind(cfg).values())
        root = Mamba3Transformer(dataclasses.replace(cfg, n_layers=1, attn_layer_idx=(), attn_cfg={}))
        root.layers = torch.nn.ModuleList()  # the parameters outside the layers: counted by their names
        return total + state(root)  # (a tied head is the embedding: counted once, as trained)


def largest_unit_parameters(cfg: ModelConfig) -> int:
    """Parameters of the largest piece a sharded model gathers at once: one block (norms, mixer, MLP;
    the largest kind's), or the embedding (with the final norm and an untied head, gathered with the
    root module)."""
    D = cfg.d_model
    block = max(block_parameters(cfg, k) for k in layers_by_kind(cfg))
    root = cfg.vocab_size * D * (1 if cfg.tie_embeddings else 2) + D
    return max(block, root)


@dataclass(frozen=True)
class RankMemory:
    """Estimated peak bytes of one training rank, by part."""

    params: float  # fp32 weights held by this rank (its shard)
    grads: float  # fp32 gradients held by this rank (its shard)
    optimizer: float  # optimizer state of its shard
    gathered: float  # a sharded model's gathered weights and unsharded gradients while a block computes
    activations: float  # kept for the backward of one micro step
    shards: int = 1  # processes the model state is divided over
    context_parallel: int = 1  # processes sharing each window

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.gathered + self.activations

    def parts_gib(self) -> dict[str, float]:
        """{part: GiB} for printing, total last."""
        names = ("params", "grads", "optimizer", "gathered", "activations", "total")
        return {k: getattr(self, k) / 2**30 for k in names}


def per_rank_memory(
    model_cfg: ModelConfig,
    training_cfg: Any,
    *,
    shards: int = 1,
    context_parallel: int | None = None,
    compute: torch.dtype | None = torch.bfloat16,
) -> RankMemory:
    """The estimate for one rank of a run of `model_cfg` with `training_cfg` (micro_batch_size,
    max_seq_len, grad_checkpointing, optimizer, reshard_after_forward) when the model state is sharded
    over `shards` processes and each window over `context_parallel` (default: the config's), its
    activations at compute dtype `compute` (what `training_cfg.dtype` resolves to on the run's device:
    model/precision.py; bf16 autocast, or None for fp32)."""
    t = training_cfg
    cp = t.context_parallel if context_parallel is None else context_parallel
    if shards < 1 or cp < 1:
        raise ConfigError(f"shards and context_parallel must be >= 1, got {shards} and {cp}")
    n = count_parameters(model_cfg)
    gathered = 0.0
    if shards > 1:
        unit = largest_unit_parameters(model_cfg)
        kept = 2 * 4 * unit  # the block computing and the one prefetched
        if not getattr(t, "reshard_after_forward", True):
            kept = max(kept, 4 * n)  # every block stays gathered from its forward to its backward
        gathered = kept + 4 * unit
    return RankMemory(
        params=4 * n / shards,
        grads=4 * n / shards,
        optimizer=optimizer_state_bytes(model_cfg, getattr(t, "optimizer", "adamw")) / shards,
        gathered=gathered,
        activations=activation_bytes(
            model_cfg, t.micro_batch_size, t.max_seq_len, t.grad_checkpointing, cp, compute
        ),
        shards=shards,
        context_parallel=cp,
    )


def shard_count(parallelism: str, dp_size: int, dp_replicate: int = 1) -> int:
    """Processes the model state is divided over: fsdp all `dp_size` data-parallel ones, hsdp one
    shard group (dp_size / dp_replicate), ddp (and one process) none."""
    if dp_size <= 1 or parallelism == "ddp":
        return 1
    if parallelism == "fsdp":
        return dp_size
    if parallelism == "hsdp":
        return max(1, dp_size // dp_replicate)
    raise ConfigError(
        f"shard_count: parallelism must be ddp, fsdp or hsdp (auto is resolved first), got {parallelism}"
    )


def usable_memory_bytes(device: torch.device) -> float | None:
    """What training may plan to use of `device` (USABLE_FRACTION of it); None where unknown."""
    have = physical_memory_bytes(device)
    return None if have is None else USABLE_FRACTION * have


def replicated_fits(
    model_cfg: ModelConfig,
    training_cfg: Any,
    device: torch.device,
    compute: torch.dtype | None = torch.bfloat16,
) -> bool:
    """Whether one whole copy of the model trains on `device` (ddp, or one process) at compute dtype
    `compute`, by `per_rank_memory` against the usable part of its memory; True where the memory is
    unknown (nothing to decide from)."""
    have = usable_memory_bytes(device)
    return have is None or per_rank_memory(model_cfg, training_cfg, compute=compute).total <= have


def physical_memory_bytes(device: torch.device) -> int | None:
    """The memory `device` has in all: a CUDA device's total, the host's RAM for the CPU; None where
    unknown."""
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return None  # a plan for a CUDA machine made on one without
        return torch.cuda.get_device_properties(device).total_memory
    if device.type == "cpu":
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):  # not a POSIX host
            return None
    return None


def check_model_fits(
    cfg: ModelConfig, device: torch.device, *, shards: int = 1, optimizer: str = "adamw"
) -> None:
    """ConfigError, before anything is built, for a model whose training state cannot fit `device` at
    all: fp32 weights, gradients and optimizer state (16 bytes per parameter with AdamW) divided over
    `shards` processes beyond its whole memory, or fp32 weights beyond the host's RAM, where the model is
    built first. (Building 10^8 layers one small allocation at a time would not fail: it would take
    hours.) When sharding over more processes would fit, the message says so."""
    n = count_parameters(cfg)
    shape = f"d_model {cfg.d_model}, n_layers {cfg.n_layers}, vocab_size {cfg.vocab_size}"
    size = f"{n / 1e6:,.1f}M parameters ({shape})"
    have = physical_memory_bytes(torch.device("cpu"))
    if have is not None and 4 * n > have:
        raise ConfigError(
            f"the model has {size}: ~{4 * n / 2**30:,.1f} GiB, more than this machine's RAM (the model is "
            f"built on the host), {have / 2**30:,.1f} GiB; use a smaller model (e.g. --config tiny)"
        )
    state = 8 * n + optimizer_state_bytes(cfg, optimizer)  # after the RAM check: it builds one layer
    have = physical_memory_bytes(device)
    if have is None or state / shards <= have:
        return
    where = f"{torch.device(device)}'s memory, {have / 2**30:,.1f} GiB"
    need = math.ceil(state / have)
    what = f"~{state / shards / 2**30:,.1f} GiB of weights, gradients and {optimizer} state"
    if shards > 1:
        what += f" per process over {shards} shards"
    raise ConfigError(
        f"the model has {size}: {what}, more than {where}; shard it over {need} or more processes "
        f"(training.parallelism=fsdp, torchrun --nproc_per_node {need}), or use a smaller model "
        "(e.g. --config tiny)"
    )
