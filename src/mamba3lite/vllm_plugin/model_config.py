"""The config hook vLLM runs for our architectures (MODELS_CONFIG_MAP), in the process that starts vLLM,
before any engine: the export's model config is checked here (one error, not an engine that fails to
start), and prefix caching is off. One hook serves the pure and the hybrid architecture: vLLM's own
hybrid hook (HybridAttentionMambaModelConfig) does exactly MambaModelConfig's, whose subclass this is.

Prefix caching of a recurrent model needs the state at block boundaries copied between cache slots
(vLLM's "align" mode and a model's `get_mamba_state_copy_func`); the plugin does not do that yet, so
`--enable-prefix-caching` is turned off here with a warning instead of serving wrong states.
"""

from __future__ import annotations

from vllm.logger import init_logger
from vllm.model_executor.models.config import MambaModelConfig

from mamba3lite.errors import ConfigError
from mamba3lite.interop.hf_export import ARCHITECTURE
from mamba3lite.vllm_plugin.layer import state_spec
from mamba3lite.vllm_plugin.model import model_config_of

logger = init_logger(__name__)


class Mamba3LiteModelConfig(MambaModelConfig):
    @classmethod
    def verify_and_update_config(cls, vllm_config) -> None:
        model_config = vllm_config.model_config
        state_spec(model_config_of(model_config.hf_config), model_config.dtype)  # ConfigError if unservable
        if vllm_config.speculative_config is not None:
            # Draft tokens need a state per draft position and a rollback, which the layer does not keep.
            raise ConfigError(
                f"speculative decoding is not supported for {ARCHITECTURE} by the mamba3lite plugin: "
                "leave out --speculative-config"
            )
        cache_config = vllm_config.cache_config
        if cache_config.enable_prefix_caching:
            logger.warning(
                "prefix caching is turned off for %s: the mamba3lite plugin does not copy Mamba-3 "
                "states between cache blocks yet (every prompt is prefilled in full)",
                ARCHITECTURE,
            )
            cache_config.enable_prefix_caching = False
        super().verify_and_update_config(vllm_config)
