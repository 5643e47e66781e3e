"""WindowSampler: which windows each rank reads, batch after batch, epoch after epoch; resumable exactly.

Order. Epoch e visits the windows in `epoch_permutation(n_windows, seed, e)`: a permutation drawn from
numpy's PCG64 seeded with [seed, e] (index order when shuffle=False). Global batch b of epoch e is
positions [b·G, (b+1)·G) of that order, G = global_batch_size. The last n_windows % G windows of an
epoch's order do not fill a global batch and are skipped (logged once per epoch; with shuffling, a
different set each epoch).

Ranks. Rank r of W takes the contiguous slice [r·G/W, (r+1)·G/W) of each global batch, so the ranks
are disjoint, together cover the global batch, and the sequence of global batches does not depend on W.

State. {"seed", "epoch", "consumed"}: `consumed` counts the windows of epoch `epoch` already handed out
(globally, over all ranks). Every rank holds the same state; resuming continues with the next window,
on any world size that divides G.

The sampler runs forever; the trainer stops by step count.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import numpy as np

from mamba3lite.errors import CheckpointError, ConfigError

log = logging.getLogger("mamba3lite")

STATE_KEYS = ("seed", "epoch", "consumed")


def epoch_permutation(n: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """The order in which epoch `epoch` visits windows 0..n-1: int64 array of shape (n,).

    A pure function: numpy Generator(PCG64(SeedSequence([seed, epoch]))).permutation(n), or
    arange(n) when shuffle is False."""
    if not shuffle:
        return np.arange(n, dtype=np.int64)
    return np.random.Generator(np.random.PCG64([seed, epoch])).permutation(n).astype(np.int64, copy=False)


def _check_int(value: object, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


class WindowSampler:
    """Hands out (`next_batch()`) or yields, for each successive global batch, this rank's list of
    window indices (G / world_size of them), forever across epochs. See the module docstring for the
    order and the state.

    Iterate one iterator at a time: iteration advances the sampler's own state, so `state_dict()` taken
    after the trainer has consumed k batches resumes at batch k + 1. (Used as a DataLoader batch_sampler
    with worker prefetching, the state runs ahead of what the trainer has consumed.)
    """

    def __init__(
        self,
        n_windows: int,
        global_batch_size: int,
        *,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        self.n_windows = _check_int(n_windows, "n_windows", 1)
        self.global_batch_size = _check_int(global_batch_size, "global_batch_size", 1)
        if self.global_batch_size > self.n_windows:
            raise ConfigError(
                f"global_batch_size {self.global_batch_size} is larger than the dataset's {self.n_windows} "
                f"windows: not one batch per epoch; use more data, a shorter max_seq_len or a smaller batch"
            )
        self.seed = _check_int(seed, "seed", 0)
        self.shuffle = bool(shuffle)
        self.epoch = 0
        self.consumed = 0
        self.windows_dropped = 0  # total over the epochs this sampler has started (the tails skipped)
        self._reported_epoch: int | None = None
        self._perm_key: tuple[int, int] | None = None
        self._perm: np.ndarray | None = None
        self.set_world(rank, world_size)

    @property
    def batches_per_epoch(self) -> int:
        return self.n_windows // self.global_batch_size

    @property
    def tail_per_epoch(self) -> int:
        """Windows per epoch that do not fill a global batch and are skipped."""
        return self.n_windows % self.global_batch_size

    @property
    def local_batch_size(self) -> int:
        """Windows per global batch for this rank: G / world_size."""
        return self.global_batch_size // self.world_size

    def set_world(self, rank: int, world_size: int) -> None:
        """Set this process's rank and the world size (e.g. after resuming on a different number of GPUs)."""
        world_size = _check_int(world_size, "world_size", 1)
        rank = _check_int(rank, "rank", 0)
        if rank >= world_size:
            raise ConfigError(f"rank {rank} must be < world_size {world_size}")
        if self.global_batch_size % world_size:
            raise ConfigError(
                f"global_batch_size {self.global_batch_size} is not divisible by world_size {world_size}; "
                f"choose a global batch that every rank can share equally"
            )
        self.rank, self.world_size = rank, world_size

    def _order(self, epoch: int) -> np.ndarray:
        key = (self.seed, epoch)
        if self._perm_key != key:  # one permutation per epoch, cached: O(n_windows) once, not per batch
            self._perm = epoch_permutation(self.n_windows, self.seed, epoch, self.shuffle)
            self._perm_key = key
        assert self._perm is not None
        return self._perm

    def _start_epoch_report(self) -> None:
        if self._reported_epoch == self.epoch:
            return
        self._reported_epoch = self.epoch
        self.windows_dropped += self.tail_per_epoch
        if self.tail_per_epoch:
            log.info(
                "sampler: epoch %d skips %d of %d windows (n_windows %% global_batch_size %d)",
                self.epoch,
                self.tail_per_epoch,
                self.n_windows,
                self.global_batch_size,
            )

    def next_batch(self) -> list[int]:
        """This rank's windows of the next global batch; advances the state (into the next epoch when
        this one's full batches are used up). `state_dict()` taken after it resumes at the batch after."""
        G = self.global_batch_size
        if self.consumed + G > self.n_windows:  # the epoch's full batches are used up
            self.epoch, self.consumed = self.epoch + 1, 0
        self._start_epoch_report()
        batch = self._order(self.epoch)[self.consumed : self.consumed + G]
        self.consumed += G
        # Read rank/world at every batch so set_world() between batches takes effect.
        k = self.local_batch_size
        return batch[self.rank * k : (self.rank + 1) * k].tolist()

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            yield self.next_batch()

    def global_batch(self, epoch: int, index: int) -> list[int]:
        """Global batch `index` of `epoch` (all ranks' windows), without touching the state."""
        G = self.global_batch_size
        assert 0 <= index < self.batches_per_epoch
        return self._order(epoch)[index * G : (index + 1) * G].tolist()

    def state_dict(self) -> dict[str, int]:
        """{"seed", "epoch", "consumed"}: JSON-able; identical on every rank."""
        return {"seed": self.seed, "epoch": self.epoch, "consumed": self.consumed}

    def load_state_dict(self, state: dict) -> None:
        """Resume at the window after the last one handed out. The world size may differ from the run
        that saved the state (set it with set_world or the constructor)."""
        if not isinstance(state, dict) or set(state) != set(STATE_KEYS):
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise CheckpointError(f"sampler state must have exactly the keys {list(STATE_KEYS)}, got {got}")
        for key in STATE_KEYS:
            if isinstance(state[key], bool) or not isinstance(state[key], int) or state[key] < 0:
                raise CheckpointError(
                    f"sampler state {key} must be a non-negative integer, got {state[key]!r}"
                )
        if state["consumed"] > self.n_windows:
            raise CheckpointError(
                f"sampler state consumed={state['consumed']} exceeds this dataset's {self.n_windows} "
                f"windows: the checkpoint was made on different data or a different max_seq_len"
            )
        self.seed, self.epoch, self.consumed = state["seed"], state["epoch"], state["consumed"]
        self._reported_epoch = None

    def __repr__(self) -> str:
        return (
            f"WindowSampler(n_windows={self.n_windows}, global_batch_size={self.global_batch_size}, "
            f"rank={self.rank}, world_size={self.world_size}, seed={self.seed}, shuffle={self.shuffle}, "
            f"epoch={self.epoch}, consumed={self.consumed})"
        )
