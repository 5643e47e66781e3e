"""The plugin's registration and its errors, without an engine: vLLM loads our config class and model for
an export, and each bad case (an untested vLLM, a directory that is not an export) is one `error:` line
from vllm_cli, with no traceback."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch
from vllm_helpers import ENGINE_ENV, NO_VLLM, export, tiny_model

pytest.importorskip("vllm", reason=NO_VLLM)

from mamba3lite.errors import ConfigError
from mamba3lite.interop.hf_export import ARCHITECTURE
from mamba3lite.vllm_plugin import register

VLLM_CLI = [sys.executable, "-m", "mamba3lite.vllm_plugin.vllm_cli"]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    return export(tiny_model(), tmp_path_factory.mktemp("plugin"))


def test_register_makes_the_export_loadable_without_remote_code(exported):
    from transformers import AutoConfig
    from vllm import ModelRegistry
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    register()
    register()  # vLLM calls it once per process; twice is harmless
    config = AutoConfig.from_pretrained(exported, trust_remote_code=False)
    assert type(config).__name__ == "VllmMamba3LiteConfig" and config.mamba3lite["headdim"] == 32
    assert ARCHITECTURE in ModelRegistry.get_supported_archs()
    assert MODELS_CONFIG_MAP[ARCHITECTURE].__name__ == "Mamba3LiteModelConfig"


def test_an_untested_vllm_is_refused(monkeypatch):
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.99.0")
    with pytest.raises(ConfigError, match=r"tested with vLLM 0\.32\.x, not 0\.99\.0"):
        register()


def run_cli(*args: str, prelude: str = "") -> subprocess.CompletedProcess:
    """vllm_cli ARGS in a subprocess (after `prelude`, Python run first in that process)."""
    code = (
        f"{prelude}\nimport runpy; runpy.run_module('mamba3lite.vllm_plugin.vllm_cli', run_name='__main__')"
    )
    return subprocess.run(
        [sys.executable, "-c", code, *args], env={**os.environ, **ENGINE_ENV}, capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip


def test_serving_a_directory_that_is_not_an_export_is_one_error(exported, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in exported.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    config = json.loads((bad / "config.json").read_text())
    del config["mamba3lite"]
    (bad / "config.json").write_text(json.dumps(config))
    proc = run_cli("serve", str(bad), "--port", "0")
    assert proc.returncode != 0
    assert "error: config.json has no 'mamba3lite' section" in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr


def test_an_untested_vllm_stops_vllm_cli_with_one_error(exported):
    proc = run_cli("serve", str(exported), prelude="import vllm; vllm.__version__ = '0.99.0'")
    assert proc.returncode != 0
    assert "error: the mamba3lite vLLM plugin was tested with vLLM 0.32.x, not 0.99.0" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_state_shapes_from_the_config_are_the_layers(exported):
    from types import SimpleNamespace

    from transformers import AutoConfig

    from mamba3lite.vllm_plugin.model import Mamba3LiteForCausalLM, model_config_of

    register()
    hf = AutoConfig.from_pretrained(exported)
    cfg = model_config_of(hf)
    vllm_config = SimpleNamespace(model_config=SimpleNamespace(hf_config=hf, dtype=torch.bfloat16))
    shapes = Mamba3LiteForCausalLM.get_mamba_state_shape_from_config(vllm_config)
    dtypes = Mamba3LiteForCausalLM.get_mamba_state_dtype_from_config(vllm_config)
    H, P, N, S = cfg.nheads, cfg.headdim, cfg.d_state, cfg.n_angles
    assert shapes == ((H, S), (H, P, N), (1, H, N), (H, P))  # the state's parts, batch axis dropped
    assert dtypes == (torch.float32, torch.float32, torch.bfloat16, torch.bfloat16)


def test_load_weights_takes_an_export_and_names_each_bad_tensor(exported):
    from safetensors.torch import load_file
    from torch import nn

    from mamba3lite.errors import CheckpointError
    from mamba3lite.vllm_plugin.model import Mamba3LiteForCausalLM

    tensors = load_file(exported / "model.safetensors")
    holder = nn.Module()  # the vLLM model's parameters without an engine: ours under `model.`
    holder.model = tiny_model()
    with torch.no_grad():
        for p in holder.parameters():
            p.zero_()
    load = Mamba3LiteForCausalLM.load_weights
    assert load(holder, tensors.items()) == set(tensors)
    assert all(torch.equal(holder.get_parameter(k), v) for k, v in tensors.items())
    name = "model.layers.0.mixer.in_proj.weight"
    with pytest.raises(CheckpointError, match=re.escape("holds 'model.extra'")):
        load(holder, [*tensors.items(), ("model.extra", torch.zeros(1))])
    with pytest.raises(CheckpointError, match=re.escape(f"'{name}' has shape")):
        load(holder, [(k, v[:1] if k == name else v) for k, v in tensors.items()])
    with pytest.raises(CheckpointError, match=re.escape(f"lacks 1 tensor(s) the model needs, e.g. '{name}'")):
        load(holder, [(k, v) for k, v in tensors.items() if k != name])


HYBRID = {"attn_layer_idx": [1], "attn_cfg": {"num_heads": 2, "num_heads_kv": 1}}


def test_a_hybrid_export_is_routed_to_the_hybrid_class(exported, tmp_path):
    """The config vLLM reads names the hybrid architecture and the attention heads it sizes pages by; the
    pure class refuses a hybrid config (an overridden architecture) and the other way round."""
    from types import SimpleNamespace

    from transformers import AutoConfig

    from mamba3lite.vllm_plugin import HYBRID_ARCHITECTURE
    from mamba3lite.vllm_plugin.model import Mamba3LiteForCausalLM, Mamba3LiteHybridForCausalLM

    register()
    pure = AutoConfig.from_pretrained(exported)
    assert pure.architectures == [ARCHITECTURE] and getattr(pure, "num_attention_heads", 0) == 0
    config = json.loads((exported / "config.json").read_text())
    config["mamba3lite"] |= HYBRID
    (tmp_path / "config.json").write_text(json.dumps(config))
    hybrid = AutoConfig.from_pretrained(tmp_path)
    assert hybrid.architectures == [HYBRID_ARCHITECTURE]
    assert (hybrid.num_attention_heads, hybrid.num_key_value_heads, hybrid.head_dim) == (2, 1, 32)
    for cls, hf in ((Mamba3LiteForCausalLM, hybrid), (Mamba3LiteHybridForCausalLM, pure)):
        parallel = SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1)
        vllm_config = SimpleNamespace(model_config=SimpleNamespace(hf_config=hf), parallel_config=parallel)
        with pytest.raises(ConfigError, match=f"{cls.architecture} cannot serve this export"):
            cls(vllm_config=vllm_config)


def test_a_hybrid_that_resets_at_eos_is_one_error(exported):
    from transformers import AutoConfig

    from mamba3lite.vllm_plugin.model import model_config_of

    register()
    hf = AutoConfig.from_pretrained(exported)
    hf.mamba3lite = {**hf.mamba3lite, **HYBRID, "reset_at_eos": True}
    with pytest.raises(ConfigError, match="reset_at_eos is true in a hybrid"):
        model_config_of(hf)
    hf.mamba3lite = {**hf.mamba3lite, "attn_layer_idx": [], "attn_cfg": {}}  # a pure model may
    assert model_config_of(hf).reset_at_eos


def test_the_page_is_sized_by_the_largest_state(exported):
    """vLLM sizes one page for every state layer from the model class: a conv window wider than a Mamba-3
    state sizes it (the other states are padded to it)."""
    from transformers import AutoConfig

    from mamba3lite.vllm_plugin.model import largest_state_spec, model_config_of

    register()
    hf = AutoConfig.from_pretrained(exported)
    cfg = model_config_of(hf)
    mamba = largest_state_spec(cfg, torch.float32)
    hf.mamba3lite = {**hf.mamba3lite, **HYBRID}
    hf.mamba3lite["attn_cfg"] = {**HYBRID["attn_cfg"], "d_conv": 4}
    assert largest_state_spec(model_config_of(hf), torch.float32) == mamba  # 3 x 128 floats: smaller
    hf.mamba3lite["attn_cfg"] = {**HYBRID["attn_cfg"], "d_conv": 200}
    assert largest_state_spec(model_config_of(hf), torch.float32) == (((199, 128),), (torch.float32,))


def test_vllm_cli_refuses_a_hybrid_that_resets_at_eos_with_one_error(exported, tmp_path):
    bad = tmp_path / "eos"
    bad.mkdir()
    for f in exported.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    config = json.loads((bad / "config.json").read_text())
    config["mamba3lite"] |= {**HYBRID, "reset_at_eos": True}
    (bad / "config.json").write_text(json.dumps(config))
    proc = run_cli("serve", str(bad), "--port", "0")
    assert proc.returncode != 0
    assert "error: model.reset_at_eos is true in a hybrid" in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
