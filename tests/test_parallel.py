"""The parallelism seam (train/parallel/): every strategy trains the same numbers as one process, DDP
reduces during the backward, a steady step reads the device once, and bad layouts are one clear error.

The equality runs share one recipe: a global batch of 8 windows of micro-batch 1 (8 micro-steps on one
process, 4 on each of 2, 2 on each of 4), clipping active (grad_clip 0.05 is far below the tiny
model's gradient norm), and non-finite micro-steps injected on ONE rank at step 2. The sampler gives
rank r of n the windows [r·8/n, (r+1)·8/n) of each global batch, so the micro-steps every rank then
skips together are a set of windows that the one-process reference skips by injection: windows 1, 3,
5 and 7 at every process count (micro-step 1 of each rank at 4 processes, 1 and 3 at 2), so one
reference per optimizer serves every run.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from mamba3lite.checkpoint import CheckpointManager
from mamba3lite.config import Config, TrainingConfig
from mamba3lite.errors import ConfigError
from mamba3lite.train.faults import INJECT_ENV
from mamba3lite.train.parallel import Parallelism, StepTally, plan_layout
from mamba3lite.train.parallel.process_group import DistInfo
from test_distributed import install_hook, losses, train, write_config

EQUAL_RECIPE = (
    "--set", "training.micro_batch_size=1", "--set", "training.gradient_accumulation_steps=8",
    "--set", "training.max_steps=6", "--set", "training.grad_clip=0.05", "--set", "training.eval_every=0",
    "--set", "training.save_every=100", "--set", "training.warmup_steps=2",
)  # fmt: skip
SAVE_EVERY_2 = ("--set", "training.save_every=2")

SKIPPED_WINDOWS = (1, 3, 5, 7)  # of step 2's global batch, at every process count


def skipped_micro_steps(nproc: int) -> tuple[str, list[int]]:
    """(the injection for a run of `nproc` processes, the micro-steps of step 2 every rank then skips):
    on the last rank only, its micro-steps of step 2 whose windows are SKIPPED_WINDOWS in its block
    (rank r's micro-step i reads window r·accum + i; the agreement skips micro-step i on every rank)."""
    accum = 8 // nproc
    micro = sorted({w % accum for w in SKIPPED_WINDOWS})
    assert sorted(r * accum + i for r in range(nproc) for i in micro) == list(SKIPPED_WINDOWS)
    return ",".join(f"r{nproc - 1}@{accum + i}" for i in micro), micro


_references: dict[tuple[str, ...], Path] = {}


def reference(tmp_path_factory, optimizer: str, monkeypatch, *model: str) -> Path:
    """The run directory of one process training the recipe with `optimizer` (and `model` settings),
    SKIPPED_WINDOWS skipped at step 2, a checkpoint every 2 steps; trained once per session (a reference
    is read, never written)."""
    key = (optimizer, *model)
    if key not in _references:
        root = tmp_path_factory.mktemp("ref")
        with monkeypatch.context() as m:
            m.setenv(INJECT_ENV, skipped_micro_steps(1)[0])
            opts = (*EQUAL_RECIPE, *SAVE_EVERY_2, "--set", f"training.optimizer={optimizer}", *model)
            train(write_config(root), root / "run", 1, *opts)
        _references[key] = root / "run"
    return _references[key]


def assert_the_losses_of_one_process(run, ref, nproc: int) -> None:
    """`run` (of `nproc` processes, injected by skipped_micro_steps) logged the reference's losses, skipped
    the injected micro-steps of step 2 on every rank, and clipped."""
    got, want = losses(run), losses(ref)
    assert sorted(got) == sorted(want) == [1, 2, 3, 4, 5, 6]
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-5), (step, got, want)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    skips = [r["message"] for r in rows if r.get("event") == "nan_skip"]
    micro = skipped_micro_steps(nproc)[1]
    assert len(skips) == len(micro), skips
    assert all(f"micro-step {i} of step 2" in m for i, m in zip(micro, skips)), skips
    (step2,) = [r for r in rows if r["kind"] == "train" and r["step"] == 2]
    assert step2["skipped"] == len(micro)
    # clipping was active: the logged (pre-clip) norms are far above grad_clip
    assert min(r["grad_norm"] for r in rows if r["kind"] == "train") > 0.05
    start = next(r for r in rows if r.get("event") == "start")
    assert f"{nproc} x cpu" in start["message"]


# Each strategy once with each optimizer it treats differently, one 4-process case (hsdp needs 2 x 2).
# DDP with Muon equals one process in test_distributed.py (each rank's Muon steps on the same all-reduced
# gradients); fsdp with AdamW equals one process at 4 processes, losses, weights and optimizer state, in
# test_a_sharded_checkpoint_resumes_at_any_world_size_and_strategy below (its run does these checks too).
@pytest.mark.slow
@pytest.mark.parametrize(
    "strategy,nproc,optimizer,extra",
    [
        ("fsdp", 2, "muon", ("--set", "training.reshard_after_forward=false")),
        ("ddp", 2, "adamw", ()),
        (
            "hsdp",
            4,
            "muon",
            ("--set", "training.dp_replicate=2", "--set", "training.grad_checkpointing=true"),
        ),
    ],
)
def test_a_strategy_trains_the_losses_of_one_process(
    tmp_path, tmp_path_factory, monkeypatch, strategy, nproc, optimizer, extra
):
    ref = reference(tmp_path_factory, optimizer, monkeypatch)
    monkeypatch.setenv(INJECT_ENV, skipped_micro_steps(nproc)[0])
    run = tmp_path / "run"
    opts = ("--set", f"training.optimizer={optimizer}", "--set", f"training.parallelism={strategy}", *extra)
    train(write_config(tmp_path), run, nproc, *EQUAL_RECIPE, *opts)
    assert_the_losses_of_one_process(run, ref, nproc)


def _loaded(run, step: int, config):
    """(weights, optimizer state by parameter name) of checkpoint `step` of `run`, read in this one
    process (no process group) through the manager's one loader, whatever format the step is in."""
    from mamba3lite.checkpoint.optim_state import optimizer_state_by_name
    from mamba3lite.config import load_config
    from mamba3lite.model import Mamba3Transformer
    from mamba3lite.train.optim import build_optimizer

    cfg = load_config(config)
    model = Mamba3Transformer(cfg.model)
    optimizer = build_optimizer(model, cfg.training)
    CheckpointManager(run).load(step, model, optimizer, map_location="cpu")
    return model.state_dict(), optimizer_state_by_name(optimizer, model)["state"]


@pytest.mark.slow
def test_a_sharded_checkpoint_resumes_at_any_world_size_and_strategy(tmp_path, tmp_path_factory, monkeypatch):
    """fsdp at 4 processes (AdamW, the recipe's skips injected) trains the one-process run's losses and
    writes sharded (DCP) steps holding its weights and optimizer state; its step 2 resumes at fsdp 2,
    then at one process (each time from step 2, the later steps deleted, nothing injected), and every
    continuation has the uninterrupted run's losses. (A DDP model loads 4 processes'
    shards exactly in test_checkpoint_sharded.py, and the trainer resumes DDP across world sizes in
    test_distributed.py.) (AdamW: Muon's
    bf16 Newton-Schulz turns last-bit differences of the reduction order into ~1e-4 weight differences,
    which a few more steps make visible in the loss.)"""
    ref_dir = reference(tmp_path_factory, "adamw", monkeypatch)
    config = write_config(tmp_path)
    opts = (*EQUAL_RECIPE, *SAVE_EVERY_2, "--set", "training.optimizer=adamw")
    run = tmp_path / "run"
    with monkeypatch.context() as m:
        m.setenv(INJECT_ENV, skipped_micro_steps(4)[0])
        train(config, run, 4, *opts, "--set", "training.parallelism=fsdp")
    assert_the_losses_of_one_process(run, ref_dir, 4)
    for step in (2, 4, 6):
        assert (run / f"dcp_step_{step}").is_dir() and not (run / f"model_step_{step}.safetensors").exists()
        (ref_w, ref_o), (got_w, got_o) = (_loaded(d, step, config) for d in (ref_dir, run))
        assert sorted(ref_w) == sorted(got_w)
        for k in ref_w:
            torch.testing.assert_close(got_w[k], ref_w[k], rtol=1e-4, atol=1e-6)
        assert ref_o.keys() == got_o.keys() and len(ref_o) > 5
        for name, state in ref_o.items():
            for k, v in state.items():
                torch.testing.assert_close(got_o[name][k], v, rtol=1e-3, atol=1e-8)
    ref = losses(ref_dir)
    for nproc, strategy in ((2, "fsdp"), (1, "auto")):
        for step in (4, 6):
            CheckpointManager(run).delete(step)
        train(config, run, nproc, *opts, "--set", f"training.parallelism={strategy}")
        got = losses(run)
        assert sorted(got) == [1, 2, 3, 4, 5, 6]
        for step in ref:
            assert got[step] == pytest.approx(ref[step], rel=1e-5), (nproc, strategy, step, got, ref)


# A hybrid: Mamba-3 then attention (GQA-free, rotary, the conv over qkv), packed documents.
HYBRID = (
    "--set", "model.n_layers=2", "--set", "model.attn_layer_idx=[1]", "--set", "model.reset_at_eos=true",
    "--set", "model.attn_cfg={num_heads: 2, rotary_emb_dim: 4, d_conv: 4}",
)  # fmt: skip


@pytest.mark.slow
def test_a_hybrid_trains_the_losses_of_one_process_and_its_sharded_checkpoint_reshards(
    tmp_path, tmp_path_factory, monkeypatch
):
    """ddp x2 and fsdp x2 (activation checkpointing on) train a hybrid's one-process losses, the recipe's
    skips injected; the fsdp run's sharded step 2 resumes on one process with the uninterrupted losses.
    The wrapping is per block, whatever its mixer (AdamW: see the test above for why)."""
    ref = reference(tmp_path_factory, "adamw", monkeypatch, *HYBRID)
    config = write_config(tmp_path)
    opts = (*EQUAL_RECIPE, "--set", "training.optimizer=adamw", *HYBRID)
    ddp, fsdp = tmp_path / "ddp", tmp_path / "fsdp"
    with monkeypatch.context() as m:
        m.setenv(INJECT_ENV, skipped_micro_steps(2)[0])
        train(config, ddp, 2, *opts, "--set", "training.parallelism=ddp")
        sharded = ("--set", "training.parallelism=fsdp", "--set", "training.grad_checkpointing=true")
        train(config, fsdp, 2, *opts, *SAVE_EVERY_2, *sharded)
    assert_the_losses_of_one_process(ddp, ref, 2)
    assert_the_losses_of_one_process(fsdp, ref, 2)
    assert (fsdp / "dcp_step_2").is_dir()
    for step in (4, 6):
        CheckpointManager(fsdp).delete(step)
    train(config, fsdp, 1, *opts, *SAVE_EVERY_2, "--set", "training.parallelism=auto")
    rows = [json.loads(line) for line in (fsdp / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r.get("event") == "resume"] == [2]
    got, want = losses(fsdp), losses(ref)
    assert sorted(got) == [1, 2, 3, 4, 5, 6]
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-5), (step, got, want)


# Loaded by every torchrun worker: records, per rank, when DDP's reducer hook runs relative to each
# micro-step's backward, every all_reduce outside a backward (with its element count), and every
# device-to-host read (item/tolist/__float__/__bool__/__int__) outside the model's own code, per step.
INSTRUMENT = """
import json, os, traceback
if os.environ.get("RANK") is not None and os.environ.get("SEAM_TRACE_DIR"):
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from mamba3lite.train import trainer
    from mamba3lite.train.parallel import strategies

    events = []
    state = {"in_backward": False}
    out = os.path.join(os.environ["SEAM_TRACE_DIR"], "rank" + os.environ["RANK"] + ".json")

    def recording_hook(process_group, bucket):
        events.append(["hook", state["in_backward"]])
        return default_hooks.allreduce_hook(process_group, bucket)

    original_wrap = strategies.Replicated.wrap

    def wrap(self, model, compile):
        wrapped = original_wrap(self, model, compile)
        self.ddp.register_comm_hook(None, recording_hook)
        return wrapped

    strategies.Replicated.wrap = wrap

    original_backward = torch.Tensor.backward

    def backward(self, *args, **kwargs):
        events.append(["backward"])
        state["in_backward"] = True
        try:
            return original_backward(self, *args, **kwargs)
        finally:
            state["in_backward"] = False
            events.append(["backward_end"])

    torch.Tensor.backward = backward

    original_all_reduce = dist.all_reduce

    def all_reduce(tensor, *args, **kwargs):
        if not state["in_backward"]:
            events.append(["all_reduce", tensor.numel()])
        return original_all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = all_reduce

    def counted(name):
        original = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            stack = traceback.extract_stack(limit=40)
            if not any("mamba3lite/model/" in f.filename for f in stack):
                events.append(["read", name, stack[-2].filename.split("/")[-1]])
            return original(self, *args, **kwargs)

        setattr(torch.Tensor, name, read)

    for name in ("item", "tolist", "__float__", "__bool__", "__int__"):
        counted(name)

    original_step = trainer.Pretrainer.train_step

    def train_step(self):
        events.append(["step"])
        try:
            return original_step(self)
        finally:
            events.append(["step_end"])

    trainer.Pretrainer.train_step = train_step
    original_train = trainer.Pretrainer.train

    def train(self, *args, **kwargs):
        try:
            return original_train(self, *args, **kwargs)
        finally:
            events.append(["end"])
            with open(out, "w") as f:
                json.dump(events, f)

    trainer.Pretrainer.train = train
"""


def per_step(events: list) -> list[list]:
    """The events inside each train_step (not the evaluations, checkpoints and the run's end between
    and after them)."""
    steps: list[list] = []
    inside = False
    for e in events:
        if e[0] == "step":
            steps.append([])
            inside = True
        elif e[0] in ("step_end", "end"):
            inside = False
        elif inside:
            steps[-1].append(e)
    return steps


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_ddp_reduces_during_the_last_backward_and_a_steady_step_reads_the_device_once(
    tmp_path, monkeypatch, strategy
):
    install_hook(tmp_path, monkeypatch, INSTRUMENT)
    monkeypatch.setenv("SEAM_TRACE_DIR", str(tmp_path))
    config = write_config(tmp_path)
    opts = (
        "--set",
        "training.eval_every=0",
        "--set",
        "training.save_every=100",
        "--set",
        "training.max_steps=5",
        "--set",
        "training.gradient_accumulation_steps=4",  # global 8 windows: 2 micro-steps of 2 on each rank
    )
    train(config, tmp_path / "run", 2, *opts, "--set", f"training.parallelism={strategy}")
    for rank in (0, 1):
        steps = per_step(json.loads((tmp_path / f"rank{rank}.json").read_text()))
        assert len(steps) == 5
        for i, events in enumerate(steps[1:], start=2):  # step 1 is the start-up window
            reads = [e for e in events if e[0] == "read"]
            assert len(reads) <= 1, (i, reads)
            assert reads and reads[0][1] == "tolist" and reads[0][2] == "tally.py", reads
            outside = [e[1] for e in events if e[0] == "all_reduce"]
            # per micro-step the finiteness agreement (1 element), then the step's settle (3 elements);
            # never a gradient-sized all-reduce after a backward
            assert outside == [1, 1, 3], (i, outside)
            if strategy != "ddp":
                continue
            marks = [e[0] if e[0] != "hook" else ("hook_in" if e[1] else "hook_out") for e in events]
            # accumulation 2: the first backward under no_sync runs no hook; the last one runs DDP's
            # reducer hooks while it is in progress; no hook runs outside a backward
            first, last = marks.index("backward"), len(marks) - 1 - marks[::-1].index("backward")
            assert "hook_in" not in marks[first:last] and "hook_out" not in marks
            assert marks[last + 1 :].count("hook_in") >= 1
            assert marks.index("backward_end", last) > max(j for j, m in enumerate(marks) if m == "hook_in")


def test_a_skipped_micro_step_back_propagates_exact_zeros():
    """NaN x 0 is NaN: the tally masks with torch.where, so a non-finite loss's backward adds exactly
    nothing, also when the NaN was made from the loss (fault injection's way)."""
    from mamba3lite.train.faults import FaultInjector

    w = torch.nn.Parameter(torch.tensor([1.5, -2.0]))
    tally = StepTally(torch.device("cpu"), None, 1)
    faults = FaultInjector({1})
    for _ in range(2):
        loss = faults.apply((w**2).sum())
        tally.admit(loss).backward()
    assert torch.equal(w.grad, 2 * w.detach())  # the first micro-step's gradient, nothing from the second
    assert faults.micro_count == 2
    outcome = tally.settle(torch.tensor(1.0), stop=False, damaged=False)
    assert outcome.finite == [True, False] and outcome.good == 1
    assert outcome.loss_mean == pytest.approx(6.25) and not outcome.stop and not outcome.damaged


def test_rescale_and_clip_use_the_good_micro_steps_and_read_nothing(monkeypatch):
    par = Parallelism.local(torch.device("cpu"))
    w = torch.nn.Parameter(torch.zeros(3))
    tally = par.tally()
    spoiled = w.sum() * 8.0 + float("nan")  # NaN in value, finite in its backward (as faults.py makes)
    for loss in (w.sum() * 2.0, spoiled, w.sum() * 4.0):
        (tally.admit(loss) / 3).backward()
    reads = []
    monkeypatch.setattr(torch.Tensor, "item", lambda self: reads.append(self) or 0.0)
    norm = par.reduce_and_clip([w], tally, max_norm=1.0, accum=3)
    assert reads == []
    # mean over the two good micro-steps: (2 + 4) / 2 = 3 per element, norm 3·√3, clipped to 1
    assert float(norm) == pytest.approx(3 * math.sqrt(3))
    assert float(w.grad.norm()) == pytest.approx(1.0, rel=1e-5)


def test_a_nan_inside_the_backward_shows_in_the_gradient_norm():
    """A NaN born in the model (not only in its loss) reaches the gradients through the masked backward
    (0 x NaN); the norm the step reads is then non-finite, and the gradient guard skips the step."""
    par = Parallelism.local(torch.device("cpu"))
    w = torch.nn.Parameter(torch.ones(3))
    tally = par.tally()
    (tally.admit((w * float("nan")).sum()) / 1).backward()
    norm = par.reduce_and_clip([w], tally, max_norm=1.0, accum=1)
    outcome = tally.settle(norm, stop=False, damaged=False)
    assert outcome.finite == [False] and not math.isfinite(outcome.grad_norm)


def tc(**kw) -> TrainingConfig:
    return Config().replace("training", **kw).training


def test_layouts_from_the_config():
    assert plan_layout(tc(), 1).strategy == "local"
    assert plan_layout(tc(), 4, fits_replicated=True) == plan_layout(tc(parallelism="ddp"), 4)
    assert plan_layout(tc(), 4, fits_replicated=False).strategy == "fsdp"
    ddp, fsdp = plan_layout(tc(parallelism="ddp"), 4), plan_layout(tc(parallelism="fsdp"), 4)
    assert (ddp.dp_replicate, ddp.dp_shard, ddp.dp_size) == (4, 1, 4)
    assert (fsdp.dp_replicate, fsdp.dp_shard, fsdp.dp_size) == (1, 4, 4)
    hsdp = plan_layout(tc(parallelism="hsdp", dp_replicate=2), 8)
    assert (hsdp.strategy, hsdp.mesh_shape, hsdp.dp_size) == ("hsdp", (2, 4, 1), 8)
    assert plan_layout(tc(dp_replicate=2), 4).strategy == "hsdp"  # auto with replicas asked for
    # context parallel: world = data-parallel x C; sharded over every rank, the cp ones included
    cp_ddp = plan_layout(tc(parallelism="ddp", context_parallel=2), 4)
    assert (cp_ddp.mesh_shape, cp_ddp.dp_size, cp_ddp.shards) == ((2, 1, 2), 2, 1)
    cp_fsdp = plan_layout(tc(parallelism="fsdp", context_parallel=2), 4)
    assert (cp_fsdp.mesh_shape, cp_fsdp.dp_size, cp_fsdp.shards) == ((1, 2, 2), 2, 4)
    assert plan_layout(tc(context_parallel=2), 2).mesh_shape == (1, 1, 2)  # one data-parallel rank


@pytest.mark.parametrize(
    "settings,world,message",
    [
        ({"parallelism": "hsdp", "dp_replicate": 3}, 4, r"dp_replicate 3 does not divide the 4 processes"),
        (
            {"parallelism": "hsdp", "dp_replicate": 1},
            4,
            r"hsdp needs replicas .* training.dp_replicate is 1 of 4",
        ),
        ({"parallelism": "hsdp", "dp_replicate": 4}, 4, r"dp_replicate is 4 of 4 processes \(1 is fsdp"),
        ({"parallelism": "hsdp", "dp_replicate": 2}, 1, r"dp_replicate is 2 but this is one process"),
        ({"context_parallel": 2}, 1, r"context_parallel is 2 but this is one process"),
        ({"context_parallel": 3}, 4, r"context_parallel 3 does not divide the 4 processes"),
        ({"context_parallel": 2, "max_seq_len": 15}, 4, r"does not divide the window of 15 tokens"),
        ({"context_parallel": 2, "eval_tasks": ["piqa"]}, 4, r"eval_tasks .* with training.context_par"),
        ({"context_parallel": 2, "parallelism": "hsdp", "dp_replicate": 2}, 8, r"hsdp is not supported"),
        (
            {"parallelism": "fsdp", "eval_tasks": ["piqa"]},
            2,
            r"eval_tasks .* cannot run under parallelism fsdp",
        ),
    ],
)
def test_a_layout_that_cannot_be_built_is_one_clear_error(settings, world, message):
    with pytest.raises(ConfigError, match=message):
        plan_layout(tc(**settings), world)


def test_one_process_is_the_plain_module():
    par = Parallelism.from_config(Config(), DistInfo())
    model = torch.nn.Linear(2, 2)
    assert par.wrap(model) is model and par.name == "local" and not par.is_sharded
    assert (par.dp_size, par.dp_rank, par.mesh) == (1, 0, None)
