"""train/metrics/: sinks declared in the config (`logging:`), one `row_scalars` for TensorBoard and W&B,
the environment read where the config is resolved, the peak-FLOP/s table, the package's layering."""

from __future__ import annotations

import ast
import subprocess
import sys
import types
from pathlib import Path

import pytest

from mamba3lite.config import Config, LoggingConfig
from mamba3lite.errors import ConfigError
from mamba3lite.train.metrics import (
    ConsoleSink,
    JsonlSink,
    TensorBoardSink,
    WandbSink,
    build_logger,
    resolve_sinks,
    row_scalars,
)

SRC = Path(__file__).resolve().parents[1] / "src" / "mamba3lite"


@pytest.fixture(autouse=True)
def _no_wandb_environment(monkeypatch):
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    monkeypatch.delenv("WANDB_RUN_NAME", raising=False)


def _logger(run_dir, logging_config):
    return build_logger(
        run_dir,
        log_every=1,
        flops_per_token=None,
        peak_flops_per_s=None,
        device=None,
        max_steps=3,
        start_step=0,
        progress=False,
        logging_config=logging_config,
    )


def _step(log, step: int = 1) -> dict:
    return log.log_step(step, loss=2.0, lr=0.1, grad_norm=1.0, tokens_processed=8, tokens_total=8 * step)


def _fake_wandb(monkeypatch) -> dict:
    seen: dict = {"logged": []}
    mod = types.ModuleType("wandb")
    mod.init = lambda **kw: seen.update(init=kw) or types.SimpleNamespace(id="run1")
    mod.log = lambda data, step: seen["logged"].append((step, data))
    mod.finish = lambda: None
    monkeypatch.setitem(sys.modules, "wandb", mod)
    return seen


# ---------------------------------------------------------------------------------- row_scalars
ROW = {
    "kind": "train",
    "step": 7,
    "time": 1.5e9,
    "tokens": 896,
    "loss": 2.5,
    "warmup_window": True,  # a flag, not a scalar
    "note": "text",  # not a number
    "skipped": 0,
}


def test_row_scalars_are_the_numbers_of_a_row_by_kind():
    assert row_scalars(ROW) == {"train/tokens": 896, "train/loss": 2.5, "train/skipped": 0}
    assert row_scalars({"kind": "eval", "step": 7, "time": 0.0, "val_loss": 2.0}) == {"eval/val_loss": 2.0}
    assert row_scalars({"kind": "event", "step": 7, "event": "stop", "message": "x"}) == {}


def test_tensorboard_and_wandb_log_the_same_scalars(monkeypatch, tmp_path):
    seen = _fake_wandb(monkeypatch)
    wandb_sink = WandbSink("proj")
    added: list[tuple[str, float, int]] = []

    class Writer:
        def __init__(self, log_dir: str) -> None:
            pass

        def add_scalar(self, tag: str, value: float, step: int) -> None:
            added.append((tag, value, step))

        def flush(self) -> None:
            pass

        def close(self) -> None:
            pass

    tb_sink = TensorBoardSink(tmp_path / "tb")
    tb_sink._writer_cls = Writer
    for sink in (wandb_sink, tb_sink):
        sink.write(ROW)
        sink.write({"kind": "event", "step": 7, "event": "stop", "message": "x"})
    assert seen["logged"] == [(7, row_scalars(ROW))]
    assert {tag: value for tag, value, _ in added} == row_scalars(ROW) and {s for *_, s in added} == {7}


# ------------------------------------------------------------------------------ sinks from config
def test_auto_is_todays_set_console_jsonl_progress_and_tensorboard_when_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", types.ModuleType("tensorboard"))
    assert resolve_sinks(LoggingConfig()) == ["console", "tensorboard", "progress", "jsonl"]
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # not installed: left out, no error
    assert resolve_sinks(LoggingConfig()) == ["console", "progress", "jsonl"]
    assert resolve_sinks(LoggingConfig(wandb_project="p")) == ["console", "wandb", "progress", "jsonl"]


def test_the_sinks_named_in_the_config_are_the_sinks_a_run_gets(tmp_path, capsys):
    cfg = Config.from_dict({"logging": {"sinks": ["jsonl"]}})
    log = _logger(tmp_path, cfg.logging)
    assert [type(s) for s in log.sinks] == [JsonlSink]
    _step(log)
    log.close()
    assert capsys.readouterr().out == "" and not (tmp_path / "tb").exists()
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 1

    cfg = Config().with_overrides(["logging.sinks=console,jsonl"])
    assert cfg.logging.sinks == ["console", "jsonl"]
    log = _logger(tmp_path / "two", cfg.logging)
    assert [type(s) for s in log.sinks] == [ConsoleSink, JsonlSink]
    _step(log)
    log.close()
    assert "loss=2.0000" in capsys.readouterr().out


def test_an_unknown_sink_is_refused_with_a_did_you_mean():
    with pytest.raises(
        ConfigError, match=r"logging\.sinks: unknown sink `tensorbord`; did you mean `tensorboard`"
    ):
        Config.from_dict({"logging": {"sinks": ["jsonl", "tensorbord"]}})
    with pytest.raises(ConfigError, match="unknown key in section `logging:` `sink`; did you mean `sinks`"):
        Config.from_dict({"logging": {"sink": ["jsonl"]}})


@pytest.mark.parametrize(
    "sinks, match",
    [
        (["console"], "must include jsonl"),
        ([], "distinct sinks"),
        (["jsonl", "jsonl"], "distinct sinks"),
        (["jsonl", "wandb"], "names wandb but no project is set"),
    ],
)
def test_sink_lists_that_cannot_work_are_refused(sinks, match):
    with pytest.raises(ConfigError, match=match):
        LoggingConfig(sinks=sinks)


@pytest.mark.parametrize("name", ["tensorboard", "wandb"])
def test_a_named_sink_whose_package_is_missing_is_a_config_error_with_the_install_hint(
    monkeypatch, tmp_path, name
):
    monkeypatch.setitem(sys.modules, name, None)  # `import name` raises ImportError
    cfg = LoggingConfig(sinks=["auto", name], wandb_project="p")
    with pytest.raises(ConfigError, match=rf"names {name}, .* pip install 'mamba3lite\[{name}\]'"):
        resolve_sinks(cfg)
    with pytest.raises(ConfigError, match="not installed"):
        _logger(tmp_path, cfg)
    assert not (tmp_path / "metrics.jsonl").exists()  # refused before any sink was opened


# ------------------------------------------------------------------------------ the environment
def test_wandb_project_comes_from_the_environment_when_the_field_is_unset(monkeypatch, tmp_path):
    assert LoggingConfig().wandb_project is None and "wandb" not in resolve_sinks(LoggingConfig())
    monkeypatch.setenv("WANDB_PROJECT", "from-env")
    monkeypatch.setenv("WANDB_RUN_NAME", "name-from-env")
    cfg = Config.from_dict({})
    assert cfg.logging.wandb_project == "from-env" and cfg.logging.wandb_run_name == "name-from-env"
    assert cfg.to_dict()["logging"]["wandb_project"] == "from-env"  # recorded in the resolved config
    assert Config.from_dict({"logging": {"wandb_project": "mine"}}).logging.wandb_project == "mine"

    seen = _fake_wandb(monkeypatch)
    log = _logger(tmp_path, Config.from_dict({"logging": {"wandb_project": "mine"}}).logging)
    assert seen["init"]["project"] == "mine" and seen["init"]["name"] == "name-from-env"
    assert log.wandb_run_id == "run1"
    log.close()


def test_the_builder_reads_no_environment(monkeypatch, tmp_path):
    cfg = LoggingConfig()  # resolved while WANDB_PROJECT is unset
    monkeypatch.setenv("WANDB_PROJECT", "too-late")
    seen = _fake_wandb(monkeypatch)
    log = _logger(tmp_path, cfg)
    assert "init" not in seen and not any(isinstance(s, WandbSink) for s in log.sinks)
    log.close()


# ------------------------------------------------------------------------------- hardware peaks
def test_peak_flops_override_lookup_and_cpu(monkeypatch):
    import torch

    from mamba3lite.model.hardware import peak_flops

    assert peak_flops(torch.device("cpu"), 123.0) == 123e12
    assert peak_flops(torch.device("cpu")) is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name, peak in (("NVIDIA L40S", 362e12), ("NVIDIA L4", 121e12), ("NVIDIA H200", 989e12)):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device, name=name: name)
        assert peak_flops(torch.device("cuda")) == peak, name
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "Some Future GPU")
    assert peak_flops(torch.device("cuda")) is None


# ----------------------------------------------------------------------------------- layering
def _imported_modules(path: Path) -> set[str]:
    """Every module `path` imports, lazily (inside functions) included."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
    return out


def test_train_imports_nothing_from_report():
    offenders = {
        str(p.relative_to(SRC)): sorted(m for m in _imported_modules(p) if m.startswith("mamba3lite.report"))
        for p in (SRC / "train").rglob("*.py")
    }
    assert {k: v for k, v in offenders.items() if v} == {}
    assert not (SRC / "train" / "logging.py").exists()


def test_importing_the_metrics_package_imports_neither_torch_nor_numpy():
    code = (
        "import sys, mamba3lite.train.metrics, mamba3lite.report.plot; "
        "print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
