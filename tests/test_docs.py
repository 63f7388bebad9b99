"""The repository documents itself: nothing in it points outside it, and the README stays a front page.

The docs site itself (``docs/``, ``mkdocs.yml``) is built with ``mkdocs build --strict`` by ``scripts/test.sh``, so a
broken link, anchor or page fails the test command; these checks need no mkdocs.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# What exists only beside this repository, on the machines it was developed on: the shared folder, the design
# contract's numbered sections and the research notes (the docs pages say what they said).
# The folder beside the repository, named once; the patterns and the cases below are built from it.
SIBLING = "shared"
OUTSIDE = re.compile(rf"\.\./{SIBLING}|/work/{SIBLING}|{SIBLING}/(reference|DESIGN)|DESIGN §|(?<![\w/])reference/\w+\.md")
# Folders that are not the repository's own text: environments, build outputs, caches, git's store.
NOT_SOURCE = {".git", ".venv", "site", "build", "out", "bench_out", "__pycache__", ".pytest_cache", ".hypothesis"}
BINARY = {".png", ".onnx", ".data", ".npy", ".safetensors", ".mp4", ".pyc"}
README_MAX_LINES = 250
THIS_FILE = Path(__file__).resolve()
# A pointer from the code (or the README) into the docs: docs/<page>.md, maybe with #<heading anchor>.
DOCS_POINTER = re.compile(r"docs/([\w-]+)\.md(?:#([\w-]+))?")


def text_files(root: Path = ROOT):
    """The repository's own text files under ``root``, as ``(relative path, text)``."""
    for folder, dirs, files in os.walk(root):  # symlinks (docs/results) are not followed: their targets are walked
        dirs[:] = sorted(d for d in dirs if d not in NOT_SOURCE and not d.endswith(".egg-info"))
        for name in sorted(files):
            path = Path(folder) / name
            if path.suffix not in BINARY and not path.is_symlink():
                yield path.relative_to(root), path.read_text(errors="replace")


def outside_references(root: Path = ROOT) -> list[str]:
    """``path:line: text`` of every line under ``root`` that names a path outside the repository."""
    return [f"{path}:{number}: {line.strip()}" for path, text in text_files(root) if root / path != THIS_FILE
            for number, line in enumerate(text.splitlines(), 1) if OUTSIDE.search(line)]


def heading_anchors(page: Path) -> set[str]:
    """The anchors mkdocs gives a page's headings (Python-Markdown's toc slugs; code spans read as their text)."""
    anchors, fenced = set(), False
    for line in page.read_text().splitlines():
        fenced ^= line.startswith("```")
        if not fenced and line.startswith("#"):
            title = line.lstrip("#").strip().replace("`", "")
            anchors.add(re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", title).strip().lower()))
    return anchors


def broken_docs_pointers(root: Path = ROOT) -> list[str]:
    """Pointers ``docs/<page>.md#<anchor>`` whose page or heading does not exist."""
    broken = []
    for path, text in text_files(root):
        if root / path == THIS_FILE:  # its examples
            continue
        for match in DOCS_POINTER.finditer(text):
            page = root / "docs" / f"{match[1]}.md"
            if not page.is_file() or (match[2] and match[2] not in heading_anchors(page)):
                broken.append(f"{path}: {match[0]}")
    return broken


def test_no_file_points_outside_the_repository():
    assert outside_references() == [], "point to the docs pages (docs/*.md) instead"


@pytest.mark.parametrize("line", [f"See `../{SIBLING}/DESIGN.md` for the contract.",
                                  f"# Qwen3.5-0.8B ({SIBLING}/reference/qwen3_5.md §1.3)",
                                  f"(``/work/{SIBLING}/tools/install_qefficient_cpu.sh VENV`` makes such a Python.)",
                                  '"""Compute context lengths (DESIGN §15): an export with a ladder of lengths',
                                  "Hand-checked values (reference/vllm_evs.md §3.1), also vLLM's."])
def test_a_reference_outside_is_found(tmp_path, line):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text("# A page\n\n" + line + "\n")
    (tmp_path / ".venv").mkdir()
    (tmp_path / ".venv" / "ignored.py").write_text(line + "\n")  # an environment is not the repository's text
    assert outside_references(tmp_path) == [f"docs/page.md:3: {line}"]


def test_pointers_into_the_docs_name_a_page_and_heading_that_exist():
    assert broken_docs_pointers() == []


def test_a_broken_pointer_into_the_docs_is_found(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "design.md").write_text("# Design\n\n## The three graphs\n\n```\n# not a heading\n```\n")
    (tmp_path / "code.py").write_text("# (docs/design.md#the-three-graphs) (docs/design.md#not-a-heading)\n"
                                      "# (docs/design.md) (docs/missing.md)\n")
    assert broken_docs_pointers(tmp_path) == ["code.py: docs/design.md#not-a-heading", "code.py: docs/missing.md"]


def test_readme_is_a_front_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < README_MAX_LINES
    # The two commands, as .ci/run and scripts/test.sh run them.
    assert "bash scripts/install.sh && .venv/bin/qeff-evs demo" in readme
    assert "bash scripts/test.sh" in readme
    for page in ("getting-started", "models", "export-compile", "serving", "settings", "deploying", "performance",
                 "design", "vocabulary"):
        assert f"](docs/{page}.md)" in readme, page
        assert (ROOT / "docs" / f"{page}.md").is_file(), page
