"""The sharded checkpoint format (torch.distributed.checkpoint): saved by every rank, async by default, its
meta written last by rank 0 with every shard's sha256; verified, pruned, moved aside and cleaned like a
triple; loaded into any strategy at any world size, and read in one process by the commands.

The fast tests save a plain model in the sharded format in this process (no process group: DCP writes one
rank's files); the slow ones run FSDP2 in 2 and 4 processes over gloo (sharded_helpers.py).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import sharded_helpers as H
from gloo_processes import spawn
from mamba3lite.checkpoint import SLOW_SAVE_ENV, CheckpointManager, RunState
from mamba3lite.checkpoint.resume import plan_resume
from mamba3lite.checkpoint.state import full_model_state, full_optimizer_state
from mamba3lite.cli import main
from mamba3lite.errors import ConfigError
from mamba3lite.rundir import CONFIG_NAME, sharded_dir

REPO = Path(__file__).resolve().parents[1]


def trained(optimizer: str = "adamw", steps: int = 2):
    model, opt = H.build("plain", optimizer)
    H.train_steps(model, opt, steps)
    return model, opt


def full(model, opt) -> dict:
    return {"model": full_model_state(model), "optim": full_optimizer_state(model, opt)}


def save_sharded(run: Path, step: int, model, opt, **kw) -> CheckpointManager:
    ckpt = CheckpointManager(run, **kw)
    ckpt.save(step, model, opt, RunState(step=step), sharded=True)
    return ckpt


# ------------------------------------------------------------------------------------- one process
def test_async_save_returns_before_the_files_and_the_meta_comes_after(tmp_path, monkeypatch):
    model, opt = trained()
    saved = {k: v.clone() for k, v in full(model, opt)["model"].items()}
    monkeypatch.setenv(SLOW_SAVE_ENV, "1.5")  # the background writer pauses before the shards
    ckpt = CheckpointManager(tmp_path)
    t0 = time.perf_counter()
    meta_path = ckpt.save(2, model, opt, RunState(step=2), sharded=True, async_save=True)
    returned_after = time.perf_counter() - t0
    assert returned_after < 1.5, returned_after
    assert not meta_path.exists() and not (sharded_dir(tmp_path, 2) / ".metadata").exists()
    assert ckpt.pending_step() == 2 and not ckpt.status(2).loadable
    with torch.no_grad():  # training goes on: the save holds its own copy of the state
        for p in model.parameters():
            p.add_(1.0)
    ckpt.finish_pending()
    assert meta_path.exists() and ckpt.pending_step() is None
    st = ckpt.status(2)
    assert st.verified and st.sharded, st.problems
    meta = json.loads(meta_path.read_text())
    assert ".metadata" in meta["shards"]["files"] and "__0_0.distcp" in meta["shards"]["files"]
    fresh, _ = H.build("plain")
    ckpt.load(2, fresh, None)
    H.assert_same(saved, full_model_state(fresh))


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_weights_and_optimizer_round_trip_exactly(tmp_path, optimizer):
    model, opt = trained(optimizer)
    save_sharded(tmp_path, 2, model, opt)
    fresh, fresh_opt = H.build("plain", optimizer)
    meta = CheckpointManager(tmp_path).load(2, fresh, fresh_opt)
    assert meta["shards"]["optimizer"] == optimizer
    H.assert_same(full(model, opt), full(fresh, fresh_opt))
    # and training goes on identically from the loaded state
    H.train_steps(model, opt, 1)
    H.train_steps(fresh, fresh_opt, 1)
    H.assert_same(full(model, opt), full(fresh, fresh_opt))
    other = "adamw" if optimizer == "muon" else "muon"
    with pytest.raises(ConfigError, match=f"training.optimizer={optimizer}"):
        CheckpointManager(tmp_path).load(2, *H.build("plain", other))


@pytest.mark.parametrize("damage", ["flip", "delete", "delete-index"])
def test_a_damaged_or_missing_shard_file_skips_the_step_naming_it(tmp_path, damage, capsys):
    model, opt = trained()
    save_sharded(tmp_path, 2, model, opt)
    H.train_steps(model, opt, 1)
    ckpt = save_sharded(tmp_path, 3, model, opt)
    shard = sharded_dir(tmp_path, 3) / (".metadata" if damage == "delete-index" else "__0_0.distcp")
    if damage == "flip":
        raw = bytearray(shard.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        shard.write_bytes(bytes(raw))
    else:
        shard.unlink()
    ckpt = CheckpointManager(tmp_path)  # a new start: nothing hashed yet
    with pytest.warns(UserWarning, match=f"step 3 is not usable.*{shard.name}"):
        assert ckpt.latest_step() == 2
    assert str(shard) in "; ".join(ckpt.status(3).problems)
    capsys.readouterr()
    assert main(["inspect", str(tmp_path), "--verify"]) == 2
    assert shard.name in capsys.readouterr().out


def test_retention_move_aside_and_a_resave_cover_shard_directories(tmp_path):
    model, opt = trained()
    for step in (2, 4, 6):
        ckpt = save_sharded(tmp_path, step, model, opt, keep_last_n=2)
    assert ckpt.list_steps() == [4, 6] and not sharded_dir(tmp_path, 2).exists()
    where = ckpt.move_aside([6], from_step=4)
    assert (where / "dcp_step_6" / ".metadata").exists() and (where / "meta_step_6.json").exists()
    assert ckpt.list_steps() == [4]
    (sharded_dir(tmp_path, 4) / "stray").write_bytes(b"from an older save")  # a re-save starts clean
    save_sharded(tmp_path, 4, model, opt)
    assert not (sharded_dir(tmp_path, 4) / "stray").exists() and ckpt.status(4).verified


# Step 2 saved whole, then step 4 asynchronously with the test-only pause (set only now: the save of step 2
# would pause too) holding its background writer inside the save while the test kills the process.
_KILLED_SAVER = """
import os, sys, time
sys.path.insert(0, sys.argv[2])
import sharded_helpers as H
from mamba3lite.checkpoint import SLOW_SAVE_ENV, CheckpointManager, RunState
model, opt = H.build("plain")
ckpt = CheckpointManager(sys.argv[1])
ckpt.save(2, model, opt, RunState(step=2), sharded=True)
H.train_steps(model, opt, 2)
os.environ[SLOW_SAVE_ENV] = "60"
ckpt.save(4, model, opt, RunState(step=4), sharded=True, async_save=True)
print("returned", flush=True)
time.sleep(600)
"""


@pytest.mark.slow
def test_kill_during_an_async_save_leaves_the_previous_step_and_the_next_start_cleans_up(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != SLOW_SAVE_ENV} | {"OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED_SAVER, str(tmp_path), str(REPO / "tests")],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout.readline().strip() == "returned"
        deadline = time.monotonic() + 50  # the background writer makes the directory, then pauses 60 s
        while not sharded_dir(tmp_path, 4).is_dir() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert sharded_dir(tmp_path, 4).is_dir()  # the save of step 4 began
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    ckpt = CheckpointManager(tmp_path)
    with pytest.warns(UserWarning, match="dcp_step_4 holds the shards of a save that did not finish"):
        plan = plan_resume(ckpt, "latest")
    assert (plan.target, plan.torn) == (2, [4])
    plan.tidy(ckpt)
    assert not sharded_dir(tmp_path, 4).exists() and ckpt.list_steps() == [2]
    assert ckpt.status(2).verified


def test_the_rng_of_a_rank_the_saving_run_did_not_have_is_rank_0s():
    state = RunState(step=1, rng={"torch": "r0"}, rank_rngs=[{"torch": "r0"}, {"torch": "r1"}])
    assert state.rng_of(1) == {"torch": "r1"} and state.rng_of(3) == {"torch": "r0"}
    assert RunState(step=1, rng={"torch": "r0"}).rng_of(1) == {"torch": "r0"}


# ------------------------------------------------------------------------------------ many processes
@pytest.fixture(scope="module")
def saved_by_four(tmp_path_factory):
    """A run directory whose step 2 four FSDP2 processes saved asynchronously, with a config the commands
    can rebuild the model from (GPT-2's vocabulary: generate needs a tokenizer), and config.yaml."""
    from mamba3lite.config import Config

    root = tmp_path_factory.mktemp("four")
    run = root / "run"
    cfg = Config.from_dict(
        {
            "model": dataclasses.asdict(H.model_config(50257)),
            "training": {"max_seq_len": 16, "device": "cpu", "dtype": "fp32"},
            "data": {"dummy": True},
        }
    )
    spawn(4, H.save_worker, str(run), 2, "fsdp", "adamw", cfg.to_dict())
    (run / CONFIG_NAME).write_text(cfg.to_yaml())
    return run, torch.load(root / "saved.pt", weights_only=False)


@pytest.mark.slow
def test_four_processes_save_and_two_one_and_ddp_load_and_fsdp_writes_three_files(saved_by_four, tmp_path):
    run, ref = saved_by_four
    meta = json.loads((run / "meta_step_2.json").read_text())
    assert sorted(meta["shards"]["files"]) == [".metadata", *(f"__{r}_0.distcp" for r in range(4))]
    rngs = RunState.from_meta(meta).rank_rngs
    assert len(rngs) == 4 and len({r["torch"] for r in rngs}) == 4  # every rank's own generator
    # one process, no process group: DCP reads every rank's shards
    model, opt = H.build("plain", vocab=50257)
    CheckpointManager(run).load(2, model, opt)
    H.assert_same(ref, full(model, opt))
    # a three-file step of the same state, for the FSDP job below
    three = tmp_path / "three"
    CheckpointManager(three).save(2, model, opt, RunState(step=2))
    jobs = [
        (str(run), 2, "fsdp", str(tmp_path / "fsdp2.pt")),
        (str(run), 2, "ddp", str(tmp_path / "ddp2.pt")),
        (str(three), 2, "fsdp", str(tmp_path / "three_fsdp2.pt")),
    ]
    spawn(2, H.load_worker, jobs, 50257)
    for *_, out in jobs:
        H.assert_same(ref, torch.load(out, weights_only=False), out)
    for _, _, kind, out in jobs:  # what the FSDP models saved as three files, in one process
        if kind == "fsdp":
            model, opt = H.build("plain", vocab=50257)
            CheckpointManager(out + ".three").load(2, model, opt)
            H.assert_same(ref, full(model, opt), out + ".three")


@pytest.mark.slow
def test_the_commands_read_a_sharded_run_in_one_process(saved_by_four, tmp_path, capsys):
    from safetensors.torch import load_file

    from mamba3lite.interop.init_from import load_init_source

    run, ref = saved_by_four
    capsys.readouterr()
    assert main(["inspect", str(run), "--verify"]) == 0
    assert "1 of 1 steps loadable" in capsys.readouterr().out
    gen = ["generate", "--checkpoint-dir", str(run), "--prompt", "x", "--max-new-tokens", "3", "--seed", "1"]
    assert main(gen) == 0
    data = tmp_path / "tokens"
    data.mkdir()
    np.random.default_rng(0).integers(0, 50257, 400).astype("<u2").tofile(data / "shard_0000.bin")
    capsys.readouterr()
    ev = ["eval", "--checkpoint-dir", str(run), "--data-path", str(data), "--token-dtype", "uint16", "--json"]
    assert main(ev) == 0
    assert math.isfinite(json.loads(capsys.readouterr().out)["loss"])
    assert main(["export", str(run), "--out", str(tmp_path / "exported")]) == 0
    exported = load_file(tmp_path / "exported" / "model.safetensors")
    assert any(torch.equal(t, ref["model"]["embed.weight"]) for t in exported.values())
    source = load_init_source(str(run))  # --init-from
    H.assert_same({k: v for k, v in ref["model"].items()}, dict(source.state))
    assert main(["export", str(run), "--format", "hf", "--out", str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "model.safetensors").is_file() and (tmp_path / "hf" / "config.json").is_file()
    # serve: the server's loader on the sharded run, one completion over HTTP
    pytest.importorskip("fastapi", reason="the serve extra is not installed")
    import httpx

    from mamba3lite.pretrained import load_pretrained
    from serve_helpers import live_server

    loaded = load_pretrained(run)
    H.assert_same(ref["model"], {k: v for k, v in loaded.model.state_dict().items() if k in ref["model"]})
    with live_server(loaded, loaded.load_tokenizer()) as srv:
        body = {"model": "tiny", "prompt": "x", "max_tokens": 3, "temperature": 0}
        r = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text


@pytest.mark.slow
def test_the_trainer_saves_an_fsdp_model_sharded_and_resumes_it_exactly(tmp_path):
    spawn(1, H.trainer_worker, str(tmp_path))
    for run in ("straight", "resumed"):
        ckpt = CheckpointManager(tmp_path / run)
        assert ckpt.verified_steps() == [2, 4] and ckpt.status(4).sharded, run
        assert not list((tmp_path / run).glob("model_step_*"))  # no three-file step beside
    resumed = torch.load(tmp_path / "resumed.pt", weights_only=False)
    H.assert_same(torch.load(tmp_path / "straight.pt", weights_only=False), resumed)
