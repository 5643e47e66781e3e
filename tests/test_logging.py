"""TrainingLogger: window averages, tokens/s over the window, start-up window, sinks, W&B tolerance."""

from __future__ import annotations

import json
import math
import sys
import types

import pytest

from mamba3lite.train.metrics import (
    ConsoleSink,
    JsonlSink,
    TrainingLogger,
    WandbSink,
    build_logger,
    format_console,
)


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class ListSink:
    def __init__(self) -> None:
        self.rows: list[dict] = []

    def write(self, row: dict) -> None:
        self.rows.append(row)

    def close(self) -> None:
        pass


def quiet_logger(run_dir, **overrides):
    """build_logger with no FLOPs, no device, no progress bar, logging every step of a 3-step run
    (`overrides` change any of those)."""
    kw = dict(log_every=1, flops_per_token=None, peak_flops_per_s=None, device=None, max_steps=3)
    kw.update(start_step=0, progress=False)
    return build_logger(run_dir, **{**kw, **overrides})


def test_window_mean_ppl_and_tokens_per_second():
    clock, sink = FakeClock(), ListSink()
    log = TrainingLogger(log_every=4, sinks=[sink], clock=clock, flops_per_token=6.0, peak_flops_per_s=1200.0)
    losses = [4.0, 3.0, 2.0, 1.0, 8.0, 6.0, 7.0, 5.0]
    out = []
    for i, loss in enumerate(losses, start=1):
        clock.t += 0.5 if i <= 4 else 2.0  # the first window is the fast one: no hard-coded tps
        out.append(
            log.log_step(
                i,
                loss=loss,
                lr=1e-3 * i,
                grad_norm=float(i),
                tokens_processed=100,
                tokens_total=100 * i,
                skipped=1 if i == 6 else 0,
            )
        )
    assert out[:3] == [None] * 3 and out[4:7] == [None] * 3
    first, second = sink.rows
    assert first["step"] == 4 and first["loss"] == pytest.approx(2.5)  # true mean of 4 losses
    assert first["ppl"] == pytest.approx(math.exp(2.5))  # exp of the mean, not mean of exps
    assert first["tokens_per_s"] == pytest.approx(400 / 2.0) and first["warmup_window"] is True
    assert second["loss"] == pytest.approx(6.5) and second["tokens_per_s"] == pytest.approx(400 / 8.0)
    assert "warmup_window" not in second and second["skipped"] == 1 and first["skipped"] == 0
    assert second["lr"] == pytest.approx(8e-3) and second["grad_norm"] == pytest.approx(6.5)
    assert second["grad_norm_max"] == 8.0 and second["tokens"] == 800
    assert second["mfu"] == pytest.approx(6.0 * 50.0 / 1200.0)
    # steady state excludes the start-up window
    assert log.steady_tokens_per_s() == pytest.approx(50.0)


def test_fully_skipped_steps_do_not_enter_the_loss_mean_but_count_tokens():
    clock, sink = FakeClock(), ListSink()
    log = TrainingLogger(log_every=3, sinks=[sink], clock=clock)
    for i, loss in enumerate([2.0, None, 4.0], start=1):
        clock.t += 1.0
        log.log_step(
            i,
            loss=loss,
            lr=1.0,
            grad_norm=None if loss is None else 1.0,
            tokens_processed=10,
            tokens_total=10 * i,
            skipped=2 if loss is None else 0,
        )
    (row,) = sink.rows
    assert (
        row["loss"] == pytest.approx(3.0)
        and row["skipped"] == 2
        and row["tokens_per_s"] == pytest.approx(10.0)
    )


def test_flush_emits_partial_window_and_restart_marks_startup():
    clock, sink = FakeClock(), ListSink()
    log = TrainingLogger(log_every=50, sinks=[sink], clock=clock)
    clock.t += 1
    log.log_step(1, loss=1.0, lr=0.1, grad_norm=0.5, tokens_processed=7, tokens_total=7)
    assert log.flush()["window_steps"] == 1 and log.flush() is None
    clock.t += 1
    log.log_step(2, loss=1.0, lr=0.1, grad_norm=0.5, tokens_processed=7, tokens_total=14)
    log.flush()
    assert "warmup_window" not in sink.rows[-1]
    log.restart_window()  # e.g. after a resume or a rollback
    clock.t += 1
    log.log_step(3, loss=1.0, lr=0.1, grad_norm=0.5, tokens_processed=7, tokens_total=21)
    assert log.flush()["warmup_window"] is True


def test_jsonl_rows_and_supersede(tmp_path):
    path = tmp_path / "metrics.jsonl"
    jsonl = JsonlSink(path)
    log = TrainingLogger(log_every=1, jsonl=jsonl)
    for i in range(1, 5):
        log.log_step(i, loss=1.0 / i, lr=0.1, grad_norm=1.0, tokens_processed=4, tokens_total=4 * i)
    log.log_eval(4, 16, {"val_loss": 0.5, "val_ppl": math.exp(0.5)})
    log.event(4, "stop", "signal")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["kind"] for r in rows] == ["train"] * 4 + ["eval", "event"]
    assert all({"step", "time", "kind"} <= r.keys() for r in rows)
    assert all("tokens" in r for r in rows[:5])
    assert log.supersede_after(2) == 4  # steps 3, 4 train + eval + event at 4
    log.event(2, "rollback", "to step 2")  # appending still works after the rewrite
    log.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r.get("superseded", False) for r in rows] == [False, False, True, True, True, True, False]


def test_console_line_has_seed_fields_and_new_ones(capsys):
    row = {
        "kind": "train",
        "step": 50,
        "loss": 3.25,
        "ppl": 25.79,
        "lr": 3e-4,
        "tokens_per_s": 12345.6,
        "grad_norm": 0.75,
        "skipped": 2,
        "peak_mem_mb": 100.0,
        "tokens": 1000,
        "time": 0,
    }
    line = format_console(row)
    for part in (
        "step=     50",
        "loss=3.2500",
        "ppl=25.79",
        "lr=3.00e-04",
        "tps=12,346",
        "gnorm=0.750",
        "skipped=2",
    ):
        assert part in line
    ConsoleSink().write({"kind": "event", "step": 3, "event": "nan_skip", "message": "x"})
    assert "[nan_skip] step=3: x" in capsys.readouterr().out


def _fake_wandb(monkeypatch, init):
    calls: list = []
    mod = types.ModuleType("wandb")
    mod.init = init
    mod.log = lambda data, step: calls.append((step, data))
    mod.finish = lambda: calls.append("finish")
    monkeypatch.setitem(sys.modules, "wandb", mod)
    return calls


@pytest.mark.parametrize("error", [ImportError, PermissionError, ConnectionError, RuntimeError])
def test_wandb_failure_is_a_warning_not_a_crash(monkeypatch, tmp_path, error):
    def init(**kw):
        raise error("no auth / no network")

    _fake_wandb(monkeypatch, init)
    monkeypatch.setenv("WANDB_PROJECT", "p")
    with pytest.warns(UserWarning, match="W&B disabled"):
        log = quiet_logger(tmp_path)
    row = log.log_step(1, loss=1.0, lr=0.1, grad_norm=1.0, tokens_processed=1, tokens_total=1)
    assert row is not None and log.wandb_run_id is None
    log.close()
    assert (tmp_path / "metrics.jsonl").exists()


def test_wandb_resumes_the_same_run_and_survives_log_errors(monkeypatch):
    seen = {}

    def init(**kw):
        seen.update(kw)
        return types.SimpleNamespace(id=kw.get("id") or "new123")

    calls = _fake_wandb(monkeypatch, init)
    sink = WandbSink("proj", run_id="abc")
    assert seen["id"] == "abc" and seen["resume"] == "allow" and sink.run_id == "abc"
    sink.write({"kind": "train", "step": 5, "time": 0.0, "loss": 1.5, "warmup_window": True})
    assert calls == [(5, {"train/loss": 1.5})]
    sys.modules["wandb"].log = lambda *a, **k: (_ for _ in ()).throw(ConnectionError("offline"))
    with pytest.warns(UserWarning, match="W&B logging failed"):
        sink.write({"kind": "train", "step": 6, "time": 0.0, "loss": 1.0})
    sink.write({"kind": "train", "step": 7, "time": 0.0, "loss": 1.0})  # disabled now: no error
    assert WandbSink("proj").run_id == "new123"


def test_jsonl_drops_a_torn_last_line_instead_of_gluing_the_next_row_to_it(tmp_path):
    # A kill -9 mid-write leaves a last line without its newline; a fresh run appending to the same
    # file must not merge its first row into it (both rows would be unreadable).
    path = tmp_path / "metrics.jsonl"
    good = json.dumps({"kind": "train", "step": 1, "loss": 2.0})
    path.write_text(good + "\n" + '{"kind": "train", "st')
    sink = JsonlSink(path)
    sink.write({"kind": "event", "step": 0, "event": "start"})
    sink.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows == [json.loads(good), {"kind": "event", "step": 0, "event": "start"}]


def test_damaged_bytes_in_metrics_jsonl_are_bad_lines_not_a_crash(tmp_path):
    """Invalid UTF-8 (or a row without an integer step) is counted like a torn line by the readers
    (`plot`, `inspect`), and a resume's supersede pass drops it instead of raising."""
    from mamba3lite.train.metrics.jsonl import read_metrics

    path = tmp_path / "metrics.jsonl"
    good = [{"kind": "train", "step": s, "loss": 2.0} for s in (1, 2)]
    lines = [json.dumps(r).encode() for r in good] + [
        b"\xff\xfe\x00garbage",
        b'{"kind": "train", "step": "x"}',
    ]
    path.write_bytes(b"\n".join(lines) + b"\n")
    m = read_metrics(tmp_path)
    assert [r["step"] for r in m.train] == [1, 2] and m.bad_lines == 2
    sink = JsonlSink(path)
    assert sink.supersede_after(1) == 1
    sink.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows == [good[0], {**good[1], "superseded": True}]


def test_the_progress_bar_counts_from_the_step_a_run_resumes_at(monkeypatch, tmp_path):
    # Built at step 0 and only moved to the resumed step, the bar took the resumed steps as done in no
    # time: thousands of steps/s and an ETA of 00:00 for the whole run.
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    logger = quiet_logger(tmp_path, log_every=10, max_steps=560, progress=True)
    bar = logger.progress._bar
    assert bar is not None and bar.initial == 0
    logger.restart_window(460)
    assert bar.initial == bar.n == 460 and bar.format_dict["rate"] is None
    logger.log_step(461, loss=3.0, lr=1e-3, grad_norm=1.0, tokens_processed=64, tokens_total=64)
    assert bar.n == 461 and bar.format_dict["n"] - bar.format_dict["initial"] == 1
    logger.close()


def test_supersede_drops_lines_of_huge_numbers_or_deep_nesting_instead_of_raising(tmp_path):
    path = tmp_path / "metrics.jsonl"
    good = [{"kind": "train", "step": s, "loss": 2.0} for s in (1, 2)]
    lines = [
        json.dumps(good[0]),
        '{"kind": "train", "step": ' + "9" * 5000 + "}",
        "[" * 100_000,
        json.dumps(good[1]),
    ]
    path.write_text("\n".join(lines) + "\n")
    sink = JsonlSink(path)
    assert sink.supersede_after(1) == 1
    sink.close()
    assert [json.loads(line) for line in path.read_text().splitlines()] == [
        good[0],
        {**good[1], "superseded": True},
    ]


@pytest.mark.parametrize(
    "content, kept",
    [
        (b"", b""),
        (b"a\n", b"a\n"),
        (b"a\nbc", b"a\n"),
        (b"abc", b""),
        (b"x" * 200_000 + b"\n" + b"y" * 150_000, b"x" * 200_000 + b"\n"),  # the tail spans blocks
        (b"q\n" + b"w" * (1 << 16), b"q\n"),  # the newline just before a block boundary
        (b"z" * 300_000, b""),
    ],
)
def test_the_torn_tail_is_found_from_the_end_of_the_log(tmp_path, content, kept):
    from mamba3lite.train.metrics.jsonl import _drop_torn_tail

    path = tmp_path / "metrics.jsonl"
    path.write_bytes(content)
    _drop_torn_tail(path)
    assert path.read_bytes() == kept
