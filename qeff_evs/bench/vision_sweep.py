"""Vision sweep: the vision side's cost per temporal patch from short to long videos (issue 10).

Per frame count, one clip at the language clip's frame size: the runtime's vision side (encoder calls of
F temporal patches, then the EVS graph once) and, up to ``whole_video_max_frames`` (it grows with the
square of the video and stops fitting in memory), the pre-issue-10 whole-video graph
(``whole_video.py``), in alternating order within each repetition. A first pass per frame count, alone
and untimed, records the peak resident memory above the loaded graphs, to set against what the
vision side must hold (issue 10, "one batch's activations plus the accumulated rows"): the peak of one
encoder call of F temporal patches, measured first (after a warm-up call: a session's first run
allocates more), plus the bytes of merged rows the host accumulates (``T*h*w`` rows of ``hidden``
floats, + the family's extra rows).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from qeff_evs import evs
from qeff_evs.bench import memory
from qeff_evs.bench.config import BenchConfig
from qeff_evs.bench.graphs import BenchGraphs
from qeff_evs.bench.timing import Samples, alternating, median, timed
from qeff_evs.bench.whole_video import host_inputs as whole_video_inputs
from qeff_evs.bench.workload import synthetic_clip

Progress = Callable[[str], None]

ENCODER, WHOLE_VIDEO = "encoder", "whole_video"
TIME_TOLERANCE = 0.10  # time per temporal patch within +-10% from the shortest to the longest video
MEMORY_TOLERANCE = 0.10  # peak above the loaded graphs <= (one call's peak + accumulated rows) + 10%
SPEEDUP_FRAMES, SPEEDUP_MIN = 16, 2.5  # at 16 frames, >= 2.5x less time per patch than the whole-video graph


@dataclass
class VisionSweepPoint:
    frames: int
    temporal_patches: int
    video_tokens: int
    retained_tokens: int
    accumulated_bytes: int  # the merged rows (+ extra rows) the host keeps, float32
    samples: dict[str, Samples] = field(default_factory=dict)
    peak_above_start_mb: dict[str, float | None] = field(default_factory=dict)


@dataclass
class VisionSweep:
    frame_size: int
    q: float
    frames_per_call: int
    whole_video_max_frames: int
    points: list[VisionSweepPoint]
    call_peak_mb: float | None = None  # one encoder call of F temporal patches, above the loaded graphs


def _peak_above(call) -> float | None:
    start = memory.resident_mb()
    memory.reset_peak()
    call()
    peak = memory.peak_mb()
    return None if peak is None or start is None else peak - start


def run_vision_sweep(config: BenchConfig, graphs: BenchGraphs, progress: Progress) -> VisionSweep:
    pipeline = graphs.vision_pipeline()
    one_call = synthetic_clip(graphs.preprocess, graphs.frames_per_call * graphs.preprocess.temporal_patch_size,
                              config.frame_size, config.seed).video
    progress(f"vision sweep: one encoder call of {graphs.frames_per_call} temporal patches (warm-up, peak memory)")
    pipeline.merged_rows(one_call)
    call_peak = _peak_above(lambda: pipeline.merged_rows(one_call))
    hidden = graphs.language_shape.hidden * (1 + sum(graphs.language_shape.extras.values()))
    cases = []
    for frames in config.vision_sweep_frames:
        clip = synthetic_clip(graphs.preprocess, frames, config.frame_size, config.seed)
        t, h, w = graphs.family.merged_grid(clip.grid_thw)
        k = evs.retained_token_count(h * w, t, config.window_rate)
        point = VisionSweepPoint(frames, t, t * h * w, k, t * h * w * hidden * 4)
        calls = {ENCODER: lambda video=clip.video, k=k: pipeline.encode(video, k)}
        if graphs.whole_video is not None and frames <= config.whole_video_max_frames:
            feeds = {"pixel_values": clip.video.pixel_values.numpy().astype(np.float32),
                     **whole_video_inputs(graphs.hf_config.vision_config, clip.grid_thw, (t, h, w), k)}
            calls[WHOLE_VIDEO] = lambda feeds=feeds: graphs.whole_video.run(None, feeds)
        for name, call in calls.items():
            progress(f"vision sweep: {frames} frames, {name} alone (warm-up, peak memory)")
            point.peak_above_start_mb[name] = _peak_above(call)
            point.samples[name] = Samples()
        cases.append((point, calls))
    for rep in range(config.repeats):
        for point, calls in cases:
            for name in alternating(list(calls), rep):
                timed(calls[name], point.samples[name])
        progress(f"vision sweep rep {rep + 1}/{config.repeats}: CPU s per temporal patch "
                 + ", ".join(f"{p.frames}: {p.samples[ENCODER].cpu[-1] / p.temporal_patches:.2f}" for p, _ in cases))
    return VisionSweep(config.frame_size, config.window_rate, graphs.frames_per_call, config.whole_video_max_frames,
                       [point for point, _ in cases], call_peak)


def vision_rows(sweep: VisionSweep, clocks: tuple[str, ...]) -> list[dict]:
    rows = []
    for p in sweep.points:
        row = {"frames": p.frames, "temporal_patches": p.temporal_patches, "video_tokens": p.video_tokens,
               "retained_tokens": p.retained_tokens, "accumulated_mb": p.accumulated_bytes / 2**20}
        for name, samples in p.samples.items():
            row[name] = {"peak_above_start_mb": p.peak_above_start_mb.get(name),
                         **{f"{clock}_s_per_patch": median(samples.clock(clock)) / p.temporal_patches
                            for clock in clocks}}
        rows.append(row)
    return rows
