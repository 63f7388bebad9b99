"""``verify --fp16``'s router comparison on an MoE export, over a video prompt's own prefill chunks.

``qeff_evs.export.verify_routers.router_comparison`` runs the export's language graph three ways (fp32; the card's fp16
emulation with the routers in fp16; the same with the routers kept fp32, as the export's node-precision file keeps
them) and counts, per token and sparse layer, whose top-k expert set changes, with fp32's margin between the k-th and
(k+1)-th router probability of each flipped token. ``qeff-evs verify --fp16`` feeds it video-like rows; here it gets
what ``qeff-evs run`` feeds the graph for a synthetic 16-frame 448x448 clip and a question: the export's encoder
over the clip's pixels (deepstack rows included), the family's prompt layout and M-RoPE positions, chunks of the
export's prefill length (a padded last chunk's padding is not counted)::

    python benchmarks/moe_router_video.py EXPORT_DIR OUT_DIR [--frames 16] [--size 448] [--q 0] [--seeds 0 1]

``EXPORT_DIR``: an MoE export at released widths, e.g. ``benchmarks/moe_whole_model.py export``'s
``OUT/work_qwen3_vl_moe/export``. Each seed is its own clip and question. Besides the flip counts (which at random
weights' margins are a count of near-ties) the report has the error of the router probabilities themselves against
fp32 (``verify_routers.router_agreement``) and, at the first sparse layer, what the router's own precision adds. Writes
``OUT_DIR/moe_router_video_<family>.json`` and ``.md``. The language graph is gigabytes: run it under ``flock
/tmp/qeff-heavy.lock``; one variant is open at a time.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from qeff_evs import evs
from qeff_evs.bench.sessions import open_inference_session
from qeff_evs.bench.workload import first_special_id, prompt_pieces, question_ids, synthetic_clip
from qeff_evs.export.verify_routers import RouterChunk, router_comparison
from qeff_evs.manifest import pruning_graph
from qeff_evs.models.pruning import VideoPruning
from qeff_evs.runtime.backends.ort import OrtEncoderSession, OrtPruningSession
from qeff_evs.runtime.backends.vision import VisionPipeline
from qeff_evs.runtime.engine.request import EncodedMedia, prepare_prompt
from qeff_evs.runtime.engine.steps import prefill_step
from qeff_evs.runtime.engine.window import prefill_chunks
from qeff_evs.runtime.export_bundle import open_export

QUESTION_TOKENS = 32


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def video_chunks(export_dir: Path, frames: int, size: int, q: float,
                 seed: int) -> tuple[list[RouterChunk], dict]:
    """The prefill chunks of the clip + question, as the runtime builds them, and what the prompt holds."""
    bundle = open_export(export_dir)
    manifest, family = bundle.manifest, bundle.family
    shape = manifest.language_shape
    vision = VisionPipeline(family, OrtEncoderSession(open_inference_session(manifest.path(export_dir, "encoder"))),
                            {"evs": OrtPruningSession(open_inference_session(
                                manifest.path(export_dir, pruning_graph("evs"))))},
                            manifest.frames_per_call, manifest.temporal_patch_buckets)
    clip = synthetic_clip(bundle.preprocess, frames, size, seed)
    log(f"encoding the {frames}-frame {size}x{size} clip (grid {clip.grid_thw}) at q {q:g}")
    result = vision.encode(clip.video, VideoPruning("evs", q))
    t, h, w = family.merged_grid(clip.grid_thw)
    encoded = EncodedMedia(result.rows, result.kept_indices, result.extras,
                           tuple(evs.tokens_per_frame_kept(result.kept_indices, t, h * w)))
    question = question_ids(QUESTION_TOKENS, first_special_id(family), seed)
    prompt = prepare_prompt(prompt_pieces(family, question), [clip.video], [encoded], family)
    chunks = []
    for computed, scheduled in prefill_chunks(len(prompt.ids), manifest.prefill_seq_len):
        step = prefill_step(prompt, computed, scheduled, manifest.prefill_seq_len, manifest.user_vision_size,
                            shape.hidden, shape.extras)
        chunks.append(RouterChunk(step.input_ids, step.position_ids, {"vision_embeds": step.vision_embeds,
                                                                      **step.extras},
                                  step.position_ids[0, 0] >= 0))
    norms = np.linalg.norm(result.rows, axis=-1)
    about = {"seed": seed, "frames": frames, "size": size, "q": q, "grid_thw": list(clip.grid_thw), "video_tokens": t * h * w,
             "kept_tokens": len(result.kept_indices), "prompt_tokens": len(prompt.ids), "chunks": len(chunks),
             "prefill_seq_len": manifest.prefill_seq_len,
             "vision_row_norms": [float(np.min(norms)), float(np.median(norms)), float(np.max(norms))]}
    return chunks, about


PRECISIONS = (("router_fp16", "fp16 (plain -convert-to-fp16)"), ("router_fp32", "fp32 (node precision)"))


def markdown(r: dict) -> str:
    first = r["runs"][0]
    d, w = first["router"], first["workload"]
    lines = [f"`verify --fp16` router comparison, {r['family']} export ({r['text_layers']} text + "
             f"{r['vision_layers']} vision layers, {d['routers']} routers, top-{d['top_k']} of {r['experts']}), "
             f"over {len(r['runs'])} {w['frames']}-frame {w['size']}x{w['size']} clip(s) at q {w['q']:g} (seeds "
             f"{', '.join(str(run['workload']['seed']) for run in r['runs'])}), each with a {QUESTION_TOKENS}-token "
             f"question, chunks of {w['prefill_seq_len']}.", "",
             "| seed | (token, layer) pairs | median margin | router on the card | top-k set changes | share "
             "| largest margin of a flip | median margin of the flips | prob. error median | prob. error max "
             "| pairs within 2x their error |", "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for run in r["runs"]:
        d = run["router"]
        for label, name in PRECISIONS:
            margins = d[f"flipped_margins_{label}"]
            median = f"{np.median(margins):.2e}" if margins else "-"
            lines.append(f"| {run['workload']['seed']} | {d['tokens_x_layers']} | {d['median_margin']:.2e} | {name} "
                         f"| {len(margins)} | {d[f'flipped_share_{label}']:.3%} "
                         f"| {d[f'flipped_margin_max_{label}']:.2e} | {median} "
                         f"| {d[f'prob_error_median_{label}']:.2e} | {d[f'prob_error_max_{label}']:.2e} "
                         f"| {d[f'within_error_share_{label}']:.3%} |")
    lines += ["", "Per sparse layer, the router probabilities' error against fp32 (per token the largest over the "
              "experts; median / max over the tokens), and at the first sparse layer (the same input in both fp16 "
              "runs) what the router's own precision adds:", "",
              "| seed | layer | router fp16: error median / max | router fp32: error median / max "
              "| flips (fp16 / fp32 router) | their largest margin (fp16 / fp32) |", "|---|---|---|---|---|---|"]
    for run in r["runs"]:
        d = run["router"]
        for layer, (ours, kept) in enumerate(zip(d["prob_error_by_layer_router_fp16"],
                                                 d["prob_error_by_layer_router_fp32"])):
            flips = [d.get(f"flipped_by_layer_{label}", [[]] * (layer + 1))[layer] for label, _ in PRECISIONS]
            largest = " / ".join(f"{max(f):.2e}" if f else "-" for f in flips)
            lines.append(f"| {run['workload']['seed']} | {layer} | {ours[0]:.2e} / {ours[1]:.2e} "
                         f"| {kept[0]:.2e} / {kept[1]:.2e} | {len(flips[0])} / {len(flips[1])} | {largest} |")
        lines.append(f"| {run['workload']['seed']} | 0, fp16 router vs fp32 router | "
                     f"{d['router_own_error_median']:.2e} / {d['router_own_error_max']:.2e} | | | |")
        if f"later_layers_prob_error_max_after_flip_{PRECISIONS[0][0]}" in d:
            lines.append(f"| {run['workload']['seed']} | after the first: largest error of tokens flipped at an "
                         "earlier layer / of the others | " + " | ".join(
                             f"{d[f'later_layers_prob_error_max_after_flip_{label}']:.2e} / "
                             f"{d[f'later_layers_prob_error_max_no_earlier_flip_{label}']:.2e}"
                             for label, _ in PRECISIONS) + " | | |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("export_dir", type=Path)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--frames", type=int, default=16)
    parser.add_argument("--size", type=int, default=448)
    parser.add_argument("--q", type=float, default=0.0)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="one clip and question per seed")
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    bundle = open_export(args.export_dir)
    text = bundle.family.config.text_config
    result = {"family": bundle.family.config.model_type,
              "text_layers": text.num_hidden_layers, "vision_layers": bundle.family.config.vision_config.depth,
              "hidden": text.hidden_size, "experts": text.num_experts, "top_k": text.num_experts_per_tok, "runs": []}
    for seed in args.seeds:
        chunks, workload = video_chunks(args.export_dir, args.frames, args.size, args.q, seed)
        log(f"seed {seed}: router comparison over {len(chunks)} chunks: fp32, then routers in fp16, then in fp32")
        started = time.perf_counter()
        report = router_comparison(args.export_dir, workload=chunks)
        if report is None:
            raise SystemExit(f"{args.export_dir}: the language graph has no MoE routers")
        result["runs"].append({"workload": workload, "router": report.detail,
                               "seconds": time.perf_counter() - started})
    name = f"moe_router_video_{result['family']}"
    (args.out_dir / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out_dir / f"{name}.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
