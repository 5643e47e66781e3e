"""Prefetcher: the input of the next optimizer steps, drawn and gathered on a background thread.

The training thread asks for one step at a time (`take(position)`); with `depth` > 0 a daemon thread has
already drawn that step's windows from the prefetcher's OWN sampler (a clone of the trainer's, running
up to `depth` steps ahead) and gathered them (`produce`), into pinned memory when the batches go to a
CUDA device, so the trainer's host-to-device copies can be `non_blocking`. `depth` 0 does the same work
on the calling thread when asked: the synchronous reader.

Exact resume. Each item carries the sampler state before and after its step (`Prefetched`). The
trainer's own sampler is the CONSUMED position: it loads `after` when it takes the step, so a checkpoint
records the batches trained on, never the ones only produced. `take(position)` hands out the step that
starts at `position`; queued steps that start elsewhere (the trainer loaded another state: a resume, a
rollback) are dropped and the thread restarts from `position` (`reset`).

Errors. What drawing or gathering raises (a damaged shard's DataError, or any other exception) becomes
the item of the step it belongs to, raised by the trainer when it takes that step (its sampler still at
the step's start), never earlier on the thread; the thread then stops producing. `close()` stops the
thread and joins it (the trainer calls it when `train()` returns or raises): no thread outlives a run.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from mamba3lite.data.sampler import WindowSampler

# A step's micro-batches: [(x_BT, y_BT), ...], CPU tensors.
Batches = list[tuple[torch.Tensor, torch.Tensor]]

_POLL_S = 0.05  # how often a thread blocked on a full queue checks that it should stop


@dataclass
class Prefetched:
    """One optimizer step's input and the sampler states around it."""

    before: dict  # the sampler's state before this step's windows were drawn
    after: dict  # ... and after: the consumer's sampler state once it has taken this step
    batches: Batches = field(default_factory=list)  # empty when `error` is set
    error: Exception | None = None  # what drawing or gathering this step raised


class Prefetcher:
    """Produces steps ahead of the trainer (see the module docstring).

    Args:
        sampler: the sampler that `produce` draws from; the prefetcher owns it (its state is only touched
            while no thread runs). A clone of the trainer's (`WindowSampler.clone()`).
        produce: draws one step's windows from `sampler` and gathers them: its micro-batches on the CPU.
        depth: steps produced ahead (`training.prefetch_batches`); 0 = produce on the calling thread.
        pin: copy the batches into pinned (page-locked) memory on the thread (for a CUDA device).
    """

    def __init__(
        self, sampler: WindowSampler, produce: Callable[[], Batches], *, depth: int, pin: bool
    ) -> None:
        assert depth >= 0, depth
        self.sampler, self.produce, self.depth, self.pin = sampler, produce, depth, pin
        self._thread: threading.Thread | None = None
        self._queue: queue.Queue[Prefetched] = queue.Queue()
        self._stop = threading.Event()

    @property
    def running(self) -> bool:
        """Whether a producing thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    def take(self, position: dict) -> Prefetched:
        """The step that starts at sampler state `position` (blocks until it is produced)."""
        if self.depth == 0:
            if self.sampler.state_dict() != position:
                self.sampler.load_state_dict(position)
            return self._produce_one()
        if self._thread is None:
            self.reset(position)
        item = self._get()
        if item.before != position:  # the consumer moved (resume, rollback): what is queued is stale
            self.reset(position)
            item = self._get()
        return item

    def reset(self, state: dict) -> None:
        """Drop every queued step and produce from sampler state `state` on (a new thread if depth > 0)."""
        self.close()
        self.sampler.load_state_dict(state)
        if self.depth == 0:
            return
        self._queue, self._stop = queue.Queue(maxsize=self.depth), threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(self._queue, self._stop), name="mamba3lite-prefetch", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        """Stop the thread and wait for it (it finishes the step it is gathering, if any); drop the queue."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        self._queue = queue.Queue()

    def _get(self) -> Prefetched:
        assert self._thread is not None
        while True:
            try:
                return self._queue.get(timeout=1.0)
            except queue.Empty:
                # Every way out of _run puts an item first, so a dead thread with an empty queue is a bug.
                assert self._thread.is_alive(), "the prefetch thread ended without handing out its last step"

    def _produce_one(self) -> Prefetched:
        before = self.sampler.state_dict()
        try:
            batches = self.produce()
            if self.pin:
                batches = [(x_BT.pin_memory(), y_BT.pin_memory()) for x_BT, y_BT in batches]
        except Exception as e:  # raised by the consumer at this step, not here
            return Prefetched(before, self.sampler.state_dict(), error=e)
        return Prefetched(before, self.sampler.state_dict(), batches)

    def _run(self, q: queue.Queue[Prefetched], stop: threading.Event) -> None:
        while not stop.is_set():
            item = self._produce_one()
            while not stop.is_set():
                try:
                    q.put(item, timeout=_POLL_S)
                    break
                except queue.Full:
                    continue
            if item.error is not None:  # the consumer stops at this step: nothing after it is wanted
                return
