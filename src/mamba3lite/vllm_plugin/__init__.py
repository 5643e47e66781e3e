"""vLLM out-of-tree plugin: `vllm serve EXPORT_DIR` runs a Mamba-3 model exported by
`mamba3lite export --format hf` (SISO or MIMO, pure or a hybrid with attention layers), with the
package's own model code.

    pip install -e '.[vllm]'                 # in an environment with vLLM (`make vllm-venv`)
    vllm serve exported/tiny-hf              # the plugin is found through its entry point

vLLM loads every `vllm.general_plugins` entry point in each of its processes and calls it; `register`
is ours (pyproject.toml). It
- checks the installed vLLM is a version the plugin was tested with (`compat.py`);
- registers the export's config class for its model_type (`Mamba3LiteConfig`, the same file the export
  carries, with the names vLLM reads set from it: hf_config.py), so no trust_remote_code is needed;
- registers the model classes (model.py) lazily, by import path: `Mamba3LiteForCausalLM` under the
  export's architecture name (attention-free) and `Mamba3LiteHybridForCausalLM` for hybrids, each with
  the config hook (prefix caching off);
- registers the layers' state backend (layer.py), which reuses vLLM's Mamba-1 metadata.
Calling it twice is harmless (vLLM does, once per process).
"""

from __future__ import annotations

from mamba3lite.interop.hf_export import ARCHITECTURE, MODEL_TYPE
from mamba3lite.vllm_plugin.compat import check_vllm_version
from mamba3lite.vllm_plugin.names import HYBRID_ARCHITECTURE

BACKEND_NAME = "MAMBA3LITE"
BACKEND_PATH = "mamba3lite.vllm_plugin.layer.Mamba3LiteStateBackend"
MODEL_PATHS = {
    ARCHITECTURE: "mamba3lite.vllm_plugin.model:Mamba3LiteForCausalLM",
    HYBRID_ARCHITECTURE: "mamba3lite.vllm_plugin.model:Mamba3LiteHybridForCausalLM",
}


def register() -> None:
    """The `vllm.general_plugins` entry point (see the module docstring)."""
    import vllm
    from transformers import AutoConfig
    from vllm import ModelRegistry
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

    from mamba3lite.vllm_plugin.hf_config import VllmMamba3LiteConfig
    from mamba3lite.vllm_plugin.model_config import Mamba3LiteModelConfig

    check_vllm_version(vllm.__version__)
    AutoConfig.register(MODEL_TYPE, VllmMamba3LiteConfig, exist_ok=True)
    if BACKEND_NAME not in MambaAttentionBackendEnum.__members__:
        MambaAttentionBackendEnum.register(BACKEND_NAME, BACKEND_PATH)
    for architecture, path in MODEL_PATHS.items():
        if architecture not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(architecture, path)
        MODELS_CONFIG_MAP[architecture] = Mamba3LiteModelConfig
