"""`mamba3lite lighthouse [--port 29510] [--min-replicas N]`: the coordinator of a fault-tolerant job."""

from __future__ import annotations

import argparse

HELP = "start the torchft lighthouse that forms the quorums of replica groups (training.fault_tolerance)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bind", default="[::]", help="address to listen on (default: every interface)")
    p.add_argument("--port", type=int, default=29510, help="port to listen on (default 29510; 0: any free)")
    p.add_argument(
        "--min-replicas",
        type=int,
        default=1,
        help="replica groups a quorum needs (default 1: training goes on with any one healthy group)",
    )
    p.add_argument(
        "--join-timeout-ms",
        type=int,
        default=5000,
        help="how long a quorum waits for groups that heartbeat but have not asked to join (one restarting, "
        "or one still blocked in a collective a dead group left): the healthy groups stand still at most "
        "this long (default 5000, the heartbeat timeout's)",
    )
    p.add_argument(
        "--heartbeat-timeout-ms",
        type=int,
        default=5000,
        help="a group silent this long is considered dead and left out of the next quorum",
    )


def run(args: argparse.Namespace) -> int:
    from mamba3lite.train.parallel.lighthouse import serve_lighthouse

    return serve_lighthouse(args.bind, args.port, args.min_replicas, args.join_timeout_ms,
                            args.heartbeat_timeout_ms)  # fmt: skip
