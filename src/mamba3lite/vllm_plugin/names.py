"""The names the plugin registers with vLLM, in a module below everything else of the plugin."""

from __future__ import annotations

# The architecture vLLM serves a hybrid export as (hf_config.py routes it; config.json names the export's
# one architecture, `interop.hf_export.ARCHITECTURE`, for pure models and hybrids alike).
HYBRID_ARCHITECTURE = "Mamba3LiteHybridForCausalLM"
