"""The repository explains itself (docs/architecture.md §6 rule 20): no file points at a document that is
not in it, the README links the two pages under docs/, and every section or rule that code, tests and
presets cite there exists."""

from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
# Spelled in pieces, so this file does not name them itself.
OUTSIDE_DOCS = [stem + ".md" for stem in ("MAMBA3", "STYLE", "DESIGN")]
SKIPPED_DIRS = {"__pycache__", "node_modules", "site"}  # site: `make docs` output


def repository_files() -> list[Path]:
    """Every file of the repository's tree: hidden directories (.git, .venv, caches) and build output
    are not walked."""
    out = []
    for top, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not (d.startswith(".") or d in SKIPPED_DIRS or d.endswith(".egg-info"))]
        out += [Path(top) / f for f in files if not f.startswith(".")]
    return out


def texts() -> dict[Path, str]:
    """{path: text} of the repository's text files (binary files skipped)."""
    out = {}
    for path in repository_files():
        data = path.read_bytes()
        if b"\0" not in data[:4096]:
            out[path] = data.decode("utf-8", errors="replace")
    return out


def test_no_file_references_a_document_outside_the_repository():
    found = [
        f"{path.relative_to(ROOT)}:{i}: {name}"
        for path, text in texts().items()
        for i, line in enumerate(text.splitlines(), 1)
        for name in OUTSIDE_DOCS
        if name in line
    ]
    assert not found, "cite docs/model.md, docs/architecture.md or the primary source instead:\n" + "\n".join(
        found
    )
    assert len(repository_files()) > 100  # the walk saw the repository, not an empty tree


def test_the_readme_links_both_pages():
    readme = (ROOT / "README.md").read_text()
    for page in ("docs/model.md", "docs/architecture.md"):
        assert f"]({page})" in readme, page
        assert (ROOT / page).is_file(), page


def _sections(page: Path) -> set[str]:
    """The numbers of a page's numbered headings: "## 2. X" -> "2", "### 2.3 Y" -> "2.3"."""
    return set(re.findall(r"^#{2,3} (\d+(?:\.\d+)?)\.? ", page.read_text(), re.M))


def test_every_cited_section_and_rule_exists():
    model, arch = _sections(DOCS / "model.md"), _sections(DOCS / "architecture.md")
    assert {"1.1", "1.2", "1.3", "2.3", "2.4", "3", "4", "5", "6", "7"} <= model
    rules = set(re.findall(r"^(\d+)\. \*\*", (DOCS / "architecture.md").read_text(), re.M))
    assert rules == {str(n) for n in range(1, 21)}
    cited = 0
    for path, text in texts().items():
        for page, known in (("docs/model.md", model), ("docs/architecture.md", arch)):
            for m in re.finditer(re.escape(page) + r" ((?:§[\d.]+(?:-[\d.]+)?(?:, )?)+)", text):
                for first, last in re.findall(r"§(\d+(?:\.\d+)*)(?:-(\d+(?:\.\d+)*))?", m.group(1)):
                    for number in filter(None, (first, last)):
                        cited += 1
                        assert number in known, f"{path.relative_to(ROOT)}: {page} has no §{number}"
        for rule in re.findall(r"docs/architecture\.md §6 rule (\d+)", text):
            assert rule in rules, f"{path.relative_to(ROOT)}: no rule {rule}"
    assert cited > 30  # the citations were found, so the check above checked something
