"""The models for vLLM: the package's `Mamba3Transformer`, its mixers replaced by their vLLM kinds
(`VllmMamba3`, layer.py; `VllmMHA`, attention.py), so the parameter names are the export's (`model.` +
the model's own) and `load_weights` reads `mamba3lite export --format hf` directories as they are.

    Mamba3LiteForCausalLM         pure (every layer Mamba-3): attention-free, one vLLM state group
    Mamba3LiteHybridForCausalLM   Mamba-3 + attention (`attn_layer_idx`): a hybrid, the attention
                                  layers' keys and values in vLLM's paged cache

Two classes because vLLM reads attention-free / hybrid off the class; hf_config.py routes an export to
its class. A hybrid does not reset at EOS (attention.py says why): one error. Tensor and pipeline
parallelism are not supported (one clear error); run more replicas instead.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import Tensor, nn
from vllm.config import VllmConfig
from vllm.model_executor.models.interfaces import HasInnerState, IsAttentionFree, IsHybrid

from mamba3lite.errors import CheckpointError, ConfigError
from mamba3lite.interop.hf_export import ARCHITECTURE, HF_PREFIX
from mamba3lite.model.config import ATTENTION_KIND, MAMBA3_KIND, ModelConfig
from mamba3lite.model.mamba3 import linear_in_own_dtype
from mamba3lite.model.transformer import Mamba3Transformer
from mamba3lite.vllm_plugin.attention import VllmMHA
from mamba3lite.vllm_plugin.hf_config import architecture_of
from mamba3lite.vllm_plugin.layer import VllmMamba3, state_spec
from mamba3lite.vllm_plugin.names import HYBRID_ARCHITECTURE
from mamba3lite.vllm_plugin.qkv_conv import conv_state_spec


def model_config_of(hf_config) -> ModelConfig:
    """The mamba3lite ModelConfig an export's config.json carries under "mamba3lite"."""
    fields = getattr(hf_config, "mamba3lite", None)
    if not isinstance(fields, dict):
        raise ConfigError(
            "config.json has no 'mamba3lite' section: serve a directory written by "
            "`mamba3lite export --format hf`"
        )
    try:
        cfg = ModelConfig(**fields)
    except TypeError as e:  # a field this mamba3lite does not know (an export from a newer version)
        raise ConfigError(
            f"config.json's 'mamba3lite' section does not fit this mamba3lite ({e}): upgrade mamba3lite, or "
            "export the run again with this one"
        ) from None
    if cfg.attn_layer_idx and cfg.reset_at_eos:
        raise ConfigError(
            "model.reset_at_eos is true in a hybrid: its attention layers would start a new document after "
            "each EOS inside a request, which vLLM's attention cannot do (it sees the whole request); serve "
            "this one with `mamba3lite serve`"
        )
    return cfg


def largest_state_spec(cfg: ModelConfig, dtype: torch.dtype) -> tuple[tuple, tuple]:
    """(shapes, dtypes) of the largest per-request state a layer of the model keeps in vLLM's Mamba state
    cache: a Mamba-3 layer's, or an attention layer's conv window (d_conv > 1). vLLM sizes the shared
    page by it (the others are padded to it)."""
    specs = [state_spec(cfg, dtype)]
    W = cfg.attn_cfg.get("d_conv", 0) if cfg.attn_layer_idx else 0
    if W > 1:
        heads, kv, hd = cfg.attn_cfg["num_heads"], cfg.attn_num_heads_kv, cfg.attn_head_dim
        specs.append(conv_state_spec(W, hd * (heads + 2 * kv), dtype))

    def nbytes(spec) -> int:
        return sum(math.prod(s) * d.itemsize for s, d in zip(*spec))

    return max(specs, key=nbytes)


class _Mamba3LiteVllm(nn.Module):
    """What the two model classes share: the model, built from the export's config, and its forward."""

    # The architecture name this class serves (hf_config.architecture_of of its configs).
    architecture: str

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig) -> tuple[tuple[int, ...], ...]:
        cfg = model_config_of(vllm_config.model_config.hf_config)
        return largest_state_spec(cfg, vllm_config.model_config.dtype)[0]

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig) -> tuple[torch.dtype, ...]:
        cfg = model_config_of(vllm_config.model_config.hf_config)
        return largest_state_spec(cfg, vllm_config.model_config.dtype)[1]

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        parallel = vllm_config.parallel_config
        if parallel.tensor_parallel_size > 1 or parallel.pipeline_parallel_size > 1:
            raise ConfigError(
                "the mamba3lite vLLM plugin runs on one device per replica: use tensor_parallel_size=1 and "
                "pipeline_parallel_size=1 (data parallelism works)"
            )
        cfg = model_config_of(vllm_config.model_config.hf_config)
        if architecture_of(cfg) != self.architecture:  # only where the architecture was overridden
            raise ConfigError(
                f"{self.architecture} cannot serve this export, a model for {architecture_of(cfg)}: leave "
                "the architecture as the export's config gives it"
            )
        self.cfg = cfg
        self.model = Mamba3Transformer(cfg)
        mc, cc = vllm_config.model_config, vllm_config.cache_config
        build = {
            MAMBA3_KIND: lambda i, name: VllmMamba3.build(cfg, mc, cc, name),
            ATTENTION_KIND: lambda i, name: VllmMHA.build(cfg, i, mc, cc, name),
        }
        for i, block in enumerate(self.model.layers):
            name = f"{prefix}{'.' if prefix else ''}{HF_PREFIX}layers.{i}.mixer"
            block.mixer = build[cfg.layer_kind(i)](i, name)

    def embed_input_ids(self, input_ids: Tensor) -> Tensor:
        return self.model.embed(input_ids)

    def forward(
        self,
        input_ids: Tensor | None,
        positions: Tensor,
        intermediate_tensors=None,
        inputs_embeds: Tensor | None = None,
        **kwargs,
    ) -> Tensor:
        """The final-norm hidden states (T, D) of the step's flat batch of T tokens (the layers read the
        batch's layout from vLLM's forward context)."""
        x_1TD = (self.model.embed(input_ids) if inputs_embeds is None else inputs_embeds)[None]
        eos_T = None
        if self.cfg.reset_at_eos:
            if input_ids is None:
                raise ConfigError("a model that resets at EOS needs token ids, not embeddings, as input")
            eos_T = input_ids == self.cfg.eos_id
        # Block.forward with the vLLM mixers' own arguments (the EOS and the positions, not a cache).
        for block in self.model.layers:
            x_1TD = x_1TD + block.mixer(block.norm(x_1TD), eos_T, positions)
            if block.mlp is not None:
                x_1TD = x_1TD + block.mlp(block.norm2(x_1TD))
        return self.model.norm_f(x_1TD)[0]

    def compute_logits(self, hidden_TD: Tensor) -> Tensor:
        return linear_in_own_dtype(self.model.lm_head, hidden_TD).float()

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        """Copy the export's tensors into the model; every parameter must be given, with its shape.
        A tied head is absent from the export (it is the embedding, one parameter here too)."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            param = params.get(name)
            if param is None:
                raise CheckpointError(
                    f"the export holds '{name}', which this model has no parameter for: was it written by "
                    "another mamba3lite version? Export the run again"
                )
            if tuple(param.shape) != tuple(tensor.shape):
                raise CheckpointError(
                    f"'{name}' has shape {tuple(tensor.shape)} in the export and {tuple(param.shape)} in its "
                    "config.json's model: the directory is inconsistent, export the run again"
                )
            with torch.no_grad():
                param.copy_(tensor)
            loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise CheckpointError(
                f"the export lacks {len(missing)} tensor(s) the model needs, e.g. '{missing[0]}': export the "
                "run again"
            )
        return loaded


class Mamba3LiteForCausalLM(_Mamba3LiteVllm, HasInnerState, IsAttentionFree):
    """A pure Mamba-3 model: every layer's state in vLLM's Mamba state cache."""

    architecture = ARCHITECTURE


class Mamba3LiteHybridForCausalLM(_Mamba3LiteVllm, HasInnerState, IsHybrid):
    """Mamba-3 with attention layers: Mamba-3 states and paged keys and values, as vLLM's hybrids."""

    architecture = HYBRID_ARCHITECTURE
