"""An FP8 release against its bf16 twin through the streamed export: export peak memory, time and disk.

A random-weight Qwen3-VL checkpoint at Qwen3-VL-8B's widths (its config.json: hidden 4096, 32 heads / 8 KV heads,
MLP 12288, vocabulary 151,936, untied; vision 27 blocks of 1152, deepstack at 8/16/24) and ``--text-layers`` decoder
layers, written twice by the bench's seeded generator (``qeff_evs.bench.checkpoint.write_random_checkpoint``, shard
by shard, as released): in bf16, and as Qwen's "-FP8" release (the same weights, the decoder's linears in e4m3 blocks
of 128 x 128 with bf16 ``weight_scale_inv``, ``quantization_config`` in config.json). Each is exported by
``qeff-evs export`` (the streamed export; the FP8 weights dequantized tensor by tensor) in a fresh process, one after
the other, the same options; measured: the process's peak resident memory, wall and CPU time, the checkpoint's and
the export's bytes on disk.

    flock /tmp/qeff-heavy.lock python benchmarks/quantized_export.py OUT_DIR --work WORK_DIR [--text-layers 6]

Writes ``OUT_DIR/quantized_export.json`` and ``.md``. WORK_DIR holds the checkpoints and exports (each removed once
measured unless ``--keep``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from qeff_evs.bench.checkpoint import write_random_checkpoint
from qeff_evs.models.registry import family_class

FAMILY = "qwen3_vl"
TEXT_8B = dict(hidden_size=4096, intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
               vocab_size=151936)
VISION_8B = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=4096,
                 deepstack_visual_indexes=[8, 16, 24])
EXPORT_ARGS = ["--video-pruning-rate", "0.5", "--frames", "16", "--height", "448", "--width", "448",
               "--ctx-len", "8192", "--full-batch-size", "1"]
# Runs one export and prints the process's peak resident memory (KiB) and CPU seconds last.
CHILD = ("import resource, sys; from qeff_evs import cli; code = cli.main(sys.argv[1:]); "
         "usage = resource.getrusage(resource.RUSAGE_SELF); "
         "print('peak_kib', usage.ru_maxrss, usage.ru_utime + usage.ru_stime); sys.exit(code)")


def config_8b(text_layers: int):
    spec = family_class(FAMILY)
    kwargs = spec.realistic_config_kwargs(text_layers, VISION_8B["depth"])
    kwargs["text_config"] = {**kwargs["text_config"], **TEXT_8B}
    kwargs["vision_config"] = {**kwargs["vision_config"], **VISION_8B}
    kwargs["tie_word_embeddings"] = False
    return spec.config_class(**kwargs)


def disk_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def export(checkpoint: Path, out: Path, weight_dtype: str) -> dict:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", CHILD, "export", str(checkpoint), "-o", str(out), *EXPORT_ARGS,
                           "--weight-dtype", weight_dtype], capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode:
        raise RuntimeError(f"export of {checkpoint} failed: {done.stderr[-3000:]}")
    _, peak, cpu = done.stdout.strip().splitlines()[-1].split()
    return {"wall_s": round(wall, 1), "cpu_s": round(float(cpu), 1), "peak_rss_gib": round(int(peak) / 2**20, 2),
            "export_gib": round(disk_bytes(out) / 2**30, 2)}


def markdown(result: dict) -> str:
    lines = [f"# FP8 release against bf16 through the streamed export (Qwen3-VL-8B widths, {result['text_layers']} text "
             f"layers, 27 vision blocks)", "",
             f"Options: `{' '.join(EXPORT_ARGS)} --weight-dtype {result['weight_dtype']}`; one process per export, "
             "under the heavy-job lock.", "",
             "| checkpoint | on disk GiB | write s | export wall s | export CPU s | export peak RSS GiB | export on disk GiB |",
             "|---|---|---|---|---|---|---|"]
    for name, row in result["checkpoints"].items():
        lines.append(f"| {name} | {row['checkpoint_gib']} | {row['write_s']} | {row['wall_s']} | {row['cpu_s']} | "
                     f"{row['peak_rss_gib']} | {row['export_gib']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--text-layers", type=int, default=6)
    parser.add_argument("--weight-dtype", choices=("float32", "float16"), default="float16",
                        help="the export's weights (default: float16, the card target's)")
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = {}
    for name, fp8 in (("bf16", False), ("fp8", True)):
        folder = args.work / name
        shutil.rmtree(folder, ignore_errors=True)
        start = time.perf_counter()
        write_random_checkpoint(config_8b(args.text_layers), FAMILY, folder / "checkpoint", seed=0,
                                dtype=torch.bfloat16, fp8=fp8, progress=print)
        row = {"write_s": round(time.perf_counter() - start, 1),
               "checkpoint_gib": round(disk_bytes(folder / "checkpoint") / 2**30, 2)}
        row.update(export(folder / "checkpoint", folder / "export", args.weight_dtype))
        rows[name] = row
        print(name, row, flush=True)
        if not args.keep:  # the next checkpoint needs the disk
            shutil.rmtree(folder)
    result = {"family": FAMILY, "widths": "Qwen3-VL-8B", "text_layers": args.text_layers,
              "weight_dtype": args.weight_dtype, "export_args": EXPORT_ARGS, "checkpoints": rows}
    (args.out / "quantized_export.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "quantized_export.md").write_text(markdown(result))
    print(markdown(result))
    if not args.keep:
        shutil.rmtree(args.work, ignore_errors=True)


if __name__ == "__main__":
    main()
