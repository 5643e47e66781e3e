"""`mamba3lite quickstart`: the whole pipeline end to end on a slice of the stdlib corpus with a tiny
model and a very short budget, re-running continues, and bad inputs are one-line errors.

The budget is so short that the plan is one step and the timer stops the trainer after it; nothing
asserted depends on how fast the machine is."""

from __future__ import annotations

import json
import re
import shlex
import signal
from pathlib import Path

import pytest

from mamba3lite.checkpoint import CheckpointManager
from mamba3lite.cli import build_parser, main
from mamba3lite.data.shards import Manifest
from userside_helpers import tiny_config_yaml


def quickstart_args(tmp_path, workdir) -> list[str]:
    # 8 windows a micro batch: the before/after evaluations score every window of the val split (269
    # of 32 tokens) in a quarter of the forward passes 2 would take (nearly half a run after start-up).
    config = tiny_config_yaml(tmp_path / "tiny_test.yaml", max_seq_len=32, micro_batch_size=8)
    return ["quickstart", "--minutes", "0.01", "--workdir", str(workdir), "--config", config,
            "--max-docs", "12", "--sample-tokens", "5", "--vocab", "300"]  # fmt: skip


@pytest.mark.slow
def test_end_to_end_then_rerun_continues(cli, tmp_path):
    work = tmp_path / "qs"
    r = cli(*quickstart_args(tmp_path, work), timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "Traceback" not in r.stderr
    m = Manifest.load(work / "data" / "stdlib-bpe300")
    assert m.extra["stats"]["documents_in"] == 12 and m.n_tokens("train") > 0
    assert m.vocab_size == 300 and (work / "data" / "stdlib-bpe300" / "tokenizer.json").is_file()
    run = work / "run-stdlib-bpe300"
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
        (["--vocab", "1"], "--vocab 1 is too small"),
        (["--vocab", "300", "--tokenizer", "gpt2"], "--tokenizer gpt2 has its own"),
        (["--source", str(tmp_path / "no_such_dir"), "--workdir", str(tmp_path / "w2")], "no_such_dir"),
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
    from mamba3lite.quickstart.dataset import ensure_dataset

    out, notes = tmp_path / "ds", []
    assert ensure_dataset(out, "stdlib", 3, None, notes.append) == (out, False)
    assert ensure_dataset(out, "stdlib", 3, None, notes.append) == (out, True)
    assert ensure_dataset(out, "stdlib", 4, None, notes.append) == (out, False)
    assert "another source, slice or tokenizer" in notes[-3]
    assert Manifest.load(out).extra["stats"]["documents_in"] == 4
    # another tokenizer request: prepared again, with its own BPE
    assert ensure_dataset(out, "stdlib", 4, 300, notes.append) == (out, False)
    assert Manifest.load(out).vocab_size == 300
    assert ensure_dataset(out, "stdlib", 4, 300, notes.append) == (out, True)
    shard = out / Manifest.load(out).shards[0].path
    shard.write_bytes(shard.read_bytes()[:-2])
    assert (
        ensure_dataset(out, "stdlib", 4, 300, notes.append) == (out, False) and "does not verify" in notes[-3]
    )


@pytest.mark.parametrize("minutes", ["inf", "1e400", "-inf", "nan"])
def test_minutes_must_be_finite_and_are_checked_before_any_work(tmp_path, capsys, minutes):
    work = tmp_path / "w"
    rc = main(["quickstart", f"--minutes={minutes}", "--max-docs", "3", "--workdir", str(work)])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: --minutes must be > 0") and err.count("\n") == 1, err
    assert not work.exists()  # refused before the dataset was prepared


@pytest.mark.parametrize(
    "override",
    [
        "data.train_data_path=elsewhere",
        "data.token_dtype=uint32",
        "model.vocab_size=300",
        "model.eos_id=1",
        "training.max_steps=5",
        "training.checkpoint_dir=r",
        "training.eval_every=1",
        "training.eval_batches=1",
        "training.save_every=1",
    ],
)
def test_set_of_a_field_the_quickstart_sets_is_refused(tmp_path, capsys, override):
    work = tmp_path / "w"
    config = tiny_config_yaml(tmp_path / "tiny_test.yaml", max_seq_len=32)
    rc = main(["quickstart", "--minutes", "0.01", "--max-docs", "3", "--workdir", str(work),
               "--config", config, "--set", override])  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: --set {override!r}: the quickstart sets {override.split('=')[0]} itself")
    assert not work.exists()


def test_set_help_names_the_refused_fields_and_the_rest_pass(capsys):
    from mamba3lite.quickstart import check_overrides

    with pytest.raises(SystemExit):
        main(["quickstart", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "override any config field" not in text
    assert (
        "refused for the fields the quickstart sets itself: data.*, model.vocab_size, model.eos_id, "
        "training.checkpoint_dir," in text
    )
    allowed = ["training.lr=3e-4", "training.warmup_steps=3", "training.log_every=2", "model.d_state=8"]
    check_overrides(allowed)  # upper limits of the plan (warmup_steps, log_every), or not the plan's


def summary_of(split: str = "val", training=None, **options) -> str:
    """A summary of a made-up run: 4 of its 5 minutes trained (`training`: a TrainingShare)."""
    from mamba3lite.quickstart import QuickstartOptions, QuickstartResult, summary_text
    from mamba3lite.quickstart.options import TrainingShare

    share = TrainingShare(trained_s=240.0, given_s=240.0, minutes_s=300.0, progress=1.0, before_s=30.0)
    whole = split == "val"  # the whole val split, or a few train windows when val is too small
    windows = {"windows": 50 if whole else 32, "whole_split": whole}
    ev = {"loss": 5.0, "bits_per_byte": 2.0, "tokens": 1000, "split": split, **windows}
    work = Path(options.get("workdir", "mamba3lite-quickstart"))
    result = QuickstartResult(
        data_path=work / "data" / "stdlib",
        run_dir=work / "run",
        data_reused=False,
        start_step=0,
        end_step=10,
        tokens_seen=100,
        start_eval=ev,
        end_eval={**ev, "loss": 4.0},
        sample="",
        plot=None,
        seconds=300.0,
        training=training or share,
        options=QuickstartOptions(**options),
    )
    return summary_text(result)


def next_command(summary: str, command: str) -> list[str]:
    (line,) = [x for x in summary.splitlines() if x.startswith(f"  mamba3lite {command} ")]
    return shlex.split(line.split("   (")[0])


def test_summary_next_commands_name_this_runs_options():
    text = summary_of(workdir="w/my qs", max_docs=5, config="my.yaml", overrides=["training.lr=3e-4"])
    again = build_parser().parse_args(next_command(text, "quickstart")[1:])
    assert (again.workdir, again.max_docs, again.config, again.overrides) == (
        "w/my qs", 5, "my.yaml", ["training.lr=3e-4"]
    )  # fmt: skip
    train = next_command(text, "train")  # the run's own resolved config: the recipe's choices included
    assert train[2:4] == ["--config", "w/my qs/run/config.yaml"]
    assert train[train.index("--checkpoint-dir") + 1] == "w/my qs/run"
    assert next_command(text, "inspect")[2] == "w/my qs/run"
    # The defaults: nothing to repeat.
    default = summary_of()
    assert next_command(default, "quickstart") == ["mamba3lite", "quickstart", "--minutes", "5"]
    assert next_command(default, "train")[2:4] == ["--config", "mamba3lite-quickstart/run/config.yaml"]
    other = summary_of(source="src/", tokenizer="gpt2")
    again = build_parser().parse_args(next_command(other, "quickstart")[1:])
    assert (again.source, again.tokenizer, again.vocab) == ("src/", "gpt2", None)


def test_summary_names_the_split_evaluated_and_a_stop():
    from mamba3lite.quickstart.options import TrainingShare

    val = summary_of("val")
    assert "val loss      5.000 -> 4.000 nats/token" in val
    assert "on the whole val split, 50 windows, 1,000 tokens)" in val
    assert "stopped" not in val
    assert "training      4.00 min, 80% of the 5-minute budget (before it 0.50 min of data, recipe" in val
    assert "schedule      done at the deadline" in val
    stopped = TrainingShare(trained_s=60.0, given_s=240.0, minutes_s=300.0, progress=0.25,
                            short_why="stopped by signal")  # fmt: skip
    train = summary_of("train", training=stopped)
    assert "training      1.00 min, 20% of the 5-minute budget" in train
    assert "schedule      25% done, ended early: stopped by signal" in train
    assert "val loss" not in train and "whole val split" not in train
    assert "train loss    5.000 -> 4.000" in train
    assert "on 32 train windows, 1,000 tokens: no usable val split" in train
    assert "steps         0 -> 10   tokens seen 100   (stopped by signal)" in train


@pytest.mark.parametrize(("age_s", "charged_s"), [(4.0, 4.0), (60.0, 60.0), (61.0, 0.0), (1200.0, 0.0)])
def test_the_budget_charges_the_start_up_only_of_a_process_started_for_it(monkeypatch, age_s, charged_s):
    """`python -m mamba3lite quickstart` pays its Python and torch start-up out of its minutes; a
    notebook or a test runner that calls it later does not pay its own age (a 20-minute-old pytest once
    left a 10-minute quickstart no time after its probe)."""
    import mamba3lite.quickstart.run as qs

    monkeypatch.setattr(qs, "_process_age_s", lambda: age_s)
    assert qs._startup_s() == charged_s


def test_ctrl_c_during_training_stops_the_run_and_the_summary_says_why_it_is_short(
    tmp_path, monkeypatch, capsys
):
    """SIGINT in the first step of a 5-minute quickstart's training: the run stops cleanly, is
    evaluated, sampled and plotted, and the summary says how much of the budget trained and why so
    little."""
    import mamba3lite.quickstart.calibrate as calibration
    from mamba3lite.train.trainer import Pretrainer

    monkeypatch.setattr(calibration, "time_steps", lambda trainer, cpu: (1e-3, ""))
    real_train, calls = Pretrainer.train, []

    def train(self, until_step=None):
        calls.append(self.tc.time_budget_minutes)
        real_step = self.train_step

        def step():
            signal.raise_signal(signal.SIGINT)
            return real_step()

        self.train_step = step
        return real_train(self, until_step)

    monkeypatch.setattr(Pretrainer, "train", train)
    work = tmp_path / "qs"
    config = tiny_config_yaml(tmp_path / "tiny_test.yaml", max_seq_len=32, warmup_steps=4)
    rc = main(["quickstart", "--minutes", "5", "--workdir", str(work), "--config", config,
               "--max-docs", "12", "--sample-tokens", "5", "--vocab", "300",
               "--set", "training.lr=2e-3"])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0, out
    # one training, by the clock: the minutes left after the data and the calibration (not a plan of steps)
    (minutes,) = calls
    assert 3.0 < minutes < 5.0
    assert "received SIGINT" in out and "note      stopped by signal at step 1:" in out
    assert "after     step 1:" in out and "(stopped by signal)" in out and "quickstart summary" in out
    assert re.search(r"schedule      \d+% done, ended early: stopped by signal", out)
    assert re.search(r"training      \d\.\d\d min, \d+% of the 5-minute budget", out)
    run = work / "run-stdlib-bpe300"
    assert CheckpointManager(run).verified_steps() == [1]
    meta = CheckpointManager(run).read_meta(1)
    assert 0.0 < meta["clock"]["progress"] < 0.5 and meta["clock"]["budget_s"] == pytest.approx(60 * minutes)
    events = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events if e.get("kind") == "event" and e.get("event") in ("stop", "end")] == [
        "stop"
    ]


def test_quickstart_refuses_what_train_refuses(tmp_path, capsys):
    """The quickstart trains through the one training entry (train/entry.py), so `train`'s checks are
    its checks too, made before the calibration spends any time: a run directory another trainer holds,
    and a run whose model does not fit the dataset's tokenizer."""
    from mamba3lite.checkpoint import RunLock
    from userside_helpers import save_tiny_checkpoint

    work = tmp_path / "qs"
    run = work / "run-stdlib-bpe300"
    run.mkdir(parents=True)
    with RunLock(run):  # another trainer holds the run directory
        assert main(quickstart_args(tmp_path, work)) != 0
    out, err = capsys.readouterr()
    assert err.startswith("error: ") and "in use by another trainer" in err and "Traceback" not in err
    assert "before    step" not in out  # refused before the calibration trained anything
    assert not CheckpointManager(run).list_steps()

    # the run holds a GPT-2 model (50,257 ids); the dataset has its own 300-id BPE: train refuses it
    save_tiny_checkpoint(run, step=5)
    assert main(quickstart_args(tmp_path, work)) != 0
    out, err = capsys.readouterr()
    assert err.startswith("error: ") and "which has 300 tokens, and vocab_size is 50257" in err, err
    assert "before    step" not in out and CheckpointManager(run).list_steps() == [5]
