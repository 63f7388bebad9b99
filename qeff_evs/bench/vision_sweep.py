"""Vision sweep: the vision side's cost per temporal patch from short to long videos.

Per frame count, one clip at the language clip's frame size through the runtime's vision side (encoder
calls of F temporal patches, then the EVS graph once). A first pass per frame count, alone and untimed,
records the peak resident memory above the loaded graphs, to set against what the vision side must
hold: the peak of one encoder call of F temporal patches, measured first (after a warm-up call: a
session's first run allocates more), plus the bytes of merged rows the host accumulates (``T*h*w`` rows
of ``hidden`` floats, + the family's extra rows). (The whole-video graph this replaced is timed by
``benchmarks/whole_video_baseline.py``.)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from qeff_evs import evs
from qeff_evs.bench import memory, plots
from qeff_evs.bench.config import BenchConfig
from qeff_evs.bench.phase import Phase, Progress, fmt, section_head, table_head
from qeff_evs.bench.timing import CLOCKS, Samples, alternating, median, timed
from qeff_evs.bench.workload import synthetic_clip
from qeff_evs.models.pruning import VideoPruning

if TYPE_CHECKING:
    from qeff_evs.bench.graphs import BenchGraphs

NAME = "vision_sweep"
ENCODER = "encoder"


@dataclass
class VisionSweepPoint:
    frames: int
    temporal_patches: int
    video_tokens: int
    kept_tokens: int
    accumulated_bytes: int  # the merged rows (+ extra rows) the host keeps, float32
    samples: dict[str, Samples] = field(default_factory=dict)
    peak_above_start_mb: dict[str, float | None] = field(default_factory=dict)


@dataclass
class VisionSweep:
    frame_size: int
    q: float
    frames_per_call: int
    points: list[VisionSweepPoint]
    call_peak_mb: float | None = None  # one encoder call of F temporal patches, above the loaded graphs


def run_vision_sweep(config: BenchConfig, graphs: BenchGraphs, progress: Progress) -> VisionSweep:
    pipeline = graphs.vision_pipeline()
    one_call = synthetic_clip(graphs.preprocess, graphs.frames_per_call * graphs.preprocess.temporal_patch_size,
                              config.frame_size, config.seed).video
    progress(f"vision sweep: one encoder call of {graphs.frames_per_call} temporal patches (warm-up, peak memory)")
    pipeline.merged_rows(one_call)
    call_peak = memory.peak_above(lambda: pipeline.merged_rows(one_call))
    hidden = graphs.language_shape.hidden * (1 + sum(graphs.language_shape.extras.values()))
    cases = []
    for frames in config.vision_sweep_frames:
        clip = synthetic_clip(graphs.preprocess, frames, config.frame_size, config.seed)
        t, h, w = graphs.family.merged_grid(clip.grid_thw)
        k = evs.kept_token_count(h * w, t, config.window_rate)
        point = VisionSweepPoint(frames, t, t * h * w, k, t * h * w * hidden * 4)
        pruning = VideoPruning("evs", config.window_rate)
        calls = {ENCODER: lambda video=clip.video: pipeline.encode(video, pruning)}
        for name, call in calls.items():
            progress(f"vision sweep: {frames} frames, {name} alone (warm-up, peak memory)")
            point.peak_above_start_mb[name] = memory.peak_above(call)
            point.samples[name] = Samples()
        cases.append((point, calls))
    for rep in range(config.repeats):
        for point, calls in cases:
            for name in alternating(list(calls), rep):
                timed(calls[name], point.samples[name])
        progress(f"vision sweep rep {rep + 1}/{config.repeats}: CPU s per temporal patch "
                 + ", ".join(f"{p.frames}: {p.samples[ENCODER].cpu[-1] / p.temporal_patches:.2f}" for p, _ in cases))
    return VisionSweep(config.frame_size, config.window_rate, graphs.frames_per_call, [point for point, _ in cases], call_peak)


def vision_rows(sweep: VisionSweep, clocks: tuple[str, ...]) -> list[dict]:
    rows = []
    for p in sweep.points:
        row = {"frames": p.frames, "temporal_patches": p.temporal_patches, "video_tokens": p.video_tokens,
               "kept_tokens": p.kept_tokens, "accumulated_mb": p.accumulated_bytes / 2**20}
        for name, samples in p.samples.items():
            row[name] = {"peak_above_start_mb": p.peak_above_start_mb.get(name),
                         **{f"{clock}_s_per_patch": median(samples.clock(clock)) / p.temporal_patches
                            for clock in clocks}}
        rows.append(row)
    return rows


# ---- results.json, results.md and the plot ----------------------------------------------------------


def section(sweep: VisionSweep) -> dict:
    return {"frame_size": sweep.frame_size, "q": sweep.q, "frames_per_call": sweep.frames_per_call,
            "call_peak_mb": sweep.call_peak_mb, "rows": vision_rows(sweep, CLOCKS),
            "samples": [asdict(point) for point in sweep.points]}


def load(saved: dict) -> VisionSweep:
    return VisionSweep(saved["frame_size"], saved["q"], saved["frames_per_call"], [
        VisionSweepPoint(**{**p, "samples": {name: Samples(**v) for name, v in p["samples"].items()}})
        for p in saved["samples"]], saved.get("call_peak_mb"))


def markdown(results: dict) -> list[str]:
    vsw = results[NAME]
    lines = [
        *section_head(results, NAME, f"Vision sweep: {vsw['frame_size']}x{vsw['frame_size']}, q={vsw['q']:g}, "
                      f"encoder calls of {vsw['frames_per_call']} temporal patches + the EVS graph",
                      f" One encoder call of {vsw['frames_per_call']} temporal patches peaks at "
                      f"{fmt(vsw.get('call_peak_mb'))} MB above the loaded graphs."),
        *table_head("| frames | temporal patches | K | encoder+EVS CPU s / patch | wall s / patch "
                    "| peak above loaded MB | accumulated rows MB |"),
    ]
    for r in vsw["rows"]:
        ours = r[ENCODER]
        lines.append(
            f"| {r['frames']} | {r['temporal_patches']} | {r['kept_tokens']} | {ours['cpu_s_per_patch']:.2f} | "
            f"{ours['wall_s_per_patch']:.2f} | {fmt(ours['peak_above_start_mb'])} | {r['accumulated_mb']:.0f} |")
    return lines


def plot_vision_sweep(results: dict, path: Path) -> Path:
    """Time per temporal patch and peak memory against frames: encoder calls + the EVS graph."""
    vs = results[NAME]
    rows = vs["rows"]
    frames = [r["frames"] for r in rows]
    figure, left, right = plots.side_by_side()
    label = f"encoder ({vs['frames_per_call']} patches/call) + EVS"
    line, = left.plot(frames, [r[ENCODER]["cpu_s_per_patch"] for r in rows], "o-", label=f"{label}, CPU")
    left.plot(frames, [r[ENCODER]["wall_s_per_patch"] for r in rows], "o-", color=line.get_color(), alpha=0.3,
              label=f"{label}, wall")
    right.plot(frames, [r[ENCODER]["peak_above_start_mb"] or 0.0 for r in rows], "o-", label=label)
    right.plot(frames, [r["accumulated_mb"] for r in rows], ":", color="grey", label="accumulated merged rows")
    if vs.get("call_peak_mb") is not None:
        right.plot(frames, [vs["call_peak_mb"] + r["accumulated_mb"] for r in rows], "-.",
                   color="grey", label="one encoder call + rows")
    for axes, ylabel in ((left, "vision s per temporal patch"), (right, "peak memory above loaded graphs (MB)")):
        plots.frames_axis(axes, frames)
        plots.finish(axes, ylabel=ylabel, legend_size=6)
    figure.suptitle(f"Vision side, {vs['frame_size']}x{vs['frame_size']}, q={vs['q']:g}", fontsize=10)
    return plots.save(figure, path)


PHASE = Phase(NAME, run_vision_sweep, section=section, load=load, markdown=markdown,
              plots={"vision_sweep.png": plot_vision_sweep}, language=False)
