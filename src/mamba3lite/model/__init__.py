"""The Mamba-3 language model: config, mixer, scans, LM, parameter/FLOP counts, token sampling."""

from mamba3lite.model.config import ModelConfig

__all__ = ["ModelConfig"]
