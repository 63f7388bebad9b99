"""The repository documents itself (issue 28): nothing in it points outside it, and the README stays a front page.

The docs site itself (``docs/``, ``mkdocs.yml``) is built with ``mkdocs build --strict`` by ``scripts/test.sh``, so a
broken link, anchor or page fails the test command; these checks need no mkdocs.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Paths that exist only beside this repository on the machines it was developed on (written in pieces, so this
# file does not name them itself).
OUTSIDE = ("../" + "shared", "/work/" + "shared", "shared/" + "reference", "shared/" + "DESIGN")
# Folders that are not the repository's own text: environments, build outputs, caches, git's store.
NOT_SOURCE = {".git", ".venv", "site", "build", "out", "bench_out", "__pycache__", ".pytest_cache", ".hypothesis"}
BINARY = {".png", ".onnx", ".data", ".npy", ".safetensors", ".mp4", ".pyc"}
README_MAX_LINES = 250


def outside_references(root: Path = ROOT) -> list[str]:
    """``path:line: text`` of every line under ``root`` that names a path outside the repository."""
    found = []
    for folder, dirs, files in os.walk(root):  # symlinks (docs/results) are not followed: their targets are walked
        dirs[:] = sorted(d for d in dirs if d not in NOT_SOURCE and not d.endswith(".egg-info"))
        for name in sorted(files):
            path = Path(folder) / name
            if path.suffix in BINARY or path.is_symlink():
                continue
            text = path.read_text(errors="replace")
            for number, line in enumerate(text.splitlines(), 1):
                if any(outside in line for outside in OUTSIDE):
                    found.append(f"{path.relative_to(root)}:{number}: {line.strip()}")
    return found


def test_no_file_points_outside_the_repository():
    assert outside_references() == [], "point to the docs pages (docs/*.md) instead"


@pytest.mark.parametrize("line", ["See `" + OUTSIDE[0] + "/DESIGN.md` for the contract.",
                                  "# Qwen3.5-0.8B (" + OUTSIDE[2] + "/qwen3_5.md §1.3)"])
def test_a_reference_outside_is_found(tmp_path, line):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text("# A page\n\n" + line + "\n")
    (tmp_path / ".venv").mkdir()
    (tmp_path / ".venv" / "ignored.py").write_text(line + "\n")  # an environment is not the repository's text
    assert outside_references(tmp_path) == [f"docs/page.md:3: {line}"]


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
