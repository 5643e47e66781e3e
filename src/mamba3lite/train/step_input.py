"""The input of the training steps: which windows, produced ahead, and a damaged batch kept for the
step's agreement.

`StepInput` owns the `WindowSampler` whose state is the position of the batches the run has CONSUMED
(what a checkpoint records), the `Prefetcher` that produces the next steps ahead on a thread from a
clone of it (prefetch.py), the time the training thread waited for input, and a batch that arrived
damaged (a shard whose bytes changed since prepare): zero stand-ins of its shape run in its place, so
the step still runs its collectives with every rank, and the error waits for the step's agreement,
which raises it on every rank with the sampler put back to before the step (`damaged_error`).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import torch

from mamba3lite.data import WindowSampler
from mamba3lite.errors import DataError
from mamba3lite.train.prefetch import Batches, Prefetcher


class StepInput:
    """The steps' input on one process (see the module docstring). `cut`: the parallelism seam's cut of
    a micro-batch into this rank's piece; `accum`: micro-batches per step on this process."""

    def __init__(self, train_data: Any, tc, par, accum: int, device: torch.device) -> None:
        self.data, self.tc, self.cut, self.accum, self.device = train_data, tc, par.cut, accum, device
        self.sampler = WindowSampler(len(train_data), tc.global_windows, rank=par.dp_rank,
                                     world_size=par.dp_size, seed=tc.seed, shuffle=True)  # fmt: skip
        self.prefetcher = Prefetcher(self.sampler.clone(), self._produce_step, depth=tc.prefetch_batches,
                                     pin=device.type == "cuda")  # fmt: skip
        self.wait_s = 0.0  # the training thread's wait for input since the last `take_wait`
        self.damage: DataError | None = None  # this rank's damaged batch, until the step's agreement
        self._sampler_before: dict = {}  # the sampler's state before the step's batches were drawn

    def next_indices(self) -> list[int]:
        """This rank's windows of the next step to produce, from the prefetcher's sampler (ahead of
        `sampler` by the steps produced and not yet consumed)."""
        return self.prefetcher.sampler.next_batch()

    def batch(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Windows `indices` on the CPU: one gather, no per-window tensors."""
        return self.data.get_batch(indices)

    def _produce_step(self) -> Batches:
        """One step's micro-batches on the CPU (the prefetcher runs it, on its thread when it has one)."""
        mb, accum = self.tc.micro_batch_size, self.accum
        indices = self.next_indices()
        assert len(indices) == mb * accum, f"sampler gave {len(indices)} windows, expected {mb * accum}"
        return [self.cut(*self.batch(indices[i * mb : (i + 1) * mb])) for i in range(accum)]

    def take_wait(self) -> float:
        """Seconds waited for input since the last call."""
        waited, self.wait_s = self.wait_s, 0.0
        return waited

    def draw(self, on_new_epoch: Callable[[], None]) -> Batches:
        """The step's micro-batches on the device, taken from the prefetcher (the time waited for them is
        the data wait); the sampler then holds the position after them (`on_new_epoch()` when they begin
        an epoch). A damaged batch: zero stand-ins, the error kept for the step's agreement."""
        sampler_before = self.sampler.state_dict()
        t0 = time.perf_counter()
        item = self.prefetcher.take(sampler_before)
        self.wait_s += time.perf_counter() - t0
        bad = item.error  # a DataError: a shard whose bytes changed since prepare (the message names it)
        if bad is not None and not isinstance(bad, DataError):
            raise bad
        self.damage, self._sampler_before = bad, sampler_before
        if bad is not None:
            stand_in = torch.zeros(self.tc.micro_batch_size, self.tc.max_seq_len, dtype=torch.long,
                                   device=self.device)  # fmt: skip
            return [(stand_in, stand_in)] * self.accum
        self.sampler.load_state_dict(item.after)  # consumed: what a checkpoint from now on records
        if self.sampler.epoch != sampler_before["epoch"]:
            on_new_epoch()
        to = functools.partial(torch.Tensor.to, device=self.device, non_blocking=True)
        return [(to(x_BT), to(y_BT)) for x_BT, y_BT in item.batches]

    def undo(self) -> None:
        """Put the sampler back to before the step just drawn (a step the replica groups did not commit:
        its windows are drawn again)."""
        self.sampler.load_state_dict(self._sampler_before)

    def damaged_error(self, step: int) -> DataError:
        """The error every rank raises together when any rank's batch for `step` was damaged (one rank
        raising alone would leave the others waiting in the next collective); the sampler back to before
        it (nothing of the step has happened, so a checkpoint written now resumes exactly here)."""
        mine, self.damage = self.damage, None
        self.sampler.load_state_dict(self._sampler_before)
        return mine or DataError(f"another rank's batch for step {step} is damaged (its log names the shard)")
