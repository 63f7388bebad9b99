#!/usr/bin/env python
"""The whole-video vision graph the encoder replaced, timed against the encoder + EVS graphs.

Before the encoder took frames per call, one graph took a whole video: the tower attended over all
``S = T*H*W`` patches with a dense ``(S, S)`` block mask built from ``cu_seqlens`` (cost and memory
``S^2`` per head), then EVS. It is composed here from the package's pieces, never as a switch in them: a
weight-sharing copy of the family encoder's tower given the block-mask attention below, followed by the
EVS pruning graph's ranking (``PruningRanking``) over the video as its own bucket; the host keeps the
first K of it. It rebuilds a windowed tower's whole-video inputs and carries no extra rows
(``whole_video_serves``): Qwen2.5-VL, the bench's default family. The published comparison
(``benchmarks/README.md``, "Vision sweep") came from this graph; ``bench_targets.py --whole-video``
judges the encoder's speedup target on this script's JSON::

    python benchmarks/whole_video_baseline.py -o whole_video/          # 448x448, 4/8/16 frames (~13 GB at 16)
    python benchmarks/whole_video_baseline.py --quick -o /tmp/wv       # 224x224, 4/8 frames

Per frame count, the bench's moving-square clip runs through the encoder calls + EVS graph and through the
whole-video graph: first each alone (warm-up, peak resident memory above the loaded graphs), then
``--repeats`` timed rounds in alternating order. Writes ``whole_video.json`` and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.vision_utils import get_vision_cu_seqlens, get_vision_position_ids, get_vision_window_index

from qeff_evs import evs
from qeff_evs.bench import memory
from qeff_evs.bench.config import preset
from qeff_evs.bench.graphs import build_graphs
from qeff_evs.bench.sessions import open_inference_session
from qeff_evs.bench.timing import CLOCKS, Samples, alternating, median, timed
from qeff_evs.bench.workload import synthetic_clip
from qeff_evs.export.onnx_graph import legacy_export
from qeff_evs.models.checkpoint import load_checkpoint
from qeff_evs.models.registry import family_for_config
from qeff_evs.models.pruning import PruningRanking, VideoPruning, pruning_host_inputs
from qeff_evs.models.vision_common import EncoderWrapper, grid_tensor, share_weights_copy

BLOCK_MASK_ATTENTION = "qeff_evs_flash_block_mask"  # "flash": transformers hands cu_seqlens through
INPUTS = {
    "pixel_values": {0: "grid_height"}, "rotary_position_ids": {0: "grid_height"}, "cu_seqlens": {0: "frame_bounds"},
    "window_index": {0: "vision_size"}, "cu_window_seqlens": {0: "window_bounds"}, "bucket_carrier": {0: "time"},
    "frame_count": {},
}
OUTPUTS = {"vision_embeds": {0: "video_tokens"}, "ranking": {0: "video_tokens"}}
ENCODER, WHOLE_VIDEO = "encoder", "whole_video"
# Frame counts per preset: the whole-video graph's peak grows 4x per doubling (~13 GB at 16 frames of 448x448).
FRAMES = {"full": (4, 8, 16), "quick": (4, 8), "smoke": (2, 4)}


def whole_video_serves(encoder: EncoderWrapper, family) -> bool:
    """Whether the baseline can stand in for this family: a windowed tower (its encoder takes window
    indices, which the baseline rebuilds for the whole video) whose rows carry no extra rows."""
    return "window_index" in encoder.graph_spec.inputs and not family.extras


def block_mask_attention(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0,
                         cu_seq_lens_q=None, **kwargs):
    """Attention over the whole sequence with a dense ``(S, S)`` same-segment mask from ``cu_seqlens``."""
    positions = torch.arange(query.shape[2], dtype=torch.int64)
    segments = (positions[:, None] >= cu_seq_lens_q[1:].to(torch.int64)[None, :]).sum(dim=-1)
    scores = torch.matmul(query, key.transpose(-1, -2)) * (scaling or query.shape[-1] ** -0.5)
    scores = torch.where(segments[:, None] == segments[None, :], scores, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores.float(), dim=-1).to(query.dtype)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), None


class WholeVideoVision(nn.Module):
    """Tower over the whole video (block-mask attention) + the EVS ranking: the replaced graph's work."""

    def __init__(self, encoder: EncoderWrapper, selection: PruningRanking) -> None:
        super().__init__()
        if ALL_ATTENTION_FUNCTIONS.get(BLOCK_MASK_ATTENTION) is not block_mask_attention:
            AttentionInterface.register(BLOCK_MASK_ATTENTION, block_mask_attention)
        self.visual = share_weights_copy(encoder.visual)
        self.visual.config._attn_implementation = BLOCK_MASK_ATTENTION
        self.selection = selection

    def forward(self, pixel_values, rotary_position_ids, cu_seqlens, window_index, cu_window_seqlens,
                bucket_carrier, frame_count):
        merged = self.visual(pixel_values, grid_thw=None, position_ids=rotary_position_ids, cu_seqlens=cu_seqlens,
                             window_index=window_index, cu_window_seqlens=cu_window_seqlens, max_seqlen=0,
                             max_window_seqlen=0).pooler_output
        return merged, self.selection(merged, bucket_carrier, frame_count)


def host_inputs(vision_config, grid_thw) -> dict[str, np.ndarray]:
    """Every input but ``pixel_values``, for the whole video ``grid_thw``."""
    grid = grid_tensor(grid_thw)
    window_index, cu_window_seqlens = get_vision_window_index(
        grid, spatial_merge_size=vision_config.spatial_merge_size, window_size=vision_config.window_size,
        patch_size=vision_config.patch_size)
    return {"rotary_position_ids": get_vision_position_ids(grid, vision_config.spatial_merge_size).numpy(),
            "cu_seqlens": get_vision_cu_seqlens(grid).numpy().astype(np.int32),
            "window_index": window_index.numpy(), "cu_window_seqlens": cu_window_seqlens.numpy().astype(np.int32),
            **pruning_host_inputs("evs", int(grid_thw[0]), int(grid_thw[0]), 0.0)}


def export_whole_video_graph(encoder: EncoderWrapper, selection: PruningRanking, path: Path) -> Path:
    """Trace the baseline on a 2-patch 8x8 video; every size stays a symbol."""
    module = WholeVideoVision(encoder, selection).eval()
    config = encoder.vision_config
    grid = (2, 8, 8)
    width = config.in_channels * config.temporal_patch_size * config.patch_size ** 2
    inputs = {"pixel_values": np.zeros((128, width), np.float32), **host_inputs(config, grid)}
    path.parent.mkdir(parents=True, exist_ok=True)
    legacy_export(module, [torch.from_numpy(v) for v in inputs.values()], path, input_names=list(INPUTS),
                  output_names=list(OUTPUTS), dynamic_axes={**INPUTS, **OUTPUTS})
    return path


def measure(config, frame_counts: tuple[int, ...], workdir: Path, progress) -> dict:
    """Encoder calls + EVS against the whole-video graph, per frame count (the bench's graphs and clip)."""
    graphs = build_graphs(config, workdir, progress, language=False)
    model = load_checkpoint(graphs.checkpoint_dir).model  # the bench's checkpoint, as its export read it
    family = family_for_config(model.config)
    encoder = family.encoder(model)
    if not whole_video_serves(encoder, family):
        raise ValueError(f"--family {config.family}: the whole-video baseline needs a windowed tower without "
                         "extra rows (qwen2_5_vl)")
    progress("exporting the whole-video graph")
    path = export_whole_video_graph(encoder, family.pruning_ranking("evs"), workdir / "whole_video" / "vision.onnx")
    del model, encoder
    whole_video = open_inference_session(path)
    pipeline = graphs.vision_pipeline()
    cases = []
    for frames in frame_counts:
        clip = synthetic_clip(graphs.preprocess, frames, config.frame_size, config.seed)
        t, h, w = graphs.family.merged_grid(clip.grid_thw)
        k = evs.kept_token_count(h * w, t, config.window_rate)
        feeds = {"pixel_values": clip.video.pixel_values.numpy().astype(np.float32),
                 **host_inputs(graphs.hf_config.vision_config, clip.grid_thw)}
        pruning = VideoPruning("evs", config.window_rate)
        calls = {ENCODER: lambda video=clip.video: pipeline.encode(video, pruning),
                 WHOLE_VIDEO: lambda feeds=feeds: whole_video.run(None, feeds)}
        row = {"frames": frames, "temporal_patches": t, "kept_tokens": k}
        samples = {}
        for name, call in calls.items():
            progress(f"{frames} frames, {name} alone (warm-up, peak memory)")
            row[name] = {"peak_above_start_mb": memory.peak_above(call)}
            samples[name] = Samples()
        cases.append((row, calls, samples))
    for rep in range(config.repeats):
        for row, calls, samples in cases:
            for name in alternating(list(calls), rep):
                timed(calls[name], samples[name])
        progress(f"rep {rep + 1}/{config.repeats} done")
    for row, _, samples in cases:
        for name, measured in samples.items():
            row[name].update({f"{clock}_s_per_patch": median(measured.clock(clock)) / row["temporal_patches"]
                              for clock in CLOCKS})
            row[name]["samples"] = {clock: measured.clock(clock) for clock in CLOCKS}
    return {"family": config.family, "frame_size": config.frame_size, "q": config.window_rate,
            "frames_per_call": config.frames_per_call, "repeats": config.repeats, "rows": [row for row, _, _ in cases]}


def markdown(result: dict) -> str:
    size = result["frame_size"]
    lines = [f"Vision side per temporal patch, {size}x{size}, q={result['q']:g}: encoder calls of "
             f"{result['frames_per_call']} temporal patches + the EVS graph, against the whole-video graph.", "",
             "| frames | encoder+EVS CPU s / patch (wall) | peak MB | whole-video CPU s / patch (wall) | peak MB "
             "| whole-video / encoder (CPU) |",
             "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        ours, theirs = r[ENCODER], r[WHOLE_VIDEO]
        lines.append(f"| {r['frames']} | {ours['cpu_s_per_patch']:.2f} ({ours['wall_s_per_patch']:.2f}) | "
                     f"{ours['peak_above_start_mb'] or 0:.0f} | {theirs['cpu_s_per_patch']:.2f} "
                     f"({theirs['wall_s_per_patch']:.2f}) | {theirs['peak_above_start_mb'] or 0:.0f} | "
                     f"{theirs['cpu_s_per_patch'] / ours['cpu_s_per_patch']:.1f}x |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="the bench's quick preset (224x224, 4 and 8 frames)")
    mode.add_argument("--smoke", action="store_true", help="tiny widths (the test suite's run)")
    parser.add_argument("-o", "--output", type=Path, default=Path("whole_video"), help="folder for whole_video.json")
    parser.add_argument("--frames", type=lambda s: tuple(int(v) for v in s.split(",")), default=None,
                        help="frame counts (default " + ",".join(map(str, FRAMES["full"])) + ")")
    parser.add_argument("--size", type=int, default=None, help="frame side (default: the preset's, 448)")
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds (default: the preset's, 3)")
    args = parser.parse_args(argv)
    name = "quick" if args.quick else "smoke" if args.smoke else "full"
    config = preset(name)
    config = config.replace(**{k: v for k, v in (("frame_size", args.size), ("repeats", args.repeats)) if v})
    with tempfile.TemporaryDirectory(prefix="qeff-evs-whole-video-") as workdir, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = measure(config, args.frames or FRAMES[name], Path(workdir),
                         lambda message: print(f"[whole-video] {message}", file=sys.stderr, flush=True))
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / "whole_video.json").write_text(json.dumps(result, indent=1) + "\n")
    print(markdown(result), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
