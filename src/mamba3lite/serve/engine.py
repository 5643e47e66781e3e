"""Continuous batching over the recurrent state: one decode loop per model, in its own thread.

    engine = Engine(model, tokenizer, max_batch_size=32, max_queue=256, prefix_cache=PrefixCache(256 << 20))
    engine.start()
    engine.submit([Job(prompt_ids, report_from, sampling, sink)])   # sink(event) from the engine thread
    ...
    engine.stop()

The loop: at each step boundary, waiting jobs join the running batch, in order, up to `max_batch_size`
rows and, with `max_state_bytes`, while the batch's decode state stays within that many bytes: a row
reserves the state of its prompt + max_tokens tokens when it joins (`BatchState.layout_for`; a hybrid's
key/value cache grows with the length, a pure Mamba-3 state does not), the first job that does not fit
waits with those behind it until rows leave, and `submit` refuses (`StateTooLarge`) a job that would not
fit even alone (a joining job's own state during its prefill, and the prefix cache, bounded on its own,
are not counted). A joining job's prompt is prefilled alone with the chunked scan
(`Mamba3Transformer.extend_hidden`, in segments that end on multiples of the prefix cache's boundary,
starting from the longest cached prefix), and its one-row state is copied into a row of the batch's state
(`batch_state.BatchState`). Then every row's next token is chosen from its own logits with its own
generator (`sampling.RowSampler`), rows that finished (EOS, a stop string, max_tokens) or were cancelled
(a client that went away) leave (the last row moves into the freed one), and the whole batch takes one
`Mamba3Transformer.step` on the stacked states. A row's numbers therefore never mix with another row's:
its output does not depend on what else is in the batch, and greedy output is
`generation.generate_text`'s.

Events to a job's sink, in order: `PromptScores` (only with echo and logprobs), `Delta`s (text safe to
show, and the token with its logprobs), one `Finished`.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from mamba3lite.model.mamba3 import linear_in_own_dtype
from mamba3lite.serve.batch_state import BatchState
from mamba3lite.serve.prefix_cache import PrefixCache, prefix_hashes
from mamba3lite.serve.sampling import RowSampler, Sampling, top_logprobs
from mamba3lite.serve.textout import StopMatcher, TokenText

# Prompt positions whose logits are materialised at once when a prompt is scored (rows × V floats).
SCORE_ROWS = 256


class QueueFull(Exception):
    """The engine's waiting queue has no room for the submitted jobs."""


class StateTooLarge(Exception):
    """A job whose decode state (`tokens`: its prompt + max_tokens) needs `need_bytes`, over the engine's
    `budget_bytes` even with no other row in the batch."""

    def __init__(self, tokens: int, need_bytes: int, budget_bytes: int) -> None:
        super().__init__(f"a decode state of {tokens} tokens needs {need_bytes} bytes, over {budget_bytes}")
        self.tokens, self.need_bytes, self.budget_bytes = tokens, need_bytes, budget_bytes


@dataclass
class Delta:
    """New text safe to show (may be ""), and the token that produced it (None: text released at the
    end); logprob and top [(id, logprob)] when the job asked for logprobs."""

    text: str
    token_id: int | None
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None


@dataclass
class PromptScores:
    """The reported prompt tokens, log p of each given the ones before (the first: None), and the top
    alternatives at each position (None for the first)."""

    ids: list[int]
    logprobs: list[float | None]
    top: list[list[tuple[int, float]] | None]


@dataclass
class Finished:
    """reason: "stop" (EOS or a stop string), "length" (max_tokens), "cancelled" or "error"."""

    reason: str
    prompt_tokens: int
    completion_tokens: int
    message: str = ""


@dataclass
class Job:
    """One sequence to generate. prompt_ids: what the model reads (a text prompt's leading EOS included);
    report_from: index of the first prompt token that is reported (echo / prompt logprobs)."""

    prompt_ids: list[int]
    report_from: int
    sampling: Sampling
    sink: Callable[[object], None]
    cancelled: bool = field(default=False)

    def cancel(self) -> None:
        self.cancelled = True


class _Row:
    """A job in the running batch: its sampler, text assembly and counts."""

    def __init__(self, job: Job, tokenizer, vocab_size: int, device: torch.device) -> None:
        self.job = job
        self.sampler = RowSampler(job.sampling, vocab_size, device)
        self.text = TokenText(tokenizer, job.prompt_ids)
        self.stopper = StopMatcher(job.sampling.stop)
        self.n_out = 0


class Engine:
    """The decode loop (see the module docstring). Thread-safe `submit`; counters read by /metrics."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        *,
        max_batch_size: int = 32,
        max_queue: int = 256,
        prefix_cache: PrefixCache | None = None,
        boundary: int = 256,
        max_len: int | None = None,
        max_state_bytes: int | None = None,
    ) -> None:
        assert max_batch_size >= 1 and max_queue >= 1 and boundary >= 1
        assert max_state_bytes is None or max_state_bytes > 0
        self.model, self.tokenizer = model, tokenizer
        # The most tokens a request's state holds (prompt + completion), preallocated by a layer whose state
        # grows with the length (a key/value cache); None: such a state grows by doubling as rows need.
        self.max_len = max_len
        self.device = next(model.parameters()).device
        self.vocab_size = model.cfg.vocab_size
        self.max_batch_size, self.max_queue, self.boundary = max_batch_size, max_queue, boundary
        self.prefix_cache = prefix_cache if prefix_cache is not None else PrefixCache(0)
        self._waiting: collections.deque[Job] = collections.deque()
        self._cv = threading.Condition()
        self._rows: list[_Row] = []
        # The most bytes the running batch's decode state may hold (None: no limit; module docstring).
        self.max_state_bytes = max_state_bytes
        self._state = BatchState(model, max_batch_size, max_len=max_len, budget_bytes=max_state_bytes)
        self._logits_BV: torch.Tensor | None = None  # row i's next-token logits
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.prompt_tokens = self.prefill_tokens = self.completion_tokens = self.steps = 0

    # ---- the API side ----
    @property
    def queue_len(self) -> int:
        return len(self._waiting)

    @property
    def active(self) -> int:
        return len(self._rows)

    @property
    def state_bytes(self) -> int:
        """Bytes the running batch's decode state holds (the model's state protocol: `nbytes`)."""
        return self._state.nbytes()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="mamba3lite-engine", daemon=True)
        self._thread.start()

    def submit(self, jobs: list[Job]) -> None:
        """Queue `jobs` (all or none); StateTooLarge when one could never join within `max_state_bytes`,
        QueueFull when the waiting queue cannot take them all."""
        for job in jobs:
            need = row_tokens(job)
            if not self._state.fits_alone(need):
                length = self.max_len or need
                raise StateTooLarge(need, self._state.row_bytes(length), self.max_state_bytes)
        with self._cv:
            if self._stopping:
                raise QueueFull("the server is shutting down")
            if len(self._waiting) + len(jobs) > self.max_queue:
                raise QueueFull(f"the queue is full ({self.max_queue} waiting requests)")
            self._waiting.extend(jobs)
            self._cv.notify()

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel what is waiting or running (each gets Finished("cancelled")) and end the loop."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    # ---- the engine thread ----
    def _loop(self) -> None:
        with torch.inference_mode():
            while True:
                with self._cv:
                    while not self._waiting and not self._rows and not self._stopping:
                        self._cv.wait()
                    if self._stopping:
                        break
                    joining, needs = self._take_joining()
                if needs:  # laid out outside the lock: `submit` never waits on a copy of the rows
                    placed = self._state.make_room(needs)
                    assert placed
                joined = [lg for lg in (self._admit(job) for job in joining) if lg is not None]
                if joined:
                    parts = [self._logits_BV, *joined] if self._logits_BV is not None else joined
                    self._logits_BV = torch.cat(parts)
                if self._rows:
                    try:
                        self._decode_once()
                    except Exception as e:  # a bug must fail the running requests, not hang them all
                        for row in self._rows:
                            self._finish(row, "error", f"decode failed: {type(e).__name__}: {e}")
                        self._drop_all()
        self._cancel_all()

    def _take_joining(self) -> tuple[list[Job], list[int]]:
        """The waiting jobs that join now, in order (the lock held), and the tokens each live one reserves:
        while the batch has rows for them and, with a budget, a layout of its state holds what they
        reserve; the first that does not fit waits, and those behind it too (first come, first served).
        Cancelled jobs are taken (to be answered)."""
        joining: list[Job] = []
        needs: list[int] = []
        room = self.max_batch_size - len(self._rows)
        while self._waiting and len(needs) < room:
            job = self._waiting[0]
            if not job.cancelled:
                need = row_tokens(job)
                if self._state.layout_for([*needs, need]) is None:
                    break
                needs.append(need)
            joining.append(self._waiting.popleft())
        if not self._rows and not joining and self._waiting:  # cannot happen (submit checks); never hang
            job = self._waiting.popleft()
            _send(job, Finished("error", len(job.prompt_ids) - job.report_from, 0, "its state does not fit"))
        return joining, needs

    def _cancel_all(self) -> None:
        with self._cv:
            waiting, self._waiting = list(self._waiting), collections.deque()
        for job in waiting:
            _send(job, Finished("cancelled", len(job.prompt_ids) - job.report_from, 0))
        for row in self._rows:
            self._finish(row, "cancelled")
        self._drop_all()

    def _drop_all(self) -> None:
        self._rows, self._logits_BV = [], None
        self._state.clear()

    def _admit(self, job: Job) -> torch.Tensor | None:
        """Prefill `job` and add its row; returns its next-token logits (1, V), None when it did not join."""
        n_prompt = len(job.prompt_ids) - job.report_from
        if job.cancelled:
            _send(job, Finished("cancelled", n_prompt, 0))
            return None
        try:
            cache_1, logits_1V = self._prefill(job)
        except Exception as e:  # an allocation failure must not take the loop down
            _send(job, Finished("error", n_prompt, 0, f"prefill failed: {e}"))
            return None
        self.prompt_tokens += n_prompt
        row = _Row(job, self.tokenizer, self.vocab_size, self.device)
        if job.sampling.max_tokens == 0:
            self._finish(row, "length")
            return None
        self._rows.append(row)
        self._state.add(cache_1, row_tokens(job))
        return logits_1V

    def _prefill(self, job: Job):
        """(one-row state after the prompt, logits of its last position (1, V)); PromptScores sent when
        the job scores its prompt. Segments end on multiples of `boundary`; states there are cached."""
        ids, T, b = job.prompt_ids, len(job.prompt_ids), self.boundary
        scoring = job.sampling.echo and job.sampling.logprobs is not None
        hashes = prefix_hashes(ids, [*range(b, T, b), T]) if self.prefix_cache.enabled else {}
        cache = self.model.allocate_cache(1, self.max_len)
        pos, entry = (0, None) if scoring or not hashes else self.prefix_cache.lookup(hashes)
        logits_1V = None
        if entry is not None:
            cache.load_(entry.state)
            logits_1V = entry.logits_V[None].clone()
        chosen: list[float] = []
        tops: list[list[tuple[int, float]]] = []
        n_top = job.sampling.logprobs or 0
        while pos < T:
            end = min((pos // b + 1) * b, T)
            ids_1L = torch.tensor([ids[pos:end]], dtype=torch.long, device=self.device)
            h_1LD = self.model.extend_hidden(ids_1L, cache)
            self.prefill_tokens += end - pos
            if scoring:
                logits_1V = self._score(h_1LD[0], ids, pos, end, n_top, chosen, tops)
            else:
                logits_1V = linear_in_own_dtype(self.model.lm_head, h_1LD[:, -1]).float()
            if end in hashes:
                self.prefix_cache.put(hashes[end], cache, logits_1V[0])
            pos = end
        if scoring:
            r = job.report_from
            lps = [None, *chosen[r:]]  # chosen[p] = log p(ids[p + 1]); the first reported is None
            top = [None, *tops[r:]]
            _send(job, PromptScores(ids[r:], lps, top))
        return cache, logits_1V

    def _score(self, h_LD, ids, pos, end, n_top, chosen, tops) -> torch.Tensor:
        """Append log p(ids[p + 1]) and the top alternatives for p in [pos, end); the last row's logits."""
        for i in range(0, end - pos, SCORE_ROWS):
            j = min(i + SCORE_ROWS, end - pos)
            logits_RV = linear_in_own_dtype(self.model.lm_head, h_LD[i:j]).float()
            n_targets = min(j, len(ids) - 1 - pos) - i  # the prompt's last position has no target
            if n_targets > 0:
                tgt = torch.tensor(ids[pos + i + 1 : pos + i + 1 + n_targets], device=self.device)
                c, ti, tv = top_logprobs(logits_RV[:n_targets], tgt, n_top)
                chosen += c
                tops += [list(zip(a, v)) for a, v in zip(ti, tv)]
        return logits_RV[-1:]

    def _decode_once(self) -> None:
        tokens: list[int] = []
        done: list[int] = []
        # Greedy rows without penalties: one argmax over the batch (the same values, the same argmax).
        plain = any(r.sampler.plain_greedy for r in self._rows)
        greedy_B = self._logits_BV.argmax(dim=-1).tolist() if plain else None
        for i, row in enumerate(self._rows):
            if row.job.cancelled:
                self._finish(row, "cancelled")
                token, finished = -1, True
            else:
                token = greedy_B[i] if row.sampler.plain_greedy else row.sampler.choose(self._logits_BV[i])
                finished = self._accept(row, token, self._logits_BV[i])
            tokens.append(token)
            if finished:
                done.append(i)
        for i in reversed(done):  # swap-remove, highest first: the last row is never a pending one
            last = len(self._rows) - 1
            self._state.remove(i)
            self._rows[i], tokens[i] = self._rows[last], tokens[last]
            self._rows.pop()
            tokens.pop()
        if not self._rows:
            self._drop_all()
            return
        token_B = torch.tensor(tokens, dtype=torch.long, device=self.device)
        try:
            self._logits_BV = self.model.step(token_B, self._state.view()).float()
        except Exception as e:
            for row in self._rows:
                self._finish(row, "error", f"decode step failed: {e}")
            self._drop_all()
        self.steps += 1

    def _accept(self, row: _Row, token: int, logits_V: torch.Tensor) -> bool:
        """Emit what `token` adds; True when the row is finished (it was then sent Finished)."""
        row.n_out += 1
        self.completion_tokens += 1
        if token == self.tokenizer.eos_id:
            self._finish(row, "stop")
            return True
        lp = top = None
        if row.job.sampling.logprobs is not None:
            c, ti, tv = top_logprobs(
                logits_V[None], torch.tensor([token], device=self.device), row.job.sampling.logprobs
            )
            lp, top = c[0], list(zip(ti[0], tv[0]))
        text, stopped = row.stopper.feed(row.text.add(token))
        _send(row.job, Delta(text, token, lp, top))
        if stopped:
            self._finish(row, "stop")
            return True
        if row.n_out >= row.job.sampling.max_tokens:
            self._finish(row, "length")
            return True
        return False

    def _finish(self, row: _Row, reason: str, message: str = "") -> None:
        text, _ = row.stopper.feed(row.text.finish())
        text += row.stopper.flush()
        if text:
            _send(row.job, Delta(text, None))
        n_prompt = len(row.job.prompt_ids) - row.job.report_from
        _send(row.job, Finished(reason, n_prompt, row.n_out, message))


def row_tokens(job: Job) -> int:
    """The tokens a job's state may come to hold: its prompt and max_tokens (what it reserves)."""
    return len(job.prompt_ids) + job.sampling.max_tokens


def _send(job: Job, event: object) -> None:
    try:
        job.sink(event)
    except Exception:  # a sink whose client is gone must not stop the loop
        job.cancel()
