"""qeff-evs against QEfficient at released widths with few layers: one run, one table.

For each family (default Qwen2.5-VL-3B and Qwen3-VL-2B widths, 2 text + 2 vision layers, random weights, the tiny
tokenizer: ``bench.serving.serving_checkpoint``), one 16-frame 448x448 clip (a moving square, 2 fps) goes through
``qeff-evs bench --vs-qefficient``'s comparison: QEfficient's dual-QPC graphs (frames as images) and ours (the video
at q 0, 0.5, 0.75), both on ONNX Runtime; vision bytes per chunk are also counted at 64 frames. The table, a line
per way QEfficient's graphs ran (every state fed, as its ORT runner; the state in place, as ours): QEfficient's vision
bytes per chunk, prefill time and TTFT over ours (process CPU time), each side's ms per chunk, and each side's max
|logit diff| from transformers. Each family's full report (JSON, Markdown, PNG) is written beside it.

QEfficient's export at these widths takes minutes and GBs: run it alone,

    flock /tmp/qeff-heavy.lock .venv/bin/python benchmarks/vs_qefficient_released.py \\
        --qefficient-python /path/to/qefficient-venv/bin/python --workdir /tmp/vs_qefficient \\
        -o benchmarks/results/vs_qefficient

(docs/performance.md, "Compared with QEfficient", says what such a Python needs.)
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from qeff_evs.bench.serving import serving_checkpoint
from qeff_evs.bench.vs_qefficient import VsConfig, qefficient_python, run_comparison
from qeff_evs.bench.vs_qefficient_report import summary_markdown, summary_row
from qeff_evs.runtime.inputs.synthetic import moving_square_video


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--qefficient-python", default=None, help="default $QEFF_EVS_QEFFICIENT_PYTHON")
    parser.add_argument("--families", default="qwen2_5_vl,qwen3_vl")
    parser.add_argument("--frames", type=int, default=16)
    parser.add_argument("--size", type=int, default=448)
    parser.add_argument("--accounting-frames", default="64")
    parser.add_argument("--workdir", type=Path, required=True, help="checkpoints, exports, QEfficient's graphs")
    parser.add_argument("-o", "--output", type=Path, required=True)
    args = parser.parse_args()
    python = qefficient_python(args.qefficient_python)
    args.output.mkdir(parents=True, exist_ok=True)
    clip = args.workdir / f"clip_{args.frames}x{args.size}.npy"
    args.workdir.mkdir(parents=True, exist_ok=True)
    np.save(clip, moving_square_video(args.frames, args.size, args.size, seed=3))
    rows = []
    for family in args.families.split(","):
        checkpoint = args.workdir / family / "checkpoint"
        if not (checkpoint / "config.json").is_file():
            progress(f"{family}: random checkpoint at released widths, 2 + 2 layers")
            serving_checkpoint(family, checkpoint)
        config = VsConfig(checkpoint, clip, python, frames=args.frames, size=(args.size, args.size),
                          accounting_frames=tuple(int(f) for f in args.accounting_frames.split(",")))
        results = run_comparison(config, args.output / family, args.workdir / family, progress,
                                 command="benchmarks/vs_qefficient_released.py")
        rows.append(summary_row(results))
        progress(f"{family}: {json.dumps(rows[-1])}")
    (args.output / "vs_qefficient_released.json").write_text(json.dumps(rows, indent=2) + "\n")
    table = summary_markdown(rows)
    (args.output / "vs_qefficient_released.md").write_text("\n".join(table) + "\n")
    print("\n".join(table))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
