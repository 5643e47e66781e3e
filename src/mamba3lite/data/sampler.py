"""WindowSampler: which windows each rank reads, batch after batch, epoch after epoch; resumable exactly.

Order. Epoch e visits the windows in a seeded permutation of 0..n-1, named by the state's `order`:

    feistel-v1   (new runs) `window_at(position, n, seed, e)`: a bijection of [0, n) computed per
                 position, never stored: a 6-round Feistel network keyed by (seed, e) over the smallest
                 even number of bits that holds n (a power of two below 4n), walked along its cycle until
                 the value falls inside [0, n) (cycle walking keeps a bijection of the larger domain a
                 bijection of [0, n)). O(1) memory at any n: a 10^12-window epoch costs nothing up front.
    pcg64-perm   (runs started before the order had a name) `epoch_permutation(n, seed, e)`: numpy's
                 PCG64 seeded with [seed, e] permutes arange(n), held in memory (8 bytes a window, about
                 3.9 GB per rank at 10^12 tokens of 2,048-token windows). Kept so such runs resume in the
                 order they began with.

With shuffle=False both are index order. Global batch b of epoch e is positions [b·G, (b+1)·G) of the
order, G = global_batch_size. The last n_windows % G windows of an epoch's order do not fill a global
batch and are skipped (logged once per epoch; with shuffling, a different set each epoch).

Ranks. Rank r of W takes the contiguous slice [r·G/W, (r+1)·G/W) of each global batch, so the ranks
are disjoint, together cover the global batch, and the sequence of global batches does not depend on W
(a rank computes only its own G/W positions).

State. {"seed", "epoch", "consumed", "order"}: `consumed` counts the windows of epoch `epoch` already
handed out (globally, over all ranks). Every rank holds the same state; resuming continues with the next
window, on any world size that divides G. A state without "order" was written before it existed: it is
a "pcg64-perm" state, and the sampler that loads it goes on in that order.

The sampler runs forever; the trainer stops by step count.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import numpy as np

from mamba3lite.errors import CheckpointError, ConfigError

log = logging.getLogger("mamba3lite")

FEISTEL = "feistel-v1"
PCG64_PERM = "pcg64-perm"
ORDERS = (FEISTEL, PCG64_PERM)
STATE_KEYS = ("seed", "epoch", "consumed", "order")
LEGACY_STATE_KEYS = ("seed", "epoch", "consumed")  # written before the order had a name: PCG64_PERM

_ROUNDS = 6
_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _mix64(x: int) -> int:
    """splitmix64's finaliser on a Python int (the round keys)."""
    x = (x + _GOLDEN) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _mix64_array(x: np.ndarray) -> np.ndarray:
    """The same finaliser on a uint64 array (numpy's uint64 arithmetic wraps modulo 2^64)."""
    x = x + np.uint64(_GOLDEN)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _round_keys(seed: int, epoch: int) -> list[int]:
    base = _mix64(_mix64(seed & _MASK64) ^ (epoch & _MASK64))
    return [_mix64(base ^ r) for r in range(_ROUNDS)]


def _half_bits(n: int) -> int:
    """Bits of each Feistel half: 2·half is the smallest even width >= 2 whose range holds [0, n)."""
    return max(1, ((n - 1).bit_length() + 1) // 2)


def _feistel(x: np.ndarray, half: int, keys: list[int]) -> np.ndarray:
    """One pass of the balanced Feistel network over [0, 4^half): a bijection of that range."""
    shift, mask = np.uint64(half), np.uint64((1 << half) - 1)
    left, right = x >> shift, x & mask
    for k in keys:
        left, right = right, left ^ (_mix64_array(right ^ np.uint64(k)) & mask)
    return (left << shift) | right


def windows_at(positions: np.ndarray, n: int, seed: int, epoch: int) -> np.ndarray:
    """The windows at `positions` (integers in [0, n), any shape) of epoch `epoch`'s "feistel-v1" order:
    int64 array of the same shape. A pure function; `windows_at(arange(n), ...)` is a permutation of
    arange(n), different for each (seed, epoch)."""
    assert 1 <= n < 2**63, n
    pos = np.asarray(positions, dtype=np.int64)
    assert pos.size == 0 or (int(pos.min()) >= 0 and int(pos.max()) < n), "positions outside [0, n)"
    half, keys = _half_bits(n), _round_keys(seed, epoch)
    y = _feistel(pos.astype(np.uint64), half, keys)
    # Cycle walking: a value outside [0, n) is passed through again; the domain is below 4n, so the
    # expected number of passes is below 4, and the walk from a position in [0, n) ends inside it.
    out = y >= np.uint64(n)
    while out.any():
        y[out] = _feistel(y[out], half, keys)
        out = y >= np.uint64(n)
    return y.astype(np.int64)


def window_at(position: int, n: int, seed: int, epoch: int) -> int:
    """The window at `position` of epoch `epoch`'s "feistel-v1" order over n windows (see windows_at)."""
    return int(windows_at(np.array([position]), n, seed, epoch)[0])


def epoch_permutation(n: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """The "pcg64-perm" order of epoch `epoch` over windows 0..n-1: int64 array of shape (n,).

    A pure function: numpy Generator(PCG64(SeedSequence([seed, epoch]))).permutation(n), or
    arange(n) when shuffle is False. O(n) memory: only runs that began in this order use it."""
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
    order and the state. `order`: the order of a new run ("feistel-v1"); a loaded state brings its own.

    Iterate one iterator at a time: iteration advances the sampler's own state, so `state_dict()` taken
    after the trainer has consumed k batches resumes at batch k + 1. (A reader that draws ahead, such as
    the trainer's prefetcher, draws from a `clone()` and hands each batch's state along with it.)
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
        order: str = FEISTEL,
    ) -> None:
        self.n_windows = _check_int(n_windows, "n_windows", 1)
        if self.n_windows >= 2**62:
            raise ConfigError(f"n_windows must be below 2**62, got {self.n_windows}")
        self.global_batch_size = _check_int(global_batch_size, "global_batch_size", 1)
        if self.global_batch_size > self.n_windows:
            raise ConfigError(
                f"global_batch_size {self.global_batch_size} is larger than the dataset's {self.n_windows} "
                f"windows: not one batch per epoch; use more data, a shorter max_seq_len or a smaller batch"
            )
        self.seed = _check_int(seed, "seed", 0)
        if order not in ORDERS:
            raise ConfigError(f"sampler order must be one of {list(ORDERS)}, got {order!r}")
        self.order = order
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

    def clone(self) -> WindowSampler:
        """A sampler of the same data, batch, rank and order at the same position, with its own state
        (what a reader drawing ahead of the consumer draws from)."""
        other = WindowSampler(
            self.n_windows, self.global_batch_size, rank=self.rank, world_size=self.world_size,
            seed=self.seed, shuffle=self.shuffle, order=self.order,
        )  # fmt: skip
        other.load_state_dict(self.state_dict())
        return other

    def _windows(self, epoch: int, start: int, stop: int) -> np.ndarray:
        """The windows at positions [start, stop) of epoch `epoch`'s order: int64 array."""
        assert 0 <= start <= stop <= self.n_windows
        if not self.shuffle:
            return np.arange(start, stop, dtype=np.int64)
        if self.order == FEISTEL:
            return windows_at(np.arange(start, stop, dtype=np.int64), self.n_windows, self.seed, epoch)
        key = (self.seed, epoch)
        if self._perm_key != key:  # one permutation per epoch, cached: O(n_windows) once, not per batch
            self._perm = epoch_permutation(self.n_windows, self.seed, epoch)
            self._perm_key = key
        assert self._perm is not None
        return self._perm[start:stop]

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
        # Read rank/world at every batch so set_world() between batches takes effect.
        k = self.local_batch_size
        start = self.consumed + self.rank * k
        self.consumed += G
        return self._windows(self.epoch, start, start + k).tolist()

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            yield self.next_batch()

    def global_batch(self, epoch: int, index: int) -> list[int]:
        """Global batch `index` of `epoch` (all ranks' windows), without touching the state."""
        G = self.global_batch_size
        assert 0 <= index < self.batches_per_epoch
        return self._windows(epoch, index * G, (index + 1) * G).tolist()

    def state_dict(self) -> dict[str, int | str]:
        """{"seed", "epoch", "consumed", "order"}: JSON-able; identical on every rank."""
        return {"seed": self.seed, "epoch": self.epoch, "consumed": self.consumed, "order": self.order}

    def load_state_dict(self, state: dict) -> None:
        """Resume at the window after the last one handed out, in the state's order (a state without
        "order" is a "pcg64-perm" one). The world size may differ from the run that saved the state (set
        it with set_world or the constructor)."""
        keys = set(state) if isinstance(state, dict) else None
        if keys not in (set(STATE_KEYS), set(LEGACY_STATE_KEYS)):
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise CheckpointError(
                f"sampler state must have exactly the keys {list(STATE_KEYS)} (or {list(LEGACY_STATE_KEYS)}, "
                f"as written before the order had a name), got {got}"
            )
        for key in LEGACY_STATE_KEYS:
            if isinstance(state[key], bool) or not isinstance(state[key], int) or state[key] < 0:
                raise CheckpointError(
                    f"sampler state {key} must be a non-negative integer, got {state[key]!r}"
                )
        order = state.get("order", PCG64_PERM)
        if order not in ORDERS:
            raise CheckpointError(
                f"sampler state order {order!r} is not one this version knows ({', '.join(ORDERS)}): "
                "the checkpoint was written by another version of mamba3lite, or edited"
            )
        if state["consumed"] > self.n_windows:
            raise CheckpointError(
                f"sampler state consumed={state['consumed']} exceeds this dataset's {self.n_windows} "
                f"windows: the checkpoint was made on different data or a different max_seq_len"
            )
        self.seed, self.epoch, self.consumed = state["seed"], state["epoch"], state["consumed"]
        self.order = order
        self._reported_epoch = None

    def __repr__(self) -> str:
        return (
            f"WindowSampler(n_windows={self.n_windows}, global_batch_size={self.global_batch_size}, "
            f"rank={self.rank}, world_size={self.world_size}, seed={self.seed}, shuffle={self.shuffle}, "
            f"order={self.order!r}, epoch={self.epoch}, consumed={self.consumed})"
        )
