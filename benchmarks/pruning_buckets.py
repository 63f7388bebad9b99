"""What the frame buckets cost: each pruning graph per bucket against the encoder, and the padding a bucket adds.

A pruning specialization serves every video up to its frame bucket (docs/design.md#specializations): the host pads the
video's merged rows to the smallest bucket holding it. This measures, with ONNX Runtime on the CPU, at Qwen2.5-VL-3B
widths (448x448 frames: 256 merged tokens per temporal patch, 2048-wide rows; the bench's random-weight vision
tower, ``--vision-layers`` blocks, and ``--full-depth`` to scale its time to the checkpoint's 32):

* per bucket B (temporal patches): the encoder's time for B temporal patches (its calls of 2), and each method's
  pruning graph on a full bucket (T = B), as a share of the encoder's;
* the padding: a video of T = B/2 + 1 temporal patches (the worst fit) in bucket B against the same video in a
  bucket of exactly T (what an export with every T as a bucket would run).

    PYTHONPATH=. python benchmarks/pruning_buckets.py -o benchmarks/results/pruning_buckets.md

Medians of ``--repeats`` runs, process CPU time (all threads) and wall time; the verdicts use CPU time.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from qeff_evs.bench.config import preset
from qeff_evs.bench.checkpoint import model_config, random_model
from qeff_evs.bench.sessions import open_inference_session
from qeff_evs.export.vision import export_encoder_graph, export_pruning_graph
from qeff_evs.models.pruning import PRUNING_METHODS, pad_to_bucket, pruning_host_inputs
from qeff_evs.models.registry import family_for_config
from qeff_evs.models.tiny import build_tokenizer

GRID_HW = (32, 32)  # 448x448 frames, patch 14: 32x32 patches, 16x16 merged tokens
TOKENS = 256
FRAMES_PER_CALL = 2
TARGET_SHARE = 0.03  # the target: the pruning graph under 3% of the encoder at every bucket


def timed(call, repeats: int) -> tuple[float, float]:
    """Median (cpu, wall) seconds of ``repeats`` calls after one warm-up call."""
    call()
    cpu, wall = [], []
    for _ in range(repeats):
        c, w = time.process_time(), time.perf_counter()
        call()
        cpu.append(time.process_time() - c)
        wall.append(time.perf_counter() - w)
    return statistics.median(cpu), statistics.median(wall)


def video_rows(frames: int, width: int, seed: int) -> np.ndarray:
    """Rows whose tokens drift a little from frame to frame (EVS has something to rank)."""
    rng = np.random.default_rng(seed)
    base = rng.standard_normal((TOKENS, width)).astype(np.float32)
    steps = rng.standard_normal((frames, TOKENS, width)).astype(np.float32) * 0.3
    return (base[None] + np.cumsum(steps, axis=0)).reshape(frames * TOKENS, width)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--buckets", default="1,2,4,8,16,32", help="frame buckets in temporal patches")
    parser.add_argument("--vision-layers", type=int, default=2, help="blocks of the random vision tower")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("-o", "--output", type=Path, default=None, help="markdown table (and .json beside it)")
    args = parser.parse_args()
    buckets = [int(b) for b in args.buckets.split(",")]

    config = preset("full").replace(vision_layers=args.vision_layers, text_layers=1)
    hf_config = model_config(config)
    model = random_model(hf_config, config.family, config.seed)
    family = family_for_config(hf_config, build_tokenizer(config.family))
    width = family.normalized_config.vision_hidden
    results: dict = {"vision_layers": args.vision_layers, "width": width, "tokens_per_patch": TOKENS,
                     "repeats": args.repeats, "buckets": {}}
    with tempfile.TemporaryDirectory() as scratch:
        encoder_path = export_encoder_graph(family.encoder(model), GRID_HW, FRAMES_PER_CALL,
                                            Path(scratch) / "encoder.onnx", progress=print)
        pruning = {m: open_inference_session(export_pruning_graph(family.pruning_ranking(m), width,
                                                                   Path(scratch) / f"pruning_{m}.onnx",
                                                                   progress=print))
                   for m in PRUNING_METHODS}
        encoder = open_inference_session(encoder_path)
        rng = np.random.default_rng(0)
        vc = hf_config.vision_config
        patch_width = vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2
        feeds = {"pixel_values": rng.standard_normal((FRAMES_PER_CALL * GRID_HW[0] * GRID_HW[1], patch_width))
                 .astype(np.float32), **family.encoder_host_inputs(GRID_HW, FRAMES_PER_CALL)}
        call_cpu, call_wall = timed(lambda: encoder.run(None, feeds), args.repeats)
        results["encoder_call"] = {"cpu": call_cpu, "wall": call_wall}
        print(f"encoder call of {FRAMES_PER_CALL} temporal patches: {call_cpu:.3f} s CPU ({call_wall:.3f} wall)")

        def ranking(method: str, rows: np.ndarray, bucket: int, frames: int) -> tuple[float, float]:
            inputs = {"merged_embeds": pad_to_bucket(rows, bucket * TOKENS),
                      **pruning_host_inputs(method, bucket, frames, 0.5)}
            return timed(lambda: pruning[method].run(None, inputs), args.repeats)

        for bucket in buckets:
            calls = math.ceil(bucket / FRAMES_PER_CALL)
            entry = {"encoder_cpu": calls * call_cpu, "encoder_wall": calls * call_wall}
            worst = bucket // 2 + 1 if bucket > 1 else 1
            full, short = video_rows(bucket, width, seed=bucket), video_rows(worst, width, seed=bucket + 1)
            for method in PRUNING_METHODS:
                cpu, wall = ranking(method, full, bucket, bucket)
                padded, _ = ranking(method, short, bucket, worst)
                exact, _ = ranking(method, short, worst, worst)
                entry[method] = {"cpu": cpu, "wall": wall, "share": cpu / entry["encoder_cpu"],
                                 "worst_fit_frames": worst, "padded_cpu": padded, "exact_cpu": exact,
                                 "padding_overhead": padded / exact}
            results["buckets"][bucket] = entry
            print(f"bucket {bucket}: encoder {entry['encoder_cpu']:.2f} s; " + "; ".join(
                f"{m} {entry[m]['cpu'] * 1e3:.1f} ms ({100 * entry[m]['share']:.2f}%), T={worst} padded "
                f"{entry[m]['padded_cpu'] * 1e3:.1f} ms vs exact {entry[m]['exact_cpu'] * 1e3:.1f} ms"
                for m in PRUNING_METHODS), flush=True)

    scale = 32 / args.vision_layers  # the checkpoint's 32 blocks: the encoder's time grows with depth
    lines = [f"Pruning graphs per frame bucket, 448x448 ({TOKENS} tokens per temporal patch, rows {width} wide), "
             f"ORT CPU, medians of {args.repeats}; encoder: the bench's {args.vision_layers}-block random tower, "
             f"calls of {FRAMES_PER_CALL} temporal patches ({call_cpu:.2f} s CPU per call).", "",
             "| bucket (temporal patches) | encoder CPU s | " + " | ".join(
                 f"{m} CPU ms | {m} / encoder | {m} / 32-block encoder | {m} worst fit: padded / exact ms"
                 for m in PRUNING_METHODS) + " |",
             "|---" * (2 + 4 * len(PRUNING_METHODS)) + "|"]
    for bucket, entry in results["buckets"].items():
        cells = [str(bucket), f"{entry['encoder_cpu']:.2f}"]
        for m in PRUNING_METHODS:
            e = entry[m]
            cells += [f"{e['cpu'] * 1e3:.1f}", f"{100 * e['share']:.2f}%", f"{100 * e['share'] / scale:.3f}%",
                      f"T={e['worst_fit_frames']}: {e['padded_cpu'] * 1e3:.1f} / {e['exact_cpu'] * 1e3:.1f} "
                      f"({e['padding_overhead']:.2f}x)"]
        lines.append("| " + " | ".join(cells) + " |")
    worst_share = max(results["buckets"][b][m]["share"] for b in results["buckets"] for m in PRUNING_METHODS)
    lines += ["", f"Largest share against the {args.vision_layers}-block encoder: {100 * worst_share:.2f}% "
              f"(target < {100 * TARGET_SHARE:.0f}%: {'met' if worst_share < TARGET_SHARE else 'missed'})."]
    table = "\n".join(lines) + "\n"
    print(table)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(table)
        args.output.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
