"""Imports inside qeff_evs run one way, down the list in docs/design.md#layout-and-import-order, and no two
files import each other; this test keeps it so.

Every ``import`` of a ``qeff_evs`` module, at module level or inside a function (lazy imports count
too), is checked against the layer table below. A module may always import its own layer's modules;
``runtime``'s sub-layers are layers of their own (inputs, backends <- engine <- the runtime's
own modules: export_bundle, media, sessions, builders, encode, requests_jsonl).

Within a layer the files' imports must form no circle: every ``import`` / ``from ... import`` statement
naming a file of the package counts, at module level, inside a function or under ``TYPE_CHECKING``
(``from qeff_evs.models import registry`` is an edge to ``models/registry.py``, not to the package's
``__init__``). A module named as a string and imported with ``importlib`` (the model registry's table
of shipped families) is a lookup, not an import statement, and is checked apart: the table must name
exactly the package's family modules.
"""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest

import qeff_evs

PACKAGE = Path(qeff_evs.__file__).parent

# Layer of each top-level part of the package (sub-layers for runtime), and what each may import.
BASE = {"evs", "vidcom2", "positions", "manifest", "specializations"}
ALLOWED: dict[str, set[str]] = {
    "evs": set(),
    "vidcom2": {"evs"},
    "positions": {"evs"},
    "manifest": {"evs", "positions"},
    "specializations": {"manifest"},
    "weights": set(),
    "models": BASE | {"weights", "models"},
    "export": BASE | {"weights", "models", "export"},
    "runtime.inputs": BASE | {"models", "runtime.inputs"},
    "runtime.backends": BASE | {"models", "runtime.backends"},
    "runtime.engine": BASE | {"models", "runtime.inputs", "runtime.backends", "runtime.engine"},
    "runtime": BASE | {"models", "runtime.inputs", "runtime.backends", "runtime.engine", "runtime"},
    "vllm": BASE | {"models", "runtime.inputs", "runtime.backends", "runtime.engine", "runtime", "vllm"},
    "bench": BASE | {"weights", "models", "export", "runtime.inputs", "runtime.backends", "runtime.engine", "runtime",
                     "bench"},
    "cli": None,  # the command (and its demo) may import anything
}
CLI_MODULES = {"cli", "demo"}


def layer_of(module: str) -> str:
    """``qeff_evs.runtime.engine.serving`` -> ``runtime.engine``; ``qeff_evs.evs`` -> ``evs``."""
    parts = module.split(".")[1:]
    if not parts:
        return "package"
    if parts[0] in CLI_MODULES:
        return "cli"
    if parts[0] == "runtime" and len(parts) > 1 and f"runtime.{parts[1]}" in ALLOWED:
        return f"runtime.{parts[1]}"
    return parts[0]


def module_name(path: Path, root: Path = PACKAGE) -> str:
    relative = path.relative_to(root.parent).with_suffix("")
    parts = list(relative.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path, root: Path = PACKAGE, modules: frozenset[str] = frozenset()) -> list[tuple[int, str]]:
    """``(line, module)`` of every qeff_evs import in the file, relative imports resolved; ``from X import
    name`` counts as an import of ``X.name`` where that is one of ``modules``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module == "qeff_evs":  # ``from qeff_evs import evs``
                found += [(node.lineno, f"qeff_evs.{alias.name}") for alias in node.names]
            elif any(f"{module}.{alias.name}" in modules for alias in node.names):
                found += [(node.lineno, f"{module}.{alias.name}" if f"{module}.{alias.name}" in modules else module)
                          for alias in node.names]
            else:
                found.append((node.lineno, module))
    return [(line, module) for line, module in found if module == "qeff_evs" or module.startswith("qeff_evs.")]


def violations(root: Path = PACKAGE) -> list[str]:
    wrong = []
    for path in sorted(root.rglob("*.py")):
        source_layer = layer_of(module_name(path, root))
        allowed = ALLOWED.get(source_layer, set())
        if allowed is None or source_layer == "package":
            continue
        for line, module in imported_modules(path, root):
            target = layer_of(module)
            if target != source_layer and target not in allowed:
                wrong.append(f"{path.relative_to(root.parent)}:{line} ({source_layer}) imports {module} ({target})")
    return wrong


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """Each module of the package -> the modules of the package it imports (itself left out)."""
    paths = {module_name(path, root): path for path in sorted(root.rglob("*.py"))}
    modules = frozenset(paths)
    return {name: {module for _, module in imported_modules(path, root, modules) if module in modules} - {name}
            for name, path in paths.items()}


def import_circles(root: Path = PACKAGE) -> list[list[str]]:
    """Every set of modules that import each other, directly or round a longer loop (Tarjan's strongly
    connected components of more than one module), each sorted."""
    graph = import_graph(root)
    index: dict[str, int] = {}
    lowest: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(module: str) -> None:
        index[module] = lowest[module] = len(index)
        stack.append(module)
        for target in sorted(graph[module]):
            if target not in index:
                visit(target)
                lowest[module] = min(lowest[module], lowest[target])
            elif target in stack:
                lowest[module] = min(lowest[module], index[target])
        if lowest[module] == index[module]:
            component = stack[stack.index(module):]
            del stack[stack.index(module):]
            if len(component) > 1:
                circles.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return sorted(circles)


def test_every_module_has_a_layer():
    unknown = sorted({layer_of(module_name(p)) for p in PACKAGE.rglob("*.py")} - set(ALLOWED) - {"package"})
    assert not unknown, (f"modules outside the layer table: {unknown}; add them to ALLOWED "
                         "(docs/design.md#layout-and-import-order)")


def test_imports_run_one_way():
    assert violations() == []


def package_with(tmp_path: Path, source: str, import_line: str) -> Path:
    """A copy of the package under ``tmp_path`` with ``import_line`` appended to ``source`` (made if new)."""
    copy = tmp_path / "qeff_evs"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    target = copy / source
    target.write_text((target.read_text() if target.exists() else "") + "\n" + import_line + "\n")
    return copy


def test_no_import_circles():
    assert import_circles() == []


def test_the_registry_table_names_every_family_module():
    from qeff_evs.models.registry import SHIPPED_MODULES

    decorated = {module_name(path) for path in PACKAGE.rglob("*.py") if "\n@register_family\n" in path.read_text()}
    assert set(SHIPPED_MODULES) == decorated and len(SHIPPED_MODULES) == len(decorated)


@pytest.mark.parametrize("source, import_line", [
    ("models/protocol.py", "def lazy():\n    from qeff_evs.models.registry import family_class\n"),
    ("bench/config.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from qeff_evs.bench import phase\n"),
    ("vllm/activation.py", "from . import plugin\n"),
])
def test_an_import_circle_fails(tmp_path, source, import_line):
    copy = package_with(tmp_path, source, import_line)
    found = import_circles(copy)
    assert len(found) == 1 and module_name(copy / source, copy) in found[0], found


@pytest.mark.parametrize("source, import_line", [
    ("models/bad.py", "from qeff_evs.export.vision import export_vision_graph"),
    ("runtime/backends/bad.py", "import qeff_evs.runtime.engine.serving"),
    ("runtime/engine/bad.py", "from qeff_evs.export import pipeline"),
    ("vllm/bad.py", "def lazy():\n    from qeff_evs.export.pipeline import export_checkpoint\n"),
    ("evs.py", "from qeff_evs import positions"),
    ("specializations/bad.py", "from ..models import language"),
    ("weights/bad.py", "from qeff_evs.models.registry import family_class"),
])
def test_an_import_against_the_order_fails(tmp_path, source, import_line):
    # A copy of the package with one offending import added: the checker must name it.
    found = violations(package_with(tmp_path, source, import_line))
    assert len(found) == 1 and found[0].startswith(f"qeff_evs/{source}:"), found
