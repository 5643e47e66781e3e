"""The quickstart resolves its run once (quickstart/plan.py): one load of the config, one check of the
run directory, one `prepare_run` for the calibration's throw-away trainer and the run,
one verification of the checkpoint it resumes from; and it prints one kind of number per line: the
periodic evaluations labelled as a fixed subset of the val windows, before and after as the whole split.

The run trains by the clock; its steps are capped at 6 (and 6 expected, for the cadence) so that
nothing asserted depends on how fast the machine is."""

from __future__ import annotations

import json
import re
from collections import Counter

import pytest

from mamba3lite.cli import main
from userside_helpers import tiny_config_yaml


@pytest.mark.slow
def test_quickstart_resolves_once_and_labels_every_validation_number(tmp_path, monkeypatch, capsys):
    import mamba3lite.config as config_module
    import mamba3lite.quickstart.budget as budget
    import mamba3lite.quickstart.calibrate as calibration
    import mamba3lite.quickstart.plan as plan
    import mamba3lite.quickstart.run as qs
    import mamba3lite.train.entry as entry
    from mamba3lite.checkpoint.run_dir import RunDir
    from mamba3lite.quickstart.budget import Budget, Plan
    from mamba3lite.quickstart.compile_choice import CompileChoice

    calls: Counter = Counter()
    loaded: list = []

    def count(owner, name, record=None):
        real = getattr(owner, name)

        def counted(*args, **kwargs):
            calls[name] += 1
            if record is not None:
                record.append(args[0])
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, name, counted)

    count(config_module, "load_config", loaded)
    for name in ("check_run_directory", "prepare_run", "training_session"):
        count(entry, name)
    count(plan, "prepare_run")  # the quickstart's own call (imported by name into plan.py)
    count(RunDir, "resume_step")
    # a process 20 minutes old (a slow suite's pytest): its age is not the quickstart's budget to pay
    monkeypatch.setattr(qs, "_process_age_s", lambda: 20 * 60.0)
    # 6 steps expected at the calibration's speed: evaluations every ceil(6 / 3) = 2 steps; the clock's
    # minutes are far more than 6 steps take, so the cap of 6 ends the run
    monkeypatch.setattr(Budget, "expected", lambda self, s, now=None: Plan(6, s))
    monkeypatch.setattr(budget, "STEP_CAP", 6)
    monkeypatch.setattr(calibration, "time_steps", lambda trainer, cpu: (1e-3, ""))
    # the step path without timing a compile (its rule is tests/test_compile_choice.py's)
    monkeypatch.setattr(plan, "plan_compile", lambda cfg, train_s: CompileChoice(False, "eager (test)"))
    work = tmp_path / "qs"
    # micro batches of 8: the evaluations of the whole val split (~270 windows) in few forwards
    config = tiny_config_yaml(tmp_path / "tiny_test.yaml", max_seq_len=32, warmup_steps=4, micro_batch_size=8)
    rc = main(["quickstart", "--minutes", "10", "--workdir", str(work), "--config", config,
               "--max-docs", "12", "--sample-tokens", "3", "--vocab", "300"])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0, out
    assert [str(c) for c in loaded] == [config]  # the preset itself is loaded once
    assert calls["check_run_directory"] == 1 and calls["prepare_run"] == 1 and calls["resume_step"] == 1
    assert calls["training_session"] == 2  # the calibration and the run
    assert "min by the clock" in out and "step path: eager (test)" in out
    assert "ended early: the trainer's cap of 6 steps (training.max_steps)" in out

    # before and after: the whole val split, its windows counted; the periodic ones: a labelled subset
    (whole,) = set(re.findall(r"\(on the whole val split, (\d+) windows\)", out))
    assert re.search(rf"before    step 0: val loss .*\(on the whole val split, {whole} windows\)", out)
    assert re.search(rf"after     step 6: val loss .*\(on the whole val split, {whole} windows\)", out)
    periodic = re.findall(r"^eval step=\s+(\d+) \|.* \| subset (\d+) of (\d+) val windows$", out, re.M)
    assert [step for step, _, _ in periodic] == ["2", "4", "6"]
    (subset,) = {n for _, n, _ in periodic}
    assert {of for _, _, of in periodic} == {whole} and int(whole) / 2 <= int(subset) < int(whole)
    assert f"on the whole val split, {whole} windows" in out.split("quickstart summary")[1]
    run = work / "run-stdlib-bpe300"
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    recorded = {(r["val_windows"], r["val_split_windows"]) for r in rows if r["kind"] == "eval"}
    assert recorded == {(int(subset), int(whole))}
