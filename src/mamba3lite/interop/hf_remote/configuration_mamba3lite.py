"""Mamba3LiteConfig: the transformers config of a model exported by `mamba3lite export --format hf`.

`mamba3lite` holds the model's own config (every field of mamba3lite's ModelConfig, by name); the other
fields are the names transformers' tools read (vocabulary size, width, depth, each layer's kind as
`layer_types`, special token ids), set from it by the exporter.
"""

from __future__ import annotations

from transformers import PretrainedConfig


class Mamba3LiteConfig(PretrainedConfig):
    model_type = "mamba3lite"

    mamba3lite: dict | None = None
    vocab_size: int = 50257
    hidden_size: int = 768
    num_hidden_layers: int = 12
    layer_types: list | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    use_cache: bool = True
    tie_word_embeddings: bool = True
