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
