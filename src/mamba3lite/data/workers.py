"""The parallel stage of `prepare`: tokenizer worker processes and each source's units read in batches.

`start_pool` starts the workers (fork where available) before any thread of ours exists; `UnitStream`
reads one source's units in batches, keeps up to `depth` batches in flight and yields the results in
submission order, so the output never depends on the number of workers or on timing.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor

from mamba3lite.data import clean
from mamba3lite.data.clean import UnitResult, WorkerConfig
from mamba3lite.data.sources import Location

_BATCH_UNITS = 512
_BATCH_BYTES = 256 * 1024


def _init_pool_worker(cfg: WorkerConfig, parent: int) -> None:
    # Ctrl-C is the main process's to handle (it stops the pool); workers would only add tracebacks.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # A worker whose parent was killed (SIGKILL, OOM killer) would otherwise wait on the task queue
    # forever: the other workers keep its write end open, so no EOF ever arrives.
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True, name="parent-watch").start()
    clean.init_worker(cfg)


def _exit_with_parent(parent: int, poll_s: float = 0.5) -> None:
    while os.getppid() == parent:
        time.sleep(poll_s)
    os._exit(1)


def _start_method():
    """fork where available: workers inherit the tokenizer already built here (building it takes ~0.5 s,
    a large part of a small corpus's time) and start in milliseconds. The workers are started before
    any thread of ours (tqdm's, the executor's) exists. Elsewhere (macOS, Windows) spawn."""
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("fork" if "fork" in methods else "spawn")


def start_pool(cfg: WorkerConfig, workers: int) -> ProcessPoolExecutor | None:
    """`workers` started tokenizer processes, or None (and this process set up as the worker) for 0.

    A ProcessPoolExecutor, not a multiprocessing.Pool: when a worker dies (killed for memory) a Pool loses
    its task and waits forever; the executor raises BrokenProcessPool."""
    if not workers:
        clean.init_worker(cfg)
        return None
    pool = ProcessPoolExecutor(
        workers, mp_context=_start_method(), initializer=_init_pool_worker, initargs=(cfg, os.getpid())
    )
    pool.submit(int).result()  # start the workers now, before any thread of ours exists
    return pool


class _Ready:
    """A batch processed lazily in this process (workers=0): the same interface as a Future."""

    def __init__(self, items: list) -> None:
        self._items = items

    def result(self) -> list[UnitResult]:
        # Looked up at call time, so a test can replace the worker function.
        return clean.process_batch(self._items)


def submitter(pool: ProcessPoolExecutor | None) -> Callable[[list], object]:
    """items -> a handle whose .result() is process_batch(items): in `pool`, or lazily here."""
    if pool is None:
        return _Ready
    return lambda items: pool.submit(clean.process_batch, items)


class UnitStream:
    """One source's units, processed in batches with up to `depth` batches in flight, yielded in order
    as (location, result)."""

    def __init__(self, units: Iterator, submit, depth: int, on_read: Callable[[int, int], None]) -> None:
        self._units = units
        self._submit = submit
        self._depth = depth
        self._on_read = on_read
        self._pending: deque = deque()
        self._current: Iterator = iter(())
        self._reading = True

    def _read_batch(self) -> tuple[list, list, int, Exception | None]:
        locs, items, n_bytes = [], [], 0
        try:
            for loc, kind, payload in self._units:
                locs.append(loc)
                items.append((kind, payload))
                n_bytes += len(payload) if payload is not None else 0
                if len(items) >= _BATCH_UNITS or n_bytes >= _BATCH_BYTES:
                    break
        except Exception as e:  # re-raised by next() at this position
            # A read error (a truncated archive, a damaged Parquet page) is raised where the consumer
            # reaches it: read-ahead depth grows with --workers, and a run that reaches its target
            # first must not fail with more workers when it succeeds with fewer.
            return locs, items, n_bytes, e
        return locs, items, n_bytes, None

    def _fill(self) -> None:
        while self._reading and len(self._pending) < self._depth:
            locs, items, n_bytes, error = self._read_batch()
            if items:
                self._on_read(len(items), n_bytes)
                self._pending.append((locs, self._submit(items)))
            if error is not None or not items:
                self._reading = False
                if error is not None:
                    self._pending.append((None, error))
                return

    def next(self) -> tuple[Location, UnitResult] | None:
        """The next (location, result), or None when the source is exhausted."""
        while True:
            nxt = next(self._current, None)
            if nxt is not None:
                return nxt
            self._fill()
            if not self._pending:
                return None
            locs, handle = self._pending.popleft()
            if locs is None:
                raise handle
            results = handle.result()
            self._fill()  # keep the workers busy while this batch is consumed
            self._current = zip(locs, results)
