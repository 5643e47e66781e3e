"""Every validation number says what it is a mean over: the trainer's evaluation rows record the windows
scored and the windows of the whole validation set (`val_windows`, `val_split_windows`), and the console
line of `mamba3lite train` (and `inspect`) labels a subset as a subset and the whole set as the whole set."""

from __future__ import annotations

import json

import pytest

from mamba3lite.cli import main
from mamba3lite.train.metrics.console import format_console, val_windows_label
from mamba3lite.train.validation import eval_row
from userside_helpers import tiny_config_yaml


def test_label_names_a_subset_the_whole_split_or_only_the_count():
    assert val_windows_label({"val_windows": 16, "val_split_windows": 570}) == "subset 16 of 570 val windows"
    assert val_windows_label({"val_windows": 570, "val_split_windows": 570}) == "whole val split, 570 windows"
    # a row written before the split's size was recorded: only what it knows
    assert val_windows_label({"val_windows": 1200}) == "1,200 val windows"
    assert val_windows_label({}) is None
    row = {"kind": "eval", "step": 5, "val_loss": 2.0, "val_ppl": 7.39, **eval_row(2.0, 16, None, 570)}
    assert format_console(row).endswith("| val_ppl=7.39 | subset 16 of 570 val windows")
    assert eval_row(2.0, 16, None)["val_windows"] == 16 and "val_split_windows" not in eval_row(2.0, 16, None)


@pytest.mark.parametrize(("eval_batches", "label"), [(2, "subset 4 of 8 val windows"),
                                                     (4, "whole val split, 8 windows")])  # fmt: skip
def test_train_eval_line_and_row_say_which_windows(tmp_path, capsys, eval_batches, label):
    # dummy data: a val set of max(eval_batches x micro_batch_size, 8) = 8 windows; micro batches of 2
    config = tiny_config_yaml(tmp_path / "tiny.yaml", eval_every=2, eval_batches=eval_batches)
    run = tmp_path / "run"
    rc = main(["train", "--config", config, "--dummy", "--checkpoint-dir", str(run), "--max-steps", "2"])
    out = capsys.readouterr().out
    assert rc == 0, out
    (line,) = [x for x in out.splitlines() if x.startswith("eval step=")]
    assert line.startswith("eval step=      2 | val_loss=") and line.endswith(f"| {label}"), line
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    (ev,) = [r for r in rows if r["kind"] == "eval"]
    assert (ev["val_windows"], ev["val_split_windows"]) == (2 * eval_batches, 8)
    # `inspect` labels both its eval lines (the checkpoint's last evaluation, the log's last eval row)
    assert main(["inspect", str(run)]) == 0
    report = capsys.readouterr().out
    assert report.count(f"({label})") == 2, report
