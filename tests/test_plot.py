"""`mamba3lite plot`: a real PNG from metrics.jsonl; superseded rows and events handled."""

from __future__ import annotations

import json
import math
import struct

import pytest

from mamba3lite.report.metrics import ema
from mamba3lite.train.metrics.jsonl import read_metrics

pytest.importorskip("matplotlib")


def _write_metrics(run_dir, torn_tail=False):
    rows = [{"kind": "event", "event": "start", "step": 0, "time": 0.0, "tokens": 0}]
    for s in range(1, 41):
        rows.append(
            {
                "kind": "train",
                "step": s,
                "time": float(s),
                "tokens": s * 1000,
                "loss": 10.0 * math.exp(-s / 20),
                "lr": 1e-3,
                "tokens_per_s": 5000.0 + s,
                "warmup_window": s == 1,
            }
        )
        if s % 10 == 0:
            rows.append(
                {
                    "kind": "eval",
                    "step": s,
                    "time": float(s),
                    "tokens": s * 1000,
                    "val_loss": 10.0 * math.exp(-s / 25),
                }
            )
    # an abandoned timeline after a rollback to step 30
    rows += [
        {"kind": "train", "step": s, "time": 50.0 + s, "tokens": s * 1000, "loss": 99.0, "superseded": True}
        for s in (31, 32)
    ]
    rows.append({"kind": "event", "event": "rollback", "step": 30, "time": 60.0, "tokens": 30000})
    text = "\n".join(json.dumps(r) for r in rows) + "\n"
    if torn_tail:
        text += '{"kind": "train", "st'
    (run_dir / "metrics.jsonl").write_text(text)


def _png_size(path):
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", head[16:24])


def test_read_metrics_splits_rows(tmp_path):
    _write_metrics(tmp_path, torn_tail=True)
    m = read_metrics(tmp_path)
    assert len(m.train) == 40 and len(m.eval) == 4
    assert [e["event"] for e in m.events] == ["start", "rollback"]
    assert len(m.superseded) == 2 and all(r["loss"] == 99.0 for r in m.superseded)
    assert m.bad_lines == 1  # the torn last line is counted, not fatal


def test_ema_is_bias_corrected():
    assert ema([4.0, 4.0, 4.0]) == pytest.approx([4.0, 4.0, 4.0])
    smoothed = ema([0.0] * 5 + [10.0] * 5, alpha=0.5)
    assert smoothed[4] == 0.0 and 0.0 < smoothed[5] < 10.0 and smoothed[-1] > smoothed[5]


def test_plot_renders_a_real_png(tmp_path, cli):
    _write_metrics(tmp_path)
    out = tmp_path / "curves.png"
    r = cli("plot", str(tmp_path), "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert str(out) in r.stdout
    w, h = _png_size(out)
    assert (w, h) == (900, 900)
    assert out.stat().st_size > 20_000  # axes, two curves, legend: not a blank canvas
    import matplotlib.image as mpimg

    img = mpimg.imread(out)
    assert img[..., :3].std() > 0.05  # a blank or single-colour image fails here
    assert not list(tmp_path.glob(".*tmp*"))  # the temp file was renamed away


def test_plot_default_output_in_run_dir(tmp_path):
    from mamba3lite.report.plot import plot_run

    _write_metrics(tmp_path)
    assert plot_run(tmp_path) == tmp_path / "metrics.png"
    assert (tmp_path / "metrics.png").stat().st_size > 20_000


@pytest.mark.parametrize("case", ["missing_dir", "no_metrics", "empty", "not_png"])
def test_plot_bad_inputs(tmp_path, cli, case):
    target = tmp_path
    args = []
    if case == "missing_dir":
        target = tmp_path / "nope"
    elif case == "empty":
        (tmp_path / "metrics.jsonl").write_text("")
    elif case == "not_png":
        _write_metrics(tmp_path)
        args = ["-o", str(tmp_path / "plot.jpg")]
    r = cli("plot", str(target), *args)
    assert r.returncode != 0
    assert r.stderr.startswith("error: ")
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "metrics.png").exists()


def test_ema_weighs_rows_by_the_steps_they_average():
    # 20 one-step rows (a probe, loss falling) then 10-step rows at ~3.6: the smoothed curve of the
    # 10-step rows must come down to them, not sit ~1 nat above, pulled by the many early rows.
    losses = [10.8 - 0.35 * i for i in range(20)] + [3.6] * 8
    steps = [1] * 20 + [10] * 8
    assert ema(losses, steps=steps)[-1] < 3.75 < ema(losses)[-1]
    assert ema(losses, steps=[10] * 28) == pytest.approx(ema(losses))  # equal windows: the row EMA


def test_plot_into_a_directory_writes_inside_it_and_leaves_no_temp_file(tmp_path, monkeypatch):
    from pathlib import Path

    from mamba3lite.report.plot import plot_run

    _write_metrics(tmp_path)
    d = tmp_path / "plots.png"  # a directory, even named like the file
    d.mkdir()
    assert plot_run(tmp_path, d) == d / "metrics.png" and (d / "metrics.png").stat().st_size > 20_000

    def refuse(self, target):
        raise PermissionError(13, "Permission denied", str(target))

    monkeypatch.setattr(Path, "replace", refuse)  # the rename fails (a read-only target, say)
    with pytest.raises(PermissionError):
        plot_run(tmp_path, tmp_path / "other.png")
    assert not list(tmp_path.rglob(".*tmp*")) and not (tmp_path / "other.png").exists()


@pytest.mark.parametrize(
    "bad", [{"loss": None}, {"loss": 1e308}, {"tokens_per_s": 1e308}, {"window_steps": 1e308}]
)
def test_rows_with_null_or_huge_values_are_skipped_with_one_warning(tmp_path, bad):
    """A hand-edited or damaged row used to crash `plot` (None in the EMA; matplotlib's axis arithmetic
    overflowing at 1e308) and `inspect RUN`; it is now a bad line, named in one warning."""
    from pathlib import Path

    from mamba3lite.report.inspect_run import last_metrics_rows
    from mamba3lite.report.plot import plot_run

    _write_metrics(tmp_path)
    row = {"kind": "train", "step": 41, "time": 41.0, "tokens": 41000, "loss": 1.0, "lr": 1e-3, **bad}
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write(json.dumps(row) + "\n")
    with pytest.warns(UserWarning, match=f"line 49 is not a valid metrics .*: {next(iter(bad))}") as record:
        m = read_metrics(tmp_path)
        assert plot_run(tmp_path) == tmp_path / "metrics.png"
        lines = last_metrics_rows(Path(tmp_path))
    assert m.bad_lines == 1 and len(m.train) == 40 and "step 40" in lines[0]
    assert len([w for w in record if "not a valid metrics" in str(w.message)]) == 3  # one per read
