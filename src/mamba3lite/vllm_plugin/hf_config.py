"""The export's config as vLLM reads it: `Mamba3LiteConfig` (the file the export carries) plus the names
vLLM takes from a config before any model code runs.

- `architectures`: vLLM decides whether a model is attention-free or a hybrid from its model class
  (`IsAttentionFree` / `IsHybrid`), a class-level fact, so a hybrid export (attention layers in
  `mamba3lite.attn_layer_idx`) is routed to its own class, `HYBRID_ARCHITECTURE`; config.json names
  `ARCHITECTURE` for both (transformers' remote code has one class).
- `num_attention_heads`, `num_key_value_heads`, `head_dim`: the attention layers' shape, from which vLLM
  sizes a key/value page before it builds the model (and pads the Mamba-3 state pages to it).

A `mamba3lite` section that does not make a ModelConfig is left as it is: the plugin's config hook
reports it as one error (model.py's `model_config_of`), not the config parser deep inside vLLM.
"""

from __future__ import annotations

from mamba3lite.errors import Mamba3LiteError
from mamba3lite.interop.hf_export import ARCHITECTURE
from mamba3lite.interop.hf_remote.configuration_mamba3lite import Mamba3LiteConfig
from mamba3lite.model.config import ModelConfig
from mamba3lite.vllm_plugin.names import HYBRID_ARCHITECTURE


class VllmMamba3LiteConfig(Mamba3LiteConfig):
    """`Mamba3LiteConfig` with vLLM's names set from the `mamba3lite` section (module docstring)."""

    def __post_init__(self, **kwargs) -> None:
        super().__post_init__(**kwargs)
        try:
            cfg = ModelConfig(**(self.mamba3lite or {}))
        except (Mamba3LiteError, TypeError):
            return
        if not cfg.attn_layer_idx:
            return
        self.architectures = [HYBRID_ARCHITECTURE]
        self.num_attention_heads = cfg.attn_cfg["num_heads"]
        self.num_key_value_heads = cfg.attn_num_heads_kv
        self.head_dim = cfg.attn_head_dim


def architecture_of(cfg: ModelConfig) -> str:
    """The vLLM architecture that serves a model of config `cfg`."""
    return HYBRID_ARCHITECTURE if cfg.attn_layer_idx else ARCHITECTURE
