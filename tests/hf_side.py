"""The user's side of a Hugging Face export, run as a script in a process where `import mamba3lite` fails
(a meta-path blocker, installed before anything else is imported, and no src/ on the path): only torch,
transformers, tokenizers (and peft) are there.

    python tests/hf_side.py EXPORT_DIR JOB.json RESULT.json

JOB: {"texts": [...], "ids": [[...]], "prompt": "...", "short_prompt": "...", "new_tokens": N, "peft": bool,
      "prompts": [...], "path_tokens": M}
RESULT: {"blocked": true, "encodings": [[...]], "logits": [[[...]]], "generated": [...],
         "fed_per_forward": [...], "batched": [[...], [...]], "short_alone": [...], "peft": {...},
         the ordinary ways to continue each of `prompts` (the path table of tests/test_export_hf.py):
         "start": [[...]], "bare": [[...]], "decoded": [...], "transformers": [[...]], "pipeline": [...]}
"""

from __future__ import annotations

import json
import sys


class _Blocker:
    """Refuses the package by name, wherever it might be installed."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "mamba3lite":
            raise ModuleNotFoundError(f"{name} is blocked in this process", name=name)
        return None


sys.meta_path.insert(0, _Blocker())


def _blocked() -> bool:
    try:
        import mamba3lite  # noqa: F401
    except ModuleNotFoundError:
        return True
    return False


def main(export_dir: str, job_path: str, result_path: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with open(job_path, encoding="utf-8") as f:
        job = json.load(f)
    model = AutoModelForCausalLM.from_pretrained(export_dir, trust_remote_code=True).eval()
    tok = AutoTokenizer.from_pretrained(export_dir, trust_remote_code=True)
    result = {"blocked": _blocked(), "eos": [tok.eos_token_id, tok.bos_token_id, tok.pad_token_id]}
    # first: the LoRA step at the end wraps the model's layers
    result |= _ordinary_paths(model, tok, job["prompts"], job["path_tokens"])
    result["encodings"] = [tok.encode(t, add_special_tokens=False) for t in job["texts"]]
    result["defaults"] = [tok(t)["input_ids"] for t in job["texts"]]
    with torch.no_grad():
        result["logits"] = model(torch.tensor(job["ids"])).logits.tolist()

    # Tokens the model reads per forward call (its embedding's input, one row): the prompt, then 1 per
    # new token.
    fed: list[int] = []
    hook = model.get_input_embeddings().register_forward_pre_hook(lambda m, args: fed.append(args[0].numel()))
    # As `mamba3lite generate`: a document starts after the EOS (the tokenizer's bos_token).
    prompt_ids = [tok.bos_token_id, *tok.encode(job["prompt"], add_special_tokens=False)]
    result["generated"] = _greedy(model, tok, [prompt_ids], job["new_tokens"])[0]
    hook.remove()
    result["fed_per_forward"] = fed
    # A batch of two prompts of different lengths, left-padded, and the shorter one alone.
    short_ids = [tok.bos_token_id, *tok.encode(job["short_prompt"], add_special_tokens=False)]
    result["batched"] = _greedy(model, tok, [prompt_ids, short_ids], job["new_tokens"])
    result["short_alone"] = _greedy(model, tok, [short_ids], job["new_tokens"])[0]
    if job.get("peft"):
        result["peft"] = _peft_step(model, job["ids"])
    with open(result_path, "w", encoding="utf-8") as f:
        json.dump(result, f)


def _ordinary_paths(model, tok, prompts: list[str], new_tokens: int) -> dict:
    """Each prompt as a user of the export continues it, greedy: `tok(prompt)` + generate(), and
    pipeline("text-generation"); with what the tokenizer does to it (its ids, bare ids, the ids decoded
    with skip_special_tokens)."""
    from transformers import pipeline

    out: dict = {"start": [], "bare": [], "decoded": [], "transformers": [], "pipeline": []}
    pipe = pipeline("text-generation", model=model, tokenizer=tok)
    for prompt in prompts:
        enc = tok(prompt, return_tensors="pt")
        out["start"].append(enc.input_ids[0].tolist())
        out["bare"].append(tok(prompt, add_special_tokens=False).input_ids)
        out["decoded"].append(tok.decode(enc.input_ids[0], skip_special_tokens=True))
        gen = model.generate(**enc, max_new_tokens=new_tokens, do_sample=False)
        out["transformers"].append(gen[0, enc.input_ids.shape[1] :].tolist())
        text = pipe(prompt, max_new_tokens=new_tokens, do_sample=False, return_full_text=False)
        out["pipeline"].append(text[0]["generated_text"])
    return out


def _greedy(model, tok, rows: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Greedy generate() on left-padded rows with their attention mask; each row's new tokens."""
    import torch

    width = max(len(r) for r in rows)
    ids = torch.tensor([[tok.pad_token_id] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False)
    return out[:, width:].tolist()


def _peft_step(model, ids) -> dict:
    """A LoRA adapter on in_proj/out_proj: one forward/backward/optimizer step."""
    import torch
    from peft import LoraConfig, get_peft_model

    lora = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["in_proj", "out_proj"]))
    lora.train()
    trainable = [n for n, p in lora.named_parameters() if p.requires_grad]
    x = torch.tensor(ids)
    loss = lora(input_ids=x, labels=x, use_cache=False).loss
    loss.backward()
    grads = {n: float(p.grad.abs().sum()) for n, p in lora.named_parameters() if p.requires_grad}
    opt = torch.optim.SGD([p for p in lora.parameters() if p.requires_grad], lr=0.1)
    opt.step()
    with torch.no_grad():
        after = lora(input_ids=x, labels=x, use_cache=False).loss
    return {"trainable": trainable, "loss": float(loss), "after": float(after), "grads": grads}


if __name__ == "__main__":
    main(*sys.argv[1:])
