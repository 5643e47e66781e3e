"""The optimizers' registry (mamba3lite/optimizers.py: each entry names what builds it): the config's
choices are the registry, a name it does not know is one error wherever it arrives, the memory estimate
counts exactly the state each optimizer holds, and an optimizer registered by a test alone (no other file
touched) is chosen by the config, built, trained, checkpointed, resumed and counted."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mamba3lite import optimizers
from mamba3lite.checkpoint import CheckpointManager
from mamba3lite.checkpoint.optim_state import check_optimizer_kind, optimizer_state_by_name
from mamba3lite.checkpoint.state import full_optimizer_state, torch_optimizers
from mamba3lite.config import OPTIMIZERS, Config, TrainingConfig, load_config
from mamba3lite.errors import CheckpointError, ConfigError
from mamba3lite.model import Mamba3Transformer
from mamba3lite.model.memory import check_model_fits, optimizer_state_bytes, per_rank_memory
from mamba3lite.optimizers import OptimizerKind, lookup
from mamba3lite.train import optim
from mamba3lite.train.optim import build_optimizer
from mamba3lite.train.trainer import Pretrainer
from test_trainer import metrics, tiny_config
from tiny_shapes import TINY_MODEL_SHAPE

MODEL = Config().replace("model", vocab_size=64, eos_id=0, **{**TINY_MODEL_SHAPE, "n_layers": 2}).model


@pytest.fixture
def sgd(monkeypatch):
    """ "sgd" registered for this test only, as a user adds an optimizer torch provides: one registry
    entry (torch's class and its options), no other file or function."""
    kind = OptimizerKind(
        "sgd", "SGD with momentum", lambda name, p: 4, "torch.optim:SGD", options={"momentum": 0.9}
    )
    monkeypatch.setitem(optimizers.KINDS, "sgd", kind)
    return kind


def held_state_bytes(optimizer) -> int:
    """Bytes of the per-element state an optimizer holds (tensors shaped like their parameter; AdamW's
    scalar step counts are not per element)."""
    total = 0
    for part in torch_optimizers(optimizer).values():
        for p, state in part.state.items():
            total += sum(v.nbytes for v in state.values() if torch.is_tensor(v) and v.shape == p.shape)
    return total


def one_step(model_cfg, optimizer_name: str):
    torch.manual_seed(0)
    model = Mamba3Transformer(model_cfg)
    opt = build_optimizer(model, TrainingConfig(optimizer=optimizer_name, device="cpu", dtype="fp32"))
    model(torch.arange(16).view(1, 16)).float().mean().backward()
    opt.step()
    return model, opt


def test_the_configs_choices_are_the_registry_and_every_optimizer_has_a_builder():
    assert OPTIMIZERS is optimizers.KINDS and set(OPTIMIZERS) == {"adamw", "muon"}
    for name in OPTIMIZERS:
        assert callable(optim.builder(OPTIMIZERS[name]))
        assert f"{name}: " in TrainingConfig.__dataclass_fields__["optimizer"].metadata["help"]


@pytest.mark.parametrize("name", ["adamw", "muon", "sgd"])
@pytest.mark.parametrize(
    "model",
    [{}, {"tie_embeddings": False}, {"n_layers": 3, "attn_layer_idx": (1,), "attn_cfg": {"num_heads": 2}}],
    ids=["tied-head", "own-head", "hybrid"],
)
def test_the_memory_estimate_counts_the_state_the_built_optimizer_holds(sgd, name, model):
    cfg = dataclasses.replace(MODEL, **model)
    _, opt = one_step(cfg, name)
    assert optimizer_state_bytes(cfg, name) == held_state_bytes(opt) > 0
    for shards in (1, 2):
        training = TrainingConfig(optimizer=name, micro_batch_size=1, max_seq_len=16)
        assert per_rank_memory(cfg, training, shards=shards).optimizer == held_state_bytes(opt) / shards


def test_an_unknown_name_is_one_error_wherever_it_arrives(tmp_path):
    says = r"training\.optimizer must be one of adamw, muon, got 'muom'; did you mean `muon`\?"
    with pytest.raises(ConfigError, match=says):
        load_config("tiny", ["training.optimizer=muom"])
    with pytest.raises(ConfigError, match=says):
        TrainingConfig(optimizer="muom")
    wrong = TrainingConfig()
    wrong.optimizer = "adan"  # past the config's own check
    arg = r"training\.optimizer names the optimizer 'adan', which is none of adamw, muon"
    with pytest.raises(ConfigError, match=arg):
        build_optimizer(Mamba3Transformer(MODEL), wrong)
    with pytest.raises(ConfigError, match=arg):
        optimizer_state_bytes(MODEL, "adan")
    with pytest.raises(ConfigError, match=arg):
        check_model_fits(MODEL, torch.device("cpu"), optimizer="adan")
    _, opt = one_step(MODEL, "adamw")
    says = r"optim_step_2\.pt \(the optimizer state's record\) names the optimizer 'adan', which is none of"
    with pytest.raises(CheckpointError, match=says + r" adamw, muon; did you mean `adamw`\?"):
        check_optimizer_kind("adan", opt, str(tmp_path / "optim_step_2.pt"))
    with pytest.raises(CheckpointError, match=r"names the optimizer None, which is none of adamw, muon$"):
        check_optimizer_kind(None, opt, "optim_step_2.pt")  # a damaged record


def test_a_registered_optimizer_is_chosen_built_checkpointed_resumed_and_counted(sgd, tmp_path):
    model, opt = one_step(MODEL, "sgd")
    assert type(opt) is torch.optim.SGD and opt.kind == "sgd"
    assert torch_optimizers(opt) == {"": opt}
    saved = full_optimizer_state(model, opt)
    assert saved["optimizer"] == "sgd" and saved == {
        **optimizer_state_by_name(opt, model),
        "format": saved["format"],
    }
    with pytest.raises(ConfigError, match=r"holds the state of training\.optimizer=sgd"):
        check_optimizer_kind("sgd", build_optimizer(model, TrainingConfig()), "optim_step_2.pt")

    run = tmp_path / "run"
    first = Pretrainer(tiny_config(run, max_steps=2, save_every=2, optimizer="sgd")).train()
    assert CheckpointManager(run).list_steps() == [2]
    resumed = Pretrainer(tiny_config(run, max_steps=4, save_every=2, optimizer="sgd"), resume="latest")
    assert type(resumed.optimizer) is torch.optim.SGD and first.step == 2
    result = resumed.train()
    straight = Pretrainer(tiny_config(tmp_path / "straight", max_steps=4, optimizer="sgd")).train()
    # the same losses as a run that never stopped: the weights and SGD's momentum came back exactly
    assert [x for _, x in result.history][-2:] == [x for _, x in straight.history][-2:]
    assert any(r.get("event") == "resume" for r in metrics(run))
    with pytest.raises(ConfigError, match=r"holds the state of training\.optimizer=sgd"):
        Pretrainer(tiny_config(run, max_steps=6, optimizer="adamw"), resume="latest").train()


def test_lookup_returns_the_registered_kind():
    assert lookup("muon").parts == ("adamw", "muon") and lookup("adamw").parts == ()
