"""An export killed for real: ``qeff-evs export`` in a process of its own that sends itself SIGKILL at a chosen point
(no ``finally``, no cleanup, the lock dropped by the kernel), as ``kill -9`` or the OOM killer would stop it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Where the child kills itself: a point of the export, patched to send SIGKILL when it is reached.
KILL_POINTS = {
    # half-way through a unit of weights (its .partial file holds one weight)
    "weights": "qeff_evs.export.weights:WeightStore._write_weight:2",
    # a unit's data renamed into place, its index not yet written
    "unit index": "qeff_evs.export.weights:replace_text:1",
    # the same, at the second unit (the first one complete)
    "second unit index": "qeff_evs.export.weights:replace_text:2",
    # every weight and graph written, the compile inputs not
    "compile inputs": "qeff_evs.export.pipeline:write_compile_script:1",
    # everything written but the manifest
    "manifest": "qeff_evs.manifest:Manifest.write:1",
}

CHILD = """
import importlib, os, signal, sys, warnings
module, attribute, count = sys.argv[1].split(":")
owner = importlib.import_module(module)
parts = attribute.split(".")
holder = owner if len(parts) == 1 else getattr(owner, parts[0])
original = getattr(holder, parts[-1])
calls = [0]
def killing(*args, **kwargs):
    calls[0] += 1
    if calls[0] >= int(count):
        os.kill(os.getpid(), signal.SIGKILL)
    return original(*args, **kwargs)
setattr(holder, parts[-1], killing)
warnings.simplefilter("ignore")
from qeff_evs.cli import main
sys.exit(main(sys.argv[2:]))
"""


def export_argv(checkpoint: Path, out: Path, options: dict) -> list[str]:
    """``qeff-evs export`` arguments for ``options`` (flag -> value)."""
    argv = ["export", str(checkpoint), "-o", str(out)]
    for flag, value in options.items():
        argv += [flag, str(value)]
    return argv


def killed_export(checkpoint: Path, out: Path, options: dict, point: str) -> subprocess.CompletedProcess:
    """Run the export of ``checkpoint`` into ``out`` in a child that kills itself at ``point`` (``KILL_POINTS``);
    asserts that it was killed."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", CHILD, KILL_POINTS[point], *export_argv(checkpoint, out, options)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == -signal.SIGKILL, (point, done.returncode, done.stderr[-2000:])
    return done


def folder_bytes(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (by relative path) and its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(Path(folder).rglob("*")) if p.is_file()}


def differences(folder: Path, reference: Path) -> list[str]:
    """The files that differ between two folders: missing on either side, or other bytes."""
    ours, theirs = folder_bytes(folder), folder_bytes(reference)
    return sorted(set(ours) ^ set(theirs)) + [name for name in ours if name in theirs and ours[name] != theirs[name]]


def manifest_of(folder: Path) -> dict:
    return json.loads((Path(folder) / "manifest.json").read_text())
