"""state_dict names: ours <-> the official `MambaLMHeadModel`'s.

    ours                         official
    embed.weight                 backbone.embedding.weight
    layers.{i}.<rest>            backbone.layers.{i}.<rest>   (norm, mixer.*, norm2, mlp.fc1, mlp.fc2)
    norm_f.weight                backbone.norm_f.weight
    lm_head.weight               lm_head.weight               (tied: the embedding itself)

The mixer's own names are the official layer's already (docs/model.md §1.2), so below the block level
nothing is renamed.
"""

from __future__ import annotations

from torch import Tensor

EMBED_OURS, EMBED_OFFICIAL = "embed.weight", "backbone.embedding.weight"
HEAD = "lm_head.weight"
_BACKBONE = "backbone."


def official_name(ours: str) -> str:
    """The official name of our parameter `ours`."""
    if ours == HEAD:
        return HEAD
    if ours == EMBED_OURS:
        return EMBED_OFFICIAL
    return _BACKBONE + ours


def our_name(official: str) -> str | None:
    """Our name of the official parameter `official`; None for a name outside the model's layout."""
    if official == HEAD:
        return HEAD
    if official == EMBED_OFFICIAL:
        return EMBED_OURS
    if official.startswith(_BACKBONE) and official != EMBED_OFFICIAL:
        return official[len(_BACKBONE) :]
    return None


def to_official(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Our state_dict with official names (same tensors, same order)."""
    return {official_name(k): v for k, v in state.items()}
