"""The Mamba-3 language model: config, mixer, scans, LM, parameter/FLOP counts, token sampling."""

from mamba3lite.model.config import ModelConfig
from mamba3lite.model.flops import count_parameters, model_flops_per_token
from mamba3lite.model.mamba3 import Mamba3, Mamba3Cache
from mamba3lite.model.sampling import sample_next
from mamba3lite.model.transformer import Mamba3Transformer, ModelCache

__all__ = [
    "Mamba3",
    "Mamba3Cache",
    "Mamba3Transformer",
    "ModelCache",
    "ModelConfig",
    "count_parameters",
    "model_flops_per_token",
    "sample_next",
]
