"""Pretrainer: exact resume, NaN guard (skip, rollback, limits), explicit --resume N, lock, evaluation.

A tiny real Mamba-3 model (fp32, CPU) on seeded dummy tokens or on a small dataset written through
`shards.write_shard` + `Manifest`, so every test runs the real loop in a second or two.
"""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
import torch

from mamba3lite.checkpoint import CheckpointManager
from mamba3lite.config import Config
from mamba3lite.data.shards import write_dataset
from mamba3lite.errors import CheckpointError, ConfigError, DataError, TrainingError
from mamba3lite.rundir import checkpoint_files
from mamba3lite.train.trainer import INJECT_ENV, Pretrainer, parse_injection
from tiny_shapes import TINY_MODEL_SHAPE

VOCAB = 64


def tiny_config(run_dir, **training) -> Config:
    cfg = Config().replace(
        "model",
        vocab_size=VOCAB,
        eos_id=0,
        **TINY_MODEL_SHAPE,
    )
    base = dict(
        max_seq_len=16,
        micro_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=6,
        warmup_steps=2,
        lr=1e-2,
        min_lr=1e-3,
        log_every=1,
        save_every=1000,
        eval_every=0,
        eval_batches=2,
        dtype="fp32",
        device="cpu",
        checkpoint_dir=str(run_dir),
        keep_last_n=0,
        progress=False,
    )
    base.update(training)
    return cfg.replace("training", **base).replace("data", dummy=True)


def make_dataset(root, n_train: int = 4000, n_val: int = 600, seed: int = 0) -> str:
    """A prepared-dataset directory (manifest + train/val shards) with a learnable pattern."""
    rng = np.random.default_rng(seed)
    parts = []
    for split, n in (("train", n_train), ("val", n_val)):
        tokens = (np.arange(n) * 7 + rng.integers(0, 3, n)) % (VOCAB - 1) + 1
        tokens[::50] = 0  # "EOS"
        parts.append((split, tokens, n // 50, 3 * n))
    write_dataset(
        root, parts, vocab_size=VOCAB, eos_id=0, tokenizer={"name": "test", "vocab_hash": "ab" * 32}
    )
    return str(root)


def metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def weights(trainer: Pretrainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.raw_model.state_dict().items()}


def test_parse_injection():
    assert parse_injection("3, 10:3,r1@20") == {3, 10, 11, 12}
    assert parse_injection("3,r1@20:2", rank=1) == {3, 20, 21}
    assert parse_injection("") == set()


def test_exact_resume_bit_for_bit(tmp_path):
    full = Pretrainer(tiny_config(tmp_path / "a"))
    r_full = full.train()
    assert r_full.step == 6 and len(r_full.history) == 6

    first = Pretrainer(tiny_config(tmp_path / "b"))
    r1 = first.train(until_step=3)
    assert r1.step == 3 and CheckpointManager(tmp_path / "b").latest_step() == 3
    second = Pretrainer(tiny_config(tmp_path / "b"))  # resume="latest"
    r2 = second.train()
    assert [s for s, _ in r1.history + r2.history] == [1, 2, 3, 4, 5, 6]
    assert [loss for _, loss in r1.history + r2.history] == [loss for _, loss in r_full.history]
    w_full, w_resumed = weights(full), weights(second)
    assert all(torch.equal(w_full[k], w_resumed[k]) for k in w_full)
    assert second.sampler.state_dict() == full.sampler.state_dict()
    assert second.tokens_seen == full.tokens_seen == 6 * 2 * 2 * 16
    events = [r["event"] for r in metrics(tmp_path / "b") if r["kind"] == "event"]
    assert "resume" in events


def test_nan_skip_leaves_optimizer_untouched_and_is_logged(tmp_path, monkeypatch):
    monkeypatch.setenv(INJECT_ENV, "2")  # micro-step 2 = first micro-step of step 2
    t = Pretrainer(tiny_config(tmp_path, gradient_accumulation_steps=1))
    result = t.train()
    # step 2's only micro-step was skipped: 6 optimizer steps still happen, from 7 batches
    assert result.step == 6 and t.faults.micro_count == 7
    state = t.optimizer.state[t.params[0]]
    assert int(state["step"]) == 6
    assert all(torch.isfinite(p).all() for p in t.raw_model.parameters())
    rows = metrics(tmp_path)
    assert sum(r.get("event") == "nan_skip" for r in rows) == 1
    assert sum(r.get("skipped", 0) for r in rows if r["kind"] == "train") == 1


def test_partial_skip_equals_training_on_the_good_micro_batch(tmp_path, monkeypatch):
    # accumulation 2 with micro-step 1 skipped == the step's gradient is the good micro-batch's alone
    monkeypatch.setenv(INJECT_ENV, "1")
    a = Pretrainer(tiny_config(tmp_path / "a", max_steps=1))
    a.train()
    monkeypatch.delenv(INJECT_ENV)
    b = Pretrainer(tiny_config(tmp_path / "b", max_steps=1))
    indices = b.input.next_indices()
    x, y = b.input.batch(indices[:2])
    b.raw_model(x, y).backward()
    torch.nn.utils.clip_grad_norm_(b.params, b.tc.grad_clip)
    from mamba3lite.train.optim import set_lr

    set_lr(b.optimizer, b.schedule.lr(0))
    b.optimizer.step()
    wa, wb = weights(a), weights(b)
    assert all(torch.allclose(wa[k], wb[k], rtol=0, atol=1e-7) for k in wa)


def test_rollback_after_consecutive_nan_then_continue(tmp_path, monkeypatch):
    # save at 2 and 4; micro-steps 10..12 (steps 6-7) are bad -> roll back to step 4 and go on
    monkeypatch.setenv(INJECT_ENV, "10:3")
    t = Pretrainer(tiny_config(tmp_path, max_steps=8, save_every=2, nan_guard_max_consecutive=3))
    result = t.train()
    assert result.step == 8 and result.rollbacks == 1
    rows = metrics(tmp_path)
    (rb,) = [r for r in rows if r.get("event") == "rollback"]
    assert rb["step"] == 4 and "rolled back to step 4" in rb["message"]
    superseded = [r for r in rows if r.get("superseded")]
    assert superseded and all(r["step"] > 4 for r in superseded)
    live_train_steps = [r["step"] for r in rows if r["kind"] == "train" and not r.get("superseded")]
    assert live_train_steps == list(range(1, 9))


def test_nan_without_checkpoint_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv(INJECT_ENV, "0:3")
    t = Pretrainer(tiny_config(tmp_path, nan_guard_max_consecutive=3))
    with pytest.raises(TrainingError, match="no checkpoint"):
        t.train()


def test_rollbacks_without_progress_are_bounded(tmp_path, monkeypatch):
    monkeypatch.setenv(INJECT_ENV, "8:1000")  # from step 5 on, every micro-step is bad
    t = Pretrainer(
        tiny_config(tmp_path, max_steps=10, save_every=2, nan_guard_max_consecutive=2, max_rollbacks=2)
    )
    with pytest.raises(TrainingError, match="max_rollbacks = 2"):
        t.train()
    assert t.rollbacks == 2
    assert CheckpointManager(tmp_path).latest_step() == 4


def test_persistent_non_finite_gradient_norm_rolls_back_then_stops(tmp_path):
    """Finite losses, overflowing backward (every gradient of one parameter is inf): each micro-step's
    finite loss resets the per-micro-step NaN streak, so the steps are counted on their own; the run
    rolls back after nan_guard_max_consecutive such steps and stops at max_rollbacks instead of looping."""
    t = Pretrainer(
        tiny_config(tmp_path, max_steps=20, save_every=2, nan_guard_max_consecutive=3, max_rollbacks=1)
    )
    poisoned = []

    def overflow(g):
        if t.step < 2:
            return g
        poisoned.append(1)
        assert len(poisoned) < 100, "the guard never fired: the run loops on the same step"
        return g * float("inf")

    t.params[0].register_hook(overflow)
    with pytest.raises(TrainingError, match="max_rollbacks = 1"):
        t.train()
    assert t.rollbacks == 1 and t.step == 2
    rows = metrics(tmp_path)
    (rb,) = [r for r in rows if r.get("event") == "rollback"]
    assert "3 consecutive non-finite gradient norms at step 3: rolled back to step 2" in rb["message"]
    assert [r["step"] for r in rows if r["kind"] == "train"] == [1, 2]


def test_resume_latest_refuses_when_no_checkpoint_verifies_and_touches_nothing(tmp_path):
    """Starting afresh would overwrite them and retention would delete them: the seed's "failed load ->
    restart from scratch" is an error here."""
    Pretrainer(tiny_config(tmp_path, max_steps=4, save_every=2, keep_last_n=2)).train()
    for p in tmp_path.glob("optim_step_*.pt"):
        p.write_bytes(p.read_bytes()[:-1] + bytes([p.read_bytes()[-1] ^ 0xFF]))

    def files():  # all but the run lock, whose holder line each Pretrainer rewrites
        return {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file() and p.name != ".lock"}

    before = files()
    with (
        pytest.warns(UserWarning),
        pytest.raises(CheckpointError, match=r"none of the checkpoints.*verifies"),
    ):
        Pretrainer(tiny_config(tmp_path, max_steps=6, save_every=2, keep_last_n=2)).train()
    assert files() == before


def test_fresh_start_supersedes_the_rows_of_an_attempt_that_saved_nothing(tmp_path):
    Pretrainer(tiny_config(tmp_path, max_steps=3)).train()
    for step in CheckpointManager(tmp_path).list_steps():  # as if killed before its first save
        CheckpointManager(tmp_path).delete(step)
    Pretrainer(tiny_config(tmp_path, max_steps=2)).train()
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows if r["kind"] == "train" and not r.get("superseded")] == [1, 2]
    (restart,) = [r for r in rows if r.get("event") == "restart"]
    assert restart["step"] == 0 and "metrics rows of an earlier attempt superseded" in restart["message"]


def test_resume_with_changed_adamw_settings_uses_the_configs_and_says_so(tmp_path):
    Pretrainer(tiny_config(tmp_path, max_steps=2, weight_decay=0.1, betas=(0.9, 0.95))).train()
    t = Pretrainer(tiny_config(tmp_path, max_steps=4, weight_decay=0.5, betas=(0.8, 0.99), eps=1e-6))
    t.train()
    decayed, other = t.optimizer.param_groups
    assert (decayed["weight_decay"], other["weight_decay"]) == (0.5, 0.0)
    assert all(tuple(g["betas"]) == (0.8, 0.99) and g["eps"] == 1e-6 for g in (decayed, other))
    (event,) = [r for r in metrics(tmp_path) if r.get("event") == "config"]
    assert "weight_decay 0.1 -> 0.5" in event["message"] and "eps 1e-08 -> 1e-06" in event["message"]
    assert int(t.optimizer.state[t.params[0]]["step"]) == 4  # the moments themselves were restored


def test_resume_with_another_max_seq_len_warns_that_the_data_order_is_not_continued(tmp_path):
    data = make_dataset(tmp_path / "data")
    cfg = tiny_config(tmp_path / "run", max_steps=2).replace("data", dummy=False, train_data_path=data)
    Pretrainer(cfg).train()
    Pretrainer(cfg.replace("training", max_steps=3, max_seq_len=8)).train()
    (warning,) = [r for r in metrics(tmp_path / "run") if r.get("event") == "warning"]
    assert "max_seq_len changed from 16 (checkpoint step 2) to 8" in warning["message"]


def test_a_first_save_killed_before_its_meta_is_not_a_checkpoint_and_the_run_starts_afresh(tmp_path):
    Pretrainer(tiny_config(tmp_path, max_steps=2, save_every=2)).train()
    checkpoint_files(tmp_path, 2)["meta"].unlink()  # the meta is written last: the save did not finish
    with pytest.warns(UserWarning, match="meta_step_2.json is missing"):
        result = Pretrainer(tiny_config(tmp_path, max_steps=3, save_every=2)).train()
    assert result.step == 3 and CheckpointManager(tmp_path).list_steps() == [2, 3]


def test_explicit_resume_loads_exactly_that_step(tmp_path):
    run = tmp_path / "run"
    a = Pretrainer(tiny_config(run, max_steps=6, save_every=2))
    ra = a.train()
    b = Pretrainer(tiny_config(run, max_steps=6, save_every=2), resume=2)
    rb = b.train(until_step=4)
    assert rb.history[0][0] == 3  # resumed at 2, not at the latest (6)
    assert rb.history == ra.history[2:4]  # the same data order and state as the first timeline
    assert len(list((run / "superseded").glob("*-from-step-2/model_step_6.safetensors"))) == 1
    assert CheckpointManager(run).list_steps() == [2, 4]
    rows = metrics(run)
    assert any(r.get("superseded") and r["step"] == 6 for r in rows)
    with pytest.raises(CheckpointError, match="step 5"):
        Pretrainer(tiny_config(run, max_steps=6), resume=5).train()


def test_fresh_run_refuses_a_directory_with_checkpoints(tmp_path):
    Pretrainer(tiny_config(tmp_path, max_steps=1)).train()
    with pytest.raises(CheckpointError, match="already holds checkpoints"):
        Pretrainer(tiny_config(tmp_path, max_steps=2), resume="none").train()


def test_second_trainer_on_the_same_directory_is_refused(tmp_path):
    first = Pretrainer(tiny_config(tmp_path, max_steps=4))
    reached, release = threading.Event(), threading.Event()
    original = first.train_step

    def gated() -> bool:
        if first.step == 2:
            reached.set()
            release.wait(timeout=60)
        return original()

    first.train_step = gated
    out = {}
    thread = threading.Thread(target=lambda: out.setdefault("r", first.train()))
    thread.start()
    assert reached.wait(timeout=60)
    try:
        with pytest.raises(CheckpointError, match="in use by another trainer"):
            Pretrainer(tiny_config(tmp_path, max_steps=4)).train()
    finally:
        release.set()
        thread.join(timeout=120)
    assert out["r"].step == 4 and CheckpointManager(tmp_path).latest_step() == 4


def test_evaluation_on_manifest_val_split_with_bits_per_byte(tmp_path):
    data = make_dataset(tmp_path / "data")
    cfg = tiny_config(tmp_path / "run", max_steps=4, eval_every=2).replace(
        "data", dummy=False, train_data_path=data
    )
    t = Pretrainer(cfg)
    result = t.train()
    evals = [r for r in metrics(tmp_path / "run") if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [2, 4]
    ev = evals[-1]
    assert ev["val_bpb"] == pytest.approx(ev["val_loss"] / np.log(2) / 3.0)
    assert ev["val_ppl"] == pytest.approx(np.exp(ev["val_loss"]))
    assert result.last_eval["val_loss"] == ev["val_loss"]
    meta = json.loads(checkpoint_files(tmp_path / "run", 4)["meta"].read_text())
    assert meta["data"]["vocab_hash"] == "ab" * 32 and meta["data"]["tokenizer"] == "test"
    assert meta["data"]["vocab_size"] == VOCAB and meta["sampler"] and meta["rng"]["torch"]
    run_info = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run_info["data_manifest_sha256"] and run_info["code_version"]["package"]
    assert (tmp_path / "run" / "config.yaml").read_text().count("train_data_path") == 1


def test_epoch_boundaries_and_skipped_windows_are_logged(tmp_path):
    """The windows that do not fill a global batch are skipped each epoch: said at the start and at
    every new epoch (the seed's DataLoader(drop_last=True) dropped them without a word)."""
    data = make_dataset(tmp_path / "data", n_train=420)  # 419 // 16 = 26 windows: 6 steps of 4, 2 skipped
    cfg = tiny_config(tmp_path / "run", max_steps=8).replace("data", dummy=False, train_data_path=data)
    Pretrainer(cfg).train()
    events = [r for r in metrics(tmp_path / "run") if r["kind"] == "event"]
    start = next(r for r in events if r["event"] == "start")
    assert "epoch 0 of 6 steps over 26 windows, 2 skipped per epoch" in start["message"]
    (epoch,) = [r for r in events if r["event"] == "epoch"]
    assert epoch["step"] == 6 and epoch["message"].startswith("epoch 1 of 6 steps")
    assert epoch["message"].endswith("begins at step 7")


def test_val_data_path_equal_to_the_training_data_without_a_val_split_is_refused(tmp_path):
    tokens = np.arange(2000) % (VOCAB - 1) + 1
    data = str(tmp_path / "data")
    write_dataset(
        data,
        [("train", tokens, 1, 2000)],
        vocab_size=VOCAB,
        eos_id=0,
        tokenizer={"name": "t", "vocab_hash": "ab" * 32},
    )
    cfg = tiny_config(tmp_path / "run", eval_every=2).replace(
        "data", dummy=False, train_data_path=data, val_data_path=str(tmp_path / "data" / ".")
    )
    with pytest.raises(ConfigError, match=r"val_data_path .* is the training data.*held-out"):
        Pretrainer(cfg)
    assert not (tmp_path / "run").exists()


def test_non_finite_validation_loss_is_an_event_and_the_run_goes_on(tmp_path):
    """A diverging model's inf validation loss: the metrics file is strict JSON, so it was a ValueError
    (a traceback) before the step's checkpoint; now an event, and the checkpoints are written."""
    t = Pretrainer(tiny_config(tmp_path, max_steps=8, eval_every=4, save_every=4))
    forward = t.raw_model.forward
    t.raw_model.forward = lambda x, y=None: forward(x, y) * (1.0 if t.raw_model.training else float("inf"))
    assert t.train().step == 8
    assert CheckpointManager(tmp_path).list_steps() == [4, 8]
    rows = metrics(tmp_path)
    assert not [r for r in rows if r["kind"] == "eval"]
    assert [r["step"] for r in rows if r.get("event") == "eval_nonfinite"] == [4, 8]


def test_data_that_eval_would_refuse_is_refused_before_training(tmp_path):
    data = make_dataset(tmp_path / "data")  # EOS id 0, tokenizer "test" (vocab hash ab..)
    cfg = tiny_config(tmp_path / "run").replace("data", dummy=False, train_data_path=data)
    with pytest.raises(DataError, match=r"training data .* uses EOS id 0, the model 5: set model.eos_id=0"):
        Pretrainer(cfg.replace("model", eos_id=5))
    other = tmp_path / "other"
    write_dataset(other, [("val", np.arange(600) % VOCAB, 6, 1800)], vocab_size=VOCAB, eos_id=0,
                  tokenizer={"name": "another", "vocab_hash": "cd" * 32})  # fmt: skip
    with pytest.raises(
        DataError, match=r"validation data .* tokenized with another .* training data with test"
    ):
        Pretrainer(cfg.replace("data", val_data_path=str(other)))
    assert not (tmp_path / "run").exists()


def test_a_dataset_directory_as_checkpoint_dir_is_refused(tmp_path):
    data = make_dataset(tmp_path / "data")
    before = sorted(p.name for p in (tmp_path / "data").rglob("*"))
    cfg = tiny_config(tmp_path / "data").replace("data", dummy=False, train_data_path=data)
    with pytest.raises(ConfigError, match=r"is a dataset directory .* --checkpoint-dir at a run directory"):
        Pretrainer(cfg)
    assert sorted(p.name for p in (tmp_path / "data").rglob("*")) == before


def test_resuming_at_or_past_max_steps_says_there_is_nothing_to_train(tmp_path):
    Pretrainer(tiny_config(tmp_path, max_steps=4)).train()
    assert Pretrainer(tiny_config(tmp_path, max_steps=3)).train().step == 4
    (warning,) = [r for r in metrics(tmp_path) if r.get("event") == "warning"]
    assert "at step 4, not before training.max_steps 3: nothing to train" in warning["message"]


def test_logged_tokens_per_second_counts_accumulation(tmp_path):
    t = Pretrainer(tiny_config(tmp_path, max_steps=4, log_every=2))
    t.train()
    rows = [r for r in metrics(tmp_path) if r["kind"] == "train"]
    assert [r["tokens"] for r in rows] == [2 * 64, 4 * 64]  # micro 2 x accum 2 x seq 16 per step
    for r in rows:
        assert r["tokens_per_s"] == pytest.approx(2 * 64 / r["window_seconds"])
    assert rows[0]["warmup_window"] is True and "warmup_window" not in rows[1]


def test_request_stop_saves_after_the_current_step(tmp_path):
    t = Pretrainer(tiny_config(tmp_path, max_steps=50))
    original = t.train_step

    def step_then_ask() -> bool:
        ok = original()
        if t.step == 2:
            t.request_stop()  # what the SIGTERM/SIGINT handler does
        return ok

    t.train_step = step_then_ask
    result = t.train()
    assert result.stopped and result.step == 2
    assert CheckpointManager(tmp_path).latest_step() == 2
    assert [r["event"] for r in metrics(tmp_path) if r["kind"] == "event"][-1] == "stop"


def test_damaged_batch_mid_run_saves_the_good_steps_and_resumes_exactly_after_repair(tmp_path):
    # A shard byte changed after prepare (an id >= vocab_size) is found when its batch is fetched, at
    # step 4 here. The run stops with the DataError naming the shard, but steps 1-3 are saved (the run's
    # save_every is 1000), and once the byte is repaired the same command resumes and ends bit-identical
    # to a run that never saw the damage.
    data = make_dataset(tmp_path / "data")

    def cfg(run):
        return tiny_config(tmp_path / run).replace("data", dummy=False, train_data_path=data)

    clean = Pretrainer(cfg("clean"))
    drawn = []
    next_indices = clean.input.next_indices
    clean.input.next_indices = lambda: drawn.append(next_indices()) or drawn[-1]
    clean.train()
    shard = next((tmp_path / "data" / "train").glob("*.bin"))
    tokens = np.fromfile(shard, dtype="<u2")  # dtype_for_vocab(64)
    pos = drawn[3][1] * 16 + 5  # inside the second window of step 4 only (windows overlap by one token)
    original = tokens[pos]
    tokens[pos] = VOCAB + 3
    tokens.tofile(shard)

    damaged = Pretrainer(cfg("run"))
    with pytest.raises(DataError, match=rf"{shard.name}: token id {VOCAB + 3} .* outside the vocabulary"):
        damaged.train()
    assert CheckpointManager(tmp_path / "run").latest_step() == 3
    saved = [r for r in metrics(tmp_path / "run") if r["kind"] == "event" and r["event"] == "save"]
    assert len(saved) == 1 and "before stopping on a damaged batch" in saved[0]["message"]

    tokens[pos] = original
    tokens.tofile(shard)
    resumed = Pretrainer(cfg("run"))
    assert resumed.train().step == 6
    w_clean, w_resumed = weights(clean), weights(resumed)
    assert all(torch.equal(w_clean[k], w_resumed[k]) for k in w_clean)
    assert resumed.sampler.state_dict() == clean.sampler.state_dict()
    assert resumed.tokens_seen == clean.tokens_seen


def test_a_checkpoint_at_an_evaluation_step_carries_that_evaluation(tmp_path):
    # Regression: the loop saved before it evaluated, so checkpoint N's meta (what `inspect` and a
    # resumed run report as the last evaluation) held the evaluation of an earlier step.
    data = make_dataset(tmp_path / "data")
    cfg = tiny_config(tmp_path / "run", max_steps=4, eval_every=2, save_every=2)
    Pretrainer(cfg.replace("data", dummy=False, train_data_path=data)).train()
    evals = {r["step"]: r["val_loss"] for r in metrics(tmp_path / "run") if r["kind"] == "eval"}
    for step in (2, 4):
        meta = json.loads(checkpoint_files(tmp_path / "run", step)["meta"].read_text())
        assert meta["last_eval"]["step"] == step and meta["last_eval"]["val_loss"] == evals[step]


def test_damaged_validation_shard_stops_at_the_evaluation_with_the_step_saved(tmp_path):
    data = make_dataset(tmp_path / "data")
    shard = next((tmp_path / "data" / "val").glob("*.bin"))
    good = np.fromfile(shard, dtype="<u2")
    (good + VOCAB).astype("<u2").tofile(shard)  # every id out of range, same size
    cfg = tiny_config(tmp_path / "run", max_steps=4, eval_every=2).replace(
        "data", dummy=False, train_data_path=data
    )
    with pytest.raises(DataError, match=rf"{shard.name}: token id \d+ .* outside the vocabulary"):
        Pretrainer(cfg).train()
    assert CheckpointManager(tmp_path / "run").latest_step() == 2  # the steps before the evaluation
    good.tofile(shard)
    resumed = Pretrainer(cfg)
    assert resumed.train().step == 4 and resumed.last_eval["step"] == 4


def test_resume_on_changed_data_warns_that_it_is_no_longer_exact(tmp_path):
    data = tmp_path / "data"
    cfg = tiny_config(tmp_path / "run", max_steps=2).replace("data", dummy=False, train_data_path=str(data))
    make_dataset(data, seed=0)
    Pretrainer(cfg).train()
    make_dataset(data, seed=1)  # re-prepared: same tokenizer and size, other tokens
    Pretrainer(cfg.replace("training", max_steps=4)).train()
    warnings = [r for r in metrics(tmp_path / "run") if r.get("event") == "warning"]
    assert len(warnings) == 1 and warnings[0]["step"] == 2
    assert "changed since checkpoint step 2" in warnings[0]["message"]
    Pretrainer(cfg.replace("training", max_steps=6)).train()  # unchanged since step 4: no new warning
    assert sum(r.get("event") == "warning" for r in metrics(tmp_path / "run")) == 1


def test_val_data_path_may_name_the_manifest_file(tmp_path):
    # `eval` takes DIR/manifest.json for DIR; the trainer took it for a file without splits and
    # validated on the training split (and its check against validating on training data missed it).
    data = make_dataset(tmp_path / "data")
    cfg = tiny_config(tmp_path / "run", max_steps=2, eval_every=2, eval_batches=1000).replace(
        "data", dummy=False, train_data_path=data, val_data_path=f"{data}/manifest.json"
    )
    Pretrainer(cfg).train()
    (ev,) = [r for r in metrics(tmp_path / "run") if r["kind"] == "eval"]
    assert ev["val_windows"] == (600 - 1) // 16  # the val split's windows, not the train split's 249


def test_settings_that_silently_change_the_run_are_warned_about_at_the_start(tmp_path):
    def warnings_of(run):
        return [r["message"] for r in metrics(run) if r.get("event") == "warning"]

    short_val = make_dataset(tmp_path / "short", n_val=10)  # 10 tokens: no window of 16 + 1
    cfg = tiny_config(tmp_path / "a", max_steps=2, eval_every=1).replace(
        "data", dummy=False, train_data_path=short_val
    )
    Pretrainer(cfg).train()
    assert [r for r in metrics(tmp_path / "a") if r["kind"] == "eval"] == []
    (w,) = warnings_of(tmp_path / "a")
    assert "no validation data" in w and "val split" in w and "(10 tokens) is too short" in w
    no_val = str(tmp_path / "noval")
    train_only = [("train", np.arange(2000) % (VOCAB - 1) + 1, 1, 2000)]
    write_dataset(
        no_val, train_only, vocab_size=VOCAB, eos_id=0, tokenizer={"name": "t", "vocab_hash": "ab" * 32}
    )
    cfg = tiny_config(tmp_path / "b", max_steps=2, eval_every=1).replace(
        "data", dummy=False, train_data_path=no_val
    )
    Pretrainer(cfg).train()
    (w,) = warnings_of(tmp_path / "b")
    assert f"{no_val} has no val split; prepare with --val-fraction, or set data.val_data_path" in w
    Pretrainer(tiny_config(tmp_path / "c", max_steps=3, warmup_steps=5)).train()
    (w,) = warnings_of(tmp_path / "c")
    assert "training.warmup_steps 5 > training.max_steps 3: the learning rate only warms up" in w
    lrs = [r["lr"] for r in metrics(tmp_path / "c") if r["kind"] == "train"]
    assert max(lrs) == pytest.approx(1e-2 * 3 / 5) and f"to {max(lrs):.3g} instead of" in w


def test_running_a_finished_run_again_logs_no_second_evaluation(tmp_path):
    Pretrainer(
        tiny_config(tmp_path, max_steps=4, eval_every=3)
    ).train()  # 4 is off the cadence: evaluated at the end
    assert [r["step"] for r in metrics(tmp_path) if r["kind"] == "eval"] == [3, 4]
    Pretrainer(tiny_config(tmp_path, max_steps=4, eval_every=3)).train()
    assert [r["step"] for r in metrics(tmp_path) if r["kind"] == "eval"] == [3, 4]


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_rollback_skips_the_data_that_led_to_the_divergence(tmp_path, prefetch):
    """Non-finite losses caused by the data itself (here: the windows of step 6) recurred identically
    after a rollback that replayed the same batches, until max_rollbacks stopped the run. The rollback
    now continues with the batches after the failure (also with the next steps already prefetched)."""
    t = Pretrainer(
        tiny_config(tmp_path, max_steps=12, save_every=2, nan_guard_max_consecutive=2, max_rollbacks=1,
                    prefetch_batches=prefetch)
    )  # fmt: skip
    order = [t.sampler.global_batch(0, i) for i in range(12)]
    poison = set(order[5])
    poison_rows = t.train_data.get_batch(sorted(poison))[0]
    forward, drawn = t.raw_model.forward, []
    batch = t.input.batch

    def tracked_batch(indices):
        drawn.append(list(indices))
        return batch(indices)

    def poisoned(x):  # the batch holds a window of step 6 (by content: the batch is produced ahead)
        return bool((x[:, None, :] == poison_rows[None]).all(-1).any())

    t.input.batch = tracked_batch
    t.raw_model.forward = lambda x, y=None: (
        forward(x, y) * (float("nan") if t.raw_model.training and poisoned(x) else 1.0)
    )
    result = t.train()
    assert result.step == 12 and result.rollbacks == 1
    (rb,) = [r for r in metrics(tmp_path) if r.get("event") == "rollback"]
    assert "rolled back to step 4 and skipping the data of steps 5-6" in rb["message"], rb["message"]
    live = [r["step"] for r in metrics(tmp_path) if r["kind"] == "train" and not r.get("superseded")]
    assert live == list(range(1, 13))
    assert sum(bool(poison & set(d)) for d in drawn) == 2  # step 6's two micro-batches, never again


def test_resume_deletes_an_unfinished_save_instead_of_keeping_it_aside(tmp_path):
    # model and optimizer files of step 6 without a meta: a save cut short (kill -9, full disk). Moving
    # them to superseded/ kept ~2x the model's size for good after every such preemption.
    Pretrainer(tiny_config(tmp_path, max_steps=4, save_every=2)).train()
    for kind in ("model", "optim"):
        src, dst = checkpoint_files(tmp_path, 4)[kind], checkpoint_files(tmp_path, 6)[kind]
        dst.write_bytes(src.read_bytes())
    with pytest.warns(UserWarning, match="meta_step_6.json is missing"):
        Pretrainer(tiny_config(tmp_path, max_steps=8, save_every=2)).train()
    assert not (tmp_path / "superseded").exists()
    assert CheckpointManager(tmp_path).verified_steps() == [2, 4, 6, 8]
    (resume,) = [r for r in metrics(tmp_path) if r.get("event") == "resume"]
    assert "unfinished save(s) of step(s) [6] (no meta) deleted" in resume["message"]


def test_a_rollback_hashes_the_checkpoint_again(tmp_path, monkeypatch):
    # A bit flipped in step 4's weights after they were saved keeps size and mtime: the manager that
    # wrote them must not vouch for them from its cache; the rollback goes to step 2 instead.
    import os

    monkeypatch.setenv(INJECT_ENV, "10:2")  # step 6's micro-steps
    t = Pretrainer(tiny_config(tmp_path, max_steps=8, save_every=2, nan_guard_max_consecutive=2))
    save = t.save_checkpoint

    def save_then_rot():
        save()
        if t.step == 4:
            path = checkpoint_files(tmp_path, 4)["model"]
            st = os.stat(path)
            data = bytearray(path.read_bytes())
            data[-1] ^= 1
            path.write_bytes(bytes(data))
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))

    t.save_checkpoint = save_then_rot
    with pytest.warns(UserWarning, match="model_step_4.safetensors: sha256 differs"):
        assert t.train().step == 8
    (rb,) = [r for r in metrics(tmp_path) if r.get("event") == "rollback"]
    assert "rolled back to step 2" in rb["message"]


def test_a_resume_supersedes_whole_rows_of_abandoned_steps_only(tmp_path):
    # log_every 3, save_every 4: a window 7-9 straddled checkpoint 8, so resuming at 8 marked the row
    # of steps 7-9 superseded and steps 7-8, which are kept, had no row. A save now closes the window.
    Pretrainer(tiny_config(tmp_path, max_steps=10, log_every=3, save_every=4)).train()
    Pretrainer(tiny_config(tmp_path, max_steps=12, log_every=3, save_every=4), resume=8).train()
    rows = [r for r in metrics(tmp_path) if r["kind"] == "train"]
    kept = [r for r in rows if not r.get("superseded")]
    assert all(r["step"] > 8 for r in rows if r.get("superseded"))
    assert sum(r["window_steps"] for r in kept) == 12  # every kept step in exactly one kept row
    assert [r["step"] for r in kept if r["step"] <= 8] == [3, 4, 6, 8]


def test_the_steps_saved_before_a_damaged_batch_keep_their_rows(tmp_path):
    data = make_dataset(tmp_path / "data")
    cfg = tiny_config(tmp_path / "run", max_steps=6, log_every=10).replace(
        "data", dummy=False, train_data_path=data
    )
    t = Pretrainer(cfg)
    next_indices, drawn = t.input.next_indices, []

    def damaged_at_step_4():  # counts draws, not t.step: the prefetcher draws steps ahead of training
        drawn.append(None)
        if len(drawn) == 4:
            raise DataError("shard_00000.bin: token id 67 at position 5 is outside the vocabulary")
        return next_indices()

    t.input.next_indices = damaged_at_step_4
    with pytest.raises(DataError):
        t.train()
    assert CheckpointManager(tmp_path / "run").latest_step() == 3
    (row,) = [r for r in metrics(tmp_path / "run") if r["kind"] == "train"]
    assert row["step"] == 3 and row["window_steps"] == 3


def test_a_stop_requested_by_a_timer_is_not_called_a_signal(tmp_path):
    t = Pretrainer(tiny_config(tmp_path, max_steps=6))
    t.request_stop("the time budget")
    assert t.train().stopped
    (stop,) = [r for r in metrics(tmp_path) if r.get("event") == "stop"]
    assert stop["message"].startswith("stopped by the time budget at step 1")


def test_resume_to_a_step_never_saved_is_refused_before_the_runs_records_are_touched(tmp_path):
    Pretrainer(tiny_config(tmp_path, max_steps=4, save_every=2)).train()
    before = (tmp_path / "metrics.jsonl").read_text()
    with pytest.raises(CheckpointError, match=r"no checkpoint of step 3 in .*Loadable steps: \[2, 4\]"):
        Pretrainer(tiny_config(tmp_path, max_steps=6, save_every=2), resume=3).train()
    assert (tmp_path / "metrics.jsonl").read_text() == before  # no "error" event in a healthy run


def test_a_run_json_that_is_not_an_object_is_refused_not_replaced(tmp_path):
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "run.json").write_text("[]")
    with pytest.raises(CheckpointError, match=r"run.json is not a valid run record .*got \[\]"):
        Pretrainer(tiny_config(tmp_path, max_steps=1)).train()
    assert (tmp_path / "run.json").read_text() == "[]"
    assert not list(tmp_path.glob("*_step_*")) and not (tmp_path / "config.yaml").exists()


@pytest.mark.parametrize("fails_at", ["init", "log"])
def test_a_wandb_failure_leaves_training_going_with_one_warning(tmp_path, monkeypatch, fails_at):
    """The whole trainer, with a `wandb` that fails when the run starts or at its second logged step
    (auth, network): one warning, every step trained and in metrics.jsonl, the checkpoint saved."""
    import sys
    import types
    import warnings

    logged: list[int] = []

    def init(**kw):
        if fails_at == "init":
            raise ConnectionError("wandb.init: no network")
        return types.SimpleNamespace(id="run123")

    def log(data, step):
        if fails_at == "log" and step == 2:
            raise ConnectionError("wandb.log: connection reset")
        logged.append(step)

    fake = types.ModuleType("wandb")
    fake.init, fake.log, fake.finish = init, log, lambda: logged.append(-1)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setenv("WANDB_PROJECT", "mamba3lite-test")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = Pretrainer(tiny_config(tmp_path, max_steps=4)).train()
    about_wandb = [str(w.message) for w in caught if "W&B" in str(w.message)]
    assert result.step == 4 and CheckpointManager(tmp_path).latest_step() == 4
    assert len(about_wandb) == 1, about_wandb
    assert about_wandb[0].startswith("W&B disabled" if fails_at == "init" else "W&B logging failed")
    train_steps = [
        r["step"] for r in map(json.loads, (tmp_path / "metrics.jsonl").open()) if r["kind"] == "train"
    ]
    assert train_steps == [1, 2, 3, 4]
    assert logged == ([] if fails_at == "init" else [1])  # nothing more is sent once it failed
