"""scripts/device_check.sh, the reference path's GPU check, in CPU mode (no GPU here): one PASS line per family.

On a CUDA machine the same script runs the PyTorch backend on the GPU against ONNX Runtime on the CPU; here
``--device cpu`` runs every e2e check of it (tiny checkpoint, export, one video question on torch and on ORT,
tokens equal and top logits within 1e-4). Its other check, the suite's ``-k torch`` parity tests, is the
suite's own (``--no-pytest`` here); on the GPU a selection that finds no test fails (pytest's exit status 5).
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def device_check_module():
    spec = importlib.util.spec_from_file_location("device_check", ROOT / "scripts" / "device_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_device_check_passes_every_family_in_cpu_mode():
    done = subprocess.run(["bash", "scripts/device_check.sh", "--device", "cpu", "--no-pytest"], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    lines = [line for line in done.stdout.splitlines() if line.startswith("device_check ")]
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for family in device_check_module().FAMILIES:
        (line,) = [line for line in lines if line.startswith(f"device_check e2e {family}:")]
        assert " PASS " in line and "tokens equal (8)" in line, line
        gap = float(re.search(r"max top-logit gap (\S+)", line).group(1))
        assert gap <= 1e-4, line
    assert lines[-1] == "device_check summary: 0 of 3 checks failed"

