"""training.dtype: auto resolves to bf16 only where the device computes it natively (model/precision.py);
the trainer autocasts iff the resolved dtype is bf16, says which and why at its start, records it in
run.json, and warns about an explicit bf16 on a device without native bf16. The probe is monkeypatched,
so both kinds of device are tested on any machine."""

from __future__ import annotations

import json

import pytest
import torch

from mamba3lite import cli
from mamba3lite.config import Config, TrainingConfig, load_config
from mamba3lite.errors import ConfigError
from mamba3lite.evaluate import evaluate_model
from mamba3lite.model import Mamba3Transformer, precision
from mamba3lite.model.precision import (
    CUDA_NATIVE_BF16,
    native_bf16,
    planned_cuda_precision,
    planned_precision,
    resolve_precision,
)
from mamba3lite.train.trainer import Pretrainer
from test_trainer import make_dataset, metrics, tiny_config


@pytest.fixture
def native(monkeypatch):
    """Set what the probe answers: native(True) is a device with native bf16, native(False) one without."""

    def set_to(answer: bool) -> None:
        monkeypatch.setattr(precision, "native_bf16", lambda device: answer)

    return set_to


@pytest.mark.parametrize(
    ("dtype", "has_native", "want", "reason", "warned"),
    [
        ("auto", True, torch.bfloat16, "auto -> bf16: this CPU (", False),
        ("auto", False, None, "auto -> fp32: this CPU (", False),
        ("fp32", True, None, "fp32 (training.dtype)", False),
        ("fp32", False, None, "fp32 (training.dtype)", False),
        ("bf16", True, torch.bfloat16, "bf16 (training.dtype)", False),
        ("bf16", False, torch.bfloat16, "bf16 (training.dtype), emulated: this CPU (", True),
    ],
)
def test_the_resolver_both_ways(native, dtype, has_native, want, reason, warned):
    native(has_native)
    p = resolve_precision(dtype, "cpu")
    assert p.requested == dtype and p.dtype == want and p.name == ("bf16" if want else "fp32")
    assert p.reason.startswith(reason) and "\n" not in p.reason
    assert p.matmul_dtype == (torch.bfloat16 if want else torch.float32)
    if not has_native and dtype == "auto":
        assert p.reason.endswith(f"({torch.backends.cpu.get_cpu_capability()}) has no native bf16")
    assert (p.warning is not None) == warned
    if warned:  # the cost and the fix, in one line
        assert "~10x" in p.warning and "--set training.dtype=auto (or fp32)" in p.warning
        assert "\n" not in p.warning


def test_the_probe_answers_for_the_device_it_is_given():
    assert native_bf16("cpu") is bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert native_bf16(torch.device("meta")) is False  # a device that computes nothing
    if not torch.cuda.is_available():
        assert native_bf16("cuda") is False
        assert resolve_precision("auto", "cuda").dtype is None


def test_a_plan_resolves_like_the_run_but_plans_an_unaskable_cuda_device_as_a_bf16_one(native, monkeypatch):
    """`planned_precision`: what `resolve_precision` gives wherever the device can be asked; a CUDA
    device on a machine without one (a plan made on a login node) is planned as one with native bf16,
    the reason naming the compute capability auto depends on rather than a wrong "auto -> fp32"."""
    native(False)
    for dtype in ("auto", "bf16", "fp32"):
        assert planned_precision(dtype, "cpu") == resolve_precision(dtype, "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    auto = planned_precision("auto", "cuda:0")
    assert auto == planned_cuda_precision("auto") and auto.dtype == torch.bfloat16 and auto.warning is None
    assert (
        auto.reason.startswith(f"auto: bf16 on {CUDA_NATIVE_BF16}, else fp32")
        and "-> fp32" not in auto.reason
    )
    bf16 = planned_precision("bf16", "cuda")
    assert bf16.dtype == torch.bfloat16 and bf16.warning is None and CUDA_NATIVE_BF16 in bf16.reason
    assert planned_precision("fp32", "cuda").dtype is None


def test_auto_is_the_default_and_the_quickstarts_preset_says_auto():
    assert TrainingConfig().dtype == "auto"
    assert load_config("tiny").training.dtype == "auto"
    assert load_config("mamba3_180m").training.dtype == "bf16"  # a GPU preset keeps its bf16


def test_a_typo_is_one_config_error_naming_the_choices_and_the_closest(capsys, tmp_path):
    with pytest.raises(ConfigError) as e:
        Config().replace("training", dtype="bf61")
    assert "training.dtype must be one of auto, bf16, fp32, got 'bf61'; did you mean `bf16`?" in str(e.value)
    code = cli.main(["train", "--config", "tiny", "--dummy", "--checkpoint-dir", str(tmp_path / "r"),
                     "--set", "training.dtype=atuo"])  # fmt: skip
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code != 0 and len(err) == 1 and "did you mean `auto`?" in err[0], err
    assert not (tmp_path / "r").exists()


def _autocast_seen(trainer: Pretrainer) -> list[torch.dtype | None]:
    """What the first block's forward saw, per call: the CPU autocast dtype, None without autocast."""
    seen: list[torch.dtype | None] = []

    def hook(module, args) -> None:
        on = torch.is_autocast_enabled("cpu")
        seen.append(torch.get_autocast_dtype("cpu") if on else None)

    trainer.raw_model.layers[0].register_forward_pre_hook(hook)
    return seen


AUTOCASTS = [("auto", True, torch.bfloat16), ("auto", False, None), ("fp32", True, None),
             ("bf16", False, torch.bfloat16)]  # fmt: skip


@pytest.mark.parametrize(("dtype", "has_native", "autocast"), AUTOCASTS)
def test_the_trainer_autocasts_iff_the_resolved_dtype_is_bf16(tmp_path, native, dtype, has_native, autocast):
    native(has_native)
    t = Pretrainer(tiny_config(tmp_path, dtype=dtype, max_steps=1, warmup_steps=1, eval_every=1))
    seen = _autocast_seen(t)
    t.train()
    assert t.autocast_dtype == autocast
    # the step's 2 micro-batches and the evaluation's eval_batches, all alike
    assert len(seen) == 2 + t.tc.eval_batches and set(seen) == {autocast}
    (start,) = [r for r in metrics(tmp_path) if r.get("event") == "start"]
    assert start["message"].endswith(f"; compute {t.precision.reason}")
    (entry,) = json.loads((tmp_path / "run.json").read_text())["starts"]
    assert entry["dtype"] == ("fp32" if autocast is None else "bf16")
    assert entry["dtype_reason"] == t.precision.reason


def test_an_explicit_bf16_without_native_bf16_is_kept_and_warned_about_once(tmp_path, native):
    def warnings_of(run):
        return [r["message"] for r in metrics(run) if r.get("event") == "warning"]

    native(False)
    Pretrainer(tiny_config(tmp_path / "a", dtype="bf16", max_steps=1, warmup_steps=1)).train()
    (w,) = warnings_of(tmp_path / "a")  # once, at the start: not per step
    assert w.startswith("training.dtype is bf16, but this CPU (") and "--set training.dtype=auto" in w
    native(True)
    Pretrainer(tiny_config(tmp_path / "b", dtype="bf16", max_steps=1, warmup_steps=1)).train()
    assert warnings_of(tmp_path / "b") == []
    native(False)
    Pretrainer(tiny_config(tmp_path / "c", dtype="auto", max_steps=1, warmup_steps=1)).train()
    assert warnings_of(tmp_path / "c") == []


def test_evaluate_resolves_the_runs_dtype_for_its_device_and_warns_about_an_emulated_bf16(tmp_path, native):
    data = make_dataset(tmp_path / "ds", n_train=400, n_val=200)
    torch.manual_seed(0)
    model = Mamba3Transformer(tiny_config(tmp_path).model)

    def loss(dtype: str) -> float:
        kw = {"max_seq_len": 16, "batch_size": 2, "max_batches": 2, "vocab_hash": "ab" * 32}
        return evaluate_model(model, data, dtype=dtype, tokenizer_name="test", **kw).loss

    native(False)
    assert loss("auto") == loss("fp32")  # auto is fp32 here: the same computation
    with pytest.warns(UserWarning, match=r"no native bf16.*--set training\.dtype=auto"):
        emulated = loss("bf16")
    assert emulated != loss("fp32") and emulated == pytest.approx(loss("fp32"), rel=2e-2)  # bf16 ran
    native(True)
    assert loss("auto") == emulated  # auto is bf16 where it is native
