"""Shared fixtures. Tests run on CPU; anything slower than a few seconds is marked `slow`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run_cli(
    *args: str, cwd: str | os.PathLike | None = None, timeout: float = 600, env: dict | None = None
) -> subprocess.CompletedProcess:
    """Run `python -m mamba3lite ARGS` in a subprocess, as a user would; returns the completed process."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "mamba3lite", *args],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture
def cli():
    return run_cli


class RayNodes:
    """A Ray cluster on this machine (`ray.cluster_utils.Cluster`): a head and added nodes of 1 CPU each,
    dashboard off. `ensure(n)` adds or removes worker nodes so that n nodes (the head included) are
    alive; `connect()` makes this process its driver until `disconnect()` (a test module's span: tests
    after it fork worker pools, which should not inherit a live Ray driver's threads)."""

    def __init__(self) -> None:
        from ray.cluster_utils import Cluster

        self.cluster = Cluster(
            initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False}
        )
        self.address = self.cluster.address
        self.added: list = []

    def connect(self) -> None:
        import ray

        ray.init(address=self.address, logging_level="WARNING", log_to_driver=False)

    def disconnect(self) -> None:
        import ray

        ray.shutdown()

    def ensure(self, n: int) -> None:
        while len(self.added) + 1 < n:
            self.added.append(self.cluster.add_node(num_cpus=1))
        while len(self.added) + 1 > n:
            self.cluster.remove_node(self.added.pop())
        self.cluster.wait_for_nodes()

    def remove_one(self) -> None:
        """Take an added node away (its processes killed), as a lost machine."""
        self.cluster.remove_node(self.added.pop(), allow_graceful=False)

    def shutdown(self) -> None:
        import ray

        ray.shutdown()  # a test that failed while connected
        self.cluster.shutdown()


@pytest.fixture(scope="session")
def ray_nodes():
    """One Ray cluster on this machine for the whole test session (starting one takes ~6 s, each added
    node ~2 s), shut down at its end. Needs `ray` (the dev extra installs it; not skipped without)."""
    nodes = RayNodes()
    try:
        yield nodes
    finally:
        nodes.shutdown()
