"""Serve's admission by decode-state bytes (`Engine(max_state_bytes=...)`, `mamba3lite serve
--max-state-mb`): the model says what a state of B rows and L tokens costs (`Mamba3Transformer.state_bytes`
equals the allocated state's `nbytes`), a hybrid's request waits while the budget is full and joins when
a row leaves, the batch's state never exceeds the budget, a request that could never fit gets 400
through the API, a pure model's admission does not change (its state does not grow), and greedy outputs
are the same with or without a budget."""

from __future__ import annotations

import argparse
import threading
from types import SimpleNamespace

import httpx
import pytest
import torch

from mamba3lite.cli import main
from mamba3lite.commands.serve import state_limit_note
from mamba3lite.model import Mamba3Transformer, ModelConfig
from mamba3lite.serve.batch_state import BatchState
from mamba3lite.serve.engine import Delta, Engine, Finished, Job, StateTooLarge
from mamba3lite.serve.protocol import Limits
from mamba3lite.serve.sampling import Sampling
from mamba3lite.tokenizer import load_tokenizer
from serve_helpers import MODEL, live_server, metric_values

PROMPTS = ("def add(a, b):", "import os\n", "class Point:", "x = ")
N_NEW = 6


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("gpt2")


def tiny(tok, **kw) -> Mamba3Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=tok.vocab_size, d_model=32, n_layers=4, d_intermediate=40, mlp_multiple_of=8,
                      d_state=16, headdim=8, chunk_size=8, eos_id=tok.eos_id, **kw)  # fmt: skip
    return Mamba3Transformer(cfg).eval()


@pytest.fixture(scope="module")
def hybrid(tok):
    return tiny(tok, attn_layer_idx=(1, 3), attn_cfg={"num_heads": 4})


@pytest.fixture(scope="module")
def pure(tok):
    return tiny(tok)


def prompt_ids(tok, text: str) -> list[int]:
    return [tok.eos_id, *tok.encode(text)]


class Recorder:
    """Every job's events in the order the engine sent them (one thread sends them all), each with the
    engine's active rows and state bytes at that moment."""

    def __init__(self, engine: Engine) -> None:
        self.engine, self.events, self.done = engine, [], threading.Semaphore(0)

    def job(self, i: int, ids: list[int], max_tokens: int) -> Job:
        def sink(ev) -> None:
            self.events.append((i, ev, self.engine.active, self.engine.state_bytes))
            if isinstance(ev, Finished):
                self.done.release()

        return Job(ids, 1, Sampling(max_tokens=max_tokens, temperature=0.0), sink)

    def run(self, jobs: list[Job]) -> None:
        self.engine.submit(jobs)
        for _ in jobs:
            assert self.done.acquire(timeout=120), "a job did not finish"

    def tokens(self, i: int) -> list[int]:
        return [
            ev.token_id
            for j, ev, *_ in self.events
            if j == i and isinstance(ev, Delta) and ev.token_id is not None
        ]

    def first(self, i: int, kind: type) -> int:
        return next(n for n, (j, ev, *_) in enumerate(self.events) if j == i and isinstance(ev, kind))


def greedy(model, ids: list[int], n_new: int = N_NEW) -> list[int]:
    out = [int(t[0]) for t in model.generate(torch.tensor([ids]), n_new, temperature=0.0)]
    return out[: out.index(model.cfg.eos_id)] if model.cfg.eos_id in out else out


# ---- what a state costs, from the model ----
def test_state_bytes_is_the_allocated_states_nbytes_constant_for_a_pure_model(pure, hybrid):
    for model in (pure, hybrid):
        for rows, length in ((1, 1), (3, 17), (2, 64)):
            assert model.state_bytes(rows, length) == model.allocate_cache(rows, length).nbytes()
            assert model.state_bytes(rows, length) == rows * model.state_bytes(1, length)
    assert pure.state_bytes(1, 10) == pure.state_bytes(1, 10_000)  # a recurrent state: any length
    assert hybrid.state_bytes(1, 10) < hybrid.state_bytes(1, 20) < hybrid.state_bytes(1, 10_000)


def test_a_budgeted_batch_lays_out_the_longest_reservation_within_the_budget(hybrid):
    """Two rows of 20 tokens fit, a third waits until one leaves; the buffer is exactly its layout's
    bytes, within the budget, and a layout of shorter rows is taken again once the long one left."""
    budget = hybrid.state_bytes(2, 20)
    batch = BatchState(hybrid, max_rows=8, budget_bytes=budget)
    assert batch.layout_for([20, 20]) == (2, 20) and batch.layout_for([20, 20, 20]) is None
    assert batch.layout_for([21]) == (1, 21)  # two rows of 21 are over it
    for _ in range(2):
        one = hybrid.allocate_cache(1)
        hybrid.prefill(torch.tensor([[5, 6, 7]]), one)
        batch.add(one, 20)
    assert batch.nbytes() == hybrid.state_bytes(batch.capacity, 20) <= budget
    assert batch.layout_for([20]) is None and batch.layout_for([5]) is None
    batch.remove(0)
    assert batch.layout_for([20]) == (batch.capacity, 20)
    assert batch.fits_alone(20) and not batch.fits_alone(10_000)


# ---- the engine ----
def test_a_request_waits_while_the_budget_is_full_and_joins_when_one_finishes(hybrid, tok):
    """A budget of one row of each request's size: the second request's first token comes after the
    first's end, never two rows at once, the state never over the budget; twice that budget: both decode
    together. Greedy tokens are generate's either way."""
    ids = [prompt_ids(tok, p) for p in PROMPTS[:2]]
    need = max(len(x) for x in ids) + N_NEW
    want = [greedy(hybrid, x) for x in ids]
    for rows, overlap in ((1, False), (2, True)):
        budget = hybrid.state_bytes(rows, need)
        engine = Engine(hybrid, tok, max_batch_size=4, max_state_bytes=budget)
        engine.start()
        try:
            rec = Recorder(engine)
            rec.run([rec.job(i, x, N_NEW) for i, x in enumerate(ids)])
        finally:
            engine.stop()
        assert [rec.tokens(i) for i in range(2)] == want
        assert (rec.first(1, Delta) < rec.first(0, Finished)) == overlap
        assert max(active for *_, active, _ in rec.events) == rows
        assert max(nbytes for *_, nbytes in rec.events) <= budget


def test_greedy_outputs_are_unchanged_by_a_budget(hybrid, tok):
    """Four requests of different lengths under a budget that holds two of them at a time (rows leave,
    waiting ones join, the buffer is laid out again) and under no budget: the same tokens, generate's."""
    ids = [prompt_ids(tok, p) for p in PROMPTS]
    lengths = [N_NEW + 4 * i for i in range(len(ids))]
    outs = []
    for budget in (None, hybrid.state_bytes(2, max(len(x) + n for x, n in zip(ids, lengths)))):
        engine = Engine(hybrid, tok, max_batch_size=4, max_state_bytes=budget)
        engine.start()
        try:
            rec = Recorder(engine)
            rec.run([rec.job(i, x, n) for i, (x, n) in enumerate(zip(ids, lengths))])
        finally:
            engine.stop()
        outs.append([rec.tokens(i) for i in range(len(ids))])
        if budget is not None:
            assert max(active for *_, active, _ in rec.events) == 2
    assert outs[0] == outs[1] == [greedy(hybrid, x, n) for x, n in zip(ids, lengths)]


def test_a_pure_models_admission_is_unchanged_its_state_does_not_grow(pure, hybrid, tok):
    """A budget of max_batch_size rows at one token: every request of a pure model joins at once however
    long it may grow, and its state is the unbudgeted engine's; a hybrid's same requests do not."""
    ids = [prompt_ids(tok, p) for p in PROMPTS]
    long = 100_000  # max_tokens: each job cancels itself at its first token
    seen = {}
    for model in (pure, hybrid):
        for budget in (None, model.state_bytes(4, 1)):
            engine = Engine(model, tok, max_batch_size=4, max_state_bytes=budget)
            engine.start()
            try:
                rec = Recorder(engine)
                jobs = [rec.job(i, x, long) for i, x in enumerate(ids)]
                if model is hybrid and budget is not None:
                    with pytest.raises(StateTooLarge):
                        engine.submit(jobs)
                    continue
                sink = [j.sink for j in jobs]
                for j, s in zip(jobs, sink):
                    j.sink = lambda ev, j=j, s=s: (s(ev), isinstance(ev, Delta) and j.cancel())
                rec.run(jobs)
            finally:
                engine.stop()
            seen[model is pure, budget is None] = (max(a for *_, a, _ in rec.events), engine.state_bytes)
    assert seen[True, True] == seen[True, False] == (4, pure.allocate_cache(4).nbytes())


def test_submit_refuses_a_request_that_could_not_fit_alone_and_queues_nothing(hybrid, tok):
    ids = prompt_ids(tok, PROMPTS[0])
    engine = Engine(hybrid, tok, max_batch_size=4, max_state_bytes=hybrid.state_bytes(1, len(ids) + 10))
    rec = Recorder(engine)
    with pytest.raises(StateTooLarge) as e:
        engine.submit([rec.job(0, ids, 10), rec.job(1, ids, 11)])  # all or none: the first fits
    assert e.value.tokens == len(ids) + 11 and e.value.need_bytes == hybrid.state_bytes(1, len(ids) + 11)
    assert engine.queue_len == 0
    engine.submit([rec.job(0, ids, 10)])
    assert engine.queue_len == 1


# ---- through the API and the command ----
def test_a_request_too_large_for_the_budget_gets_400_and_the_server_goes_on(hybrid, tok):
    limits = Limits(max_tokens=4096, max_prompt_tokens=512)
    budget = hybrid.state_bytes(1, 64)
    with live_server(SimpleNamespace(model=hybrid), tok, limits=limits, max_state_bytes=budget) as srv:
        body = {"model": MODEL, "prompt": "def add(a, b):", "max_tokens": 1000, "temperature": 0}
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["code"] == "state_too_large" and err["param"] == "max_tokens"
        assert "--max-state-mb" in err["message"] and f"{budget / (1 << 20):.1f} MB" in err["message"]
        r = httpx.post(srv.url + "/v1/completions", json={**body, "max_tokens": N_NEW}, timeout=60)
        assert r.status_code == 200
        gauges = metric_values(httpx.get(srv.url + "/metrics", timeout=30).text)
        assert gauges["mamba3lite_decode_state_capacity_bytes"] == budget
        assert 0 < gauges["mamba3lite_decode_state_bytes"] <= budget
        assert r.json()["choices"][0]["text"] == tok.decode(greedy(hybrid, prompt_ids(tok, body["prompt"])))


def test_the_flag_is_checked_and_a_limit_under_the_largest_request_is_noted(tmp_path, capsys, hybrid):
    run_dir = tmp_path / "run"  # the flags are checked before the run is read
    for bad in ("-1", "inf", "nan"):
        assert main(["serve", "--checkpoint-dir", str(run_dir), "--max-state-mb", bad]) == 2
        err = capsys.readouterr().err
        assert "--max-state-mb must be >= 0" in err and err.count("\n") == 1
    args = argparse.Namespace(max_prompt_tokens=100, max_tokens_limit=28, max_state_mb=1.0)
    assert state_limit_note(args, hybrid, None) is None
    assert state_limit_note(args, hybrid, hybrid.state_bytes(1, 128)) is None
    note = state_limit_note(args, hybrid, hybrid.state_bytes(1, 127))
    assert "128 tokens" in note and "--max-state-mb 1" in note and "get 400" in note
