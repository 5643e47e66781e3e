"""The Mamba-3 language model: config, mixers by layer kind, scans, LM, decode state, parameter/FLOP
counts, token sampling."""

from mamba3lite.model.config import ModelConfig
from mamba3lite.model.decode_state import DecodeState, ModelCache
from mamba3lite.model.flops import count_parameters, model_flops_per_token
from mamba3lite.model.mamba3 import Mamba3, Mamba3Cache
from mamba3lite.model.sampling import sample_next
from mamba3lite.model.transformer import Mamba3Transformer

__all__ = [
    "DecodeState",
    "Mamba3",
    "Mamba3Cache",
    "Mamba3Transformer",
    "ModelCache",
    "ModelConfig",
    "count_parameters",
    "model_flops_per_token",
    "sample_next",
]
