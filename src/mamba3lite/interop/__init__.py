"""Crossing the border with the official Mamba-3 code (state-spaces/mamba, `MambaLMHeadModel`).

source.py          an official model directory on disk (or hf:NAME): its config, weights, tokenizer
official_config.py config.json (`MambaConfig`) <-> our `ModelConfig`
names.py           state_dict names: ours <-> official
weights.py         official weight files in and out (pytorch_model.bin, model.safetensors, shards)
gpt2_tokenizer.py  our offline GPT-2 vocabulary as a Hugging Face tokenizer.json
model_card.py      the README.md of an exported model
import_.py         official directory -> run directory (`mamba3lite import`)
export.py          run directory -> official directory (`mamba3lite export`)
init_from.py       the weights `train --init-from` starts from
"""
