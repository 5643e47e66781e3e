"""`mamba3lite export --format hf`: a run's checkpoint -> a directory transformers loads by itself.

    result = export_hf("runs/tiny", "exported/tiny-hf")                  # newest verified step
    # then, with transformers only (no mamba3lite, no CUDA kernels):
    #   AutoModelForCausalLM.from_pretrained("exported/tiny-hf", trust_remote_code=True)
    #   AutoTokenizer.from_pretrained("exported/tiny-hf")

The directory holds:
    config.json                    model_type "mamba3lite", auto_map to the two files below, the model's
                                   own config under "mamba3lite", and the names HF tools read; each
                                   layer's mixer kind as `layer_types`, in transformers' words for
                                   hybrids: "linear_attention" (a recurrent layer: Mamba-3), or
                                   "full_attention" at attn_layer_idx
    configuration_mamba3lite.py    Mamba3LiteConfig
    modeling_mamba3lite.py         generated from this package's model source (`hf_modeling`)
    model.safetensors              names "model." + ours, the checkpoint's dtypes; larger than
                                   `max_shard_bytes`: model-0000i-of-0000n.safetensors + an index
    generation_config.json         the special ids and `mamba3lite generate`'s default sampling
    tokenizer.json                 GPT-2 built offline, or the run's own file (its sha256 checked
                                   against the one the checkpoint records)
    tokenizer_config.json          eos/bos/pad (all the EOS token: a document starts after it),
                                   add_bos_token, the run's chat template when it has one
    README.md                      the model card

Token ids: a text starts a document, as `mamba3lite generate` and `serve` read a prompt: `tokenizer(text)`
gives [EOS] + the run's ids (tokenizer.json's post-processor "[EOS] $A", which transformers 5 reads,
and vLLM tokenizes text prompts through transformers; `add_bos_token` says so too), so
`model.generate`, `pipeline("text-generation")`, lm-eval's `hf` model and vLLM condition a prompt as
mamba3lite does. `add_special_tokens=False` gives the bare ids; `skip_special_tokens=True` drops the
start when decoding. tokenizer.json is the run's file with that post-processor in place of its null
one, the rest byte for byte (`tokenizer.with_document_start`; `import` takes it out again, so the run's
vocabulary hash comes back). GPT-2's "<|endoftext|>" in text is ordinary text to our tokenizer, so the
export sets `split_special_tokens` (the text is split and merged, never turned into the EOS id); a
trained BPE's EOS is an added token, which the text does become in both.

Chat: `apply_chat_template` tokenizes without special tokens (the template is meant to write them), so
the exported template starts with `{{ bos_token }}` and then renders the run's template with an empty
`bos_token`, as `serve` renders it before it adds the start: one start, never two. Where the EOS text
is ordinary text (GPT-2) the template cannot write the start, and renders without it:
`tokenizer(apply_chat_template(..., tokenize=False))` then adds it.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from mamba3lite.errors import CheckpointError, ConfigError
from mamba3lite.interop.export import checkpoint_state, exported_step, tokenizer_json
from mamba3lite.interop.hf_modeling import (
    CONFIGURATION_NAME,
    MODELING_NAME,
    configuration_source,
    modeling_source,
)
from mamba3lite.interop.names import HEAD
from mamba3lite.interop.source import CONFIG_NAME
from mamba3lite.interop.weights import INDEX_NAME, SAFETENSORS_NAME
from mamba3lite.model.config import ATTENTION_KIND, MAMBA3_KIND
from mamba3lite.rundir import TOKENIZER_NAME
from mamba3lite.tokenizer import document_start, with_document_start

MODEL_TYPE = "mamba3lite"
ARCHITECTURE = "Mamba3LiteForCausalLM"
HF_PREFIX = "model."  # Mamba3LiteForCausalLM.model is the Mamba3Transformer
# Our layer kinds in transformers' `layer_types` words (its PreTrainedConfig checks them against its list,
# and reads the older "mamba" / "attention" as these two).
HF_LAYER_TYPES = {MAMBA3_KIND: "linear_attention", ATTENTION_KIND: "full_attention"}
GENERATION_CONFIG_NAME = "generation_config.json"
TOKENIZER_CONFIG_NAME = "tokenizer_config.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3  # transformers' own default shard size (5 GB)
# `mamba3lite generate`'s defaults (commands/generate.py), so generate() samples alike by default.
GENERATE_DEFAULTS = {"do_sample": True, "temperature": 0.8, "top_k": 50, "max_new_tokens": 200}
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
                torch.float64: "float64"}  # fmt: skip


@dataclass
class HFExportResult:
    out: Path
    step: int
    n_params: int
    files: list[str]
    notes: list[str]


def hf_state(state: dict[str, torch.Tensor], tied: bool) -> dict[str, torch.Tensor]:
    """Our state_dict under the HF model's names; a tied head left out (transformers re-ties it)."""
    return {HF_PREFIX + k: v for k, v in state.items() if not (tied and k == HEAD)}


def shard_names(state: dict[str, torch.Tensor], max_shard_bytes: int) -> list[list[str]]:
    """Tensor names in shards of at most `max_shard_bytes` each (a larger tensor alone in its shard),
    in state_dict order: transformers' rule."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in state.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def write_hf_weights(directory: Path, state: dict[str, torch.Tensor], max_shard_bytes: int) -> list[str]:
    """`state` (HF names) as model.safetensors, or as shards + model.safetensors.index.json when it is
    larger than `max_shard_bytes`. Returns the file names written."""
    from safetensors.torch import save_file

    state = {k: v.detach().cpu().contiguous() for k, v in state.items()}
    shards = shard_names(state, max_shard_bytes)
    if len(shards) == 1:
        save_file(state, directory / SAFETENSORS_NAME, metadata={"format": "pt"})
        return [SAFETENSORS_NAME]
    weight_map, files = {}, []
    for i, names in enumerate(shards, start=1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: state[k] for k in names}, directory / fname, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(names, fname)
        files.append(fname)
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    return [*files, INDEX_NAME]


def hf_config(cfg, dtype: torch.dtype, bos_id: int | None = None) -> dict:
    """config.json of the export of a model of ModelConfig `cfg` stored in `dtype`; `bos_id`: the
    document start (default: the EOS)."""
    return {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "auto_map": {
            "AutoConfig": f"{CONFIGURATION_NAME[:-3]}.Mamba3LiteConfig",
            "AutoModelForCausalLM": f"{MODELING_NAME[:-3]}.{ARCHITECTURE}",
        },
        "mamba3lite": asdict(cfg),  # the glue runs the chunked scan whatever scan_impl says
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers,
        "layer_types": [HF_LAYER_TYPES[cfg.layer_kind(i)] for i in range(cfg.n_layers)],
        "bos_token_id": cfg.eos_id if bos_id is None else bos_id,
        "eos_token_id": cfg.eos_id,
        "pad_token_id": cfg.eos_id,
        "tie_word_embeddings": cfg.tie_embeddings,
        "use_cache": True,
        "dtype": _DTYPE_NAMES[dtype],
    }


def tokenizer_files(
    tok_bytes: bytes, eos_id: int, is_gpt2: bool, chat_template: str | None
) -> tuple[bytes, dict]:
    """(tokenizer.json, tokenizer_config.json) for the run's tokenizer.json `tok_bytes` whose EOS is
    `eos_id`. The document start (`bos_token`) is the BOS that the file's post-processor adds (an
    imported model's: `tokenizer.document_start`), else the EOS, which the post-processor is then made
    to add (`tokenizer.with_document_start`: byte for byte in place of a null one, undone by `import`)."""
    spec = json.loads(tok_bytes)
    eos = next((t["content"] for t in spec.get("added_tokens") or [] if t.get("id") == eos_id), None)
    if eos is None:
        eos = next((s for s, i in (spec.get("model") or {}).get("vocab", {}).items() if i == eos_id), None)
    if eos is None:
        raise CheckpointError(f"the run's tokenizer.json has no token of the EOS id {eos_id}")
    start = document_start(spec)
    if start is None:
        tok_bytes = with_document_start(tok_bytes, eos, eos_id)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": eos if start is None else start[0],
        "eos_token": eos,
        "pad_token": eos,
        "add_bos_token": True,  # [EOS] + ids: a prompt starts a document (module docstring)
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1_000_000_000,  # recurrent: no context limit of its own
        "split_special_tokens": is_gpt2,
    }
    if chat_template is not None:
        config["chat_template"] = export_chat_template(chat_template, writes_start=not is_gpt2)
    return tok_bytes, config


# Jinja: `bos_token` is "" from here on, as `serve` renders the run's template (`+%}`: the run's
# template keeps its first newline, which trim_blocks would otherwise eat).
_EMPTY_BOS = '{% set bos_token = "" +%}'


def export_chat_template(template: str, *, writes_start: bool) -> str:
    """The run's chat template as the export ships it: the document start written once (when the
    tokenizer reads the EOS text as the EOS id: `writes_start`), then the run's own template with an
    empty `bos_token`."""
    return ("{{ bos_token }}" if writes_start else "") + _EMPTY_BOS + template


def export_hf(
    run_dir: str | Path,
    out: str | Path,
    *,
    step: int | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> HFExportResult:
    """Write the Hugging Face directory `out` (absent or empty) for checkpoint `step` (default: the
    newest verified one) of run `run_dir`; see the module docstring for what it holds."""
    from mamba3lite.interop.outdir import check_out_dir, staged_dir
    from mamba3lite.model import count_parameters
    from mamba3lite.pretrained import recorded_tokenizer
    from mamba3lite.serve.chat import find_chat_template

    if max_shard_bytes < 1:
        raise ConfigError(f"--max-shard-size must be >= 1 byte, got {max_shard_bytes}")
    out = Path(out)
    check_out_dir(out)
    run, got, notes = exported_step(run_dir, step)
    p, step, meta, cfg = run.path, got.step, got.meta, got.config.model
    tok_bytes, tok_desc = tokenizer_json(p, meta, cfg.vocab_size)
    tok_name = recorded_tokenizer((meta.get("data") or {}).get("tokenizer"), p)
    template = find_chat_template(p, tok_name)
    tok_bytes, tok_config = tokenizer_files(tok_bytes, cfg.eos_id, tok_name == "gpt2", template)
    bos_id = document_start(json.loads(tok_bytes))[1]  # the EOS, or the run's tokenizer's own BOS
    state = hf_state(checkpoint_state(got), cfg.tie_embeddings)
    dtype = next(iter(state.values())).dtype
    n_params = count_parameters(cfg)
    card = _card(p, step, meta, cfg, n_params, tok_desc, notes)
    with staged_dir(out) as tmp:
        files = write_hf_weights(tmp, state, max_shard_bytes)
        texts = {
            CONFIG_NAME: json.dumps(hf_config(cfg, dtype, bos_id), indent=2) + "\n",
            GENERATION_CONFIG_NAME: json.dumps(_generation_config(cfg, bos_id), indent=2) + "\n",
            TOKENIZER_CONFIG_NAME: json.dumps(tok_config, indent=2, ensure_ascii=False) + "\n",
            CONFIGURATION_NAME: configuration_source(),
            MODELING_NAME: modeling_source(),
            "README.md": card,
        }
        for name, text in texts.items():
            (tmp / name).write_text(text, encoding="utf-8")
        (tmp / TOKENIZER_NAME).write_bytes(tok_bytes)
    return HFExportResult(out, step, n_params, sorted([*files, *texts, TOKENIZER_NAME]), notes)


def _generation_config(cfg, bos_id: int) -> dict:
    ids = {"bos_token_id": bos_id, "eos_token_id": cfg.eos_id, "pad_token_id": cfg.eos_id}
    return {**ids, **GENERATE_DEFAULTS}


def _card(p: Path, step: int, meta: dict, cfg, n_params: int, tok_desc: str, notes: list[str]) -> str:
    """The README.md model card of the export."""
    last_eval = meta.get("last_eval") if isinstance(meta.get("last_eval"), dict) else {}
    val_loss = last_eval.get("val_loss")
    finite = isinstance(val_loss, (int, float)) and math.isfinite(val_loss)
    loss = f"{val_loss:.4f}" if finite else "not recorded"
    kind = f"MIMO rank {cfg.mimo_rank}" if cfg.is_mimo else "SISO"
    if cfg.attn_layer_idx:
        kind += f", hybrid with attention at layers {', '.join(map(str, cfg.attn_layer_idx))}"
    lines = [
        "---",
        "library_name: transformers",
        "pipeline_tag: text-generation",
        "tags: [mamba3lite, mamba-3, ssm]",
        "---",
        "",
        f"# {p.resolve().name} (step {step})",
        "",
        f"A Mamba-3 language model (arXiv 2603.15569), {kind}, {cfg.n_layers} layers, d_model {cfg.d_model}, "
        f"{n_params:,} parameters, trained with mamba3lite for {int(meta.get('tokens_seen', 0)):,} tokens "
        f"(validation loss {loss}). Tokenizer: {tok_desc}.",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        'model = AutoModelForCausalLM.from_pretrained("PATH", trust_remote_code=True)',
        'tok = AutoTokenizer.from_pretrained("PATH")',
        'ids = tok("Once upon a time", return_tensors="pt").input_ids  # [EOS] + the text: a document starts',
        "out = model.generate(ids, max_new_tokens=50, do_sample=False)",
        "```",
        "",
        "The modeling file is generated from mamba3lite's model source: pure PyTorch (the chunked scan and "
        "the O(1) recurrent decode step), no CUDA kernels needed; generate() keeps the recurrent state as "
        "its cache"
        + (", and the attention layers' keys and values beside it." if cfg.attn_layer_idx else "."),
    ]
    if notes:
        lines += ["", "Notes:", *[f"- {n}" for n in notes]]
    return "\n".join(lines) + "\n"
