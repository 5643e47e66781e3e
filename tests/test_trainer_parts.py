"""The small objects the trainer is made of, each alone: the steps' input (step_input.py), the agreed
stop (stop.py), the run record it keeps (run_record.py), the loading path's facts (loading.py), the
average's refusal of a sharded model (averaging.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mamba3lite.checkpoint import CheckpointManager, RunState
from mamba3lite.config import Config
from mamba3lite.data import WindowSampler
from mamba3lite.data.shards import MANIFEST_NAME
from mamba3lite.errors import ConfigError, DataError
from mamba3lite.train.averaging import NoAverage, build_average
from mamba3lite.train.loading import resume_facts
from mamba3lite.train.run_record import RunRecord, check_not_a_dataset
from mamba3lite.train.step_input import StepInput
from mamba3lite.train.stop import AgreedStop, StopFlag

T = 4


class Windows:
    """A dataset of `n` windows whose tokens are their own index; `bad` ones are damaged."""

    def __init__(self, n: int, bad: set[int] = frozenset()) -> None:
        self.n, self.bad = n, bad

    def __len__(self) -> int:
        return self.n

    def get_batch(self, indices):
        if self.bad & set(indices):
            raise DataError(f"shard_00000.bin: windows {sorted(self.bad & set(indices))} are damaged")
        x_BT = torch.tensor([[i] * T for i in indices])
        return x_BT, x_BT + 1


ONE_PROCESS = SimpleNamespace(cut=lambda x, y: (x, y), dp_rank=0, dp_size=1)


def step_input(data, prefetch: int = 0, accum: int = 2) -> StepInput:
    tc = Config().replace("training", micro_batch_size=2, gradient_accumulation_steps=accum, max_seq_len=T,
                          seed=3, prefetch_batches=prefetch).training  # fmt: skip
    return StepInput(data, tc, ONE_PROCESS, accum, torch.device("cpu"))


@pytest.mark.parametrize("prefetch", [0, 2])
def test_step_input_draws_the_samplers_windows_in_order_and_says_when_an_epoch_begins(prefetch):
    inp, epochs = step_input(Windows(10), prefetch), []
    order = WindowSampler(10, 4, seed=3, shuffle=True)
    try:
        for step in range(5):  # 2 steps of 4 windows an epoch (2 left over)
            batches = inp.draw(lambda step=step: epochs.append(step))
            want = order.next_batch()
            assert [int(x[0, 0]) for x_BT, _ in batches for x in x_BT.split(1)] == want
            assert inp.sampler.state_dict() == order.state_dict()  # consumed: the checkpoint's position
    finally:
        inp.prefetcher.close()
    assert epochs == [2, 4] and inp.take_wait() >= 0.0 and inp.wait_s == 0.0


def test_a_damaged_batch_runs_as_zeros_and_its_error_puts_the_sampler_back():
    order = WindowSampler(10, 4, seed=3, shuffle=True)
    order.next_batch()  # the first step's windows: clean
    inp = step_input(Windows(10, bad=set(order.next_batch()[:1])))
    inp.draw(lambda: None)
    before = inp.sampler.state_dict()
    batches = inp.draw(lambda: None)
    assert inp.damage is not None and all(int(x.abs().sum()) == 0 for x, _ in batches) and len(batches) == 2
    error = inp.damaged_error(step=2)
    assert "are damaged" in str(error) and inp.damage is None and inp.sampler.state_dict() == before
    # another rank's damage: this rank names it
    assert "another rank's batch for step 7" in str(inp.damaged_error(step=7))


def test_agreed_stop_reads_the_steps_agreement_once_then_asks_the_ranks():
    flag, asked = StopFlag(announce=False), []
    alone = AgreedStop(flag, None)
    assert alone.now() is False
    flag.request("test")
    assert alone.now() is True
    ranks = AgreedStop(StopFlag(announce=False), lambda mine: asked.append(mine) or True)
    ranks.settled = False  # what the step's one agreement read
    assert ranks.now() is False and asked == []  # no collective of its own
    assert ranks.now() is True and asked == [False]  # nothing settled since: a fresh agreement
    ranks.settled = False
    ranks.unsettle()  # an evaluation or a save took time after the step
    assert ranks.now() is True and asked == [False, False]


def test_run_record_continues_the_wandb_run_a_checkpoint_recorded(tmp_path):
    ckpt = CheckpointManager(tmp_path)
    ckpt.save(5, torch.nn.Linear(2, 2), None, RunState(step=5, wandb_run_id="run-abc"))
    record = RunRecord("latest")
    record.continue_wandb(ckpt, -1)  # a fresh start: nothing to continue
    assert record.wandb_run_id is None
    record.continue_wandb(ckpt, 5)
    assert record.wandb_run_id == "run-abc"
    record.continue_wandb(ckpt, 9)  # no such checkpoint: left as it was
    assert record.wandb_run_id == "run-abc"


def test_a_dataset_directory_is_not_a_run_directory(tmp_path):
    check_not_a_dataset(tmp_path)
    (tmp_path / MANIFEST_NAME).write_text("{}")
    with pytest.raises(ConfigError, match=r"is a dataset directory .* point --checkpoint-dir at a run"):
        check_not_a_dataset(tmp_path)


def test_resume_facts_are_this_runs():
    cfg = Config().replace("training", global_batch_size=64, micro_batch_size=16, max_seq_len=128)
    facts = resume_facts(cfg, {"vocab_size": 5}, "RUN")
    assert facts["model"] == cfg.to_dict()["model"] and facts["data"] == {"vocab_size": 5}
    assert (facts["max_seq_len"], facts["global_batch_windows"], facts["global_batch_explicit"]) == (
        128,
        64,
        True,
    )


def test_an_average_of_a_sharded_model_is_refused_and_off_is_no_average():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match=r"ema_decay is 0.9 but this run shards its model \(fsdp\)"):
        build_average(model, 0.9, sharded_by="fsdp")
    assert isinstance(build_average(model, 0.0, sharded_by="fsdp"), NoAverage)
    assert build_average(model, 0.9).decay == 0.9
