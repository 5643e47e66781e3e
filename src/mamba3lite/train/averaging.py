"""Weight averaging for the final evaluation: an exponential moving average (EMA) of the parameters.

`training.ema_decay` β > 0 keeps, beside the weights the optimizer trains, their average

    w̄_1 = w_1                          (the first update copies: no pull towards the random init)
    w̄_k = β·w̄_{k−1} + (1 − β)·w_k      after optimizer step k

(torch.optim.swa_utils.get_ema_multi_avg_fn's rule). The trainer calls `update(model)` after every
optimizer step; what users of a checkpoint read (load_pretrained: eval, generate, serve, the quickstart's
final evaluation; export) is the average, the training goes on from the raw weights.

Why an EMA and not the mean of the last K steps: a five-minute quickstart run is ~1,000-2,000 steps and
may be stopped by its time budget before max_steps, so a window fixed to the end of the schedule (the
last K steps before max_steps) might never start; an EMA is an average of the recent past at every step
(β = 0.99: a horizon of ~1/(1 − β) = 100 steps, a few percent of the run), costs one copy of the weights
and one lerp per step, and its state is one tensor per parameter plus a count, whatever K would be.

State (`state_dict`): {"decay", "updates", "weights": {parameter name: tensor}}; the checkpoint keeps the
weights in a file of their own and the rest in the meta (checkpoint package docstring). `NoAverage` is the
"off" object (ema_decay 0): the loop calls it the same way and nothing happens.
"""

from __future__ import annotations

import torch

from mamba3lite.errors import CheckpointError, ConfigError


class WeightAverage:
    """The EMA of `model`'s trainable parameters (by name, as `named_parameters()` lists them: a tied
    parameter once), in their own dtype and device."""

    def __init__(self, model: torch.nn.Module, decay: float) -> None:
        assert 0.0 < decay < 1.0, decay
        self.decay = decay
        self.updates = 0
        self.names = [n for n, p in model.named_parameters() if p.requires_grad]
        self.weights: dict[str, torch.Tensor] = {}  # empty until the first update

    @torch.no_grad()
    def update(self, model: torch.nn.Module) -> None:
        """Fold the model's current parameters in (after an optimizer step)."""
        params = dict(model.named_parameters())
        current = [params[n].detach() for n in self.names]
        if self.updates == 0:
            self.weights = {n: p.clone() for n, p in zip(self.names, current, strict=True)}
        else:
            torch._foreach_lerp_(list(self.weights.values()), current, 1.0 - self.decay)
        self.updates += 1

    def averaged_state(self, model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
        """`model.state_dict()` with every averaged parameter replaced by its average (buffers and frozen
        parameters as the model has them; a tied alias the same tensor as its source, as in the model):
        what a checkpoint stores as the averaged weights. None before the first update."""
        if not self.updates:
            return None
        state = model.state_dict()
        by_id = {id(p): self.weights[n] for n, p in model.named_parameters() if n in self.weights}
        for name, p in model.named_parameters(remove_duplicate=False):  # a tied alias: its source's
            if id(p) in by_id:
                state[name] = by_id[id(p)]
        return state

    def state_dict(self) -> dict:
        return {"decay": self.decay, "updates": self.updates, "weights": dict(self.weights)}

    def load_state_dict(self, state: dict) -> None:
        """Restore `updates` and the weights (copied into this average's tensors' dtype and device, which
        follow the model's). `state["weights"]` may hold more than the averaged parameters (a checkpoint's
        averaged state_dict: buffers, tied aliases). The decay stays this run's: like the lr, the config of
        the run that resumes wins."""
        updates, weights = int(state["updates"]), state["weights"]
        if updates and (missing := [n for n in self.names if n not in weights]):
            raise CheckpointError(
                f"the averaged weights of the checkpoint lack {len(missing)} of the model's parameters "
                f"(first {missing[0]})"
            )
        self.updates = updates
        self.weights = {n: weights[n].clone() for n in self.names} if updates else {}


class NoAverage:
    """training.ema_decay 0: no average (every call does nothing)."""

    decay = 0.0
    updates = 0

    def update(self, model: torch.nn.Module) -> None:
        pass

    def averaged_state(self, model: torch.nn.Module) -> None:
        return None

    def state_dict(self) -> None:
        return None

    def load_state_dict(self, state: dict) -> None:
        pass


def build_average(
    model: torch.nn.Module, decay: float, sharded_by: str | None = None
) -> WeightAverage | NoAverage:
    """The average `training.ema_decay` asks for: `WeightAverage(model, decay)`, or `NoAverage()` at 0.
    `sharded_by`: the strategy that shards the model (parallelism auto chose fsdp; an explicit choice is
    refused by config.py), where an average, a whole copy of the weights, is refused."""
    if decay > 0 and sharded_by is not None:
        raise ConfigError(
            f"training.ema_decay is {decay} but this run shards its model ({sharded_by}): weight averaging "
            "is not supported for sharded models; --set training.parallelism=ddp or training.ema_decay=0"
        )
    return WeightAverage(model, decay) if decay > 0 else NoAverage()
