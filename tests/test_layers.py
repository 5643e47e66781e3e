"""The package's imports form layers (docs/architecture.md §6 rule 16): no module imports itself through
others, and no two of its parts (the folders and the top-level modules) import each other.

The graph is read from the source with `ast`, every import statement counted wherever it stands: a
lazy import inside a function is a dependency too, only a later one. An edge goes to the module an
import names: `from mamba3lite.data import shards` -> data.shards; `from mamba3lite.checkpoint
import CheckpointManager` -> checkpoint (its __init__). The root package's __init__ (which
imports nothing) is not a node.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "mamba3lite"


def package_modules(root: Path = ROOT) -> dict[str, Path]:
    """{"mamba3lite.data.shards": path, "mamba3lite.checkpoint": its __init__.py, ...}."""
    mods = {}
    for f in sorted((root / PACKAGE).rglob("*.py")):
        name = ".".join(f.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        mods[name] = f
    return mods


def _resolve(module: str, level: int, here: str, is_package: bool) -> str:
    """The absolute name of `from <level dots><module> import ...` written in module `here`."""
    if level == 0:
        return module
    base = here.split(".") if is_package else here.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def imports_of(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """The package modules `name` imports, anywhere in its file (functions and TYPE_CHECKING included)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(node.module or "", node.level, name, path.name == "__init__.py")
            # `from pkg import sub` names the submodule; `from mod import thing` names mod
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
        else:
            continue
        for target in targets:  # (a name that is no module here, e.g. a broken import, is not an edge)
            if target in mods and target not in (name, PACKAGE):
                out.add(target)
    return out


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    mods = package_modules(root)
    return {name: imports_of(name, path, mods) for name, path in mods.items() if name != PACKAGE}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted, then the list."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def a_cycle_through(component: list[str], graph: dict[str, set[str]]) -> list[str]:
    """One concrete loop inside a strongly connected component, as a path a -> b -> ... -> a."""
    members = set(component)
    start = component[0]
    # breadth-first from start's successors back to start, staying inside the component
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & members):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return [*path[::-1], start]
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{component} is not a cycle")


def part_of(module: str, graph: dict[str, set[str]]) -> str:
    """The part of the package a module belongs to: its folder ("data/"; a package's __init__ too) or,
    at the top level, itself ("config")."""
    top = ".".join(module.split(".")[:2])
    is_folder = top != module or any(m.startswith(f"{module}.") for m in graph)
    return f"{top.split('.')[1]}/" if is_folder else top.split(".")[1]


def part_edges(graph: dict[str, set[str]]) -> dict[tuple[str, str], list[str]]:
    """{(part A, part B): ["a.mod -> b.mod", ...]} for every import from one part into another."""
    edges: dict[tuple[str, str], list[str]] = {}
    for src, targets in graph.items():
        for dst in targets:
            a, b = part_of(src, graph), part_of(dst, graph)
            if a != b:
                edges.setdefault((a, b), []).append(f"{src} -> {dst}")
    return edges


def two_way_parts(graph: dict[str, set[str]]) -> list[str]:
    """Each pair of parts that import each other, with the imports that make each direction."""
    edges = part_edges(graph)
    rows = []
    for (a, b), there in sorted(edges.items()):
        back = edges.get((b, a))
        if back and a < b:
            rows.append(f"{a} <-> {b}: {', '.join(sorted(there))} | {', '.join(sorted(back))}")
    return rows


# ------------------------------------------------------------------------------------ the checker


def _graph_of(tmp_path: Path, files: dict[str, str]) -> dict[str, set[str]]:
    for rel, text in files.items():
        f = tmp_path / PACKAGE / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
    (tmp_path / PACKAGE / "__init__.py").touch()
    return import_graph(tmp_path)


def test_the_checker_sees_a_lazy_import_cycle_and_names_it(tmp_path):
    graph = _graph_of(
        tmp_path,
        {
            "a.py": "from mamba3lite import b\n",
            "b.py": "def f():\n    from mamba3lite.c import g\n",
            "c.py": "def g():\n    import mamba3lite.a\n",
            "d.py": "from mamba3lite import a\n",
        },
    )
    found = cycles(graph)
    assert found == [["mamba3lite.a", "mamba3lite.b", "mamba3lite.c"]]
    assert a_cycle_through(found[0], graph) == [
        "mamba3lite.a",
        "mamba3lite.b",
        "mamba3lite.c",
        "mamba3lite.a",
    ]


def test_the_checker_sees_two_folders_importing_each_other_without_a_module_cycle(tmp_path):
    graph = _graph_of(
        tmp_path,
        {
            "data/__init__.py": "",
            "data/x.py": "from mamba3lite.report.y import f\n",
            "data/z.py": "",
            "report/__init__.py": "",
            "report/y.py": "from ..data import z\n",  # relative imports count too
            "top.py": "from mamba3lite.data import x\n",
        },
    )
    assert cycles(graph) == []
    there, back = "mamba3lite.data.x -> mamba3lite.report.y", "mamba3lite.report.y -> mamba3lite.data.z"
    assert two_way_parts(graph) == [f"data/ <-> report/: {there} | {back}"]


# ----------------------------------------------------------------------------------- the package


def test_no_module_imports_itself_through_others():
    graph = import_graph()
    found = [" -> ".join(a_cycle_through(c, graph)) for c in cycles(graph)]
    assert not found, "import cycles (move the shared piece into a module below both):\n  " + "\n  ".join(
        found
    )


@pytest.mark.parametrize("part", ["errors", "atomicfile", "intake", "rundir", "optimizers"])
def test_the_bottom_layer_imports_only_errors(part):
    graph = import_graph()
    above = sorted(
        f"{m} -> {t}"
        for m, ts in graph.items()
        if part_of(m, graph) == part
        for t in ts
        if part_of(t, graph) not in ("errors", part)
    )
    assert not above, f"{part} must import nothing above errors: " + ", ".join(above)


def test_no_two_parts_of_the_package_import_each_other():
    rows = two_way_parts(import_graph())
    assert not rows, "parts that import each other (each pair one direction at most):\n  " + "\n  ".join(rows)
