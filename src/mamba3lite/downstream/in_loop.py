"""Downstream benchmarks during training, as OLMo-core runs them: `training.eval_tasks` every
`training.eval_tasks_every` optimizer steps, on the first `training.eval_tasks_limit` items of each task.

    downstream = in_loop_evaluator(config, tokenizer_name)   # at start: checks everything, once
    downstream.maybe_evaluate(step, model, logger, tokens)    # after each optimizer step; does the rest

Each evaluation is one metrics row of kind "eval" whose keys are "<task>/<metric>" (lm-eval's metrics:
acc, acc_norm where the task defines it, LAMBADA's perplexity; "<task>/n" items), so every sink (JSONL,
TensorBoard, W&B) and `plot` / `inspect` show them next to the validation loss. Standard errors are not
recorded (lm-eval's bootstrap for perplexity would cost more than the evaluation).

Everything that could fail later fails at the start, in `in_loop_evaluator`: lm-eval missing, a task
name it does not know, task data missing offline, a tokenizer that does not fit the model. With
`eval_tasks_every` 0 the evaluator is `NoDownstream`, which does nothing (and imports nothing).
Under torchrun every rank scores its share of the items (lm-eval's split: every world_size-th item;
the weights are the same on every rank) and rank 0 gathers them and writes the row, so the time an
evaluation takes shrinks with the job's size instead of holding every other rank in its next
collective. With fewer items per task than ranks (a tiny eval_tasks_limit), some rank would have none,
which lm-eval does not handle: rank 0 then scores them all while the others wait.
"""

from __future__ import annotations

import time
from typing import Any

from mamba3lite.errors import ConfigError


class NoDownstream:
    """Downstream evaluation off (training.eval_tasks_every 0): nothing to do."""

    def maybe_evaluate(self, step: int, model: Any, logger: Any, tokens: int) -> dict | None:
        return None


class DownstreamEvaluator:
    """Scores `tasks` through lm-eval every `every` steps (see the module docstring)."""

    def __init__(
        self,
        tasks: list[str],
        every: int,
        limit: int | None,
        tokenizer: Any,
        *,
        max_length: int,
        batch_size: int,
        bf16: bool,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        assert every > 0 and tasks
        self.tasks, self.every, self.limit = list(tasks), every, limit
        self.tokenizer = tokenizer
        self.max_length, self.batch_size, self.bf16 = max_length, batch_size, bf16
        self.rank = rank
        # the ranks share the items, unless some rank would get none (module docstring)
        self.shared = world_size > 1 and (limit is None or limit >= world_size)

    def maybe_evaluate(self, step: int, model: Any, logger: Any, tokens: int) -> dict | None:
        """At a multiple of `every`: evaluate `model` (left in the mode it was in), write the row through
        `logger.log_eval` and return its values (on rank 0; every rank of a job calls it); else None."""
        if step <= 0 or step % self.every:
            return None
        from mamba3lite.downstream.harness import Mamba3LiteLM, run_tasks

        if self.rank > 0 and not self.shared:
            return None
        t0 = time.time()
        lm = Mamba3LiteLM(
            model, self.tokenizer, batch_size=self.batch_size, max_length=self.max_length, bf16=self.bf16,
            distributed=self.shared,
        )  # fmt: skip
        results = run_tasks(lm, self.tasks, limit=self.limit, bootstrap_iters=0)
        if results is None:  # a rank other than 0: its share is scored, rank 0 writes the row
            return None
        values: dict[str, float | int] = {}
        for task, metrics in results.items():
            for key, value in metrics.items():
                if value is not None and not key.endswith("_stderr"):
                    values[f"{task}/{key}"] = value
        values["downstream_s"] = round(time.time() - t0, 3)
        logger.log_eval(step, tokens, values)
        return values


def in_loop_evaluator(
    config: Any, tokenizer_name: str | None, *, bf16: bool = False, rank: int = 0, world_size: int = 1
):
    """The run's downstream evaluator, checked now: `NoDownstream` when training.eval_tasks_every is 0,
    else a `DownstreamEvaluator` whose tasks, data, lm-eval and tokenizer have been verified
    (ConfigError / DataError otherwise, before the first step). `tokenizer_name`: the training data's
    tokenizer (None for dummy data: GPT-2 when the vocabulary is GPT-2's). `rank`, `world_size`: this
    process's place in the job (the trainer's `DistInfo`)."""
    tc, mc = config.training, config.model
    if not tc.eval_tasks_every:
        return NoDownstream()
    from mamba3lite.downstream.tasks import task_configs
    from mamba3lite.tokenizer import GPT2_VOCAB_SIZE, load_tokenizer

    task_configs(tc.eval_tasks)  # lm-eval installed, names known, local data present
    if tokenizer_name is None:
        if mc.vocab_size != GPT2_VOCAB_SIZE:
            raise ConfigError(
                f"training.eval_tasks needs the text tokenizer of the model; the run trains on data without "
                f"one (dummy data) and model.vocab_size {mc.vocab_size} is not GPT-2's {GPT2_VOCAB_SIZE}"
            )
        tokenizer_name = "gpt2"
    tok = load_tokenizer(tokenizer_name)
    if tok.vocab_size != mc.vocab_size or tok.eos_id != mc.eos_id:
        raise ConfigError(
            f"training.eval_tasks: the tokenizer {tokenizer_name} (vocab {tok.vocab_size}, EOS {tok.eos_id}) "
            f"does not fit the model (model.vocab_size {mc.vocab_size}, model.eos_id {mc.eos_id})"
        )
    return DownstreamEvaluator(
        tc.eval_tasks,
        tc.eval_tasks_every,
        tc.eval_tasks_limit or None,
        tok,
        max_length=tc.max_seq_len,
        batch_size=tc.micro_batch_size,
        bf16=bf16,
        rank=rank,
        world_size=world_size,
    )
