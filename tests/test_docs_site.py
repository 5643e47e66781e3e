"""The docs site stays true: it builds with `mkdocs build --strict` (a broken link, a missing page or a
page outside the nav fails), its generated reference pages (CLI, config, Python API) are what the code
renders today, every command line on any page parses with the real CLI (commands, flags, presets exist),
and the Python API's examples import what they name."""

from __future__ import annotations

import ast
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from docs_pages import DOCS, ROOT, code_blocks, command_lines, pages
from mamba3lite.cli import COMMANDS, build_parser
from mamba3lite.config import available_presets, resolve_preset
from mamba3lite.errors import ConfigError
from mamba3lite.report import reference_pages

MKDOCS = Path(sys.executable).parent / "mkdocs"


def test_every_command_line_on_every_page_parses():
    seen, count = set(), 0
    for page in pages():
        for argv in command_lines(page.read_text()):
            where = f"{page.relative_to(ROOT)}: mamba3lite {shlex.join(argv)}"
            assert argv and argv[0] in COMMANDS, where
            seen.add(argv[0])
            count += 1
            try:
                args = build_parser(argv[0]).parse_args(argv)
            except (SystemExit, ConfigError) as e:  # argparse rejected a flag the page shows
                raise AssertionError(f"does not parse: {where}") from e
            config = getattr(args, "config", None)
            if config not in (None, "auto"):
                resolve_preset(config)  # a named preset must exist
    assert count >= 30, count  # the pages were read and their commands found
    assert set(COMMANDS) - {"import"} <= seen, set(COMMANDS) - seen


def test_a_renamed_flag_fails_the_check():
    page = "```bash\nmamba3lite train --config tiny --no-such-flag 1\n```\n"
    (argv,) = command_lines(page)
    with pytest.raises(ConfigError, match="unrecognized arguments: --no-such-flag"):
        build_parser(argv[0]).parse_args(argv)


def test_presets_named_in_the_docs_exist():
    for page in pages():
        for name in re.findall(r"`(mamba3_\d[a-z0-9_]*|pretrain_a100_400m)`", page.read_text()):
            assert name in available_presets(), (page.relative_to(ROOT), name)


def test_python_blocks_parse_and_their_mamba3lite_imports_exist():
    blocks, checked = 0, 0
    for page in pages():
        for block in code_blocks(page.read_text(), langs=("python",)):
            tree = ast.parse(block)
            blocks += 1
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mamba3lite"):
                    module = __import__(node.module, fromlist=["_"])
                    for alias in node.names:
                        assert hasattr(module, alias.name), (page.relative_to(ROOT), node.module, alias.name)
                        checked += 1
    assert blocks >= 2 and checked >= 3, (blocks, checked)


def test_the_reference_pages_are_the_generated_ones():
    assert reference_pages.stale_pages(ROOT) == [], "run: python -m mamba3lite.report.reference_pages"
    cli = (DOCS / "reference" / "cli.md").read_text()
    assert all(f"\n## mamba3lite {name}\n" in cli for name in COMMANDS)
    assert "--checkpoint-dir" in cli and "--max-new-tokens" in cli
    config = (DOCS / "reference" / "config.md").read_text()
    assert "| `max_seq_len` |" in config and "| `train_data_path` |" in config
    api = (DOCS / "reference" / "python-api.md").read_text()
    assert "### `RunDir.load(step: int | None = None" in api and "load_pretrained(run_dir" in api


def test_a_stale_page_is_found_and_rewritten(tmp_path):
    assert reference_pages.main([str(tmp_path), "--check"]) == 1  # missing pages are stale
    assert reference_pages.main([str(tmp_path)]) == 0
    assert reference_pages.main([str(tmp_path), "--check"]) == 0
    page = tmp_path / "docs" / "reference" / "config.md"
    page.write_text(page.read_text().replace("| `max_seq_len` |", "| `max_len` |"))
    assert reference_pages.stale_pages(tmp_path) == ["docs/reference/config.md"]


def _build(root: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(MKDOCS), "build", "--strict", "-d", str(out)],
        cwd=root,
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "NO_MKDOCS_2_WARNING": "1"},
    )


def test_the_site_builds_strict(tmp_path):
    assert MKDOCS.is_file(), "pip install -e '.[docs]' (the dev extra has mkdocs and mkdocs-material)"
    r = _build(ROOT, tmp_path / "site")
    assert r.returncode == 0, r.stdout + r.stderr
    # the results page holds RESULTS.md's current tables, included (not copied), one per area
    results = (tmp_path / "site" / "results" / "index.html").read_text()
    assert "--8&lt;--" not in results and results.count("<table>") >= 8
    for area in ("Data", "Training speed", "Quality per time", "Serving", "Scale-out", "Context parallelism"):
        assert f">{area}<" in results, area
    assert "not measured" in results  # the GPU figures say so


def test_a_page_outside_the_nav_or_a_broken_link_fails_the_build(tmp_path):
    copy = tmp_path / "repo"
    shutil.copytree(DOCS, copy / "docs")
    shutil.copy(ROOT / "mkdocs.yml", copy)
    (copy / "benchmarks").mkdir()
    shutil.copy(ROOT / "benchmarks" / "RESULTS.md", copy / "benchmarks")
    (copy / "docs" / "guides" / "orphan.md").write_text("# Orphan\n\nSee [the missing page](missing.md).\n")
    r = _build(copy, tmp_path / "site")
    assert r.returncode != 0
    assert "orphan.md" in r.stdout + r.stderr and "missing.md" in r.stdout + r.stderr


AREAS = (
    "Data",
    "Training speed",
    "Quality per time",
    "Serving",
    "Scale-out",
    "Context parallelism",
    "Hybrids",
    "GPU",
)
HEADER = "| measured | result | target | machine | date | commit | command |"


def test_results_open_with_one_current_table_per_area():
    text = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    start, end = text.index("[start:current]"), text.index("[end:current]")
    assert start < 1500, "RESULTS.md opens with the current tables"
    current = text[start:end]
    sections = re.split(r"^### ", current, flags=re.M)[1:]
    assert [s.splitlines()[0] for s in sections] == list(AREAS)
    for section in sections:
        rows = [line for line in section.splitlines() if line.startswith("|")]
        assert rows[0] == HEADER, section[:40]
        for row in rows[2:]:
            cells = [c.strip() for c in row.strip("|").split("|")]
            assert len(cells) == 7, row
            if cells[1].startswith("not measured"):
                continue  # a number nobody measured says so, and has no date or commit
            assert cells[3] and re.fullmatch(r"\d{4}-\d{2}-\d{2}", cells[4]), row
            assert cells[5] and "`" in cells[6], row  # a commit (or "not recorded") and the command
    gpu = sections[-1]
    assert "not measured" in gpu
    archive = re.search(r"\]\((results-archive/[^)]+)\)", text[:start])
    assert archive and (ROOT / "benchmarks" / archive.group(1)).is_file()
