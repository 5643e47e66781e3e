"""The README.md written beside an exported model: what it is, what it was trained on, how to load it."""

from __future__ import annotations

from typing import Any

# How each A activation computes A, and what it means for a user of the official code.
_A_ACTIVATION_TEXT = {
    "heavy_tail": "heavy-tail, A = -max(f(a), A_floor) with f(a) = 1+a (a >= 0), 1/(1-a) (a < 0): "
    "the official code's current one",
    "softplus": "softplus, A = -max(softplus(a), A_floor): the paper release's; the official code since "
    "mid-2026 uses heavy-tail, so load this model with a mamba_ssm from before that change (or edit "
    "its A activation) to get these outputs",
}


def model_card(
    *,
    title: str,
    official_config: dict[str, Any],
    n_params: int,
    a_activation: str,
    tokenizer: str,
    step: int,
    tokens_seen: int,
    manifest_sha256: str | None,
    val_loss: float | None,
    notes: list[str],
) -> str:
    """Markdown text of the model card."""
    act = _A_ACTIVATION_TEXT[a_activation]
    loss = f"{val_loss:.4f}" if val_loss is not None else "not measured"
    lines = [
        f"# {title}",
        "",
        "A Mamba-3 language model in the official `mamba_ssm` format, exported by mamba3lite.",
        "",
        "```python",
        "from mamba_ssm.models.mixer_seq_simple import MambaLMHeadModel",
        'model = MambaLMHeadModel.from_pretrained("PATH/TO/THIS/DIRECTORY", device="cuda")',
        "```",
        "",
        "| | |",
        "|---|---|",
        f"| architecture | {_architecture(official_config)} |",
        f"| parameters | {n_params:,} (padding rows of the embedding included) |",
        f"| A activation | {act} |",
        f"| tokenizer | {tokenizer} (`tokenizer.json`) |",
        f"| vocabulary | {official_config['vocab_size']:,} ids (embedding padded to a multiple of "
        f"{official_config['pad_vocab_size_multiple']}) |",
        f"| training step | {step:,} |",
        f"| tokens seen | {tokens_seen:,} |",
        f"| training data manifest sha256 | {manifest_sha256 or 'not recorded'} |",
        f"| last validation loss | {loss} |",
        "",
        "Files: `config.json` (MambaConfig), `pytorch_model.bin` (read by `from_pretrained`), "
        "`model.safetensors` (the same tensors; a tied `lm_head.weight` is the embedding and is not "
        "stored twice), `tokenizer.json` (Hugging Face `tokenizers`).",
    ]
    if notes:
        lines += ["", "Notes:", *[f"- {n}" for n in notes]]
    return "\n".join(lines) + "\n"


def _architecture(official_config: dict[str, Any]) -> str:
    """One line: layers, mixer kind, MLP, widths, head."""
    ssm = official_config["ssm_cfg"]
    kind = f"MIMO rank {ssm['mimo_rank']}" if ssm["is_mimo"] else "SISO"
    width = official_config["d_intermediate"]
    mlp = f"GatedMLP width {width}" if width else "no MLP"
    head = "tied to the embedding" if official_config["tie_embeddings"] else "untied"
    attn = official_config["attn_layer_idx"]
    layers = f"{official_config['n_layer']} layers of Mamba-3 ({kind})"
    if attn:
        a = official_config["attn_cfg"]
        kv = a.get("num_heads_kv") or a["num_heads"]
        layers += (
            f", attention (mamba_ssm MHA, {a['num_heads']} heads, {kv} key/value heads) at layers "
            f"{', '.join(map(str, attn))},"
        )
    return (
        f"{layers} + {mlp}, d_model "
        f"{official_config['d_model']}, d_state {ssm['d_state']}, headdim {ssm['headdim']}, "
        f"expand {ssm['expand']}, ngroups {ssm['ngroups']}, rope_fraction {ssm['rope_fraction']}, "
        f"LM head {head}"
    )
