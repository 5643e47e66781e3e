"""A key space of its own in the rendezvous store for each generation of a torchrun job.

Why. torchrun's c10d rendezvous hosts one TCPStore in its agent and hands the same address
(MASTER_ADDR:MASTER_PORT, TORCHELASTIC_USE_AGENT_STORE=True) to every generation of workers it starts:
after `--max-restarts` restarts killed workers, the new generation meets every key the dead one wrote.
Process groups name their keys by a counter that starts again at 0 in each process (the default group,
then each `new_group`: a DeviceMesh's, the async checkpoint's), and gloo's full-mesh connect publishes each
rank's listening address under those names. A rank of the new generation that reads a peer's key before
that peer has rewritten it gets the dead process's address: the connect is refused (a lost restart), or the
port now belongs to another live listener that accepts and then waits for a handshake that never comes
(a hang until the group's timeout, 30 minutes by default). The restart count torchrun exports cannot name
a generation either: each node's agent counts its own restarts, so two nodes may disagree.

What. Every generation agrees on a fresh namespace before any process group is made:

    rank 0     ns = a random id; set GENERATION_KEY = ns; for each rank r > 0: read the nonce r wrote under
               ns/hello/r and set ns/ack/r/<nonce>
    rank r>0   nonce = a random id; repeat: ns = GENERATION_KEY (maybe a dead generation's); set
               ns/hello/r = nonce; wait briefly for ns/ack/r/<nonce>
               until the ack comes

Nothing under a fresh `ns` can be stale, and an ack names the nonce of this process alone, so a rank that
read a dead generation's `ns` never sees an ack (that rank 0 is gone) and reads the key again; it ends on
the `ns` of this generation's rank 0, and so does every other rank. The process groups then live under
`mamba3lite/<ns>/` (a PrefixStore), where the dead generation wrote nothing. torchrun stops every worker of
a generation before it starts the next, so the previous rank 0 cannot answer. A store that is new for each
generation (rank 0 hosting it, no torchrun) passes through the same exchange at the cost of a few keys.

Every wait is bounded by one deadline (training.dist_init_timeout_s); past it the rank raises a
TrainingError that names what it waited for.
"""

from __future__ import annotations

import datetime
import os
import time
import uuid
from typing import Any

import torch.distributed as dist

from mamba3lite.errors import TrainingError

GENERATION_KEY = "mamba3lite/generation"
NAMESPACE_PREFIX = "mamba3lite"
# How long a rank > 0 waits for the ack under the namespace it read before it reads the key again (a
# dead generation's namespace never acks).
ACK_POLL_S = 0.25


class Deadline:
    """Seconds left until `limit_s` after creation, on `clock`."""

    def __init__(self, limit_s: float, clock=time.monotonic) -> None:
        self.limit_s, self._clock = limit_s, clock
        self._end = clock() + limit_s

    def left(self) -> float:
        return max(0.0, self._end - self._clock())

    def passed(self) -> bool:
        return self.left() <= 0.0


def _wait_for(store: Any, key: str, seconds: float) -> bool:
    """True once `key` exists in `store`, False if `seconds` pass first."""
    try:
        store.wait([key], datetime.timedelta(seconds=max(seconds, 0.001)))
        return True
    except (dist.DistStoreError, RuntimeError) as e:  # the store says "timeout" as a DistStoreError
        if "timeout" in str(e).lower() or isinstance(e, dist.DistStoreError):
            return False
        raise


def agree_namespace(store: Any, rank: int, world_size: int, deadline: Deadline) -> str:
    """The namespace of this generation, the same on every rank (see the module docstring). Raises a
    TrainingError naming what it waited for when `deadline` passes."""
    if rank == 0:
        ns = uuid.uuid4().hex
        store.set(GENERATION_KEY, ns)
        for r in range(1, world_size):
            if not _wait_for(store, f"{ns}/hello/{r}", deadline.left()):
                raise TrainingError(
                    f"rank 0 waited {deadline.limit_s:g} s (training.dist_init_timeout_s) for rank {r} of "
                    "this generation to join it; that rank did not start or cannot reach the rendezvous "
                    f"store ({_endpoint()}); torchrun restarts the job if restarts remain"
                )
            nonce = store.get(f"{ns}/hello/{r}").decode()
            store.set(f"{ns}/ack/{r}/{nonce}", "1")
        return ns
    nonce = uuid.uuid4().hex
    while True:
        if _wait_for(store, GENERATION_KEY, deadline.left()):
            ns = store.get(GENERATION_KEY).decode()
            store.set(f"{ns}/hello/{rank}", nonce)
            if _wait_for(store, f"{ns}/ack/{rank}/{nonce}", min(ACK_POLL_S, deadline.left())):
                return ns
        if deadline.passed():
            raise TrainingError(
                f"rank {rank} waited {deadline.limit_s:g} s (training.dist_init_timeout_s) for rank 0 of "
                f"this generation to answer at the rendezvous store ({_endpoint()}); rank 0 did not start or "
                "cannot reach it; torchrun restarts the job if restarts remain"
            )


def generation_store(rank: int, world_size: int, deadline: Deadline) -> Any:
    """torch's env:// rendezvous store (torchrun's agent store, or one rank 0 hosts), scoped to a
    namespace that only this generation writes: the store to make every process group from."""
    timeout = datetime.timedelta(seconds=max(deadline.left(), 1.0))
    try:
        store, _, _ = next(dist.rendezvous("env://", rank, world_size, timeout=timeout))
    except (RuntimeError, ValueError) as e:  # no store at MASTER_ADDR:MASTER_PORT within the time
        raise TrainingError(
            f"rank {rank} could not reach the rendezvous store at {_endpoint()} within "
            f"{deadline.limit_s:g} s (training.dist_init_timeout_s): {str(e).splitlines()[0]}"
        ) from None
    ns = agree_namespace(store, rank, world_size, deadline)
    return dist.PrefixStore(f"{NAMESPACE_PREFIX}/{ns}", store)


def _endpoint() -> str:
    return f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
