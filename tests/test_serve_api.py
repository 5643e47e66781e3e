"""`mamba3lite serve` over real sockets on 127.0.0.1 with the real `openai` SDK: completions and chat,
streamed and not, stop, n, seed, echo / logprobs, usage in the stream; and every bad-input case gets an
OpenAI-style error with the right status while the server goes on serving."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from mamba3lite.pretrained import load_pretrained
from mamba3lite.serve.protocol import MAX_STOP_CHARS, MAX_STOPS, ROLES, Limits
from serve_helpers import MODEL, generate_reference, live_server, metric_values
from userside_helpers import save_tiny_checkpoint

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return load_pretrained(save_tiny_checkpoint(tmp_path_factory.mktemp("serve") / "run"), device="cpu")


@pytest.fixture(scope="module")
def tok(loaded):
    return loaded.load_tokenizer()


@pytest.fixture(scope="module")
def srv(loaded, tok):
    with live_server(
        loaded,
        tok,
        max_batch_size=8,
        max_queue=64,
        limits=Limits(max_tokens=256, max_prompt_tokens=512, max_body_bytes=64 << 10),
    ) as s:
        yield s


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", timeout=30, max_retries=0)


def test_completion_greedy_equals_generate_and_reports_usage(client, loaded, tok):
    ref = generate_reference(loaded.model, tok, "def add(a, b):", max_new_tokens=20, temperature=0.0)
    r = client.completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=20, temperature=0)
    assert r.choices[0].text == ref.text
    assert r.choices[0].finish_reason == ("stop" if ref.stopped_at_eos else "length")
    n_prompt = len(tok.encode("def add(a, b):"))
    assert r.usage.prompt_tokens == n_prompt and r.usage.completion_tokens == ref.new_tokens
    assert r.usage.total_tokens == n_prompt + ref.new_tokens


def test_streamed_text_equals_the_non_streamed_and_usage_comes_last(client):
    kw = dict(model=MODEL, prompt="import os\n", max_tokens=24, temperature=0.9, seed=5)
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_seed_reproduces_and_n_gives_distinct_seeded_choices(client):
    kw = dict(model=MODEL, prompt=["x = ", "y = "], max_tokens=12, temperature=1.0, n=3, seed=11)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.index for c in a.choices] == list(range(6))
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices[:3]}) > 1  # choice k uses seed + k
    single = client.completions.create(model=MODEL, prompt="y = ", max_tokens=12, temperature=1.0, seed=12)
    assert single.choices[0].text == a.choices[4].text


def test_stop_strings_across_tokens_are_excluded(client):
    full = (
        client.completions.create(model=MODEL, prompt="class Point:", max_tokens=40, temperature=0)
        .choices[0]
        .text
    )
    assert len(full) > 6
    stop = full[3:6]  # very likely spans a token boundary; found either way
    r = client.completions.create(
        model=MODEL, prompt="class Point:", max_tokens=40, temperature=0, stop=[stop, "@@@@"]
    )
    assert r.choices[0].text == full[: full.index(stop)] and r.choices[0].finish_reason == "stop"
    chunks = list(
        client.completions.create(
            model=MODEL, prompt="class Point:", max_tokens=40, temperature=0, stop=stop, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text


def test_echo_logprobs_scores_the_prompt(client, tok):
    ids = tok.encode("def add(a, b):\n    return a + b")
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=3, temperature=0)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == tok.decode(ids) and lp.tokens == [tok.decode([t]) for t in ids]
    assert lp.token_logprobs[0] is None and all(x <= 0 for x in lp.token_logprobs[1:])
    assert lp.top_logprobs[0] is None and all(len(t) <= 3 for t in lp.top_logprobs[1:])
    assert lp.text_offset == [len(tok.decode(ids[:i])) for i in range(len(ids))]
    # max_tokens 1 (lm-eval's request): the prompt's scores are the same, plus one generated token
    r1 = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=1, echo=True, logprobs=1, temperature=0
    )
    lp1 = r1.choices[0].logprobs
    assert lp1.token_logprobs[: len(ids)] == pytest.approx(lp.token_logprobs, abs=1e-5)
    assert len(lp1.tokens) == len(ids) + 1
    assert lp1.token_logprobs[-1] == pytest.approx(max(lp1.top_logprobs[-1].values()))  # greedy: the top one
    # a list of lists of ids: one choice per prompt, each scored as alone
    both = client.completions.create(model=MODEL, prompt=[ids, ids[:4]], max_tokens=0, echo=True, logprobs=0)
    assert [c.index for c in both.choices] == [0, 1]
    assert both.choices[0].logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)
    assert both.choices[1].logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:4], abs=1e-5)
    assert both.usage.prompt_tokens == len(ids) + 4 and both.usage.completion_tokens == 0


def test_penalties_change_sampling_and_are_bounded(client):
    base = dict(model=MODEL, prompt="x", max_tokens=30, temperature=0)
    plain = client.completions.create(**base).choices[0].text
    penalised = client.completions.create(**base, frequency_penalty=2.0, presence_penalty=2.0).choices[0].text
    assert plain != penalised
    with pytest.raises(openai.BadRequestError):
        client.completions.create(**base, presence_penalty=3)


def test_chat_streamed_and_not(client):
    msgs = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def add"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16, temperature=0)
    assert r.choices[0].message.role == "assistant" and r.object == "chat.completion"
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=msgs,
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content
    assert (
        chunks[0].choices[0].delta.role == "assistant"
        and chunks[-1].usage.total_tokens == r.usage.total_tokens
    )
    assert "\nUser:" not in text


def test_models_health_and_metrics(srv, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(srv.url + "/health", timeout=10).json()["status"] == "ok"
    m = metric_values(httpx.get(srv.url + "/metrics", timeout=10).text)
    assert m["mamba3lite_completion_tokens_total"] > 0 and m["mamba3lite_batch_occupancy"] == 0
    assert m['mamba3lite_requests_total{endpoint="/v1/completions",status="200"}'] >= 1
    assert "mamba3lite_prefix_cache_bytes" in m and "mamba3lite_queue_length" in m


BAD = [
    (b'{"prompt": "x", ', 400, "invalid_json"),
    (b'{"prompt": "\xff\xfe"}', 400, "invalid_json"),
    (b"[1, 2]", 400, "invalid_json"),
    (b'{"prompt": "x", "max_tokens": NaN}', 400, "invalid_json"),
    (json.dumps({"prompt": "x", "max_tokens": "ten"}).encode(), 400, "invalid_type"),
    (json.dumps({"prompt": []}).encode(), 400, "invalid_value"),
    (json.dumps({"prompt": [1, "a"]}).encode(), 400, "invalid_value"),
    (json.dumps({"prompt": [10**9]}).encode(), 400, "invalid_value"),
    (json.dumps({"prompt": "x", "suffix": "y"}).encode(), 400, "unsupported_parameter"),
    (json.dumps({"prompt": "x", "logit_bias": {"1": 5}}).encode(), 400, "unsupported_parameter"),
    (json.dumps({"prompt": "x", "n": 99}).encode(), 400, "n_over_limit"),
    (json.dumps({"prompt": "x", "logprobs": 6}).encode(), 400, "logprobs_over_limit"),
    (json.dumps({"prompt": "x", "max_tokens": 10**6}).encode(), 400, "max_tokens_over_limit"),
    (json.dumps({"prompt": "x " * 600}).encode(), 400, "prompt_too_long"),
    (json.dumps({"prompt": "x", "max_tokens": 0}).encode(), 400, "invalid_value"),
    (json.dumps({"prompt": "x", "temperature": -1}).encode(), 400, "invalid_value"),
    (json.dumps({"prompt": "x", "stop": [1]}).encode(), 400, "invalid_type"),
    (json.dumps({"prompt": "x", "model": "gpt-4"}).encode(), 404, "model_not_found"),
    (json.dumps({"prompt": "x" * (70 << 10)}).encode(), 413, "body_too_large"),
]


@pytest.mark.parametrize("body, status, code", BAD)
def test_bad_input_gets_an_openai_error_and_the_server_goes_on(srv, body, status, code):
    r = httpx.post(
        srv.url + "/v1/completions", content=body, headers={"content-type": "application/json"}, timeout=10
    )
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == code and err["message"]
    ok = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=10)
    assert ok.status_code == 200


def test_stop_sequences_are_bounded_as_openais_are(srv):
    """At most MAX_STOPS (4, OpenAI's limit) stop sequences of at most MAX_STOP_CHARS characters each: more
    is a 400 naming the limit, on both endpoints; the limit itself is served, and so is the next request."""
    long = "y" * (MAX_STOP_CHARS + 1)
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    for route, body in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", chat)):
        for stop, says in (
            (["a", "b", "c", "d", "e"], f"at most {MAX_STOPS} stop sequences, got 5"),
            (["a", long], f"at most {MAX_STOP_CHARS} characters; stop[1] has {MAX_STOP_CHARS + 1}"),
            (long, f"at most {MAX_STOP_CHARS} characters; stop[0] has"),
        ):
            r = httpx.post(srv.url + route, json={**body, "stop": stop, "max_tokens": 2}, timeout=10)
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == "stop" and says in err["message"], r.text
        at_limit = ["y" * MAX_STOP_CHARS, "a", "b", "c"]
        r = httpx.post(srv.url + route, json={**body, "stop": at_limit, "max_tokens": 2}, timeout=10)
        assert r.status_code == 200, r.text


def test_bad_chat_and_unknown_route(srv):
    r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": "hi"}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    for role in ("tool", "User", "robot"):
        messages = [{"role": "user", "content": "hi"}, {"role": role, "content": "x"}]
        r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": messages}, timeout=10)
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "messages[1].role", r.text
        assert f'"{role}"' in err["message"] and "system, developer, user, assistant" in err["message"]
    for role in ROLES:  # each allowed role is served, and the server goes on after the refusals
        messages = [{"role": role, "content": "hi"}, {"role": "user", "content": "x"}]
        r = httpx.post(
            srv.url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 2}, timeout=10
        )
        assert r.status_code == 200, r.text
    r = httpx.get(srv.url + "/v1/nothing", timeout=10)
    assert r.status_code == 404 and "error" in r.json()


def test_a_full_queue_is_429_with_retry_after(loaded, tok):
    # The engine is not started: the first request stays queued, so the queue (size 1) is full.
    with live_server(loaded, tok, max_queue=1, manage_engine=False) as s:
        body = {"prompt": "x", "max_tokens": 5, "stream": True}
        with httpx.Client(timeout=30) as c, c.stream("POST", s.url + "/v1/completions", json=body):
            for _ in range(500):
                if s.engine.queue_len == 1:
                    break
                time.sleep(0.01)
            third = httpx.post(s.url + "/v1/completions", json=body, timeout=10)
            assert third.status_code == 429 and third.headers["retry-after"] == "1"
            assert third.json()["error"]["type"] == "rate_limit_error"


def test_api_key_is_required_and_compared(loaded, tok):
    with live_server(loaded, tok, api_key="s3cret") as s:
        assert httpx.get(s.url + "/health", timeout=10).status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            r = httpx.get(s.url + "/v1/models", headers=headers, timeout=10)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        good = openai.OpenAI(base_url=s.url + "/v1", api_key="s3cret", timeout=30, max_retries=0)
        assert good.completions.create(model=MODEL, prompt="x", max_tokens=2).usage.completion_tokens >= 1
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=s.url + "/v1", api_key="nope", max_retries=0).models.list()


def test_echo_without_logprobs_returns_prompt_then_continuation(client):
    plain = client.completions.create(model=MODEL, prompt="x = ", max_tokens=6, temperature=0).choices[0]
    echoed = client.completions.create(
        model=MODEL, prompt="x = ", max_tokens=6, temperature=0, echo=True
    ).choices[0]
    assert echoed.text == "x = " + plain.text and echoed.logprobs is None
    chunks = list(
        client.completions.create(
            model=MODEL, prompt="x = ", max_tokens=6, temperature=0, echo=True, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == echoed.text


def test_a_client_that_leaves_a_non_streamed_request_frees_its_slot(srv):
    import socket

    before = srv.metrics.disconnects
    body = json.dumps({"prompt": "x", "max_tokens": 256, "temperature": 1.0}).encode()
    host, port = srv.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        )
        sock.sendall(head.encode() + body)
        for _ in range(500):  # until the request runs
            if srv.engine.active:
                break
            time.sleep(0.005)
    deadline = time.monotonic() + 20
    while (srv.engine.active or srv.metrics.disconnects == before) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert srv.engine.active == 0
    assert srv.metrics.disconnects == before + 1  # 256 tokens take far longer than the close: cancelled


def test_the_runs_chat_template_renders_the_messages(tmp_path, loaded, tok):
    from mamba3lite.serve.chat import ChatRenderer, find_chat_template

    template = (
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    found = find_chat_template(tmp_path, "gpt2")
    assert found == template and find_chat_template(tmp_path / "nowhere", "gpt2") is None
    render = ChatRenderer(found, "<|endoftext|>")
    assert render([{"role": "user", "content": "hi"}]) == ("<user>hi<assistant>", ())
    with live_server(loaded, tok, template=found) as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=30)
        r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert r.usage.prompt_tokens == len(tok.encode("<user>hi<assistant>"))
        info = httpx.get(s.url + "/tokenizer_info", timeout=10).json()
        assert info["chat_template"] == template and info["eos_token"] == info["bos_token"] == "<|endoftext|>"
        # /tokenize starts a document by default, as vLLM's does for an export; bare ids on request
        for body, want in (
            ({}, [tok.eos_id, *tok.encode("hi")]),
            ({"add_special_tokens": False}, tok.encode("hi")),
        ):
            got = httpx.post(s.url + "/tokenize", json={"prompt": "hi", **body}, timeout=10).json()["tokens"]
            assert got == want, body
    plain = ChatRenderer(None, "<|endoftext|>")
    assert plain([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]) == (
        "System: s\nUser: u\nAssistant:",
        ("\nUser:",),
    )
