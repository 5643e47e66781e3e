"""The executor seam of `prepare`, and its local implementation: a pool of worker processes.

An executor computes work units (`units.run_unit`) and hands back their records: `submit(unit)` returns
a handle whose `.result()` is the unit's `UnitRecord`; `parallelism` says how many run at once; `close()`
stops it. `LocalPool` is the processes of this machine (`--workers`); `ray_executor.RayExecutor` is a Ray
cluster (`--ray`). `prepare` never asks which one it has. `UnitStream` submits one source's units in
order, keeps up to `depth` in flight, and yields their records in plan order, so the output never depends
on the executor, the number of workers or timing.
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
from typing import Any, Protocol

from mamba3lite.data import clean, units
from mamba3lite.data.plan import WorkUnit
from mamba3lite.data.units import UnitJob, UnitRecord


class Handle(Protocol):
    def result(self) -> UnitRecord: ...


class Executor(Protocol):
    """Computes work units: the local pool or a Ray cluster."""

    parallelism: int  # units computed at once

    def submit(self, unit: WorkUnit, rows: list | None = None) -> Handle: ...

    def call(self, fn: Callable, *args: Any) -> Any:
        """Any other task (a module-level function): a handle whose .result() is fn(*args)."""
        ...

    def close(self) -> None: ...

    def describe(self) -> str: ...


def _init_pool_worker(cfg: clean.WorkerConfig, parent: int) -> None:
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


def _run_unit(job: UnitJob, unit: WorkUnit, rows: list | None = None) -> UnitRecord:
    return units.run_unit(job, unit, rows)  # looked up at call time: a test can replace the worker function


class _Lazy:
    """A task run in this process when its result is asked for (workers=0): a Future's interface."""

    def __init__(self, fn: Callable, *args: Any) -> None:
        self._fn, self._args = fn, args

    def result(self) -> Any:
        return self._fn(*self._args)


class LocalPool:
    """`workers` processes of this machine (0: this process computes each unit when it is needed).

    A ProcessPoolExecutor, not a multiprocessing.Pool: when a worker dies (killed for memory) a Pool loses
    its task and waits forever; the executor raises BrokenProcessPool."""

    def __init__(self, job: UnitJob, workers: int) -> None:
        self._job = job
        self.parallelism = max(workers, 1)
        self._workers = workers
        self._pool: ProcessPoolExecutor | None = None
        if not workers:
            clean.init_worker(job.cfg)
            return
        self._pool = ProcessPoolExecutor(
            workers,
            mp_context=_start_method(),
            initializer=_init_pool_worker,
            initargs=(job.cfg, os.getpid()),
        )
        self._pool.submit(int).result()  # start the workers now, before any thread of ours exists

    def submit(self, unit: WorkUnit, rows: list | None = None) -> Handle:
        return self.call(_run_unit, self._job, unit, rows)

    def call(self, fn: Callable, *args: Any) -> Any:
        if self._pool is None:
            return _Lazy(fn, *args)
        return self._pool.submit(fn, *args)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)  # units still queued (a target was reached)

    def describe(self) -> str:
        return f"{self._workers} local worker process(es)" if self._workers else "this process"


class UnitStream:
    """One source's units, (unit, rows or None) in plan order, computed by `executor` with up to `depth`
    in flight, their records yielded in that order; `on_record` is called with each as it is taken. An
    error reading the units (an hf: stream's) is raised once the units before it were taken."""

    def __init__(
        self,
        unit_items: Iterator[tuple[WorkUnit, list | None]],
        executor: Executor,
        depth: int,
        on_record: Callable[[UnitRecord], None],
    ) -> None:
        self._units = unit_items
        self._executor = executor
        self._depth = depth
        self._on_record = on_record
        self._pending: deque = deque()
        self._error: Exception | None = None

    def _fill(self) -> None:
        while self._error is None and len(self._pending) < self._depth:
            try:
                item = next(self._units, None)
            except Exception as e:  # raised by next() at this position
                self._error = e
                return
            if item is None:
                return
            self._pending.append(self._executor.submit(*item))

    def next(self) -> UnitRecord | None:
        """The next unit's record, or None when the source has no more units."""
        self._fill()
        if not self._pending:
            if self._error is not None:
                raise self._error
            return None
        record = self._pending.popleft().result()
        self._fill()  # keep the workers busy while this unit is consumed
        self._on_record(record)
        return record


class _Done:
    def __init__(self, record: UnitRecord) -> None:
        self._record = record

    def result(self) -> UnitRecord:
        return self._record


class Prefetched:
    """`executor` with the records of units already computed (the pre-pass of a partitioned dedup): a
    unit submitted again is answered from them (each once), any other goes to the executor."""

    def __init__(self, executor: Executor, records: dict[str, UnitRecord]) -> None:
        self._executor, self._records = executor, records
        self.parallelism = executor.parallelism

    def submit(self, unit: WorkUnit, rows: list | None = None) -> Handle:
        record = self._records.pop(unit.key, None)
        return _Done(record) if record is not None else self._executor.submit(unit, rows)

    def call(self, fn: Callable, *args: Any) -> Any:
        return self._executor.call(fn, *args)

    def close(self) -> None:
        self._executor.close()

    def describe(self) -> str:
        return self._executor.describe()
