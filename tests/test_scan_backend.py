"""The scan backend choice (model/scan_backend.py): names, the `auto` rule both ways, the Triton error
paths, and the plumbing from `model.scan_impl` through the mixer, the LM, the trainer, loading and the CLI.

The Triton kernels themselves are tests/test_scan_triton.py's. Here a stand-in module with the same three
functions (`triton_chunked_scan` delegating to the chunked scan) proves the dispatch on any machine; the
real kernels through `set_scan_impl("triton")` are tests/test_scan_triton.py's (under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import json
import types

import pytest
import torch

from mamba3lite.checkpoint import CheckpointManager
from mamba3lite.config import Config
from mamba3lite.errors import ConfigError
from mamba3lite.model import Mamba3, Mamba3Transformer, ModelConfig
from mamba3lite.model import scan_backend as sb
from mamba3lite.model.mamba3 import _bias_rotate_autograd
from mamba3lite.model.rotation import per_head
from mamba3lite.model.scan import chunked_scan
from mamba3lite.pretrained import load_pretrained
from mamba3lite.train.trainer import Pretrainer
from test_trainer import tiny_config
from test_transformer import ids, make_model

CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # a device object needs no CUDA to exist
SHAPE = {"R": 1, "N": 16, "P": 8, "chunk_size": 8}


def fake_triton(monkeypatch, *, reason: str | None = None, supports: bool = True) -> types.SimpleNamespace:
    """Stand in for mamba3lite.model.scan_triton: its availability checks and its two scans, which
    record their calls."""
    calls = []

    def triton_chunked_scan(*args, **kwargs):
        calls.append(kwargs.get("chunk_size"))
        return chunked_scan(*args, **kwargs)

    def triton_rotated_scan(
        k_hat, q_hat, k_bias, q_bias, theta, halves, v, *scalars, v_scale_HRP=None, **kwargs
    ):
        """The fused op's contract, from the mixer's own bias, rotation and MIMO values."""
        if v_scale_HRP is not None:
            v = v * v_scale_HRP[:, None].to(v.dtype)
        out_dtype = torch.promote_types(k_hat.dtype, v.dtype)
        if theta is None:
            k, q = per_head(k_hat, k_bias).to(out_dtype), per_head(q_hat, q_bias).to(out_dtype)
        else:
            k, q = _bias_rotate_autograd(k_hat, q_hat, k_bias, q_bias, theta, halves, out_dtype)
        return triton_chunked_scan(q, k, v, *scalars, **kwargs)

    module = types.SimpleNamespace(
        triton_chunked_scan=triton_chunked_scan,
        triton_rotated_scan=triton_rotated_scan,
        triton_unavailable_reason=lambda device: reason,
        triton_supports=lambda R, N, P, chunk_size: supports,
        calls=calls,
    )
    monkeypatch.setattr(sb, "_triton_module", lambda: module)
    return module


def missing(name: str):
    def load():
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    return load


# ---- names ----
@pytest.mark.parametrize("make", [lambda v: ModelConfig(scan_impl=v), lambda v: sb.check_scan_impl(v)])
def test_an_unknown_name_is_a_config_error_with_did_you_mean(make):
    with pytest.raises(ConfigError, match=r"model\.scan_impl must be one of auto, chunked, sequential, "
                       r"triton, got 'trition'; did you mean `triton`\?"):  # fmt: skip
        make("trition")


def test_the_field_defaults_to_auto_and_takes_overrides():
    assert ModelConfig().scan_impl == "auto"
    assert Config().with_overrides(["model.scan_impl=chunked"]).model.scan_impl == "chunked"
    with pytest.raises(ConfigError, match="did you mean `sequential`"):
        Config().with_overrides(["model.scan_impl=sequentail"])


def test_set_scan_impl_rejects_an_unknown_name_and_the_layer_keeps_its_old_choice():
    layer = Mamba3(32, d_state=16, headdim=8, scan_impl="sequential")
    with pytest.raises(ValueError, match="scan_impl must be one of"):
        layer.set_scan_impl("fast")
    assert layer.scan_impl_requested == "sequential"


# ---- resolve_scan_impl ----
@pytest.mark.parametrize("device", [CPU, CUDA])
@pytest.mark.parametrize("name", ["chunked", "sequential"])
def test_explicit_pytorch_backends_resolve_to_themselves_on_any_device(name, device, monkeypatch):
    monkeypatch.setattr(sb, "_triton_module", missing(sb.TRITON_MODULE))  # never consulted
    assert sb.resolve_scan_impl(name, device, **SHAPE) == name


@pytest.mark.parametrize("device", [CPU, CUDA])
def test_auto_keeps_chunked_while_the_switch_is_off_even_where_triton_would_run(device, monkeypatch):
    assert sb.AUTO_PREFERS_TRITON is False  # flips with the GPU numbers (issue 16), not before
    fake_triton(monkeypatch)
    assert sb.resolve_scan_impl("auto", device, **SHAPE) == "chunked"


@pytest.mark.parametrize(
    ("device", "reason", "supports", "want"),
    [
        (CUDA, None, True, "triton"),
        (CUDA, None, False, "chunked"),  # a shape the kernels do not handle
        (CUDA, "no GPU driver", True, "chunked"),
        (CPU, None, True, "chunked"),  # the interpreter is for tests, never chosen by auto
    ],
)
def test_auto_with_the_switch_on_picks_triton_only_on_cuda_where_it_runs(
    device, reason, supports, want, monkeypatch
):
    monkeypatch.setattr(sb, "AUTO_PREFERS_TRITON", True)
    fake_triton(monkeypatch, reason=reason, supports=supports)
    assert sb.resolve_scan_impl("auto", device, **SHAPE) == want


def test_auto_with_the_switch_on_and_no_triton_module_is_chunked(monkeypatch):
    monkeypatch.setattr(sb, "AUTO_PREFERS_TRITON", True)
    monkeypatch.setattr(sb, "_triton_module", missing("triton"))
    assert sb.resolve_scan_impl("auto", CUDA, **SHAPE) == "chunked"


def test_triton_where_it_cannot_run_is_one_error_naming_the_reason_and_the_fix(monkeypatch):
    fake_triton(monkeypatch, reason="set TRITON_INTERPRET=1 to run the kernels on the CPU")
    with pytest.raises(ConfigError) as e:
        sb.resolve_scan_impl("triton", CPU, **SHAPE)
    msg = str(e.value)
    assert msg.startswith("model.scan_impl=triton cannot run on cpu: set TRITON_INTERPRET=1")
    assert "model.scan_impl=auto or chunked" in msg and "\n" not in msg


def test_triton_on_an_unsupported_shape_is_an_error_naming_the_shape(monkeypatch):
    fake_triton(monkeypatch, supports=False)
    with pytest.raises(
        ConfigError, match=r"does not support .*mimo rank 4, d_state 256, headdim 8, chunk_size 16"
    ):
        sb.resolve_scan_impl("triton", CUDA, R=4, N=256, P=8, chunk_size=16)


@pytest.mark.parametrize(
    ("missing_name", "want"),
    [
        (sb.TRITON_MODULE, "no Triton scan (mamba3lite/model/scan_triton.py is missing)"),
        ("triton", "the `triton` package is not installed (pip install triton"),
        ("triton.language", "the `triton` package is not installed"),
        ("numpy", "the Triton scan cannot be imported"),
    ],
)
def test_the_reason_when_the_module_or_triton_does_not_import(missing_name, want, monkeypatch):
    monkeypatch.setattr(sb, "_triton_module", missing(missing_name))
    assert want in sb.triton_unavailable_reason(CUDA)
    with pytest.raises(ConfigError, match="cannot run on cuda"):
        sb.resolve_scan_impl("triton", CUDA, **SHAPE)


def test_a_broken_triton_install_is_a_reason_not_a_traceback(monkeypatch):
    def broken():
        raise ImportError("cannot import name 'JITFunction'\n from 'triton.runtime'")

    monkeypatch.setattr(sb, "_triton_module", broken)
    assert sb.triton_unavailable_reason(CUDA) == (
        "the Triton scan cannot be imported: cannot import name 'JITFunction' from 'triton.runtime'"
    )


# ---- the mixer and the LM ----
def test_the_mixer_resolves_at_its_first_forward_and_dispatches_to_the_triton_scan(monkeypatch):
    fake = fake_triton(monkeypatch)
    torch.manual_seed(0)
    layer = Mamba3(32, d_state=16, headdim=8, chunk_size=8, scan_impl="triton")
    ref = Mamba3(32, d_state=16, headdim=8, chunk_size=8, scan_impl="chunked")
    ref.load_state_dict(layer.state_dict())
    assert layer.scan_impl is None  # not resolved before the device is known
    u = torch.randn(2, 20, 32)
    out = layer(u)
    assert layer.scan_impl == "triton" and fake.calls == [8]  # the layer's chunk size is bound
    torch.testing.assert_close(out, ref(u))
    layer(u)
    assert fake.calls == [8, 8]  # resolved once, reused


def test_the_mixer_resolves_again_when_its_input_moves_to_another_device_type(monkeypatch):
    """Bound on one device type (here: as if on cuda, where auto might mean triton), a forward on another
    resolves afresh for the new one instead of running the old choice there."""
    monkeypatch.setattr(sb, "AUTO_PREFERS_TRITON", True)
    fake = fake_triton(monkeypatch)
    layer = Mamba3(32, d_state=16, headdim=8, chunk_size=8)  # auto
    layer.set_scan_impl("auto", CUDA)
    assert layer.scan_impl == "triton"
    layer(torch.randn(1, 5, 32))  # a CPU input
    assert layer.scan_impl == "chunked" and fake.calls == []


def test_set_scan_impl_with_a_device_resolves_now_and_fails_early(monkeypatch):
    fake_triton(monkeypatch, reason="no CUDA here")
    model = make_model()
    model.set_scan_impl("sequential", CPU)
    with pytest.raises(ConfigError, match="cannot run on cpu: no CUDA here"):
        model.set_scan_impl("triton", CPU)
    mixer = model.layers[0].mixer  # a refused choice leaves the layer as it was
    assert (mixer.scan_impl_requested, mixer.scan_impl) == ("sequential", "sequential")
    model.set_scan_impl("auto", CPU)
    assert model.scan_impl == "chunked"
    assert all(b.mixer.scan_impl == "chunked" for b in model.layers)


def test_the_lm_builds_every_layer_with_the_configs_backend():
    cfg = ModelConfig(
        vocab_size=61, d_model=32, n_layers=2, d_state=16, headdim=8, eos_id=0, scan_impl="sequential"
    )
    model = Mamba3Transformer(cfg)
    assert all(b.mixer.scan_impl_requested == "sequential" for b in model.layers)
    model(ids(T=5))
    assert model.scan_impl == "sequential"


# ---- trainer, loading, CLI ----
def test_the_trainer_binds_the_backend_on_its_device_before_anything_is_written(tmp_path, monkeypatch):
    fake_triton(monkeypatch, reason="set TRITON_INTERPRET=1")
    cfg = tiny_config(tmp_path / "run").replace("model", scan_impl="triton")
    with pytest.raises(ConfigError, match=r"model\.scan_impl=triton cannot run on cpu"):
        Pretrainer(cfg)
    assert not (tmp_path / "run").exists()
    fake = fake_triton(monkeypatch)
    trainer = Pretrainer(cfg)
    assert trainer.raw_model.scan_impl == "triton"
    trainer.train(until_step=1)
    assert fake.calls  # the training step ran through the (stand-in) triton scan
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    (start,) = [r for r in rows if r.get("event") == "start"]
    assert start["scan_impl"] == "triton" and "; triton scan; compute " in start["message"]


def test_a_run_resumes_under_another_backend_and_from_a_meta_without_the_field(tmp_path):
    from mamba3lite.checkpoint import _meta_digest

    run = tmp_path / "run"
    Pretrainer(tiny_config(run, max_steps=4)).train(until_step=2)
    resumed = Pretrainer(tiny_config(run, max_steps=4).replace("model", scan_impl="sequential"))
    assert resumed.train(until_step=3).step == 3 and resumed.raw_model.scan_impl == "sequential"
    # A checkpoint written before the field existed: its meta has no model.scan_impl (re-sealed).
    meta_path = run / "meta_step_3.json"
    meta = json.loads(meta_path.read_text())
    del meta["config"]["model"]["scan_impl"]
    meta["meta_sha256"] = _meta_digest(meta)
    meta_path.write_text(json.dumps(meta))
    assert Pretrainer(tiny_config(run, max_steps=4)).train().step == 4


def test_loading_a_triton_run_where_triton_cannot_run_uses_chunked_and_says_so(tmp_path, monkeypatch):
    run = tmp_path / "run"
    fake_triton(monkeypatch)
    Pretrainer(tiny_config(run).replace("model", scan_impl="triton")).train(until_step=1)
    assert CheckpointManager(run).latest_step() == 1
    fake_triton(monkeypatch, reason="triton is not installed")
    loaded = load_pretrained(run)
    assert loaded.config.model.scan_impl == "triton" and loaded.model.scan_impl == "chunked"
    (note,) = [n for n in loaded.notes if "scan" in n]
    assert "triton is not installed" in note and "uses the chunked scan" in note


def test_cli_train_with_triton_on_a_cpu_is_one_error_line(cli, tmp_path, monkeypatch):
    """Without a GPU and without TRITON_INTERPRET=1 (or without triton, or before the kernels exist)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    run = tmp_path / "run"
    proc = cli(
        "train", "--config", "tiny", "--dummy", "--set", "model.scan_impl=triton",
        "--set", "training.device=cpu", "--checkpoint-dir", str(run), "--max-steps", "2",
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert errors[0].startswith("error: model.scan_impl=triton cannot run on cpu: ")
    assert "model.scan_impl=auto or chunked" in errors[0]
    assert not run.exists()
