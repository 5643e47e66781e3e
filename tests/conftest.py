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


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 server on 127.0.0.1 (a free port), shared by the session and stopped at its end;
    see tests/s3_server.py. Skipped only where moto is not installed (`make venv` installs it)."""
    pytest.importorskip("moto.server", reason="the object-storage tests need moto[server]: make venv")
    import boto3
    from moto.server import ThreadedMotoServer

    from s3_server import TEST_ENV, S3Server

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=TEST_ENV["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=TEST_ENV["AWS_SECRET_ACCESS_KEY"],
        region_name=TEST_ENV["AWS_DEFAULT_REGION"],
    )
    try:
        yield S3Server(endpoint, client)
    finally:
        server.stop()


@pytest.fixture
def s3(s3_server, monkeypatch):
    """The session's S3 server, with this test's environment pointing botocore and s3fs at it."""
    from s3_server import TEST_ENV

    for k, v in {**TEST_ENV, "AWS_ENDPOINT_URL": s3_server.endpoint}.items():
        monkeypatch.setenv(k, v)
    for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(k, raising=False)
    return s3_server


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
