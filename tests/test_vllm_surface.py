"""The vLLM the plugin reaches is one table (``qeff_evs.vllm.surface``), and the installed vLLM is the one it supports.

* every row resolves in the installed vLLM, and each overridden or keyword-called method still takes the parameters
  the row names: a release that removes or changes one fails here, naming the row;
* nothing in qeff_evs imports vLLM but through the table;
* under another vLLM release an active plugin stops ``vllm serve`` at start-up with one line (the version faked in a
  child process: nothing is installed).
"""

from __future__ import annotations

import ast
import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm.v1.worker.worker_base")

from qeff_evs.vllm import surface  # noqa: E402
from qeff_evs.vllm.surface import SUPPORTED_VLLM, SYMBOLS, VllmSymbol  # noqa: E402

PACKAGE = Path(__file__).resolve().parent.parent / "qeff_evs"


def surface_problem(name: str, symbol: VllmSymbol) -> str | None:
    """What the installed vLLM lacks of one row, in one line naming it; None when the row holds."""
    try:
        obj = surface.resolve(symbol)
    except (ImportError, AttributeError) as error:
        return f"{name}: {symbol.module}.{symbol.attr} is gone ({type(error).__name__}: {error})"
    if symbol.parameters is None:
        return None
    params = [p for p in inspect.signature(obj).parameters if p not in ("self", "cls")]
    if params[:len(symbol.parameters)] != list(symbol.parameters):
        return f"{name}: {symbol.module}.{symbol.attr} takes {params}, the plugin relies on {list(symbol.parameters)}"
    return None


def test_the_installed_vllm_is_the_supported_release():
    assert surface.installed_vllm() == SUPPORTED_VLLM
    assert surface.version_refusal(SUPPORTED_VLLM) is None


@pytest.mark.parametrize("name", sorted(SYMBOLS))
def test_every_vllm_symbol_the_plugin_uses_is_there(name):
    assert surface_problem(name, SYMBOLS[name]) is None


def test_a_removed_or_changed_symbol_is_named():
    gone = VllmSymbol("vllm.v1.sample.sampler", "Sampler", "vLLM 0.32's sampler, deleted in 0.34")
    assert surface_problem("Sampler", gone).startswith("Sampler: vllm.v1.sample.sampler.Sampler is gone")
    changed = VllmSymbol("vllm.v1.core.sched.scheduler", "Scheduler._get_local_prefix_cache_hit", "", ("request",
                                                                                                  "bound"))
    assert "takes ['request', 'max_cache_hit_length']" in surface_problem("hit", changed)
    with pytest.raises(AttributeError, match="add its row to SYMBOLS"):
        surface.NotAVllmSymbol  # noqa: B018


def test_the_plugin_imports_vllm_only_through_the_table():
    found = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "surface.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            found += [f"{path.relative_to(PACKAGE)}:{node.lineno} {n}" for n in names
                      if n == "vllm" or n.startswith("vllm.")]
    assert found == []


def test_the_table_names_every_symbol_the_plugin_takes_from_it():
    used = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "qeff_evs.vllm.surface":
                used |= {a.name for a in node.names}
    helpers = {"installed_vllm", "version_refusal", "SUPPORTED_VLLM", "INSTALL_LINE"}
    assert used - helpers <= set(SYMBOLS)


FAKE_VERSION = """
import importlib.metadata as metadata, sys
real = metadata.version
metadata.version = lambda name: "0.33.0" if name == "vllm" else real(name)
from vllm.entrypoints.cli.main import main
sys.argv = ["vllm", "serve", sys.argv[1], "--max-model-len", "256"]
main()
"""


def test_another_vllm_release_is_refused_at_start_up_in_one_line(tiny_export, tmp_path):
    env = {**os.environ, "QEFF_EVS_BACKEND": "ort"}
    result = subprocess.run([sys.executable, "-c", FAKE_VERSION, str(tiny_export)], env=env, capture_output=True,
                            text=True, timeout=300, cwd=tmp_path)
    lines = [line for line in result.stderr.splitlines() if "qeff-evs serves through" in line]
    assert result.returncode != 0
    assert lines == [f"QEFF_EVS_BACKEND=ort: qeff-evs serves through vLLM {SUPPORTED_VLLM} and vLLM 0.33.0 is "
                     f"installed: the plugin overrides vLLM internals that move between releases; "
                     f"{surface.INSTALL_LINE}"], result.stderr[-2000:]
    assert "Traceback" not in result.stderr
