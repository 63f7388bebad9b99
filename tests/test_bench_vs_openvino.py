"""``qeff-evs bench --vs-openvino``: the verdict's ratios against hand arithmetic, the one-line refusals, and (where
an OpenVINO GenAI environment is given in $QEFF_EVS_OPENVINO_PYTHON: the suite does not build one, that downloads)
the whole case at tiny widths."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from qeff_evs.bench.vs_openvino import OPENVINO, OPENVINO_PYTHON_ENV, OURS, VsOpenVinoConfig, verdict


def arm(runtime, variant, rate, ttft, cpu=1.0, peak=100.0, ids=(1, 2)):
    return {"runtime": runtime, "variant": variant, "rate": rate, "ttft_s": ttft, "cpu_s": cpu, "peak_mb": peak,
            "ids": list(ids), "prompt_tokens": 10, "label": f"{runtime} {variant} {rate}"}


def test_verdict_ratios():
    arms = [arm(OURS, "ort", 0.0, 8.0, cpu=16.0, peak=50.0), arm(OURS, "ort", 0.5, 3.0),
            arm(OPENVINO, "fp32", 0.0, 10.0, cpu=20.0, peak=200.0), arm(OPENVINO, "default", 0.0, 5.0, peak=100.0),
            arm(OPENVINO, "default", 0.5, 4.0, ids=(3, 4))]
    got = verdict(arms, VsOpenVinoConfig(("qwen3_vl",), pruning_rates=(0.5,)))
    assert got["fastest_openvino"] == f"{OPENVINO} default 0.5"
    entry = got["backends"]["ort"]
    assert entry["ttft_q0_over_openvino_fp32"] == pytest.approx(0.8)
    assert entry["cpu_q0_over_openvino_fp32"] == pytest.approx(0.8)
    assert entry["ttft_q0_over_openvino_default"] == pytest.approx(1.6)
    assert entry["peak_over_openvino_fp32"] == pytest.approx(0.25)
    assert entry["peak_over_openvino_default"] == pytest.approx(0.5)
    assert entry["ttft_q0.5_over_fastest_openvino"] == pytest.approx(0.75)
    assert entry["q0_ids_equal_openvino_fp32"] is True


@pytest.mark.parametrize("argv, named", [
    (["--vs-openvino", "qwen3_5"], "--vs-openvino qwen3_5"),
    (["--vs-openvino", "--backends", "ort,qaic"], "--backends qaic"),
])
def test_refusals_name_the_value(argv, named):
    done = subprocess.run([sys.executable, "-m", "qeff_evs.cli", "bench", *argv], capture_output=True, text=True)
    assert done.returncode != 0
    assert named in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


@pytest.mark.skipif(not os.environ.get(OPENVINO_PYTHON_ENV),
                    reason=f"needs an OpenVINO GenAI environment in ${OPENVINO_PYTHON_ENV} (building one downloads)")
def test_smoke_run_compares_both_runtimes(tmp_path):
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "qeff_evs.cli", "bench", "--vs-openvino", "qwen2_5_vl", "--smoke",
                           "--rounds", "1", "--backends", "ort,openvino", "--workdir", str(tmp_path / "work"),
                           "-o", str(out)], capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads((out / "vs_openvino.json").read_text())
    family = results["families"][0]
    by_label = {a["label"]: a for a in family["arms"]}
    ours, theirs = by_label[f"{OURS} (ort) q 0"], by_label[f"{OPENVINO} fp32 unpruned"]
    assert ours["prompt_tokens"] == theirs["prompt_tokens"]
    assert ours["ids"] == theirs["ids"] == by_label[f"{OURS} (openvino) q 0"]["ids"]
    assert (out / "vs_openvino.png").stat().st_size > 0 and (out / "vs_openvino.md").is_file()
