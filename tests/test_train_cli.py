"""`mamba3lite train` as a user runs it: dry run on the tiny preset, SIGTERM then resume, clear errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from mamba3lite.checkpoint import CheckpointManager
from mamba3lite.cli import build_parser, main
from mamba3lite.config import load_config
from mamba3lite.data.shards import write_dataset
from mamba3lite.errors import ConfigError
from mamba3lite.tokenizer import load_tokenizer
from mamba3lite.train.trainer import Pretrainer
from tiny_shapes import TINY_MODEL_SHAPE

GPT2_VOCAB = 50257


def make_gpt2_dataset(root, n_train: int = 6000, n_val: int = 1500) -> str:
    """A small prepared dataset (manifest + uint16 shards) as `prepare` would write it."""
    rng = np.random.default_rng(0)
    parts = []
    for split, n in (("train", n_train), ("val", n_val)):
        tokens = rng.integers(0, 1000, n)
        tokens[::100] = 50256
        parts.append((split, tokens, n // 100, 4 * n))
    # The real GPT-2 vocabulary hash: train refuses data whose recorded tokenizer generate cannot load.
    tokenizer = {"name": "gpt2", "vocab_hash": load_tokenizer("gpt2").vocab_hash}
    write_dataset(root, parts, vocab_size=GPT2_VOCAB, eos_id=50256, tokenizer=tokenizer)
    return str(root)


def tiny_yaml(tmp_path, **training) -> str:
    """A config file with a very small model (vocab 256) for the subprocess tests."""
    cfg = {
        "model": {
            "vocab_size": 256,
            **TINY_MODEL_SHAPE,
            "eos_id": 0,
        },
        "training": {
            "max_seq_len": 16,
            "micro_batch_size": 2,
            **({} if "global_batch_size" in training else {"gradient_accumulation_steps": 1}),  # one batch
            "dtype": "fp32",
            "device": "cpu",
            "log_every": 1,
            "warmup_steps": 1,
            "lr": 1e-3,
            "eval_every": 0,
            **training,
        },
        "data": {"dummy": True},
    }
    p = tmp_path / "tiny_test.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return str(p)


def rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_dry_run_on_the_tiny_preset(cli, tmp_path):
    data = make_gpt2_dataset(tmp_path / "data")
    run = tmp_path / "run"
    r = cli(
        "train",
        "--config",
        "tiny",
        "--data-path",
        data,
        "--checkpoint-dir",
        str(run),
        "--dry-run",
        "--set",
        "training.max_seq_len=64",
        "--set",
        "training.micro_batch_size=2",
        "--set",
        "training.global_batch_size=2",  # one micro batch per step (the preset states its global batch)
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    assert "step=      1" in r.stdout and "step=      2" in r.stdout and "loss=" in r.stdout
    mgr = CheckpointManager(run)
    assert mgr.latest_step() == 2 and mgr.status(2).verified
    meta = mgr.read_meta(2)
    assert meta["data"]["tokenizer"] == "gpt2" and meta["data"]["vocab_size"] == GPT2_VOCAB
    kinds = [(r["kind"], r["step"]) for r in rows(run)]
    assert ("train", 1) in kinds and ("train", 2) in kinds and ("eval", 2) in kinds

    # Again into the same directory: it would resume at step 2 and train nothing; refused, untouched.
    before = {p.name: p.stat().st_mtime_ns for p in run.iterdir()}
    again = cli("train", "--config", "tiny", "--data-path", data, "--checkpoint-dir", str(run), "--dry-run")
    assert again.returncode == 2 and "Traceback" not in again.stderr
    assert (
        "--dry-run trains a fresh 2-step run" in again.stderr
        and "already holds checkpoints (steps [2])" in again.stderr
    )
    assert {p.name: p.stat().st_mtime_ns for p in run.iterdir()} == before
    ev = next(r for r in rows(run) if r["kind"] == "eval")
    assert np.isfinite(ev["val_loss"]) and "val_bpb" in ev
    assert (run / "config.yaml").exists() and json.loads((run / "run.json").read_text())[
        "data_manifest_sha256"
    ]


# In this process (main() returns the exit status and prints the error line): a process start each
# costs seconds; the one below shows a real process exits 2 with that one line.
@pytest.mark.parametrize(
    "args, message",
    [
        (["--resume", "soon", "--dummy"], "--resume must be latest, none or a step number"),
        (["--set", "training.lrr=1", "--dummy"], "did you mean `lr`"),
        (["--config", "tiny_typo_preset", "--dummy"], "config not found"),
        (
            ["--dummy", "--data-path", "/some/data"],
            "--dummy trains on random tokens, --data-path on a dataset",
        ),
    ],
)
def test_bad_input_is_one_line_error(tmp_path, capsys, args, message):
    code = main(["train", "--config", tiny_yaml(tmp_path), "--checkpoint-dir", str(tmp_path / "run"), *args])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert err.startswith("error: ") and "\n" not in err and message in err, err


def test_a_missing_data_path_is_one_line_error_of_a_real_process(cli, tmp_path):
    args = ("--data-path", "/nonexistent/data")
    r = cli("train", "--config", tiny_yaml(tmp_path), "--checkpoint-dir", str(tmp_path / "run"), *args)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "does not exist" in r.stderr and "Traceback" not in r.stderr
    assert "or fix the path; random tokens on purpose, for plumbing tests: --dummy" in r.stderr


@pytest.mark.slow
def test_missing_resume_step_is_an_error(cli, tmp_path):
    cfg = tiny_yaml(tmp_path)
    run = str(tmp_path / "run")
    Pretrainer(load_config(cfg, ["training.max_steps=2", f"training.checkpoint_dir={run}"])).train()
    r = cli("train", "--config", cfg, "--checkpoint-dir", run, "--resume", "7", "--max-steps", "9")
    assert r.returncode == 2 and "step 7" in r.stderr and "Loadable steps: [2]" in r.stderr


def _train_cmd(cfg: str, run, *extra: str) -> list[str]:
    """`python -m mamba3lite train --config CFG --checkpoint-dir RUN ...` as a subprocess argv."""
    return [
        sys.executable,
        "-m",
        "mamba3lite",
        "train",
        "--config",
        cfg,
        "--checkpoint-dir",
        str(run),
        *extra,
    ]


@pytest.mark.slow
def test_sigterm_saves_exits_zero_and_resume_continues(tmp_path):
    cfg = tiny_yaml(tmp_path, max_steps=100_000, save_every=100_000)
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        _train_cmd(cfg, run),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    deadline = time.time() + 300
    metrics = run / "metrics.jsonl"
    while time.time() < deadline:
        if (
            metrics.exists()
            and sum('"kind": "train"' in line for line in metrics.read_text().splitlines()) >= 3
        ):
            break
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    stop = [r for r in rows(run) if r.get("event") == "stop"]
    assert len(stop) == 1
    stopped_at = stop[0]["step"]
    assert stopped_at >= 3 and CheckpointManager(run).latest_step() == stopped_at
    r = subprocess.run(
        _train_cmd(cfg, run, "--max-steps", str(stopped_at + 2)),
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    resumed = [r for r in rows(run) if r.get("event") == "resume"]
    assert len(resumed) == 1 and f"from step {stopped_at}" in resumed[0]["message"]
    train_steps = [r["step"] for r in rows(run) if r["kind"] == "train"]
    assert train_steps == list(range(1, stopped_at + 3))
    assert CheckpointManager(run).latest_step() == stopped_at + 2


def test_a_hand_written_config_yaml_in_the_run_directory_is_not_overwritten(tmp_path, capsys):
    # In this process: main() returns the exit status (a real process's one-line exit 2 is checked above).
    run = tmp_path / "run"
    run.mkdir()
    mine = run / "config.yaml"
    mine.write_text("# my notes\n" + Path(tiny_yaml(tmp_path)).read_text())
    before = mine.read_bytes()
    code = main(
        ["train", "--config", str(mine), "--checkpoint-dir", str(run), "--set", "training.max_steps=1"]
    )
    err = capsys.readouterr().err.strip()
    assert code == 2 and "is the run's config.yaml" in err and "\n" not in err, err
    assert mine.read_bytes() == before and sorted(p.name for p in run.iterdir()) == ["config.yaml"]
    # The trainer's own record passed back in is fine: it is rewritten as the run's record.
    assert main(["train", "--config", tiny_yaml(tmp_path), "--checkpoint-dir", str(run / "r2"),
                 "--max-steps", "1"]) == 0  # fmt: skip
    assert main(["train", "--config", str(run / "r2" / "config.yaml"), "--checkpoint-dir", str(run / "r2"),
                 "--max-steps", "2"]) == 0  # fmt: skip
    assert CheckpointManager(run / "r2").list_steps()[-1] == 2


def test_a_reader_closing_stdout_does_not_end_the_run(tmp_path):
    """`mamba3lite train ... | head -2`: the run goes on to its last step and checkpoint, exit 0 (it used to
    die silently at the first print after the pipe closed, with exit 0 and no checkpoint)."""
    cfg, run = tiny_yaml(tmp_path, max_steps=12, save_every=6), tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(_train_cmd(cfg, run), stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    proc.stdout.readline()
    proc.stdout.close()  # as `head -1` exits
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err.decode()
    assert b"standard output was closed by its reader" in err and b"Traceback" not in err
    assert CheckpointManager(run).list_steps()[-1] == 12


def test_sigterm_after_the_run_finished_still_exits_zero(tmp_path):
    cfg, run = tiny_yaml(tmp_path, max_steps=3), tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        _train_cmd(cfg, run), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    for line in proc.stdout:
        if line.startswith("done:"):
            proc.send_signal(signal.SIGTERM)  # during the interpreter's (slow, after torch) shutdown
            break
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert CheckpointManager(run).latest_step() == 3


@pytest.mark.parametrize(
    "error, where",
    [
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 512.00 MiB."), "the accelerator"),
        (RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried 8 bytes"), "host memory"),
        # numpy's, gathering a batch on the host: a MemoryError, not a RuntimeError
        (MemoryError("Unable to allocate 29.8 GiB for an array with shape (4, 1000000001)"), "host memory"),
    ],
)
def test_out_of_memory_is_one_clear_error_naming_the_knobs(tmp_path, monkeypatch, capsys, error, where):
    """A step that runs out of memory (simulated) ends `train` with exit 2, one line naming the batch
    knobs, no traceback; the checkpoints already written stay."""
    from mamba3lite import cli

    run_dir = tmp_path / "run"
    config = tiny_yaml(tmp_path, max_steps=2, save_every=2, checkpoint_dir=str(run_dir))
    assert cli.main(["train", "--config", config]) == 0
    before = sorted(p.name for p in run_dir.rglob("*"))

    def boom(self, *a, **k):
        raise error

    monkeypatch.setattr(Pretrainer, "train", boom)
    capsys.readouterr()
    rc = cli.main(["train", "--config", config, "--max-steps", "4"])
    err = capsys.readouterr().err
    assert rc == 2
    assert f"out of memory on {where}" in err
    fix = "--set training.micro_batch_size=1 --set training.global_batch_size=2"  # the batch pinned
    assert fix in err
    args = build_parser().parse_args(["train", "--config", "tiny", *fix.split()])  # a command that parses
    assert args.overrides == fix.split()[1::2]
    assert "training.grad_checkpointing=true" in err and "Traceback" not in err
    assert sorted(p.name for p in run_dir.rglob("*")) == before


def test_out_of_memory_while_the_model_is_built_does_not_advise_smaller_batches(
    tmp_path, monkeypatch, capsys
):
    from mamba3lite import cli
    from mamba3lite.model import count_parameters

    config = tiny_yaml(tmp_path, max_steps=2, checkpoint_dir=str(tmp_path / "run"))

    def boom(self, *a, **k):
        raise RuntimeError(
            "DefaultCPUAllocator: can't allocate memory: you tried to allocate 13174571008 bytes"
        )

    monkeypatch.setattr(Pretrainer, "__init__", boom)
    assert cli.main(["train", "--config", config]) == 2
    err = capsys.readouterr().err
    n = count_parameters(load_config(config).model)
    assert (
        "out of memory on host memory while building the model" in err
        and f"{n / 1e6:,.1f}M parameters" in err
    )
    assert "Use a smaller model" in err and "micro_batch_size" not in err and "Traceback" not in err


def test_a_model_that_cannot_fit_is_refused_before_it_is_built(tmp_path, capsys, monkeypatch):
    """10^8 layers: no single allocation fails, building them would take hours. Refused at once, one
    line naming the size and the memory, nothing written; on a device, by its memory (16 bytes per
    parameter for weights, gradients, AdamW), here a simulated 1 GiB one."""
    from mamba3lite import cli
    from mamba3lite.model import memory

    run = tmp_path / "run"
    config = tiny_yaml(tmp_path, max_steps=2, checkpoint_dir=str(run))
    assert cli.main(["train", "--config", config, "--set", "model.n_layers=100000000"]) == 2
    err = capsys.readouterr().err
    assert "more than this machine's RAM" in err and "n_layers 100000000" in err and "Traceback" not in err
    assert not run.exists()
    cfg = load_config(config).model
    monkeypatch.setattr(memory, "physical_memory_bytes", lambda d: 1 << 30 if d.type == "cuda" else None)
    with pytest.raises(ConfigError, match=r"cuda:0's memory, 1\.0 GiB"):
        memory.check_model_fits(cfg.__class__(**{**cfg.__dict__, "d_model": 4096}), torch.device("cuda:0"))
    memory.check_model_fits(cfg, torch.device("cuda:0"))  # the tiny model fits


def test_out_of_memory_advice_names_compile_when_it_is_on():
    from mamba3lite.config import load_config
    from mamba3lite.train.entry import out_of_memory_advice

    cfg = load_config("tiny")
    oom = torch.OutOfMemoryError("CUDA out of memory.")
    assert "training.compile=false" not in out_of_memory_advice(oom, cfg)
    cfg.training.compile = True
    advice = out_of_memory_advice(oom, cfg)
    assert "--set training.compile=false" in advice and "training.grad_checkpointing=true" in advice


def test_out_of_memory_advice_keeps_the_global_batch_and_names_fsdp_when_replicated():
    from mamba3lite.config import load_config
    from mamba3lite.train.entry import out_of_memory_advice

    oom = torch.OutOfMemoryError("CUDA out of memory.")
    cfg = load_config("tiny", ["training.micro_batch_size=4", "training.global_batch_size=16"])
    one = out_of_memory_advice(oom, cfg)
    # the global batch is stated: halving the micro batch keeps it, nothing else to set
    assert "keep the batch: --set training.micro_batch_size=2, or --set training.grad_checkpointing" in one
    assert "global_batch_size" not in one and "parallelism" not in one  # one process: nothing to shard
    eight = out_of_memory_advice(oom, load_config("tiny", ["training.parallelism=ddp"]), world_size=8)
    assert "--set training.parallelism=fsdp" in eight and "8 processes" in eight
    sharded = load_config("tiny", ["training.parallelism=fsdp"])
    assert "parallelism" not in out_of_memory_advice(oom, sharded, world_size=8)
    built = out_of_memory_advice(oom, load_config("tiny", ["training.parallelism=ddp"]), True, world_size=8)
    assert "while building the model" in built and "--set training.parallelism=fsdp" in built
    assert "micro_batch_size" not in built


def test_other_runtime_errors_are_not_called_out_of_memory(tmp_path, monkeypatch):
    from mamba3lite import cli

    config = tiny_yaml(tmp_path, max_steps=1, checkpoint_dir=str(tmp_path / "run"))

    def boom(self, *a, **k):
        raise RuntimeError("something else broke")

    monkeypatch.setattr(Pretrainer, "train", boom)
    with pytest.raises(RuntimeError, match="something else broke"):
        cli.main(["train", "--config", config])


@pytest.mark.slow
def test_resume_keeps_the_global_batch_unless_it_is_set_explicitly(cli, tmp_path):
    """A run of 2 x 1 windows per step resumed with accumulation 2 would train on twice the batch:
    refused in one line naming both values and both fixes; set explicitly, it resumes and says so."""
    cfg = tiny_yaml(tmp_path)
    run = tmp_path / "run"
    Pretrainer(load_config(cfg, ["training.max_steps=2", f"training.checkpoint_dir={run}"])).train()
    r = cli(*_train_cmd(cfg, run, "--max-steps", "3", "--set", "training.gradient_accumulation_steps=2")[3:])
    assert r.returncode == 2 and "Traceback" not in r.stderr
    (line,) = [x for x in r.stderr.splitlines() if "global batch" in x]
    assert line.startswith("error: checkpoint step 2")
    assert "global batch of 2 windows" in line and "this run's is 4" in line
    assert "--set training.global_batch_size=2" in line and "--set training.global_batch_size=4" in line
    ok = cli(*_train_cmd(cfg, run, "--max-steps", "3", "--set", "training.global_batch_size=4")[3:])
    assert ok.returncode == 0, ok.stderr
    warned = [r["message"] for r in rows(run) if r.get("event") == "warning"]
    notes = [m for m in warned if "global_batch" in m]
    assert len(notes) == 1 and "changed from 2 (checkpoint step 2) to 4" in notes[0]
    assert CheckpointManager(run).read_meta(3)["global_batch_windows"] == 4


def test_plan_prints_each_ranks_estimate_without_building_anything(tmp_path, monkeypatch, capsys):
    from mamba3lite import cli
    from mamba3lite.model.memory import per_rank_memory

    run = tmp_path / "run"
    config = tiny_yaml(tmp_path, checkpoint_dir=str(run), global_batch_size=16)
    monkeypatch.setattr(Pretrainer, "__init__", lambda *a, **k: pytest.fail("--plan built a trainer"))
    fsdp = ["--set", "training.parallelism=fsdp", "--device-memory-gib", "80"]
    assert cli.main(["train", "--config", config, "--plan", "--nproc", "4", *fsdp]) == 0
    out = capsys.readouterr().out.splitlines()
    # the config's training.dtype is fp32: activations estimated without autocast
    est = per_rank_memory(load_config(config).model, load_config(config).training, shards=4, compute=None)
    assert out[0].endswith("fsdp: 4 data-parallel x 1 context-parallel; model state in 4 shard(s)")
    assert "micro batch 2, 2 accumulated per data-parallel process" in out[1]  # 16 / (2 x 4)
    assert out[2] == "compute: fp32 (training.dtype)"
    assert out[3] == "per rank (GiB): " + " | ".join(f"{k} {v:,.2f}" for k, v in est.parts_gib().items())
    assert out[4] == "device planned for: 80.0 GiB (72.0 usable): fits"
    assert not run.exists()
    # context parallel 2 on the same 4 processes: 2 data-parallel ranks, sharded over all 4, T / 2 each
    cp = ["--set", "training.context_parallel=2"]
    assert cli.main(["train", "--config", config, "--plan", "--nproc", "4", *fsdp, *cp]) == 0
    out = capsys.readouterr().out.splitlines()
    t = load_config(config).replace("training", context_parallel=2).training
    est = per_rank_memory(load_config(config).model, t, shards=4, compute=None)
    assert out[0].endswith("fsdp: 2 data-parallel x 2 context-parallel; model state in 4 shard(s)")
    assert out[3] == "per rank (GiB): " + " | ".join(f"{k} {v:,.2f}" for k, v in est.parts_gib().items())
    # torchrun's WORLD_SIZE when --nproc is not given; a device too small is said not to fit
    monkeypatch.setenv("WORLD_SIZE", "2")
    tight = ["--set", "training.parallelism=ddp", "--device-memory-gib", "0.0001"]
    assert cli.main(["train", "--config", config, "--plan", *tight]) == 0
    out = capsys.readouterr().out
    assert "on 2 process(es), ddp" in out and "model state in 1 shard(s)" in out and "does NOT fit" in out
    # a global batch that does not split over the processes: the run's own error, one line
    assert cli.main(["train", "--config", config, "--plan", "--nproc", "3"]) == 2
    assert "does not split into micro batches" in capsys.readouterr().err


def test_plan_of_the_hybrid_preset_counts_its_attention_layers(monkeypatch, capsys):
    """`train --config mamba3_180m_hybrid --plan`: the packaged hybrid resolves and plans without building
    anything; its activations are the hybrid's estimate (attention's grow with the window), not the pure
    180M's."""
    from mamba3lite import cli
    from mamba3lite.model.memory import per_rank_memory

    monkeypatch.setattr(Pretrainer, "__init__", lambda *a, **k: pytest.fail("--plan built a trainer"))
    args = ["train", "--config", "mamba3_180m_hybrid", "--plan", "--nproc", "1", "--device-memory-gib", "80",
            "--set", "training.device=cuda"]  # fmt: skip
    assert cli.main(args) == 0
    out = capsys.readouterr().out.splitlines()
    cfg = load_config("mamba3_180m_hybrid").replace("training", device="cuda")
    assert cfg.model.attn_layer_idx == (2, 6, 10)
    est = per_rank_memory(cfg.model, cfg.training, compute=torch.bfloat16)
    pure = load_config("mamba3_180m").replace("training", device="cuda")
    pure_est = per_rank_memory(pure.model, pure.training, compute=torch.bfloat16)
    assert out[3] == "per rank (GiB): " + " | ".join(f"{k} {v:,.2f}" for k, v in est.parts_gib().items())
    assert est.parts_gib() != pure_est.parts_gib()
    assert out[4] == "device planned for: 80.0 GiB (72.0 usable): fits"


def test_the_mfu_of_a_hybrid_counts_attentions_t2_term(tmp_path):
    """A hybrid's training rows: MFU is model/flops.py's train FLOPs per token at the run's window, its
    attention part (q·kᵀ and the weights' product with v, growing with T) included, times tokens/s over
    the peak (`training.peak_tflops`: the CPU has none to look up)."""
    from mamba3lite.model import model_flops_per_token

    run = tmp_path / "run"
    config = tiny_yaml(tmp_path, max_steps=2, max_seq_len=64, peak_tflops=0.001, checkpoint_dir=str(run))
    doc = yaml.safe_load(Path(config).read_text())
    doc["model"].update(n_layers=2, attn_layer_idx=[1], attn_cfg={"num_heads": 2, "rotary_emb_dim": 4})
    Path(config).write_text(yaml.safe_dump(doc))
    assert main(["train", "--config", config]) == 0
    cfg = load_config(config)
    parts = model_flops_per_token(cfg.model, 64)
    assert parts["attention"] == 2 * 2 * 2 * 8 * (64 + 1) / 2  # 2 matmuls x 2 heads of 8 x (T + 1) / 2 keys
    without = 3 * (parts["forward"] - parts["attention"])  # what MFU would be without the T² term
    train_rows = [r for r in rows(run) if r["kind"] == "train"]
    assert len(train_rows) == 2
    for r in train_rows:
        assert r["mfu"] == pytest.approx(parts["train"] * r["tokens_per_s"] / 1e9, rel=1e-6)
        assert r["mfu"] > without * r["tokens_per_s"] / 1e9 * (1 + 1e-3)
