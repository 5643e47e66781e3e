"""Replica groups: the data-parallel replicate dimension as torchft replica groups, for live fault
tolerance (`training.fault_tolerance`). Each group is its own torchrun job (its model, its own run
directory, the strategy inside it: the plain module or DDP); a torchft `Manager` per process carries only
what crosses groups: the quorum (which groups take part in a step), the cross-group gradient average,
the commit vote, and the live state a restarted group receives from a healthy peer (heal).

    replicas.begin_step(step)        the quorum (synchronous: a heal is applied HERE, before the step
                                     draws its data, so a joiner reads the healed position); returns
                                     what changed (new participants, a heal and its duration)
    replicas.average(flat_grad)      the mean over the groups that take part (torchft's all-reduce)
    replicas.mean_loss(loss)         the step's loss as the mean over those groups
    replicas.commit()                should_commit: the optimizer steps only when every group agrees

A step that does not commit is undone by the caller (no optimizer step, the data position back). Why a
synchronous quorum: with torchft's asynchronous one a joiner runs the step's forward before its state
has arrived, on windows drawn at its stale position, and a heal lands between backward and commit; the
quorum costs one round trip to the lighthouse per step, small beside a step.

What the groups agree on is checked: each contributes a fingerprint of its configuration (model,
optimizer, global batch, processes per group, seed, data), compared in the first collective of every
step (all equal iff n * sum(h^2) == sum(h)^2), and a joiner compares the sender's before loading what
it received. `SingleReplica` is the same interface doing nothing: the trainer never asks which it has.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
from torch.distributed import ReduceOp

from mamba3lite.checkpoint.dtensor import is_dtensor
from mamba3lite.errors import ConfigError, TrainingError

INSTALL_HINT = "pip install 'mamba3lite[ft]' (torchft==0.2.0)"


@dataclass
class StepNews:
    """What a quorum changed, for the console and metrics.jsonl."""

    participants: list[int] | None = None  # the groups taking part, when they changed
    healed_from_step: int | None = None  # this group healed: its step before the heal
    heal_s: float = 0.0  # how long the quorum with the heal took
    heal_digest: str = ""  # digest of the state received (equal to the sender's)
    sent_digest: str = ""  # this group sent its state to a joiner: the digest of what it sent


@dataclass
class Participation:
    """Which groups took part in each committed step, run-length encoded: [[first_step, last_step,
    [group ids]], ...] (what the checkpoint records)."""

    runs: list[list] = field(default_factory=list)

    def add(self, step: int, groups: list[int]) -> None:
        if self.runs and self.runs[-1][2] == groups and self.runs[-1][1] == step - 1:
            self.runs[-1][1] = step
        else:
            self.runs.append([step, step, list(groups)])

    def at(self, step: int) -> list[int] | None:
        return next((g for first, last, g in self.runs if first <= step <= last), None)

    def truncate(self, step: int) -> None:
        """Forget steps after `step` (a resume to it)."""
        self.runs = [[a, min(b, step), g] for a, b, g in self.runs if a <= step]


class SingleReplica:
    """No fault tolerance: one replica group, which is the whole job; every step commits."""

    enabled = False
    groups, group_id = 1, 0

    def attach(self, state: Callable[[], dict], load: Callable[[dict], None], fingerprint: str) -> None:
        pass

    def begin_step(self, step: int) -> StepNews | None:
        return None

    def average(self, grads: list[torch.Tensor]) -> None:
        pass

    def mean_loss(self, loss: float) -> float:
        return loss

    def commit(self) -> bool:
        return True

    def record_commit(self, step: int) -> None:
        pass

    def tokens_share(self) -> float:
        return 1.0

    def state_dict(self) -> dict | None:
        return None

    def load_state_dict(self, state: dict | None, step: int) -> None:
        pass

    def shutdown(self) -> None:
        pass


class ReplicaGroups:
    """This process's part of a fault-tolerant job (see the module docstring). `group_rank`/`group_size`:
    this process in its own group (torchrun's RANK/WORLD_SIZE)."""

    enabled = True

    def __init__(self, ft, group_rank: int, group_size: int) -> None:
        # torchft's Rust side logs every quorum and commit at INFO; the run's own events say what matters
        os.environ.setdefault("RUST_LOG", "warn")
        try:
            from torchft import Manager, ProcessGroupGloo
            from torchft._torchft import LighthouseClient
        except ImportError as e:
            raise ConfigError(f"training.fault_tolerance needs torchft ({e}); {INSTALL_HINT}") from None
        self.ft, self.groups, self.group_id = ft, ft.replica_groups, ft.replica_group_id
        self.group_rank, self.group_size = group_rank, group_size
        check_lighthouse(LighthouseClient, ft.lighthouse, ft.connect_timeout_s)
        self._store = None
        if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
            addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        else:  # one process outside torchrun: its own store for its manager
            assert group_size == 1, "a group of several processes runs under torchrun"
            self._store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            addr, port = "127.0.0.1", self._store.port
        self.pg = ProcessGroupGloo(timeout=timedelta(seconds=ft.timeout_s))
        self.manager = Manager(
            pg=self.pg,
            load_state_dict=self._load,
            state_dict=self._state,
            min_replica_size=ft.min_replica_size,
            use_async_quorum=False,
            timeout=timedelta(seconds=ft.timeout_s),
            quorum_timeout=timedelta(seconds=ft.quorum_timeout_s),
            connect_timeout=timedelta(seconds=ft.connect_timeout_s),
            rank=group_rank,
            world_size=group_size,
            store_addr=addr,
            store_port=port,
            lighthouse_addr=ft.lighthouse,
            replica_id=f"group{self.group_id}",
            init_sync=False,  # every group builds the same weights from the seed (the fingerprint says so)
        )
        self.participation = Participation()
        self.participants: list[int] = []
        self._user_state: Callable[[], dict] | None = None
        self._user_load: Callable[[dict], None] | None = None
        self.fingerprint = ""
        self._received_digest = ""
        self._sent_digest = ""

    # ------------------------------------------------------------------ what the trainer gives us
    def attach(self, state: Callable[[], dict], load: Callable[[dict], None], fingerprint: str) -> None:
        """`state()`: this group's live state (model, optimizer, run counters, sampler, RNG) for a joiner;
        `load(state)`: take a peer's; `fingerprint`: what every group must agree on (see the module
        docstring)."""
        self._user_state, self._user_load, self.fingerprint = state, load, fingerprint

    def _state(self) -> dict:
        assert self._user_state is not None, "attach first"
        state = self._user_state()
        self._sent_digest = state_digest(state)
        parts = {k: state_digest(v) for k, v in state.items()}
        return {"fingerprint": self.fingerprint, "digest": self._sent_digest, "parts": parts, "state": state}

    def _load(self, received: dict) -> None:
        assert self._user_load is not None, "attach first"
        if received["fingerprint"] != self.fingerprint:
            raise ConfigError(
                f"replica group {self.group_id}'s configuration differs from the quorum's (fingerprint "
                f"{self.fingerprint[:12]} here, {received['fingerprint'][:12]} in the healthy groups): the "
                "model, optimizer, global batch, processes per group, seed and data must be the same in "
                "every group; start this group with the others' config"
            )
        self._user_load(received["state"])
        assert self._user_state is not None
        mine = self._user_state()
        self._received_digest = state_digest(mine)
        if self._received_digest != received["digest"]:
            differ = [k for k, v in mine.items() if state_digest(v) != received["parts"].get(k)]
            raise TrainingError(
                f"replica group {self.group_id} healed, but its state differs from the sender's in "
                f"{', '.join(differ) or 'its layout'} ({self._received_digest[:12]} != "
                f"{received['digest'][:12]})"
            )

    # -------------------------------------------------------------------------------- the step
    def begin_step(self, step: int) -> StepNews | None:
        """The quorum for the step after `step` (a heal included); the participants, checked."""
        m = self.manager
        if m.current_step() != step:  # resumed from this group's checkpoint: the manager counts from there
            m.load_state_dict({"step": step, "batches_committed": m.batches_committed()})
        self._received_digest = self._sent_digest = ""
        t0 = time.perf_counter()
        m.start_quorum()
        took = time.perf_counter() - t0
        news = StepNews()
        if m.current_step() != step:
            news.healed_from_step, news.heal_s, news.heal_digest = step, took, self._received_digest
        news.sent_digest = self._sent_digest
        participants = self._agree()
        if participants != self.participants:
            self.participants = news.participants = participants
        fresh = news.participants or news.healed_from_step is not None or news.sent_digest
        return news if fresh else None

    def _agree(self) -> list[int]:
        """One all-reduce: which groups take part (a one-hot slot each) and whether their fingerprints are
        equal. A collective that fails (a peer died) names nobody: the step will not commit."""
        h = int(self.fingerprint[:5], 16)  # 20 bits: h^2 and sums stay exact in float64
        t = torch.zeros(self.groups + 3, dtype=torch.float64)
        t[self.group_id], t[-3], t[-2], t[-1] = 1.0, 1.0, h, h * h
        if not self._allreduce(t, ReduceOp.SUM):
            return self.participants
        n, s, s2 = t[-3].item(), t[-2].item(), t[-1].item()
        if n >= 1 and n * s2 != s * s:
            raise ConfigError(
                f"the replica groups of this quorum disagree on their configuration (this is group "
                f"{self.group_id}, fingerprint {self.fingerprint[:12]}): the model, optimizer, global batch, "
                "processes per group, seed and data must be the same in every group; start every group with "
                "the same config (only training.fault_tolerance.replica_group_id and the run directory "
                "differ)"
            )
        return [g for g in range(self.groups) if t[g].item() > 0]

    def _allreduce(self, t: torch.Tensor, op: ReduceOp) -> bool:
        """torchft's all-reduce over the groups of the quorum (AVG: the sum / participants); False when it
        failed (a peer died), and then this group's side of the cross-group process group is torn down at
        once. Why: at G > 2 groups a collective fails at once only in the groups that exchange data with
        the dead one directly; another waits on their still-open sockets for the whole `timeout_s`, and
        the lighthouse holds the next quorum for it (it heartbeats but has not joined) up to its join
        timeout. Closing the sockets usually fails it at once too (4 of 5 benchmark runs at 4 groups); the
        short join timeout of `mamba3lite lighthouse` bounds the rest. The next quorum builds a fresh
        process group anyway."""
        self.manager.allreduce(t, reduce_op=op).wait()
        if self.manager.errored() is None:
            return True
        self.pg.abort()
        return False

    def average(self, grads: list[torch.Tensor]) -> None:
        """The step's gradients become their mean over the groups taking part: one all-reduce of them in
        one flat buffer (sum, then / participants: for two groups (a + b) / 2 exactly, in either order)."""
        if not grads:
            return
        # FSDP2 inside the group: each rank's shards, averaged with the same rank's of the other groups
        grads = [g.to_local() if is_dtensor(g) else g for g in grads]
        flat = torch.cat([g.reshape(-1) for g in grads])
        self._allreduce(flat, ReduceOp.AVG)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    def mean_loss(self, loss: float) -> float:
        """The mean of the groups' step losses (each the mean over its own windows), over the groups whose
        loss is finite (a group whose every micro-step was skipped has none: nan when no group has one)."""
        finite = math.isfinite(loss)
        t = torch.tensor([loss if finite else 0.0, float(finite)], dtype=torch.float64)
        self._allreduce(t, ReduceOp.SUM)
        total, count = t.tolist()
        return total / count if count > 0 else float("nan")

    def commit(self) -> bool:
        """Whether the step commits (every group of the quorum voted yes, enough of them took part)."""
        return self.manager.should_commit()

    def record_commit(self, step: int) -> None:
        self.participation.add(step, self.participants)

    def tokens_share(self) -> float:
        """The share of the global batch a step trains on: the groups taking part / all of them."""
        return len(self.participants) / self.groups

    # ------------------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        return {"replica_groups": self.groups, "participation": self.participation.runs}

    def load_state_dict(self, state: dict | None, step: int) -> None:
        self.participation = Participation([list(r) for r in (state or {}).get("participation", [])])
        self.participation.truncate(step)

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)


def check_lighthouse(client_cls, address: str, timeout_s: float) -> None:
    """ConfigError when the lighthouse at `address` cannot be reached within `timeout_s`."""
    try:
        client_cls(address, connect_timeout=timedelta(seconds=timeout_s))
    except Exception as e:  # torchft's Rust client raises RuntimeError/TimeoutError with gRPC's words
        raise ConfigError(
            f"cannot reach the torchft lighthouse at {address} (training.fault_tolerance.lighthouse) within "
            f"{timeout_s:g} s: {str(e).splitlines()[0] if str(e) else type(e).__name__}; start it first with "
            "`mamba3lite lighthouse --min-replicas N` and pass its address"
        ) from None


def config_fingerprint(cfg, group_size: int) -> str:
    """sha256 of what every replica group must share: the model, the optimizer and its settings, the
    global batch, the window, the seed, the data, the processes per group and the number of groups (not
    this group's index, run directory or lighthouse)."""
    tc = cfg.training
    shared = {
        "model": cfg.to_dict()["model"],
        "data": cfg.to_dict()["data"],
        "optimizer": [tc.optimizer, tc.lr, tc.min_lr, tc.weight_decay, list(tc.betas), tc.eps, tc.muon_lr,
                      tc.muon_momentum, tc.grad_clip, tc.warmup_steps, tc.lr_schedule, tc.max_steps],
        "batch": [tc.global_windows, tc.micro_batch_size, tc.max_seq_len, tc.seed, tc.dtype],
        "groups": [tc.fault_tolerance.replica_groups, group_size],
    }  # fmt: skip
    return hashlib.sha256(json.dumps(shared, sort_keys=True, default=str).encode()).hexdigest()


def state_digest(state: Any) -> str:
    """sha256 over a nested state (tensors by dtype, shape and bytes; other values by repr, dict keys
    sorted): two states with equal digests are equal bit for bit."""
    h = hashlib.sha256()

    def feed(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            t = x.detach().cpu().contiguous()
            h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        elif isinstance(x, dict):
            h.update(b"{")
            for k in sorted(x, key=repr):
                h.update(repr(k).encode())
                feed(x[k])
            h.update(b"}")
        elif isinstance(x, (list, tuple)):
            h.update(b"[")
            for v in x:
                feed(v)
            h.update(b"]")
        else:
            h.update(repr(x).encode())

    feed(state)
    return h.hexdigest()


def build_replicas(cfg, group_rank: int, group_size: int) -> SingleReplica | ReplicaGroups:
    """The replica groups of `training.fault_tolerance`, or `SingleReplica` when it is off."""
    ft = cfg.training.fault_tolerance
    if not ft.enabled:
        return SingleReplica()
    return ReplicaGroups(ft, group_rank, group_size)
