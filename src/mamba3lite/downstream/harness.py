"""Our model as an lm-evaluation-harness model, registered as `mamba3lite`; and running lm-eval with it.

    lm = Mamba3LiteLM(model, tokenizer, max_length=2048)          # a model in memory (in-loop eval)
    lm = Mamba3LiteLM.create_from_arg_string("checkpoint_dir=runs/x,step=400,device=cpu")
    # imported, this module registers the model: simple_evaluate(model="mamba3lite", model_args=...)
    results = run_tasks(lm, ["piqa", "lambada"], limit=200)     # {"piqa": {"acc": ..., "n": 200, ...}}

lm-eval asks three kinds of question; the metrics (acc, acc_norm, LAMBADA's perplexity and accuracy,
standard errors) are computed by lm-eval itself from the answers:

    loglikelihood(context, continuation)   (Σ log p of the continuation's tokens, all greedy?)
                                           lm-eval's TemplateLM splits the pair: trailing spaces of the
                                           context move to the continuation, the continuation's tokens
                                           are those of encode(context + continuation) after
                                           encode(context). Encoding starts a document, as `generate`
                                           and an export's tokenizer do: [start] + ids (`tok_encode`;
                                           the start is the tokenizer's `bos_id`, the EOS for a run
                                           trained here), so lm-eval's `hf` model scores an export alike;
                                           an empty context is the start alone.
    loglikelihood_rolling(text)            Σ log p of the whole text, in windows of the run's
                                           max_seq_len (lm-eval's rolling windows, first token after EOS)
    generate_until(context, until)         greedy decoding until a stop string, EOS or max_gen_toks

Pairs are scored with state reuse by default (`state_reuse.py`: each distinct context runs once, every
choice continues from a copy of its recurrent state); `state_reuse=False` is lm-eval's standard path.
Both give the same numbers. Contexts are not truncated: the model is recurrent and reads any length.
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
from typing import Any

import torch

from mamba3lite.downstream.tasks import require_lm_eval, task_configs
from mamba3lite.errors import ConfigError, DataError
from mamba3lite.model.precision import resolve_precision

require_lm_eval()

from lm_eval.api.model import TemplateLM  # noqa: E402
from lm_eval.api.registry import register_model  # noqa: E402

DEFAULT_MAX_GEN_TOKS = 256


@register_model("mamba3lite")
class Mamba3LiteLM(TemplateLM):
    """lm-eval's view of a `Mamba3Transformer` and its tokenizer (see the module docstring).

    batch_size: rows per forward pass; max_length: the rolling-window length of loglikelihood_rolling
    (the run's max_seq_len); bf16: score under bf16 autocast; state_reuse: the fast multiple-choice path;
    distributed: this process is one rank of the initialized torch.distributed job (the in-loop
    evaluator under torchrun): lm-eval then gives each rank every world_size-th item and gathers the
    per-item metrics on rank 0 through `all_gather` / `gather_object` / `barrier` below.
    add_bos_token: contexts start a document ([start] + ids), as lm-eval's `hf` model reads them through
    an export's tokenizer (its own `add_bos_token` argument, of the same meaning); False: bare ids, as
    lm-eval's API models (`local-completions` against `serve` or `vllm serve`) send them, whose remote
    tokenizer never adds special tokens.
    """

    backend = "causal"

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        *,
        batch_size: int = 16,
        max_length: int = 2048,
        bf16: bool = False,
        state_reuse: bool = True,
        distributed: bool = False,
        add_bos_token: bool = True,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ConfigError(f"--batch-size must be >= 1, got {batch_size}")
        if distributed:
            import torch.distributed as dist

            self._rank, self._world_size = dist.get_rank(), dist.get_world_size()
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.max_length = max_length
        self.bf16 = bf16
        self.state_reuse = state_reuse
        self.add_bos_token = add_bos_token
        self.loaded = None  # the `Pretrained` it came from (`from_run`), for the report

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> Mamba3LiteLM:
        """`lm_eval --model mamba3lite --model_args checkpoint_dir=RUN[,step=N][,device=D]`."""
        from lm_eval.utils import simple_parse_args_string

        args = simple_parse_args_string(arg_string)
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None}
        batch_size = args.pop("batch_size", extra.get("batch_size", 16))
        device = args.pop("device", extra.get("device") or "auto")
        if "checkpoint_dir" not in args:
            raise ConfigError("model_args must name the run: checkpoint_dir=RUN")
        return cls.from_run(
            args.pop("checkpoint_dir"),
            step=args.pop("step", None),
            device=str(device),
            batch_size=int(batch_size),
            **args,
        )

    @classmethod
    def from_run(
        cls,
        run_dir: str,
        *,
        step: int | None = None,
        device: str = "auto",
        batch_size: int | None = None,
        **kw,
    ) -> Mamba3LiteLM:
        """The newest verified checkpoint of `run_dir` (or `step`) with the run's own tokenizer; scored in
        the run's dtype where the device computes it natively (model/precision.py), else fp32: a bf16 run
        scored on a CPU without native bf16 is scored in fp32 (an emulated bf16 is ~10x slower, and
        benchmark accuracies do not need the training's rounding)."""
        from mamba3lite.pretrained import load_pretrained, resolve_device

        loaded = load_pretrained(run_dir, None if step is None else int(step), device=resolve_device(device))
        tc = loaded.config.training
        dev = next(loaded.model.parameters()).device
        lm = cls(
            loaded.model,
            loaded.load_tokenizer(),
            batch_size=tc.micro_batch_size if batch_size is None else batch_size,
            max_length=tc.max_seq_len,
            bf16=resolve_precision("auto" if tc.dtype == "bf16" else tc.dtype, dev).dtype is not None,
            **kw,
        )
        lm.loaded = loaded
        return lm

    # ---- what TemplateLM needs ----
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_id

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name

    # ---- lm-eval's collectives, for `distributed` (single-process: TemplateLM's no-ops) ----
    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return super().all_gather(tensor)
        import torch.distributed as dist

        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor.contiguous())
        return torch.stack(parts)

    def gather_object(self, obj: Any, dst: int = 0) -> list | None:
        if self.world_size == 1:
            return super().gather_object(obj, dst)
        import torch.distributed as dist

        out = [None] * self.world_size if self.rank == dst else None
        dist.gather_object(obj, out, dst=dst)
        return out

    def barrier(self) -> None:
        if self.world_size > 1:
            import torch.distributed as dist

            dist.barrier()

    @property
    def prefix_token_id(self) -> int:
        return self.tokenizer.bos_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """[start] + ids, as an export's tokenizer encodes by default (lm-eval's `hf` model calls it so);
        bare ids with add_special_tokens=False, or always when the model was made with add_bos_token=False."""
        ids = self.tokenizer.encode(string)
        start = self.add_bos_token if add_special_tokens is None else add_special_tokens
        return [self.tokenizer.bos_id, *ids] if start else ids

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens)

    def _loglikelihood_tokens(
        self, requests, disable_tqdm: bool = False, **kwargs
    ) -> list[tuple[float, bool]]:
        from mamba3lite.downstream.state_reuse import score_plain, score_with_state_reuse

        pairs = [(ctx, cont) for _, ctx, cont in requests]
        score = score_with_state_reuse if self.state_reuse else score_plain
        was_training = self.model.training
        self.model.eval()
        try:
            out = score(self.model, pairs, self.batch_size, self.bf16)
        finally:
            self.model.train(was_training)
        for (key, _, _), answer in zip(requests, out):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        out = []
        for (text,) in [r.args for r in requests]:
            windows = [
                make_disjoint_window(w)
                for w in get_rolling_token_windows(
                    self.tok_encode(text, add_special_tokens=False),
                    self.prefix_token_id,
                    self.max_length,
                    context_len=1,
                )
            ]
            scores = self._loglikelihood_tokens([(None, ctx, cont) for ctx, cont in windows])
            total = sum(lp for lp, _ in scores)
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
            out.append(total)
        return out

    @torch.no_grad()
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out = []
        was_training = self.model.training
        self.model.eval()
        try:
            for context, gen_kwargs in [r.args for r in requests]:
                out.append(self._generate_one(context, dict(gen_kwargs or {})))
                self.cache_hook.add_partial("generate_until", (context, gen_kwargs), out[-1])
        finally:
            self.model.train(was_training)
        return out

    def _generate_one(self, context: str, gen_kwargs: dict) -> str:
        """Greedy continuation of `context` (lm-eval's default; a temperature > 0 with do_sample samples),
        cut before the first stop string of `until`."""
        until = gen_kwargs.pop("until", None) or []
        until = [until] if isinstance(until, str) else list(until)
        max_new = int(gen_kwargs.pop("max_gen_toks", DEFAULT_MAX_GEN_TOKS))
        temperature = float(gen_kwargs.pop("temperature", 0.0)) if gen_kwargs.pop("do_sample", False) else 0.0
        ids = self.tok_encode(context) or [self.prefix_token_id]
        x_1T = torch.tensor([ids], dtype=torch.long, device=self.device)
        new: list[int] = []
        text = ""
        for tok_1 in self.model.generate(x_1T, max_new, temperature=temperature, eos_id=self.eot_token_id):
            tok = int(tok_1[0])
            if tok == self.eot_token_id:
                break
            new.append(tok)
            text = self.tok_decode(new)
            if any(s in text for s in until):
                break
        for s in until:
            text = text.split(s)[0]
        return text


def run_tasks(
    lm: Mamba3LiteLM,
    names: list[str],
    *,
    limit: int | None = None,
    num_fewshot: int | None = None,
    bootstrap_iters: int = 100_000,
    quiet: bool = True,
) -> dict[str, dict] | None:
    """lm-eval's `simple_evaluate` over tasks `names`: {task: {metric: value, metric_stderr: .., "n": items}}
    (None on the ranks other than 0 of a `distributed` lm, which score their share of the items).

    limit: at most this many items per task (lm-eval's first N); num_fewshot: lm-eval's (default 0).
    bootstrap_iters: lm-eval's resamples for the standard errors of non-mean metrics (LAMBADA's
    perplexity); 0 skips those. ConfigError/DataError for bad names, missing data, --limit < 1.
    lm-eval is told not to reseed the process's random, numpy and torch generators (it would, by
    default: during training that resets them at every in-loop evaluation); zero-shot scoring draws
    nothing from them, and the few-shot sampler keeps lm-eval's own seed.
    """
    from lm_eval import simple_evaluate

    if limit is not None and limit < 1:
        raise ConfigError(f"--limit must be >= 1 (items per task), got {limit}")
    if num_fewshot is not None and num_fewshot < 0:
        raise ConfigError(f"--num-fewshot must be >= 0, got {num_fewshot}")
    import datasets

    specs, manager = task_configs(names)
    level = logging.getLogger("lm_eval").level
    bars = datasets.utils.logging.is_progress_bar_enabled()
    if quiet:  # lm-eval's warnings and the progress bars of its dataset maps (HellaSwag maps 10k docs)
        logging.getLogger("lm_eval").setLevel(logging.ERROR)
        datasets.utils.logging.disable_progress_bar()
    # lm-eval prints progress ("bootstrapping for stddev") on stdout: keep stdout for our own report
    # (`eval --json` prints one object and nothing else).
    try:
        with contextlib.redirect_stdout(sys.stderr), _no_git_probe():
            results = simple_evaluate(
                model=lm,
                tasks=specs,
                task_manager=manager,
                limit=limit,
                num_fewshot=num_fewshot,
                bootstrap_iters=bootstrap_iters,
                log_samples=False,
                random_seed=None,
                numpy_random_seed=None,
                torch_random_seed=None,
            )
    except (ConnectionError, OSError, FileNotFoundError) as e:
        remote = [n for n in names if isinstance(n, str) and n in {s for s in specs if isinstance(s, str)}]
        raise DataError(
            f"lm-eval could not load the data of {', '.join(remote) or 'a task'}: {e}; offline, only the "
            "local tasks (piqa, arc_easy, arc_challenge, hellaswag, winogrande, openbookqa, lambada) work"
        ) from None
    finally:
        logging.getLogger("lm_eval").setLevel(level)
        if bars:
            datasets.utils.logging.enable_progress_bar()
    return None if results is None else summarise(results, names)


@contextlib.contextmanager
def _no_git_probe():
    """Without lm-eval's `git describe` in the current directory: it records a commit hash in results we
    do not read, and outside a git checkout git prints "fatal: not a git repository" on the terminal
    (a subprocess: its stderr is the process's, which no Python-level redirect reaches)."""
    import lm_eval.evaluator as evaluator

    if not hasattr(evaluator, "get_git_commit_hash"):  # another lm-eval layout: leave it alone
        yield
        return
    probe = evaluator.get_git_commit_hash
    evaluator.get_git_commit_hash = lambda: None
    try:
        yield
    finally:
        evaluator.get_git_commit_hash = probe


def summarise(results: dict, names: list[str]) -> dict[str, dict]:
    """lm-eval's results ("acc,none", "acc_stderr,none", ...) -> {task: {"acc": ..., "acc_stderr": ...,
    "n": items}}; a stderr lm-eval could not compute ("N/A") is None."""
    out: dict[str, dict] = {}
    for name in names:
        raw = results["results"].get(name, {})
        metrics: dict[str, Any] = {}
        for key, value in raw.items():
            if "," not in key:
                continue  # "alias"
            metric, _filter = key.split(",", 1)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                metrics[metric] = float(value) if math.isfinite(float(value)) else None
            else:
                metrics[metric] = None
        n = results.get("n-samples", {}).get(name, {})
        metrics["n"] = int(n.get("effective", n.get("original", 0)))
        out[name] = metrics
    return out
