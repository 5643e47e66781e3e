"""The serve engine without HTTP: a request's tokens do not depend on the batch it decodes in (greedy
and seeded), greedy equals `generation.generate_text`, the prefix-state cache changes nothing but the
work done, stop strings split over tokens are found, and prompt scoring equals a plain forward."""

from __future__ import annotations

import dataclasses
import queue
import time

import pytest
import torch

from mamba3lite.pretrained import load_pretrained
from mamba3lite.serve.engine import Delta, Engine, Finished, Job, PromptScores
from mamba3lite.serve.prefix_cache import PrefixCache
from mamba3lite.serve.sampling import Sampling
from mamba3lite.serve.textout import StopMatcher
from serve_helpers import generate_reference
from userside_helpers import save_tiny_checkpoint

PROMPTS = ["def add(a, b):", "import os\n", "class Point:", "for i in range(10):", "x = ", "# a comment"]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return load_pretrained(save_tiny_checkpoint(tmp_path_factory.mktemp("serve") / "run"), device="cpu")


@pytest.fixture(scope="module")
def tok(loaded):
    return loaded.load_tokenizer()


def run_jobs(engine: Engine, specs, timeout: float = 60.0):
    """Submit (prompt_ids, report_from, sampling) specs together; [(text, token ids, Finished, scores)]."""
    sinks = [queue.Queue() for _ in specs]
    engine.submit([Job(ids, r, s, q.put) for (ids, r, s), q in zip(specs, sinks)])
    out = []
    deadline = time.monotonic() + timeout
    for q in sinks:
        text, ids, scores = "", [], None
        while True:
            ev = q.get(timeout=max(0.1, deadline - time.monotonic()))
            if isinstance(ev, Delta):
                text += ev.text
                if ev.token_id is not None:
                    ids.append(ev.token_id)
            elif isinstance(ev, PromptScores):
                scores = ev
            else:
                assert isinstance(ev, Finished)
                out.append((text, ids, ev, scores))
                break
    return out


def make_engine(loaded, tok, **kw) -> Engine:
    engine = Engine(loaded.model, tok, **kw)
    engine.start()
    return engine


def text_job(tok, prompt: str, **sampling):
    return ([tok.eos_id, *tok.encode(prompt)], 1, Sampling(**sampling))


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=1.0, top_k=50)])
def test_a_request_decodes_the_same_alone_and_in_a_batch(loaded, tok, sampling):
    engine = make_engine(loaded, tok, max_batch_size=8)
    try:
        specs = [text_job(tok, p, max_tokens=12 + i, seed=100 + i, **sampling) for i, p in enumerate(PROMPTS)]
        alone = [run_jobs(engine, [s])[0] for s in specs]
        together = run_jobs(engine, specs)
    finally:
        engine.stop()
    for a, b in zip(alone, together):
        assert a[1] == b[1] and a[0] == b[0]
        assert a[2].completion_tokens == len(a[1]) + (a[2].reason == "stop")
    assert len({tuple(a[1]) for a in alone}) > 1  # the prompts do give different outputs


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.8, top_k=50, seed=7)])
def test_output_equals_generate_text(loaded, tok, sampling):
    """Greedy and seeded output equal `generate`'s (through `serve_helpers.generate_reference`)."""
    engine = make_engine(loaded, tok)
    try:
        for prompt in PROMPTS[:3]:
            ref = generate_reference(loaded.model, tok, prompt, max_new_tokens=20, **sampling)
            text, ids, _fin, _ = run_jobs(engine, [text_job(tok, prompt, max_tokens=20, **sampling)])[0]
            assert ids == ref.token_ids and text == ref.text
    finally:
        engine.stop()


def test_a_prefix_cache_hit_gives_the_same_tokens_and_skips_the_prefix(loaded, tok):
    long_prompt = "def f(x):\n    return x * 2\n" * 60  # > 2 boundaries of 128 tokens
    ids = [tok.eos_id, *tok.encode(long_prompt)]
    assert len(ids) > 300
    plain = make_engine(loaded, tok, boundary=128)
    cached = make_engine(loaded, tok, boundary=128, prefix_cache=PrefixCache(64 << 20))
    try:
        s = Sampling(max_tokens=10, temperature=0.0)
        ref = run_jobs(plain, [(ids, 1, s)])[0]
        first = run_jobs(cached, [(ids, 1, s)])[0]
        before = cached.prefill_tokens
        again = run_jobs(cached, [(ids, 1, s)])[0]  # full hit: nothing prefilled
        assert cached.prefill_tokens == before
        longer = [*ids, *tok.encode(" # more")]
        ref_longer = run_jobs(plain, [(longer, 1, s)])[0]
        got_longer = run_jobs(cached, [(longer, 1, s)])[0]  # boundary hit: only the tail is prefilled
        assert cached.prefill_tokens - before == len(longer) - (len(ids) // 128) * 128
    finally:
        plain.stop()
        cached.stop()
    assert ref[1] == first[1] == again[1]
    assert ref_longer[1] == got_longer[1]
    assert cached.prefix_cache.hits == 2 and cached.prefix_cache.bytes > 0


def test_prompt_scores_equal_a_full_forward(loaded, tok):
    ids = [tok.eos_id, *tok.encode("def add(a, b):\n    return a + b\n")]
    engine = make_engine(loaded, tok, boundary=8)
    try:
        s = Sampling(max_tokens=0, echo=True, logprobs=2)
        _text, out_ids, fin, scores = run_jobs(engine, [(ids, 1, s)])[0]
    finally:
        engine.stop()
    assert out_ids == [] and fin.reason == "length" and fin.completion_tokens == 0
    with torch.no_grad():
        logp = torch.log_softmax(loaded.model(torch.tensor([ids])).float(), -1)[0]
    want = [float(logp[t, ids[t + 1]]) for t in range(len(ids) - 1)]
    assert scores.ids == ids[1:] and scores.logprobs[0] is None
    assert scores.logprobs[1:] == pytest.approx(want[1:], abs=1e-4)
    assert all(len(t) == 2 and t[0][1] >= t[1][1] for t in scores.top[1:])


@pytest.mark.parametrize(
    "pieces, stops, want",
    [
        (["ab", "c", "de"], ["cd"], ("ab", True)),
        (["a", "b", "c"], ["bc", "x"], ("a", True)),
        (["hel", "lo wor", "ld"], ["world"], ("hello ", True)),
        (["ab", "c"], ["cd"], ("abc", False)),  # an open prefix is released at the end
        (["abc"], [], ("abc", False)),
    ],
)
def test_stop_strings_are_found_across_pieces_and_excluded(pieces, stops, want):
    m = StopMatcher(stops)
    out, stopped = "", False
    for p in pieces:
        t, stopped = m.feed(p)
        out += t
        if stopped:
            break
    out += m.flush()
    assert (out, stopped) == want


def test_stop_and_cancel_free_their_rows(loaded, tok):
    engine = make_engine(loaded, tok)
    try:
        text, _ids, fin, _ = run_jobs(engine, [text_job(tok, "x", max_tokens=30, temperature=0.0)])[0]
        assert len(text) > 3 and fin.reason == "length"
        stop = text[2:4]
        t2, _, fin2, _ = run_jobs(engine, [text_job(tok, "x", max_tokens=30, temperature=0.0, stop=(stop,))])[
            0
        ]
        assert fin2.reason == "stop" and t2 == text[: text.index(stop)]
        q: queue.Queue = queue.Queue()
        job = Job([tok.eos_id], 1, Sampling(max_tokens=10_000, temperature=1.0), q.put)
        engine.submit([job])
        q.get(timeout=30)
        job.cancel()
        while not isinstance(ev := q.get(timeout=30), Finished):
            pass
        assert ev.reason == "cancelled"
        deadline = time.monotonic() + 10
        while engine.active and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.active == 0 and engine.queue_len == 0
    finally:
        engine.stop()


def state_tensors(cache) -> list[torch.Tensor]:
    """Every tensor of a model state (the test's view inside it; serve itself uses the protocol only)."""
    layers = [getattr(s, f.name) for s in cache.layers for f in dataclasses.fields(s)]
    return [*layers, cache.last_token_B]


def test_batch_state_keeps_each_rows_state_through_joins_swap_removes_and_growth(loaded):
    from mamba3lite.serve.batch_state import BatchState

    model = loaded.model
    state = BatchState(model, max_rows=8, initial_rows=2)
    rows = []
    for i in range(6):  # grows 2 -> 4 -> 8
        c = model.allocate_cache(1)
        for t in state_tensors(c):
            t.fill_(i)
        state.add(c)
        rows.append(i)
    for i in (4, 0):  # remove rows 4 and 0: the last row moves into each place
        state.remove(i)
        rows[i] = rows[-1]
        rows.pop()
    assert state.n == 4 and state.capacity == 8
    for t in state_tensors(state.view()):
        assert [int(t[r].flatten()[0]) for r in range(state.n)] == rows
    assert state.nbytes() == model.allocate_cache(8).nbytes() > 0


def test_a_failing_step_fails_the_running_requests_and_the_engine_goes_on(loaded, tok, monkeypatch):
    engine = make_engine(loaded, tok)
    try:
        real_step = loaded.model.step

        def broken(*a, **kw):
            raise RuntimeError("out of memory (simulated)")

        monkeypatch.setattr(loaded.model, "step", broken)
        _, _, fin, _ = run_jobs(engine, [text_job(tok, "x", max_tokens=5, temperature=0.0)])[0]
        assert fin.reason == "error" and "simulated" in fin.message and engine.active == 0
        monkeypatch.setattr(loaded.model, "step", real_step)
        _, ids, fin, _ = run_jobs(engine, [text_job(tok, "x", max_tokens=5, temperature=0.0)])[0]
        assert fin.reason in ("length", "stop") and ids
    finally:
        engine.stop()
