"""`mamba3lite quickstart`: the whole pipeline end to end on a slice of the stdlib corpus with a tiny
model and a very short budget, re-running continues, and bad inputs are one-line errors.

The budget is so short that the plan is one step and the timer stops the trainer after it; nothing
asserted depends on how fast the machine is."""

from __future__ import annotations

import json

import pytest

from mamba3lite.cli import main
from mamba3lite.data.shards import Manifest
from mamba3lite.train.checkpoint import CheckpointManager
from userside_helpers import tiny_config_yaml


def quickstart_args(tmp_path, workdir) -> list[str]:
    config = tiny_config_yaml(tmp_path / "tiny_test.yaml", max_seq_len=32)
    return ["quickstart", "--minutes", "0.01", "--workdir", str(workdir), "--config", config,
            "--max-docs", "12", "--sample-tokens", "5"]  # fmt: skip


@pytest.mark.slow
def test_end_to_end_then_rerun_continues(cli, tmp_path):
    work = tmp_path / "qs"
    r = cli(*quickstart_args(tmp_path, work), timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "Traceback" not in r.stderr
    m = Manifest.load(work / "data" / "stdlib")
    assert m.extra["stats"]["documents_in"] == 12 and m.n_tokens("train") > 0
    run = work / "run"
    steps = CheckpointManager(run).verified_steps()
    assert steps and steps[-1] >= 1
    expected = [
        "before    step 0: val loss",
        "after     step",
        "sample    (prompt 'def'",
        "quickstart summary",
    ]
    expected += ["tokens seen", "val loss ", "run directory", "mamba3lite generate --checkpoint-dir"]
    for text in expected:
        assert text in out, text
    assert (run / "metrics.png").stat().st_size > 1000 and (run / "config.yaml").exists()
    kinds = {json.loads(x)["kind"] for x in (run / "metrics.jsonl").read_text().splitlines()}
    assert {"train", "event"} <= kinds

    r2 = cli(*quickstart_args(tmp_path, work), timeout=900)
    assert r2.returncode == 0, r2.stdout + r2.stderr
    assert "data      reusing" in r2.stdout
    assert f"before    step {steps[-1]}:" in r2.stdout  # evaluated where the first run ended...
    assert CheckpointManager(run).verified_steps()[-1] > steps[-1]  # ...and trained on from there
    events = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert any(e.get("event") == "resume" for e in events)


def test_bad_inputs_are_one_line_errors(tmp_path, capsys):
    afile = tmp_path / "a_file"
    afile.write_text("x")
    cases = [
        (["--minutes", "0"], "--minutes must be > 0"),
        (["--workdir", str(afile)], "is not a directory"),
        (["--max-docs", "0"], "--max-docs must be >= 1"),
        (["--sample-tokens", "0"], "--sample-tokens must be >= 1"),
        (
            ["--config", "no_such_preset_xyz", "--workdir", str(tmp_path / "w"), "--max-docs", "3"],
            "config not found",
        ),
    ]
    for args, message in cases:
        rc = main(["quickstart", *args])
        err = capsys.readouterr().err
        assert rc != 0 and err.startswith("error: ") and message in err and "Traceback" not in err, (
            args,
            err,
        )
    # An output path that cannot be created (below a regular file): the OS error, one line, exit 1.
    assert main(["quickstart", "--workdir", str(afile / "sub"), "--max-docs", "3"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "a_file" in err


def test_plot_to_an_unwritable_path_is_one_line(tmp_path, capsys):
    afile = tmp_path / "a_file"
    afile.write_text("x")
    run = tmp_path / "run"
    run.mkdir()
    row = {"kind": "train", "step": 1, "time": 0.0, "tokens": 8, "loss": 5.0, "lr": 1e-3, "tokens_per_s": 9.0}
    (run / "metrics.jsonl").write_text(json.dumps(row) + "\n")
    assert main(["plot", str(run), "-o", str(afile / "x.png")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "a_file" in err and "Traceback" not in err


@pytest.mark.slow
def test_dataset_is_reused_only_when_it_verifies_and_is_the_same_slice(tmp_path):
    from mamba3lite.quickstart import ensure_dataset

    out, notes = tmp_path / "ds", []
    assert ensure_dataset(out, 3, notes.append) == (out, False)
    assert ensure_dataset(out, 3, notes.append) == (out, True)
    assert ensure_dataset(out, 4, notes.append) == (out, False) and "another slice" in notes[-3]
    assert Manifest.load(out).extra["stats"]["documents_in"] == 4
    shard = out / Manifest.load(out).shards[0].path
    shard.write_bytes(shard.read_bytes()[:-2])
    assert ensure_dataset(out, 4, notes.append) == (out, False) and "does not verify" in notes[-3]
