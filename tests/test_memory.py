"""model/memory.py per rank: the model state divided over its shards, activations over the context-parallel
size, Muon's smaller state, the refusal that names fsdp, and the 3B/7B presets' fit on 8 x 80 GB."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from mamba3lite.config import TrainingConfig, load_config
from mamba3lite.errors import ConfigError
from mamba3lite.model import Mamba3Transformer, ModelConfig, count_parameters, memory
from mamba3lite.model.memory import (
    activation_bytes,
    activation_bytes_per_token,
    check_model_fits,
    optimizer_state_bytes,
    per_rank_memory,
    replicated_fits,
    saved_bytes,
    saved_bytes_per_token,
    shard_count,
    training_memory_bytes,
)
from mamba3lite.model.transformer import Block
from mamba3lite.optimizers import is_hidden_matrix
from tiny_shapes import TINY_MODEL_SHAPE

CONFIGS = Path(__file__).resolve().parents[1] / "src" / "mamba3lite" / "configs"
SMALL = ModelConfig(vocab_size=256, eos_id=0, **TINY_MODEL_SHAPE)
TC = TrainingConfig(micro_batch_size=2, max_seq_len=32, global_batch_size=16, device="cpu")
GIB = 2**30


def test_bytes_per_token_do_not_depend_on_the_length():
    """Why the measurement may run at PROBE_TOKENS: the layer keeps the same bytes per token at any
    length (chunks of 8 here; one, two and eight chunks between the two lengths measured)."""
    torch.manual_seed(0)
    layer = Block(SMALL)
    per_token = {t: saved_bytes_per_token(layer, SMALL.d_model, t) for t in (16, 32, 128)}
    assert len(set(per_token.values())) == 1 and per_token[16] > 0, per_token


@pytest.mark.parametrize("compute", [torch.bfloat16, None], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", [{}, {"is_mimo": True, "mimo_rank": 2, "d_model": 32, "headdim": 16}])
def test_the_fake_forward_counts_what_a_real_forward_keeps(shape, compute):
    """The measurement runs on fake tensors (no arithmetic, so a 7B layer is cheap); a real forward at
    the same compute dtype (bf16 autocast, or none: fp32) keeps exactly the bytes it counts, SISO and
    MIMO, at two lengths."""
    cfg = dataclasses.replace(SMALL, **shape)
    torch.manual_seed(0)
    layer = Block(cfg)
    for t in (16, 40):
        real = saved_bytes(layer, cfg.d_model, t, compute=compute)
        assert saved_bytes(layer, cfg.d_model, t, fake=True, compute=compute) == real > 0, (t, real)


@pytest.mark.parametrize("shape", [{}, {"is_mimo": True, "mimo_rank": 2, "d_model": 32, "headdim": 16}])
def test_an_fp32_run_keeps_about_twice_the_activation_bytes_of_a_bf16_one(shape):
    """Without autocast (an fp32 run) the activations stay fp32: 1.78x bf16's bytes per token for this
    layer, 1.83x MIMO, 1.81-1.85x the tiny to 1.5B presets' (not 2x: some of what the layer keeps is
    fp32 under bf16 autocast too). Measured once per dtype: the cache tells them apart."""
    cfg = dataclasses.replace(SMALL, **shape)
    bf16 = activation_bytes_per_token(cfg, 64, torch.bfloat16)
    fp32 = activation_bytes_per_token(cfg, 64, None)
    assert 1.7 * bf16 < fp32 < 1.9 * bf16, (bf16, fp32)
    assert activation_bytes_per_token(cfg, 64) == bf16  # bf16 is the default, as before
    assert activation_bytes(cfg, 2, 64, compute=None) == pytest.approx(cfg.n_layers * 2 * 64 * fp32)


def test_model_state_divides_by_the_shards_and_activations_by_context_parallel():
    n = count_parameters(SMALL)
    one = per_rank_memory(SMALL, TC, shards=1)
    assert (one.params, one.grads, one.optimizer, one.gathered) == (4 * n, 4 * n, 8 * n, 0)
    assert one.total == pytest.approx(training_memory_bytes(SMALL, 2, 32))  # the one-process estimate
    four = per_rank_memory(SMALL, TC, shards=4)
    assert (four.params, four.grads, four.optimizer) == (n, n, 2 * n)
    assert four.activations == one.activations and four.gathered > 0  # a gathered block, not sharded
    cp = per_rank_memory(SMALL, TC, shards=4, context_parallel=2)
    assert cp.activations == pytest.approx(activation_bytes(SMALL, 2, 32, context_parallel=2))
    # T / C tokens per window, measured as the last rank runs them: a Mamba-3 piece also keeps how much
    # of the incoming state each token sees (a few bytes a token)
    assert one.activations / 2 < cp.activations < 1.05 * one.activations / 2
    deep = dataclasses.replace(SMALL, n_layers=4)
    resharded = per_rank_memory(deep, TC, shards=4)
    kept = per_rank_memory(deep, dataclasses.replace(TC, reshard_after_forward=False), shards=4)
    assert kept.gathered > resharded.gathered  # every block stays gathered from forward to backward


def test_shard_count_per_strategy():
    assert shard_count("ddp", 8) == 1
    assert shard_count("fsdp", 8) == 8
    assert shard_count("hsdp", 8, dp_replicate=2) == 4
    assert shard_count("fsdp", 1) == 1  # one process shards nothing
    with pytest.raises(ConfigError, match="auto is resolved first"):
        shard_count("auto", 8)


def test_muon_keeps_one_moment_for_the_hidden_matrices():
    """Muon's state: 4 bytes per element of the matrices the registry's rule gives it, AdamW's 8 for the
    rest, divided over the shards (tests/test_optimizers.py: what the built optimizer holds)."""
    cfg = dataclasses.replace(SMALL, n_layers=2)
    model = Mamba3Transformer(cfg)
    real = sum(p.numel() for name, p in model.named_parameters() if is_hidden_matrix(name, p))
    n = count_parameters(cfg)
    assert 0 < real < n and optimizer_state_bytes(cfg, "muon") == 4 * real + 8 * (n - real)
    muon = per_rank_memory(cfg, dataclasses.replace(TC, optimizer="muon"), shards=2)
    assert muon.optimizer == (4 * real + 8 * (n - real)) / 2
    assert per_rank_memory(cfg, TC, shards=2).optimizer == 8 * n / 2


def test_replicated_fits_by_the_estimate(monkeypatch):
    need = per_rank_memory(SMALL, TC).total
    gpu = torch.device("cuda:0")
    monkeypatch.setattr(memory, "physical_memory_bytes", lambda d: need / memory.USABLE_FRACTION + 1)
    assert replicated_fits(SMALL, TC, gpu)
    monkeypatch.setattr(memory, "physical_memory_bytes", lambda d: need / memory.USABLE_FRACTION - 1)
    assert not replicated_fits(SMALL, TC, gpu)
    monkeypatch.setattr(memory, "physical_memory_bytes", lambda d: None)
    assert replicated_fits(SMALL, TC, gpu)  # unknown memory: nothing to decide from


def test_a_model_that_fits_only_sharded_is_refused_with_fsdp_named(monkeypatch):
    cfg = load_config(CONFIGS / "mamba3_7b.yaml").model
    n = count_parameters(cfg)
    monkeypatch.setattr(memory, "physical_memory_bytes", lambda d: 80e9 if d.type == "cuda" else None)
    with pytest.raises(ConfigError) as e:
        check_model_fits(cfg, torch.device("cuda:0"))
    msg = str(e.value)
    assert f"{n / 1e6:,.1f}M parameters" in msg and "training.parallelism=fsdp" in msg
    assert "--nproc_per_node 2" in msg  # 16 bytes x 6.7B = 108 GB: two shards of 80 GB hold it
    check_model_fits(cfg, torch.device("cuda:0"), shards=8)  # fsdp over 8: not refused


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mamba3_3b", "mamba3_7b"])
def test_the_3b_and_7b_presets_fit_8_x_80gb_with_fsdp_and_not_replicated(name):
    cfg = load_config(CONFIGS / f"{name}.yaml")
    t = cfg.training
    assert t.parallelism == "fsdp"
    usable = 72 * GIB  # of 80 GB, what the other presets are sized to
    fsdp = per_rank_memory(cfg.model, t, shards=shard_count("fsdp", 8))
    ddp = per_rank_memory(cfg.model, t, shards=shard_count("ddp", 8))
    assert fsdp.total <= usable < ddp.total, (fsdp.total / GIB, ddp.total / GIB)
    assert t.accumulation(8) * t.micro_batch_size * 8 == t.global_batch_size == 256


def test_the_readme_memory_table_renders_each_presets_estimate():
    from mamba3lite.report.memory_table import memory_table_markdown

    cfg = load_config("tiny")
    ddp = per_rank_memory(cfg.model, cfg.training, shards=1).total
    fsdp = per_rank_memory(cfg.model, cfg.training, shards=4).total
    between = (fsdp + ddp) / 2 / memory.USABLE_FRACTION / GIB  # a device that holds fsdp's rank only
    head, rule, row = memory_table_markdown(["tiny"], world_size=4, device_gib=between).splitlines()
    assert "ddp x 4" in head and "fsdp x 4" in head and rule.startswith("|---|")
    n = count_parameters(cfg.model)
    assert row == (
        f"| `tiny` | {n / 1e6:,.0f}M | {cfg.training.micro_batch_size} | {ddp / GIB:,.1f} | "
        f"{fsdp / GIB:,.1f} | no / yes |"
    )
    assert (
        memory_table_markdown(["tiny"], world_size=4, device_gib=80).splitlines()[2].endswith("| yes / yes |")
    )
