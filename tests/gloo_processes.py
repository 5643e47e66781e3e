"""`spawn(world, fn, *args)`: `fn(rank, world, *args)` in `world` processes that form one gloo process group
on the CPU (a free port each time); raises if any process fails.

The processes are forked from multiprocessing's fork server, which the session's first `spawn` starts
after importing `fn`'s module and torch._dynamo (torch's optimizers import it when the first one is
built): each process then starts without importing torch, the model and the test's helpers again, a few
seconds each on a CPU; the server itself has run nothing of torch (no thread pools to fork). Each process
takes the caller's environment as it is at the call (the fork server's is the one of its start); a
module the server imported read its own settings then.
"""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, env: dict[str, str], fn, args: tuple) -> None:
    os.environ.clear()
    os.environ.update(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def spawn(world: int, fn, *args) -> None:
    """Run `fn(rank, world, *args)` in `world` fresh processes over gloo (see the module docstring)."""
    mp.set_forkserver_preload([fn.__module__, "torch._dynamo"])  # read when the server starts
    env = dict(os.environ)
    mp.start_processes(
        _entry, args=(world, _free_port(), env, fn, args), nprocs=world, start_method="forkserver"
    )
