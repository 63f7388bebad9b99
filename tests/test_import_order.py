"""Imports inside qeff_evs run one way, down the list in docs/design.md#layout-and-import-order; this test keeps it so.

Every ``import`` of a ``qeff_evs`` module, at module level or inside a function (lazy imports count
too), is checked against the layer table below. A module may always import its own layer's modules;
``runtime``'s sub-layers are layers of their own (inputs, backends <- engine <- the runtime's
own modules: export_bundle, media, sessions, builders, encode, requests_jsonl).
"""

from __future__ import annotations

import ast
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
    "models": BASE | {"models"},
    "export": BASE | {"models", "export"},
    "runtime.inputs": BASE | {"models", "runtime.inputs"},
    "runtime.backends": BASE | {"models", "runtime.backends"},
    "runtime.engine": BASE | {"models", "runtime.inputs", "runtime.backends", "runtime.engine"},
    "runtime": BASE | {"models", "runtime.inputs", "runtime.backends", "runtime.engine", "runtime"},
    "vllm": BASE | {"models", "runtime.inputs", "runtime.backends", "runtime.engine", "runtime", "vllm"},
    "bench": BASE | {"models", "export", "runtime.inputs", "runtime.backends", "runtime.engine", "runtime",
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


def imported_modules(path: Path, root: Path = PACKAGE) -> list[tuple[int, str]]:
    """``(line, module)`` of every qeff_evs import in the file, relative imports resolved."""
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


def test_every_module_has_a_layer():
    unknown = sorted({layer_of(module_name(p)) for p in PACKAGE.rglob("*.py")} - set(ALLOWED) - {"package"})
    assert not unknown, (f"modules outside the layer table: {unknown}; add them to ALLOWED "
                         "(docs/design.md#layout-and-import-order)")


def test_imports_run_one_way():
    assert violations() == []


@pytest.mark.parametrize("source, import_line", [
    ("models/bad.py", "from qeff_evs.export.vision import export_vision_graph"),
    ("runtime/backends/bad.py", "import qeff_evs.runtime.engine.serving"),
    ("runtime/engine/bad.py", "from qeff_evs.export import pipeline"),
    ("vllm/bad.py", "def lazy():\n    from qeff_evs.export.pipeline import export_checkpoint\n"),
    ("evs.py", "from qeff_evs import positions"),
    ("specializations/bad.py", "from ..models import language"),
])
def test_an_import_against_the_order_fails(tmp_path, source, import_line):
    # A copy of the package with one offending import added: the checker must name it.
    import shutil

    copy = tmp_path / "qeff_evs"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    target = copy / source
    target.write_text((target.read_text() if target.exists() else "") + "\n" + import_line + "\n")
    found = violations(copy)
    assert len(found) == 1 and found[0].startswith(f"qeff_evs/{source}:"), found
