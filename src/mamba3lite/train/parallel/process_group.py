"""The process group: torchrun's environment, its set-up and teardown, and the host-side collectives.

`init_distributed()` reads torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK): with WORLD_SIZE > 1
it initialises the default process group (NCCL on CUDA, gloo on CPU; `timeout_s` is how long a
collective may wait) and pins the local GPU; without it, everything here is a no-op for one process.
How the model is spread over the processes is the `Parallelism` seam's business (seam.py); here are the
plain agreements the loop needs outside a training step: `any_rank` (a refusal, a damaged validation
batch), `broadcast_int` (a rollback target rank 0 found), `sum_across`, `barrier`, `held_on_rank0`.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from mamba3lite.errors import CheckpointError, ConfigError, TrainingError
from mamba3lite.train.parallel.generation import Deadline, generation_store

# torch's default for a gloo group's waits, used when no timeout is given
_DEFAULT_TIMEOUT_S = 1800.0


@dataclass(frozen=True)
class DistInfo:
    """This process's place in the job."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def pick_device(preference: str, local_rank: int = 0) -> torch.device:
    """`auto` -> cuda:local_rank when CUDA is available, else cpu; `cuda` -> cuda:local_rank."""
    if preference == "auto":
        return torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    if preference == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError(
            f"training.device is {preference} but this PyTorch ({torch.__version__}) sees no CUDA device; "
            "use training.device=cpu (or auto)"
        )
    index = local_rank if preference == "cuda" else int(preference.split(":", 1)[1])
    if index >= torch.cuda.device_count():
        raise ConfigError(
            f"training.device {preference}: this machine has {torch.cuda.device_count()} CUDA device(s) "
            f"(cuda:0..cuda:{torch.cuda.device_count() - 1})"
        )
    return torch.device(f"cuda:{index}")


def init_distributed(
    device_preference: str = "auto", timeout_s: float | None = None, init_timeout_s: float | None = None
) -> DistInfo:
    """Initialise from torchrun's environment; a single process when WORLD_SIZE is unset or 1.
    `timeout_s` (training.dist_timeout_s): how long a collective waits for the others before failing
    (None: torch's default). `init_timeout_s` (training.dist_init_timeout_s): how long forming the group
    may take, its first barrier included (None: `timeout_s`).

    The group is made in a namespace of the rendezvous store that only this generation of the job writes
    (generation.py: after torchrun restarts killed workers, the keys of the dead generation are still in
    its store, and a rank that reads a dead peer's address hangs or fails). Its first barrier is bounded by
    `init_timeout_s`; then the collectives get `timeout_s`. Either wait running out is a TrainingError
    naming what this rank waited for."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(device_preference, local_rank)
    if world_size > 1 and not dist.is_initialized():
        deadline = Deadline(init_timeout_s or timeout_s or _DEFAULT_TIMEOUT_S)
        store = generation_store(rank, world_size, deadline)
        init = datetime.timedelta(seconds=max(deadline.left(), 1.0))
        try:
            if device.type == "cuda":
                torch.cuda.set_device(device)
                dist.init_process_group(
                    "nccl", store=store, rank=rank, world_size=world_size, device_id=device, timeout=init
                )
            else:
                dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=init)
            dist.barrier()  # the first collective of the generation, under the same deadline
        except RuntimeError as e:
            raise TrainingError(
                f"rank {rank} could not form the process group of this generation within "
                f"{deadline.limit_s:g} s (training.dist_init_timeout_s): {str(e).splitlines()[0]}; torchrun "
                "restarts the job if restarts remain"
            ) from None
        # the collectives' own bound from now on (torch has no public setter for a live group's timeout)
        collective = timeout_s if timeout_s is not None else _DEFAULT_TIMEOUT_S
        dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=collective))
    return DistInfo(rank=rank, world_size=world_size, local_rank=local_rank, device=device)


# Set once this process has left a process group (see `teardown`): the CLI then ends the process
# without interpreter finalization.
left_process_group = False


def teardown(after_error: bool = False) -> None:
    """Leave the process group. Every rank first waits for the others: a gloo group destroyed while a
    peer still talks to it aborts the process ("terminate called without an active exception").
    `after_error`: this rank is stopping on an error, and the others may be waiting in another
    collective (an error of this rank alone: a metrics row on a full disk) that a barrier would never
    pair with, hanging both until gloo's 30-minute timeout: leave without waiting; the others then fail
    on the closed connection and stop with one line (`lost_a_peer`).

    Even after a clean barrier + destroy, interpreter finalization of a gloo worker aborts the same way
    now and then (seen ~1 run in 15 on a loaded 2-core machine, after every atexit handler had run):
    torch's C++ objects are torn down with a thread still joinable. `cli.main` therefore ends a process
    that has left a group with `os._exit` once everything is written and flushed."""
    global left_process_group
    if not (dist.is_available() and dist.is_initialized()):
        return
    try:
        if not after_error:
            dist.barrier()
    finally:
        with contextlib.suppress(RuntimeError) if after_error else contextlib.nullcontext():
            dist.destroy_process_group()
        left_process_group = True


# What a collective raises on a rank whose peer has gone (it stopped on an error of its own, or was
# killed): gloo names the closed connection in a plain RuntimeError; NCCL and the rendezvous store raise
# the Dist*Error family.
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def lost_a_peer(error: BaseException, info: DistInfo) -> bool:
    """True if `error` is a collective failing because another rank of this job is gone."""
    if not info.distributed or not isinstance(error, RuntimeError):
        return False
    return isinstance(error, dist.DistError) or any(s in str(error) for s in _PEER_GONE)


def _device_for_collectives(info: DistInfo) -> torch.device:
    return info.device if info.device.type == "cuda" else torch.device("cpu")


def any_rank(flag: bool, info: DistInfo) -> bool:
    """True if `flag` is true on any rank (stop signals: one rank's SIGTERM stops all)."""
    if not info.distributed:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=_device_for_collectives(info))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item() > 0)


def mean_across(value: float, info: DistInfo) -> float:
    """Average of a float over ranks."""
    if not info.distributed:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=_device_for_collectives(info))
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return float(t.item() / info.world_size)


def sum_across(values: list[float], info: DistInfo) -> list[float]:
    if not info.distributed:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=_device_for_collectives(info))
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


def broadcast_int(value: int, info: DistInfo, src: int = 0) -> int:
    """Rank `src`'s integer on every rank (e.g. the rollback step rank 0 found)."""
    if not info.distributed:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=_device_for_collectives(info))
    dist.broadcast(t, src=src)
    return int(t.item())


def barrier(info: DistInfo) -> None:
    if info.distributed:
        dist.barrier()


@contextlib.contextmanager
def held_on_rank0(lock, info: DistInfo, busy: str):
    """`lock` (a DirLock) acquired by rank 0 for the block; its refusal is raised on every rank (rank 0
    raising alone would leave the others waiting in their next collective). `busy`: the other ranks'
    message."""
    error: CheckpointError | None = None
    if info.is_main:
        try:
            lock.acquire()
        except CheckpointError as e:
            error = e
    if any_rank(error is not None, info):
        raise error or CheckpointError(busy)
    try:
        yield
    finally:
        lock.release()
