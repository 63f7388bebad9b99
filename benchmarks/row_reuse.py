"""Row reuse at released widths: a conversation's turn 1 against its follow-ups, through `qeff-evs run --requests`.

One process (run it under ``flock /tmp/qeff-heavy.lock`` on a shared machine)::

    python benchmarks/row_reuse.py OUT_DIR [--family qwen2_5_vl] [--text-layers 2] [--vision-layers 2]

Writes the bench's random checkpoint at the family's released widths (``bench.checkpoint``), exports it with two KV
rows (``--full-batch-size 2``, one 16-frame 448x448 bucket, q 0.5, 128-token chunks), writes a moving-square clip and a
requests file (a question about the clip, then two follow-ups with ``after``), and runs ``qeff-evs run --requests``
on it twice in this process: with row reuse, then with ``--no-row-reuse``. Each request's time to first token (its
prefill, and for turn 1 and for a follow-up without reuse the vision side too), prompt tokens and cached tokens go to
``OUT_DIR/row_reuse.json`` and a Markdown table ``OUT_DIR/row_reuse.md``; the tokens of the two runs must be equal.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import time
import warnings
from pathlib import Path

import numpy as np

from qeff_evs import cli
from qeff_evs.bench.checkpoint import model_config, save_checkpoint
from qeff_evs.bench.config import BenchConfig
from qeff_evs.bench.report import environment
from qeff_evs.bench.suite import model_summary
from qeff_evs.export.pipeline import ExportOptions, export_checkpoint
from qeff_evs.runtime.inputs.synthetic import moving_square_video

FRAMES, SIDE, PREFILL, CTX_LEN, RATE = 16, 448, 128, 4096, 0.5
CONVERSATION = [
    {"id": "turn-1", "prompt": "What happens in this video? Describe the moving square.", "max_new_tokens": 16},
    {"id": "follow-up-1", "after": "turn-1", "prompt": "Which way does it move?", "max_new_tokens": 16},
    {"id": "follow-up-2", "after": "follow-up-1", "prompt": "And what colour is it?", "max_new_tokens": 16},
]


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def run_requests(export: Path, requests: Path, *flags: str) -> dict[str, dict]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main(["run", str(export), "--requests", str(requests), "--max-num-seqs", "2", *flags])
    if code != 0:
        raise RuntimeError(f"qeff-evs run --requests {' '.join(flags)} exited {code}")
    return {entry["id"]: entry for entry in map(json.loads, out.getvalue().splitlines())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--family", default="qwen2_5_vl")
    parser.add_argument("--text-layers", type=int, default=2)
    parser.add_argument("--vision-layers", type=int, default=2)
    parser.add_argument("--widths", choices=("realistic", "tiny"), default="realistic",
                        help="tiny: the test checkpoints' widths, to try the script quickly")
    args = parser.parse_args()
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    config = BenchConfig(family=args.family, widths=args.widths, text_layers=args.text_layers,
                         vision_layers=args.vision_layers)
    log(f"checkpoint: {args.family} at {args.widths} widths, {args.text_layers} + {args.vision_layers} layers")
    checkpoint = save_checkpoint(config, out / "checkpoint")
    log("export")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        export_checkpoint(checkpoint, out / "export", ExportOptions(
            RATE, (FRAMES,), ((SIDE, SIDE),), PREFILL, CTX_LEN, full_batch_size=2, video_pruning_methods=("evs",)))
    clip = out / "clip.npy"
    np.save(clip, moving_square_video(FRAMES, SIDE, SIDE, seed=3))
    requests = out / "requests.jsonl"
    lines = [dict(CONVERSATION[0], video=str(clip))] + CONVERSATION[1:]
    requests.write_text("".join(json.dumps(line) + "\n" for line in lines))

    log("run --requests (row reuse on)")
    reused = run_requests(out / "export", requests)
    log("run --requests --no-row-reuse")
    computed = run_requests(out / "export", requests, "--no-row-reuse")
    same = all(reused[rid]["generated_token_ids"] == computed[rid]["generated_token_ids"] for rid in reused)
    result = {"family": args.family, "model": model_summary(model_config(config)), "environment": environment(),
              "clip": {"frames": FRAMES, "side": SIDE, "rate": RATE}, "prefill_seq_len": PREFILL,
              "same_tokens": same, "reuse": reused, "no_reuse": computed}
    (out / "row_reuse.json").write_text(json.dumps(result, indent=2) + "\n")
    rows = ["| request | prompt tokens | cached (reuse) | TTFT reuse (s) | TTFT no reuse (s) | no reuse / reuse |",
            "|---|---:|---:|---:|---:|---:|"]
    for line in CONVERSATION:
        rid = line["id"]
        on, off = reused[rid], computed[rid]
        rows.append(f"| {rid} | {on['prompt_tokens']} | {on['num_cached_tokens']} | {on['time_to_first_token_s']:.2f} "
                    f"| {off['time_to_first_token_s']:.2f} | "
                    f"{off['time_to_first_token_s'] / on['time_to_first_token_s']:.1f}x |")
    rows.append(f"\nTokens equal with and without reuse: {same}.")
    (out / "row_reuse.md").write_text("\n".join(rows) + "\n")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
