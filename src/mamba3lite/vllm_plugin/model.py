"""`Mamba3LiteForCausalLM` for vLLM: the package's `Mamba3Transformer`, its mixers replaced by
`VllmMamba3` (layer.py), so the parameter names are the export's (`model.` + the model's own) and
`load_weights` reads `mamba3lite export --format hf` directories as they are.

Pure models only (every layer a Mamba-3 mixer): attention-free, one vLLM state group. Tensor and
pipeline parallelism are not supported (one clear error); run more replicas instead.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn
from vllm.config import VllmConfig
from vllm.model_executor.models.interfaces import HasInnerState, IsAttentionFree

from mamba3lite.errors import CheckpointError, ConfigError
from mamba3lite.interop.hf_export import HF_PREFIX
from mamba3lite.model.config import ModelConfig
from mamba3lite.model.mamba3 import linear_in_own_dtype
from mamba3lite.model.transformer import Mamba3Transformer
from mamba3lite.vllm_plugin.layer import VllmMamba3, state_spec


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
    if cfg.attn_layer_idx:
        raise ConfigError(
            f"model.attn_layer_idx = {list(cfg.attn_layer_idx)}: the vLLM plugin serves pure Mamba-3 models "
            "only, not hybrids with attention layers yet; serve this one with `mamba3lite serve`"
        )
    return cfg


class Mamba3LiteForCausalLM(nn.Module, HasInnerState, IsAttentionFree):
    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig) -> tuple[tuple[int, ...], ...]:
        cfg = model_config_of(vllm_config.model_config.hf_config)
        return state_spec(cfg, vllm_config.model_config.dtype)[0]

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig) -> tuple[torch.dtype, ...]:
        cfg = model_config_of(vllm_config.model_config.hf_config)
        return state_spec(cfg, vllm_config.model_config.dtype)[1]

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        parallel = vllm_config.parallel_config
        if parallel.tensor_parallel_size > 1 or parallel.pipeline_parallel_size > 1:
            raise ConfigError(
                "the mamba3lite vLLM plugin runs on one device per replica: use tensor_parallel_size=1 and "
                "pipeline_parallel_size=1 (data parallelism works)"
            )
        cfg = model_config_of(vllm_config.model_config.hf_config)
        self.cfg = cfg
        self.model = Mamba3Transformer(cfg)
        for i, block in enumerate(self.model.layers):
            name = f"{prefix}{'.' if prefix else ''}{HF_PREFIX}layers.{i}.mixer"
            block.mixer = VllmMamba3.build(cfg, vllm_config.model_config, vllm_config.cache_config, name)

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
        # Block.forward with the vLLM mixer's own second argument (the EOS positions, not a cache).
        for block in self.model.layers:
            x_1TD = x_1TD + block.mixer(block.norm(x_1TD), eos_T)
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
