"""Weight averaging (`training.ema_decay`, train/averaging.py): the average against a hand computation,
its checkpoint (a fourth file the meta vouches for), exact resume with it, load_pretrained and export
reading it, and a checkpoint without one (older, or a run that does not average) loading as before."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from mamba3lite.checkpoint import CheckpointManager
from mamba3lite.config import Config, TrainingConfig
from mamba3lite.errors import ConfigError
from mamba3lite.interop.export import checkpoint_state, exported_step
from mamba3lite.pretrained import load_pretrained
from mamba3lite.rundir import average_file, checkpoint_files
from mamba3lite.train.averaging import NoAverage, WeightAverage, build_average
from mamba3lite.train.trainer import INJECT_ENV, Pretrainer
from tiny_shapes import TINY_MODEL_SHAPE

OLD_RUN = Path(__file__).parent / "data" / "run_v1_step2"  # written before averaging existed


def test_the_average_is_the_ema_of_the_weights_after_each_step():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2).double()
    model.bias.requires_grad_(False)  # frozen: not averaged, kept as the model has it
    avg, decay, seen = WeightAverage(model, 0.9), 0.9, []
    for _ in range(4):
        with torch.no_grad():
            model.weight.add_(torch.randn_like(model.weight))
        seen.append(model.weight.detach().clone())
        avg.update(model)
    w1, w2, w3, w4 = seen
    by_hand = decay * (decay * (decay * w1 + 0.1 * w2) + 0.1 * w3) + 0.1 * w4  # the first update copies
    assert avg.updates == 4 and set(avg.weights) == {"weight"}
    torch.testing.assert_close(avg.weights["weight"], by_hand, rtol=1e-12, atol=1e-12)
    state = avg.averaged_state(model)
    torch.testing.assert_close(state["weight"], by_hand, rtol=1e-12, atol=1e-12)
    assert torch.equal(state["bias"], model.bias) and not torch.equal(state["weight"], model.weight)
    again = WeightAverage(model, 0.9)
    again.load_state_dict(avg.state_dict())
    assert again.updates == 4 and torch.equal(again.weights["weight"], avg.weights["weight"])
    assert again.weights["weight"] is not avg.weights["weight"]  # a copy: the other's updates stay its own


def test_off_is_an_average_that_does_nothing_and_the_config_checks_the_decay():
    model = torch.nn.Linear(2, 2)
    off = build_average(model, 0.0)
    off.update(model)
    assert isinstance(off, NoAverage) and off.averaged_state(model) is None and off.state_dict() is None
    assert isinstance(build_average(model, 0.5), WeightAverage)
    for bad in (1.0, -0.1, float("nan")):
        with pytest.raises(ConfigError, match=r"training.ema_decay must be in \[0, 1\)"):
            TrainingConfig(ema_decay=bad)
    with pytest.raises(ConfigError, match="not supported for sharded models"):
        TrainingConfig(ema_decay=0.9, parallelism="fsdp")


def tiny(run_dir, **training) -> Config:
    cfg = Config().replace("model", vocab_size=64, eos_id=0, **TINY_MODEL_SHAPE).replace("data", dummy=True)
    base = dict(max_seq_len=16, micro_batch_size=2, gradient_accumulation_steps=1, max_steps=6,
                warmup_steps=2, lr=1e-2, min_lr=1e-3, log_every=1, save_every=1000, eval_every=0,
                dtype="fp32", device="cpu", checkpoint_dir=str(run_dir), keep_last_n=0, ema_decay=0.5,
                progress=False)  # fmt: skip
    return cfg.replace("training", **{**base, **training})


def test_resume_with_averaging_is_exact_and_users_read_the_average(tmp_path):
    whole = Pretrainer(tiny(tmp_path / "a"))
    whole.train()
    first = Pretrainer(tiny(tmp_path / "b"))
    first.train(until_step=3)
    meta = json.loads(checkpoint_files(tmp_path / "b", 3)["meta"].read_text())
    assert meta["average"] == {"decay": 0.5, "updates": 3} and "average" in meta["files"]
    second = Pretrainer(tiny(tmp_path / "b"))
    second.train()
    assert second.average.updates == whole.average.updates == 6
    for name, w in whole.average.weights.items():
        assert torch.equal(second.average.weights[name], w), name
    raw = {k: v.clone() for k, v in whole.raw_model.state_dict().items()}
    avg = whole.average.averaged_state(whole.raw_model)
    # the checkpoint: the raw weights in model_step_6, the average beside them
    loaded = load_pretrained(tmp_path / "a")
    assert loaded.weights == "averaged weights (EMA, decay 0.5, 6 steps)"
    assert any("averaged weights" in n and "not the trained weights of step 6" in n for n in loaded.notes)
    got = loaded.model.state_dict()
    assert all(torch.equal(got[k], avg[k]) for k in avg) and not torch.equal(
        got["embed.weight"], raw["embed.weight"]
    )
    _, got, notes = exported_step(tmp_path / "a", None)
    exported = checkpoint_state(got)
    assert (
        torch.equal(exported["embed.weight"], avg["embed.weight"])
        and "exported the run's averaged" in notes[-1]
    )
    # training goes on from the raw weights: a resume loads model_step_N, not the average
    third = Pretrainer(tiny(tmp_path / "a", max_steps=7))
    third._restore(6)
    assert all(torch.equal(third.raw_model.state_dict()[k], raw[k]) for k in raw)
    assert torch.equal(third.average.weights["embed.weight"], whole.average.weights["embed.weight"])


def test_the_average_file_is_verified_and_deleted_with_its_step(tmp_path):
    Pretrainer(tiny(tmp_path, max_steps=2)).train()
    ckpt, path = CheckpointManager(tmp_path), average_file(tmp_path, 2)
    assert ckpt.status(2, need_optimizer=False).verified
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    st = ckpt.status(2, need_optimizer=False)
    assert not st.loadable and any(str(path) in p and "sha256" in p for p in st.problems)
    ckpt.delete(2)
    assert not path.exists() and ckpt.list_steps() == []


def test_a_checkpoint_without_an_average_loads_as_before(tmp_path):
    shutil.copytree(OLD_RUN, tmp_path / "v1")
    old = load_pretrained(tmp_path / "v1")
    assert (old.step, old.weights) == (2, "trained") and not any("averaged" in n for n in old.notes)
    Pretrainer(tiny(tmp_path / "old", ema_decay=0.0)).train()
    meta = json.loads(checkpoint_files(tmp_path / "old", 6)["meta"].read_text())
    assert "average" not in meta and "average" not in meta["files"]
    assert not average_file(tmp_path / "old", 6).exists()
    loaded = load_pretrained(tmp_path / "old")
    assert loaded.weights == "trained" and not any("averaged" in n for n in loaded.notes)
    # a run that starts averaging on a checkpoint without an average: the average starts anew there
    t = Pretrainer(tiny(tmp_path / "old", max_steps=8))
    t.train()
    assert t.average.updates == 2
    assert json.loads(checkpoint_files(tmp_path / "old", 8)["meta"].read_text())["average"]["updates"] == 2


def test_a_rollback_takes_the_average_back_to_the_checkpoints(tmp_path, monkeypatch):
    # saves at 2 and 4; micro-steps 10..12 (steps 6-7) are non-finite: back to step 4, then on to 8
    monkeypatch.setenv(INJECT_ENV, "10:3")
    t = Pretrainer(tiny(tmp_path, max_steps=8, save_every=2, gradient_accumulation_steps=2,
                        nan_guard_max_consecutive=3))  # fmt: skip
    result = t.train()
    assert (result.step, result.rollbacks) == (8, 1)
    # steps 1-5 before the failure; the average of step 4 restored, then steps 5-8 again
    assert t.average.updates == 8
    meta = json.loads(checkpoint_files(tmp_path, 8)["meta"].read_text())
    assert meta["average"]["updates"] == 8
