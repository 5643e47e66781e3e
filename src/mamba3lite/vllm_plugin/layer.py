"""The Mamba-3 mixer as a vLLM state layer: `VllmMamba3` is the package's `Mamba3` (same parameters,
same math) plus what vLLM needs to keep its decode state in the engine's cache.

vLLM gives each request one cache slot per layer and, each step, one flat batch of tokens: decode
requests first (one token each), then prefill pieces (a prompt, or a chunk of one under chunked
prefill), as `attn_metadata[prefix]` describes (vLLM's Mamba-1 metadata, which holds exactly what this
layer reads: the split, the pieces' bounds, their slots, and whether a piece continues a state).

    decode tokens   -> `Mamba3.step` on the rows' states, gathered from their slots and written back
    prefill pieces  -> `Mamba3.forward` with the slot's state as its cache (the chunked scan from that
                       initial state; zero for a request's first piece), the final state written in place

The slot's state tensors are the parts of the mixer's decode state, in the state's own order
(`tensors()` of the decode-state protocol, model/decode_state.py), one vLLM state each: their shapes and
dtypes come from `Mamba3.allocate_state` itself (`state_spec`), and `slot_cache` builds the state from
them (`with_tensors`), so the layout is defined once, by the model, and named only there.

Resets at EOS (`reset_at_eos`): the token after an EOS starts from a fresh state. Inside a piece that is
the scan's reset; across pieces and steps the state a token ending in EOS leaves behind is zeroed,
which is the same thing (a zero state, zero previous key and value, angles from 0).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor
from vllm.config import CacheConfig, ModelConfig, get_current_vllm_config
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.v1.attention.backends.mamba1_attn import Mamba1AttentionBackend
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

from mamba3lite.errors import ConfigError
from mamba3lite.model.config import ModelConfig as Mamba3Config
from mamba3lite.model.decode_state import RowTensors
from mamba3lite.model.mamba3 import Mamba3


class Mamba3LiteStateBackend(Mamba1AttentionBackend):
    """The layers' vLLM state backend: Mamba-1's metadata builder under a name of our own (registered by
    the plugin as MambaAttentionBackendEnum.MAMBA3LITE), so vLLM's Mamba-1/2 kernel set-up skips it."""

    @staticmethod
    def get_name() -> str:
        return "MAMBA3LITE_STATE"


def meta_state(cfg: Mamba3Config, dtype: torch.dtype) -> RowTensors:
    """One request's decode state of one layer of the model `cfg` run in `dtype`, on the meta device: the
    layout (`tensors()`'s shapes and dtypes) that vLLM's slots hold, and the template `slot_cache` fills."""
    return Mamba3.from_config(cfg, device="meta").allocate_state(1, device="meta", dtype=dtype)


def state_spec(
    cfg: Mamba3Config, dtype: torch.dtype, state: RowTensors | None = None
) -> tuple[tuple[tuple[int, ...], ...], tuple]:
    """(shapes, dtypes) of one request's decode state of one layer, in the state's `tensors()` order, for
    a model run in `dtype`: what `Mamba3.allocate_state` allocates, without the batch axis. `state`: that
    state's `meta_state` where the caller holds it already (else it is built here)."""
    parts = (meta_state(cfg, dtype) if state is None else state).tensors()
    if any(t.numel() == 0 for t in parts):
        raise ConfigError(
            f"model.d_state = {cfg.d_state} with rope_fraction = {cfg.rope_fraction} gives an empty decode "
            "state tensor, which vLLM cannot page: serve this model with `mamba3lite serve`"
        )
    return tuple(tuple(t.shape[1:]) for t in parts), tuple(t.dtype for t in parts)


def slot_cache(template: RowTensors, states: tuple[Tensor, ...], rows: Tensor | slice) -> RowTensors:
    """The decode state of cache slots `rows` of a layer's vLLM states (one state per part, in
    `template`'s order). A slice gives views (the model's in-place updates land in the slots); an index
    tensor gives copies (write them back with `write_slots`)."""
    return template.with_tensors(s[rows] for s in states)


def write_slots(states: tuple[Tensor, ...], rows: Tensor, cache: RowTensors, keep_B: Tensor | None) -> None:
    """Store `cache` (one row per slot in `rows`) into the vLLM states; rows where `keep_B` is False get
    a zero state (the row's last token was an EOS: the next one starts afresh)."""
    for state, new in zip(states, cache.tensors(), strict=True):
        if keep_B is not None:
            new = new * keep_B.view(-1, *[1] * (new.dim() - 1)).to(new.dtype)
        state[rows] = new


def register_state_layer(prefix: str, layer: MambaBase) -> None:
    """Enter a state layer into vLLM's forward context under its name (what vLLM's own layers do), so the
    engine finds it, gives it cache slots and its metadata; a second layer of the same name is an error."""
    context = get_current_vllm_config().compilation_config.static_forward_context
    if prefix in context:
        raise ValueError(f"duplicate layer name: {prefix}")
    context[prefix] = layer


def step_metadata(prefix: str):
    """This step's state metadata of layer `prefix` (vLLM's Mamba-1 metadata), or None in vLLM's
    profiling run, which comes before any cache exists."""
    metadata = get_forward_context().attn_metadata
    return metadata.get(prefix) if isinstance(metadata, dict) else None


def prefill_pieces(md) -> list[tuple[int, int, int, bool]]:
    """(slot, start, end, continues) of each prefill piece of the step: its tokens are [start, end) of
    the flat batch (after the decode tokens), and `continues` says its slot holds the state its
    request's earlier pieces left (else the slot holds a previous request's: start from zero)."""
    bounds = (md.query_start_loc_p + md.num_decode_tokens).tolist()
    slots, continues = md.state_indices_tensor_p.tolist(), md.has_initial_states_p.tolist()
    return [(slot, bounds[i], bounds[i + 1], continues[i]) for i, slot in enumerate(slots)]


class VllmMamba3(Mamba3, MambaBase):
    """`Mamba3` whose decode state lives in vLLM's cache (see the module docstring).

    forward(u_1TD, eos_T, positions_T=None) -> out_1TD over the step's flat batch of tokens; `eos_T`
    (bool, or None when the model does not reset at EOS) marks the tokens that are the EOS; the positions
    (the signature of the vLLM mixers) are unused: Mamba-3's state carries its own.
    """

    @classmethod
    def build(
        cls, cfg: Mamba3Config, model_config: ModelConfig, cache_config: CacheConfig, prefix: str
    ) -> VllmMamba3:
        """The mixer of one layer of the model `cfg`, registered with vLLM as layer `prefix`. Its scan
        backend is "auto": the fastest that runs on the device its input is on (the chunked scan on a
        CPU, Triton on a GPU), whatever backend the model was trained with."""
        layer = cls.from_config(dataclasses.replace(cfg, scan_impl="auto"))
        layer.state_template = meta_state(cfg, model_config.dtype)
        layer.state_shapes, layer.state_dtypes = state_spec(cfg, model_config.dtype, layer.state_template)
        layer.model_config, layer.cache_config, layer.prefix = model_config, cache_config, prefix
        layer.kv_cache = tuple(torch.tensor([]) for _ in layer.state_shapes)
        register_state_layer(prefix, layer)
        return layer

    # ---- vLLM's state layer interface ----
    def get_state_shape(self) -> tuple[tuple[int, ...], ...]:
        return self.state_shapes

    def get_state_dtype(self) -> tuple[torch.dtype, ...]:
        return self.state_dtypes

    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        return MambaAttentionBackendEnum.MAMBA3LITE

    # ---- the step's tokens ----
    def forward(
        self, u_1TD: Tensor, eos_T: Tensor | None = None, positions_T: Tensor | None = None
    ) -> Tensor:
        md = step_metadata(self.prefix)
        if md is None:
            # vLLM's profiling run (no cache yet): the tokens as one sequence, stateless.
            return Mamba3.forward(self, u_1TD)
        out_1TD = torch.zeros_like(u_1TD, dtype=self.out_proj.weight.dtype)
        n_dec = md.num_decode_tokens
        if md.num_decodes > 0:
            rows = md.state_indices_tensor_d[:, 0]
            cache = slot_cache(self.state_template, self.kv_cache, rows)
            out_1TD[0, :n_dec] = self.step(u_1TD[0, :n_dec], cache)
            write_slots(self.kv_cache, rows, cache, None if eos_T is None else ~eos_T[:n_dec])
        if md.num_prefills > 0:
            self._prefill(u_1TD, eos_T, md, out_1TD)
        return out_1TD

    def _prefill(self, u_1TD: Tensor, eos_T: Tensor | None, md, out_1TD: Tensor) -> None:
        """Each prefill piece through the chunked scan from its slot's state, written back in place."""
        for slot, start, end, continues in prefill_pieces(md):
            cache = slot_cache(self.state_template, self.kv_cache, slice(slot, slot + 1))
            if not continues:  # a request's first piece: the slot holds a previous request's state
                for t in cache.tensors():
                    t.zero_()
            reset_1T = None
            if eos_T is not None and bool(eos_T[start : end - 1].any()):
                reset_1T = torch.zeros(1, end - start, dtype=torch.bool, device=u_1TD.device)
                reset_1T[0, 1:] = eos_T[start : end - 1]
            out_1TD[:, start:end] = Mamba3.forward(self, u_1TD[:, start:end], cache, reset_1T)
            if eos_T is not None and bool(eos_T[end - 1]):
                for t in cache.tensors():
                    t.zero_()
