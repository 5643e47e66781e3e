"""The package keeps its rooms small: no function over 60 lines outside the scan kernels, and the two
modules that were split by concept (the checkpoint manager, the config) stay under their caps. A
function that grows past the limit is split by structure (a small object or a pure function carrying a
part), not squeezed; a Triton kernel may stay long where splitting would cost speed, and says why in its
docstring."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "src" / "mamba3lite"
MAX_FUNCTION_LINES = 60
# The Triton kernels: one program's tiles stay in registers through one long body (chunk_bwd_kernel's
# docstring says why).
KERNEL_MODULES = {"model/_scan_triton_kernels.py"}
LINE_CAPS = {"checkpoint/manager.py": 450, "config.py": 450}


def long_functions(source: str, limit: int = MAX_FUNCTION_LINES) -> list[tuple[str, int, int]]:
    """(name, first line, length) of each function or method of `source` longer than `limit` lines, from
    its `def` to its last line (decorators not counted, its docstring counted)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if length > limit:
                found.append((node.name, node.lineno, length))
    return found


def test_the_checker_finds_a_long_method_and_passes_a_short_one():
    body = "".join(f"        x{i} = {i}\n" for i in range(59))
    long_method = f"class A:\n    def grown(self):\n{body}        return 1\n"  # def + 59 + return = 61
    assert long_functions(long_method) == [("grown", 2, 61)]
    assert long_functions(long_method.replace("        x0 = 0\n", "")) == []


def test_no_function_outside_the_scan_kernels_is_over_60_lines():
    over = [
        f"{path.relative_to(ROOT)}:{line} {name} ({length} lines)"
        for path in sorted(ROOT.rglob("*.py"))
        if path.relative_to(ROOT).as_posix() not in KERNEL_MODULES
        for name, line, length in long_functions(path.read_text(encoding="utf-8"))
    ]
    assert not over, (
        f"functions over {MAX_FUNCTION_LINES} lines (split a part into a pure function or a small object):"
        "\n  " + "\n  ".join(over)
    )


def test_the_split_modules_stay_under_their_line_caps():
    for rel, cap in LINE_CAPS.items():
        n = len((ROOT / rel).read_text(encoding="utf-8").splitlines())
        assert n <= cap, (
            f"{rel} has {n} lines, over its cap of {cap}: move a concept into a module of its own"
        )
