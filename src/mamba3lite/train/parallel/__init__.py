"""How training is spread over processes: the process group (process_group.py), the layout and mesh
shape a config asks for (layout.py), the strategies (strategies.py: local, DDP, FSDP2/HSDP), one step's
device-side account (tally.py), torchft replica groups for live fault tolerance (replicas.py, and the
lighthouse that coordinates them: lighthouse.py), and the seam that owns them (seam.py: `Parallelism`)."""

from mamba3lite.train.parallel.layout import Layout, plan_layout
from mamba3lite.train.parallel.process_group import DistInfo, init_distributed, pick_device
from mamba3lite.train.parallel.seam import Parallelism
from mamba3lite.train.parallel.tally import StepOutcome, StepTally

__all__ = [
    "DistInfo",
    "Layout",
    "Parallelism",
    "StepOutcome",
    "StepTally",
    "init_distributed",
    "pick_device",
    "plan_layout",
]
