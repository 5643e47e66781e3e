"""The `mamba3lite serve` command as a user runs it: the one line it prints (with the port --port 0
got), SIGTERM under load ends it with exit 0 in bounded time, and the refusals (a non-loopback host
without a key, an empty key file, a missing extra) are one error line each."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from mamba3lite.cli import main
from userside_helpers import save_tiny_checkpoint

pytest.importorskip("fastapi")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("servecli") / "run")


def start(run_dir, *extra: str, env: dict | None = None):
    """(process, base url) of `mamba3lite serve --port 0`, after its `serving` line."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "mamba3lite", "serve", "--checkpoint-dir", str(run_dir), "--port", "0",
         "--device", "cpu", "--shutdown-timeout", "3", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
    )  # fmt: skip
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
    try:
        line = lines.get(timeout=120)
    except queue.Empty:
        proc.kill()
        raise AssertionError(f"no serving line; stderr: {proc.stderr.read()}") from None
    assert line.startswith(f"serving {run_dir} step 5 on http://127.0.0.1:"), line
    return proc, line.split(" on ")[1].strip()


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "Ctrl-C"])
def test_serve_prints_its_port_answers_and_exits_0_on_a_signal_under_load(run_dir, sig):
    proc, url = start(run_dir)
    try:
        r = httpx.post(
            url + "/v1/completions", json={"model": "run", "prompt": "def", "max_tokens": 4}, timeout=30
        )
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 1
        results: list = []

        def stream_one() -> None:
            body = {"prompt": "x", "max_tokens": 4000, "temperature": 1.0, "stream": True}
            try:
                with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as s:
                    results.append([line for line in s.iter_lines() if line])
            except httpx.HTTPError as e:
                results.append(e)

        threads = [threading.Thread(target=stream_one) for _ in range(4)]
        for t in threads:
            t.start()
        time.sleep(1.0)  # the streams are decoding
        t0 = time.monotonic()
        proc.send_signal(sig)
        assert proc.wait(timeout=30) == 0
        assert time.monotonic() - t0 < 20
        for t in threads:
            t.join(30)
        assert len(results) == 4
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "server stopped" in proc.stderr.read()


def test_a_non_loopback_host_needs_a_key(run_dir, capsys, tmp_path, monkeypatch):
    monkeypatch.delenv("MAMBA3LITE_API_KEY", raising=False)
    assert main(["serve", "--checkpoint-dir", str(run_dir), "--host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--insecure-no-auth" in err and "--api-key-file" in err
    empty = tmp_path / "key"
    empty.write_text("\n")
    assert main(["serve", "--checkpoint-dir", str(run_dir), "--api-key-file", str(empty)]) == 2
    assert "is empty" in capsys.readouterr().err
    assert main(["serve", "--checkpoint-dir", str(run_dir), "--max-batch-size", "0"]) == 2
    assert "--max-batch-size must be >= 1" in capsys.readouterr().err


def test_without_the_extra_it_says_how_to_install_it(run_dir, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # import uvicorn -> ImportError
    assert main(["serve", "--checkpoint-dir", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert "pip install 'mamba3lite[serve]'" in err and err.count("\n") == 1
