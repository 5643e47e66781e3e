"""`prepare --ray ADDRESS`: the work units computed by Ray Core tasks on an existing cluster.

The same executor interface as the local pool (`workers.Executor`): `submit(unit)` starts one task,
`units.run_unit(job, unit)` on whichever node Ray picks, and its handle's `.result()` is the unit's
record. The task reads the unit's files from their paths and writes its tokens, index and record into
OUT/.prepare/units, so every node must see the sources and OUT at the same paths (a shared file system);
the driver ships no corpus bytes, only the plan's unit (file names and sizes) and gets back the small
record (inlined in the driver's own object store: losing the node that computed it loses nothing).

Faults: a task whose worker or node dies is re-run by Ray (`max_retries`); the re-run finds the unit's
record if the first attempt completed it (`units.stored_record`) and computes nothing. A task that fails
on bad input does not raise (its record carries the error, which the driver raises at the unit's
position), so Ray never retries it. A task that keeps failing for another reason is one error naming the
unit; the staged work is kept for a re-run.

Ray is imported only here, and only when `--ray` is given.
"""

from __future__ import annotations

import contextlib
import logging
import socket

from mamba3lite.data import clean, units
from mamba3lite.data.plan import WorkUnit
from mamba3lite.data.units import UnitJob, UnitRecord
from mamba3lite.errors import ConfigError, DataError, Mamba3LiteError, TransientError

# A task lost with its worker or node is run again this many times (then the run stops, resumable).
MAX_RETRIES = 3
_CONNECT_TIMEOUT_S = 5.0


def _import_ray():
    try:
        import ray
    except ImportError as e:
        raise ConfigError("--ray needs Ray; fix: pip install 'mamba3lite[ray]'") from e
    return ray


def _run_unit_task(job: UnitJob, unit: WorkUnit, rows: list | None) -> UnitRecord:
    """The task body, in a Ray worker process: build the tokenizer once per process, then the unit."""
    import ray

    clean.ensure_worker(job.cfg)
    ctx = ray.get_runtime_context()
    return units.run_unit(job, unit, rows, node=f"{ray.util.get_node_ip_address()} {ctx.get_node_id()[:8]}")


def check(address: str) -> None:
    """Before any work: Ray is installed, and a HOST:PORT address has something listening (one clear
    error each)."""
    if not _import_ray().is_initialized():
        _check_reachable(address)


def _check_reachable(address: str) -> None:
    """One clear error for a HOST:PORT nothing listens on (Ray itself would retry for a minute)."""
    if address in ("auto", "local") or address.startswith("ray://"):
        return
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"--ray {address}: expected HOST:PORT of the cluster's head (or auto)")
    try:
        socket.create_connection((host, int(port)), timeout=_CONNECT_TIMEOUT_S).close()
    except OSError as e:
        raise ConfigError(
            f"--ray {address}: cannot reach a Ray cluster there ({e.strerror or e}); start one with "
            "`ray start --head` and pass the address it prints, or --ray auto on a node of it"
        ) from e


class _Handle:
    def __init__(self, executor: RayExecutor, ref, unit: WorkUnit | None) -> None:
        self._executor, self._ref, self._unit = executor, ref, unit

    def result(self) -> UnitRecord:
        ray = self._executor.ray
        self._executor.pending.discard(self._ref)
        try:
            return ray.get(self._ref)
        except ray.exceptions.RayTaskError as e:
            cause = e.as_instanceof_cause()
            if isinstance(cause, Mamba3LiteError):
                raise cause from None
            raise DataError(f"{self._what()}: its Ray task failed: {e.cause!r}") from e
        except ray.exceptions.RayError as e:  # worker or node lost more than MAX_RETRIES times
            raise TransientError(
                f"{self._what()}: its Ray task was lost ({type(e).__name__}); the work done so "
                "far is kept: re-run the same command to resume"
            ) from e

    def _what(self) -> str:
        return "a dedup partition" if self._unit is None else self._unit.describe()


class RayExecutor:
    """Work units as Ray tasks on the cluster at `address` (see the module docstring)."""

    def __init__(self, address: str, job: UnitJob) -> None:
        self.ray = ray = _import_ray()
        self._connected_here = False
        if not ray.is_initialized():
            _check_reachable(address)
            try:
                ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
            except (ConnectionError, RuntimeError, ValueError) as e:
                raise ConfigError(
                    f"--ray {address}: cannot connect ({e}); start a cluster with `ray start --head` and "
                    "pass the address it prints, or --ray auto on a node of it"
                ) from e
            self._connected_here = True
        self._tasks: dict = {}  # fn -> its remote function, made once (Ray exports it at its first call)
        self._task = self._remote(_run_unit_task)
        self._job_ref = ray.put(job)  # stored once, not serialized again with every unit
        self.parallelism = max(1, int(ray.cluster_resources().get("CPU", 1)))
        self._nodes = sum(1 for n in ray.nodes() if n.get("Alive"))
        self.pending: set = set()

    def submit(self, unit: WorkUnit, rows: list | None = None) -> _Handle:
        ref = self._task.remote(self._job_ref, unit, rows)  # rows: an hf: stream's, shipped with its unit
        self.pending.add(ref)
        return _Handle(self, ref, unit)

    def call(self, fn, *args):
        """Any other task (a module-level function) on the cluster; .result() is fn(*args)."""
        ref = self._remote(fn).remote(*args)
        self.pending.add(ref)
        return _Handle(self, ref, None)

    def _remote(self, fn):
        if fn not in self._tasks:
            self._tasks[fn] = self.ray.remote(fn).options(max_retries=MAX_RETRIES, retry_exceptions=False)
        return self._tasks[fn]

    def close(self) -> None:
        for ref in self.pending:  # units still queued or running when a target was reached
            with contextlib.suppress(Exception):  # already finished, or its node is gone
                self.ray.cancel(ref)
        self.pending.clear()
        if self._connected_here:
            self.ray.shutdown()

    def describe(self) -> str:
        return f"Ray, {self._nodes} node(s), {self.parallelism} CPU(s)"
