"""The transformers side of an exported model: `Mamba3LiteForCausalLM` around mamba3lite's
`Mamba3Transformer`, and `Mamba3LiteCache`, the recurrent state as generate()'s cache.

The exporter appends this file to the model's own source (its imports of mamba3lite are removed there:
the names are defined above it in the generated file).

    forward(input_ids, attention_mask=None, cache=None, labels=None, use_cache=None)
        no cache in:   the whole sequence through the chunked scan (with autograd: training, PEFT);
                       use_cache: the final state comes back as `cache`
        a cache in:    the new tokens continue from it (one token: the O(1) recurrent step, as
                       mamba3lite's own generate), the cache updated in place
    prepare_inputs_for_generation feeds generate() only the tokens the cache has not seen (one per step):
    O(1) work per new token, the prefix never runs again.

Left padding (attention_mask 0 before the text): the row's state is reset at its first real token, so
padded rows compute what they would alone. Masks with holes are not supported (one clear error).
The pad token is the EOS, which also starts every prompt (as `mamba3lite generate` feeds it): pass the
attention_mask (the tokenizer's) with the ids; generate() leaves it all ones while its eos_token_id is
the EOS, but with eos_token_id=None it would take that first EOS for padding.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.modeling_outputs import CausalLMOutputWithPast

from mamba3lite.model.config import ModelConfig
from mamba3lite.model.decode_state import ModelCache
from mamba3lite.model.mamba3 import linear_in_own_dtype
from mamba3lite.model.transformer import Mamba3Transformer

from .configuration_mamba3lite import Mamba3LiteConfig


class Mamba3LiteCache(Cache):
    """generate()'s cache: the model's own decode state (`ModelCache`: one state per layer + the last
    token, model/decode_state.py), used through its protocol only; `seen` counts the tokens it holds."""

    is_compileable = False

    def __init__(self, state: ModelCache) -> None:
        super().__init__(layers=[])
        self.state = state
        self.seen = 0

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def reorder_cache(self, beam_idx: Tensor) -> None:
        """Beam search: keep the rows `beam_idx` picks."""
        self.state = self.state.select(beam_idx)


def _fresh_starts(attention_mask: Tensor) -> Tensor | None:
    """True at each row's first attended token after left padding (None without padding)."""
    mask = attention_mask.bool()
    if bool(mask.all()):
        return None
    ended = mask[:, :-1] & ~mask[:, 1:]
    if bool(ended.any()):
        raise ValueError("Mamba3Lite supports left padding only (an attention_mask of 0s, then 1s per row)")
    prev = torch.nn.functional.pad(mask[:, :-1], (1, 0), value=False)
    return mask & ~prev


class Mamba3LitePreTrainedModel(PreTrainedModel):
    config_class = Mamba3LiteConfig
    base_model_prefix = "model"
    _no_split_modules = ("Block",)
    _is_stateful = True
    supports_gradient_checkpointing = False

    def _init_weights(self, module) -> None:
        # Every tensor comes from the checkpoint; Mamba3Transformer initialises itself when built.
        pass


class Mamba3LiteForCausalLM(Mamba3LitePreTrainedModel, GenerationMixin):
    _tied_weights_keys: ClassVar[dict[str, str]] = {"model.lm_head.weight": "model.embed.weight"}

    def __init__(self, config: Mamba3LiteConfig) -> None:
        super().__init__(config)
        # The pure-PyTorch chunked scan on every device (the exported file has no Triton kernels).
        self.model = Mamba3Transformer(ModelConfig(**{**config.mamba3lite, "scan_impl": "chunked"}))
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed

    def set_input_embeddings(self, value) -> None:
        self.model.embed = value

    def get_output_embeddings(self):
        return self.model.lm_head

    def set_output_embeddings(self, value) -> None:
        self.model.lm_head = value

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        cache: Cache | None = None,
        labels: Tensor | None = None,
        use_cache: bool | None = None,
        return_dict: bool | None = None,
        past_key_values: Cache | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast | tuple:
        m = self.model
        cache = cache if cache is not None else past_key_values
        if cache is not None and not isinstance(cache, Mamba3LiteCache):
            if cache.get_seq_length() > 0:
                raise ValueError(f"Mamba3Lite continues only from its own Mamba3LiteCache, not {type(cache)}")
            cache = None  # an empty cache generate() made for attention models
        if use_cache is None:
            use_cache = self.config.use_cache and not self.training
        fresh_BT = _fresh_starts(attention_mask) if attention_mask is not None and cache is None else None
        if cache is not None and cache.seen > 0 and input_ids.shape[1] == 1:
            logits = m.step(input_ids[:, 0], cache.state)[:, None]  # the O(1) recurrent step
            cache.seen += 1
        elif use_cache or cache is not None:
            if cache is None:
                cache = Mamba3LiteCache(m.allocate_cache(input_ids.shape[0], device=input_ids.device))
            h_BTD = m.hidden_states(input_ids, cache.state, fresh_BT)
            cache.seen += input_ids.shape[1]
            logits = linear_in_own_dtype(m.lm_head, h_BTD)
        else:
            logits = linear_in_own_dtype(m.lm_head, m.hidden_states(input_ids, fresh_BT=fresh_BT))
        logits = logits.float()
        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten().to(logits.device), ignore_index=-100
            )
        out = CausalLMOutputWithPast(loss=loss, logits=logits, cache=cache if use_cache else None)
        return out if return_dict is not False else out.to_tuple()

    def prepare_inputs_for_generation(
        self, input_ids: Tensor, cache: Cache | None = None, attention_mask: Tensor | None = None, **kwargs
    ) -> dict:
        if isinstance(cache, Mamba3LiteCache) and cache.seen > 0:
            # Only what the state has not absorbed yet: the token sampled last.
            return {"input_ids": input_ids[:, cache.seen :], "cache": cache, "use_cache": True}
        return {"input_ids": input_ids, "attention_mask": attention_mask, "cache": None, "use_cache": True}
