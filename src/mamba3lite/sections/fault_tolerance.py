"""FaultToleranceConfig: `training.fault_tolerance`, a nested section of the `training:` section (live fault
tolerance over torchft replica groups: train/parallel/replicas.py)."""

from __future__ import annotations

from dataclasses import dataclass

from mamba3lite.errors import ConfigError
from mamba3lite.sections.fields import check_positive, doc


@dataclass
class FaultToleranceConfig:
    """Live fault tolerance (torchft): the data-parallel replicas are replica groups, each its own torchrun
    job, and a group that fails costs no restart of the others (train/parallel/replicas.py).

    The global-batch contract with fewer groups: a step's global batch is `training.global_batch_size`
    windows in `replica_groups` equal slots; group g always reads slot g (its windows are the same
    whichever groups take part), so a step that commits with P of the groups trains on P/replica_groups
    of the batch, the mean gradient over the windows of those P groups, and the windows of the absent
    groups' slots are skipped (not read later). Every committed step moves the data position by one whole
    global batch, on every group; a step that does not commit moves nothing. Each step's participants are
    in metrics.jsonl ("quorum" events) and in the checkpoint, so the run can be replayed exactly."""

    enabled: bool = doc(
        False, "train as one replica group of a fault-tolerant job (needs torchft: mamba3lite[ft])"
    )
    lighthouse: str = doc(
        "",
        "address of the torchft lighthouse that forms the quorums, e.g. http://node0:29510 (start it with "
        "`mamba3lite lighthouse`); required when enabled",
    )
    replica_groups: int = doc(
        1, "replica groups of the job at full strength: the global batch is divided into this many slots"
    )
    replica_group_id: int = doc(
        0, "this group's index in [0, replica_groups): its slot of every global batch"
    )
    min_replica_size: int = doc(
        1, "groups that must take part in a step for it to commit (1 = go on with any single healthy group)"
    )
    timeout_s: float = doc(
        60.0,
        "seconds a cross-group collective, the commit vote or a heal's transfer may take before it fails",
    )
    quorum_timeout_s: float = doc(120.0, "seconds to wait for a quorum of at least min_replica_size groups")
    connect_timeout_s: float = doc(
        10.0, "seconds to reach the lighthouse and the peers' managers at start-up"
    )

    def __post_init__(self) -> None:
        s = "training.fault_tolerance"
        check_positive(s, self, ("replica_groups", "min_replica_size", "timeout_s", "quorum_timeout_s",
                            "connect_timeout_s"))  # fmt: skip
        if not 0 <= self.replica_group_id < self.replica_groups:
            raise ConfigError(
                f"{s}.replica_group_id must be in [0, {self.replica_groups}) (replica_groups is "
                f"{self.replica_groups}), got {self.replica_group_id}; give each group its own index"
            )
        if self.min_replica_size > self.replica_groups:
            raise ConfigError(
                f"{s}.min_replica_size is {self.min_replica_size} but the job has {self.replica_groups} "
                f"replica group(s): no step could ever commit; set min_replica_size <= {self.replica_groups}"
            )
        if self.enabled and not self.lighthouse.strip():
            raise ConfigError(
                f"{s}.lighthouse is empty; start one with `mamba3lite lighthouse --min-replicas "
                f"{self.min_replica_size}` and pass its address, e.g. --set {s}.lighthouse=http://HOST:29510"
            )
