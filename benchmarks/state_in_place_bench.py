"""Peak memory and time of one request on ONNX Runtime, before and after the KV cache was kept in place.

A random-weight checkpoint at Qwen3-VL-2B's widths and full depth (28 text layers, 24 vision blocks;
``Qwen3_VLFamily.realistic_widths``), saved with ``save_pretrained`` as a user's is, goes through the real
export once; then the same request (a 16-frame 448x448 moving-square clip, 8 new tokens) runs through the
ONNX Runtime engine twice, each in its own child process so each has its own peak RSS
(``resource.getrusage``): once with the runtime of ``--before-src`` (a checkout of the code before, e.g.
``git archive main | tar -x -C DIR``) and once with this checkout's. The graphs are the same files.
Heavy (an 8.5 GB checkpoint, a 14 GB export peak): run it under ``flock /tmp/qeff-heavy.lock``::

    python benchmarks/state_in_place_bench.py OUT_DIR --before-src DIR [--text-layers 28] [--vision-layers 24]
        [--frames 16] [--size 448] [--prefill-seq-len 128] [--ctx-len 8192] [--q 0.5] [--new-tokens 8]

OUT_DIR/state_in_place_bench.json holds every number; ``--table`` prints its Markdown table. "Weights" are
the bytes of the ONNX graphs a run loads (encoder, the pruning graph, language), "KV" the fp32 cache of
``ctx_len`` slots; the budget is weights + KV + 15 %.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent  # this checkout


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def build(args) -> dict:
    from qeff_evs.bench.checkpoint import save_checkpoint
    from qeff_evs.bench.config import preset

    started = time.perf_counter()
    config = preset("full", "qwen3_vl").replace(text_layers=args.text_layers, vision_layers=args.vision_layers)
    folder = save_checkpoint(config, Path(args.out) / "checkpoint")
    return {"build_s": time.perf_counter() - started,
            "checkpoint_bytes": sum(f.stat().st_size for f in folder.iterdir())}


def export(args) -> dict:
    from qeff_evs.export.pipeline import ExportOptions, export_checkpoint

    started = time.perf_counter()
    options = ExportOptions(args.q, (args.frames,), ((args.size, args.size),), args.prefill_seq_len, args.ctx_len,
                            user_vision_size=args.prefill_seq_len, video_pruning_methods=("evs",))
    export_checkpoint(Path(args.out) / "checkpoint", Path(args.out) / "export", options, progress=print)
    return {"export_s": time.perf_counter() - started}


def run(args) -> dict:
    # Spelled out rather than bench.one_request.answer_clip: the "before" checkout runs this phase with its
    # own qeff_evs, which may predate that helper; only runtime APIs both sides have are used.
    from qeff_evs.runtime.builders import answer, build_engine
    from qeff_evs.runtime.export_bundle import open_export
    from qeff_evs.runtime.inputs.synthetic import moving_square_video
    from qeff_evs.runtime.media import video_from_frames

    bundle = open_export(Path(args.out) / "export")
    shape = bundle.language_shape
    frames = moving_square_video(args.frames, args.size, args.size, seed=0)
    video = video_from_frames(frames, {"total_num_frames": len(frames), "fps": 2.0}, bundle)
    started = time.perf_counter()
    engine = build_engine(bundle, "ort", max_new_tokens=args.new_tokens)
    opened = time.perf_counter() - started
    started = time.perf_counter()
    result = answer(bundle, engine, video, "What happens in this video?")
    answered = time.perf_counter() - started
    graphs = [bundle.export_dir / "vision", bundle.export_dir / "language"]
    weights = sum(f.stat().st_size for folder in graphs for f in folder.iterdir()
                  if f.is_file() and "vidcom2" not in f.name)
    kv = shape.full_batch_size * len(shape.kv_layer_indices) * 2 * shape.kv_heads * shape.ctx_len * shape.head_dim * 4
    return {"open_s": opened, "answer_s": answered,
            "prompt_tokens": len(result.prompt_token_ids), "generated": result.generated_token_ids,
            "prefill_chunks": result.num_prefill_chunks, "weights_bytes": weights, "kv_bytes_fp32": kv,
            "runtime_src": str(Path(sys.modules["qeff_evs"].__file__).parent.parent)}


PHASES = {"build": build, "export": export, "run": run}


def child(args, phase: str, src: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(src)}  # the run's qeff_evs comes from src
    argv = [sys.executable, str(Path(__file__).resolve()), *sys.argv[1:], "--phase", phase]
    done = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=src)
    if done.returncode:
        sys.stderr.write(done.stdout[-3000:] + done.stderr[-6000:])
        raise SystemExit(done.returncode)
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(report: dict) -> str:
    gib = 1024 ** 3
    lines = ["| runtime | peak RSS (GiB) | weights + KV (GiB) | peak / (weights + KV) | open (s) | answer (s) |",
             "|---|---|---|---|---|---|"]
    for label in ("before", "after"):
        r = report[label]
        base = r["weights_bytes"] + r["kv_bytes_fp32"]
        lines.append(f"| {label} | {r['run_peak_rss_mib'] / 1024:.2f} | {base / gib:.2f} | "
                     f"{r['run_peak_rss_mib'] * 2 ** 20 / base:.3f} | {r['open_s']:.1f} | {r['answer_s']:.1f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--before-src", type=Path, required=False, help="a checkout of the runtime before")
    parser.add_argument("--phase", choices=PHASES, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--table", action="store_true", help="print the saved run's table and stop")
    parser.add_argument("--text-layers", type=int, default=28)
    parser.add_argument("--vision-layers", type=int, default=24)
    parser.add_argument("--frames", type=int, default=16)
    parser.add_argument("--size", type=int, default=448)
    parser.add_argument("--prefill-seq-len", type=int, default=128)
    parser.add_argument("--ctx-len", type=int, default=8192)
    parser.add_argument("--q", type=float, default=0.5)
    parser.add_argument("--new-tokens", type=int, default=8)
    args = parser.parse_args(argv)
    out = Path(args.out)
    if args.phase:  # a child: one phase, its numbers and its own peak RSS as the last line
        numbers = PHASES[args.phase](args)
        numbers[f"{args.phase}_peak_rss_mib"] = _peak_rss_mib()
        print(json.dumps(numbers))
        return 0
    if args.table:
        print(table(json.loads((out / "state_in_place_bench.json").read_text())))
        return 0
    if args.before_src is None:
        parser.error("--before-src DIR (a checkout of the runtime before) is needed to measure")
    out.mkdir(parents=True, exist_ok=True)
    report = {"config": {k: str(v) for k, v in vars(args).items() if k not in ("phase", "table")}}
    if not (out / "checkpoint" / "config.json").is_file():
        print("[state_in_place_bench] build", flush=True)
        report.update(child(args, "build", HERE))
    if not (out / "export" / "manifest.json").is_file():
        print("[state_in_place_bench] export", flush=True)
        report.update(child(args, "export", HERE))
    for label, src in (("before", args.before_src.resolve()), ("after", HERE)):
        print(f"[state_in_place_bench] run ({label}: {src})", flush=True)
        report[label] = child(args, "run", src)
        print(json.dumps(report[label]), flush=True)
    if report["before"]["generated"] != report["after"]["generated"]:
        raise SystemExit(f"before and after generated different tokens: {report['before']['generated']} vs "
                         f"{report['after']['generated']}")
    (out / "state_in_place_bench.json").write_text(json.dumps(report, indent=2) + "\n")
    print(table(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
