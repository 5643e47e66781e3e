"""One optimizer step's account, kept on the device and read once.

Per micro-step (`StepTally.admit`), before its backward: the loss is finite on EVERY process or it is
not (an all-reduce MIN of a device flag: a collective, not a host read), and the loss the backward runs
on is `torch.where(finite everywhere, loss, 0)`. A skipped micro-step therefore still runs its backward,
so the collectives of DDP's reducer and FSDP's reduce-scatter pair up on every process, but it adds a
zero gradient: the gradient of `where` towards a masked branch is exactly 0 (not 0 x NaN), and a model
whose own forward was finite propagates exact zeros from there. (A NaN born inside the model, in its
activations, still reaches the gradients through that backward: the step's gradient norm is then not
finite and the whole step is skipped by the gradient guard; nothing non-finite reaches the weights.)

A non-finite LAST micro-step: DDP's reducer has already run, during that backward, on gradients to which
every process added zero for it (they all agree it is skipped), so the reduced gradient is the sum over
the good micro-steps only; `Parallelism.reduce_and_clip` then rescales by accum / good, as for any
skipped micro-step. Every micro-step skipped: the gradient is zero and the step is abandoned.

At the end of the step, `settle` does ONE all-reduce (the loss sums, the stop and damaged-batch flags of
every process) and ONE device-to-host read (`tolist`) of it together with the per-micro-step verdicts and
the gradient norm: what the loop decides and logs comes from that read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class StepOutcome:
    """What every process learns at the end of a step (the same on all of them)."""

    finite: list[bool]  # per micro-step: its loss was finite on every process (it counted)
    loss_mean: float  # mean loss over the good micro-steps of every process (nan when none was good)
    grad_norm: float  # global gradient L2 norm before clipping (0 when no micro-step was good)
    stop: bool  # some process's stop flag was set
    damaged: bool  # some process's batch was damaged (the step must not count)

    @property
    def good(self) -> int:
        return sum(self.finite)


class StepTally:
    """The device-side account of one step (see the module docstring). `group`: the processes that
    must agree (None: one process)."""

    def __init__(self, device: torch.device, group: dist.ProcessGroup | None, dp_size: int) -> None:
        self.device, self.group, self.dp_size = device, group, dp_size
        self.finite_flags: list[torch.Tensor] = []  # per micro-step, agreed: 1.0 or 0.0
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=device)

    def admit(self, loss: torch.Tensor, usable: bool = True) -> torch.Tensor:
        """The loss to back-propagate for this micro-step: `loss` when it is finite on every process
        (and `usable` on every one: False for a damaged batch's stand-in), else an exact zero."""
        finite = torch.isfinite(loss.detach()).reshape(1).to(torch.float32)
        if not usable:
            finite = torch.zeros_like(finite)
        if self.group is not None:
            dist.all_reduce(finite, op=dist.ReduceOp.MIN, group=self.group)
        ok = finite[0] > 0
        self.finite_flags.append(finite[0])
        self.loss_sum += torch.where(ok, loss.detach().to(torch.float64), 0.0)
        return torch.where(ok, loss, torch.zeros_like(loss))

    def good_count(self) -> torch.Tensor:
        """Micro-steps that counted, on the device (the same on every process)."""
        return torch.stack(self.finite_flags).sum()

    def settle(self, grad_norm: torch.Tensor, stop: bool, damaged: bool) -> StepOutcome:
        """The step's one collective and one host read (see the module docstring)."""
        shared = torch.stack(
            [self.loss_sum, torch.tensor(float(stop), dtype=torch.float64, device=self.device),
             torch.tensor(float(damaged), dtype=torch.float64, device=self.device)]
        )  # fmt: skip
        if self.group is not None:
            dist.all_reduce(shared, op=dist.ReduceOp.SUM, group=self.group)
        flags = torch.stack(self.finite_flags).to(torch.float64)
        values = torch.cat([shared, flags, grad_norm.detach().reshape(1).to(torch.float64)]).tolist()
        loss_total, stops, damages = values[:3]
        finite = [v > 0 for v in values[3:-1]]
        good = sum(finite)
        loss_mean = loss_total / (good * self.dp_size) if good else float("nan")
        return StepOutcome(finite, loss_mean, values[-1], stops > 0, damages > 0)
