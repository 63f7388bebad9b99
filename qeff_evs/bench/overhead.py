"""EVS overhead: the EVS graph's cost against the encoder's, on one clip (DESIGN §5).

The vision side is two graphs, so the selection's cost is measured directly rather than as the
difference of two near-equal graphs:

* timed: per repetition, the clip's encoder calls (F temporal patches each), then the EVS graph once
  on their merged rows; ``with_evs`` = encoder + EVS, ``without_evs`` = encoder alone, so the
  overhead is the EVS graph's share of the encoder's time;
* profiled: ORT's per-node profiler on both sessions; the sum of node kernel times of the EVS graph
  against the encoder's, without run-to-run noise.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from qeff_evs import evs
from qeff_evs.bench.config import BenchConfig
from qeff_evs.bench.graphs import BenchGraphs
from qeff_evs.bench.sessions import open_inference_session
from qeff_evs.bench.timing import Samples, timed
from qeff_evs.bench.workload import synthetic_clip
from qeff_evs.runtime.backends.ort import OrtEncoderSession, OrtEVSSession
from qeff_evs.runtime.backends.vision import VisionPipeline

Progress = Callable[[str], None]

WITH_EVS = "with_evs"
WITHOUT_EVS = "without_evs"
KERNEL_SUFFIX = "_kernel_time"


@dataclass
class OverheadResult:
    frames: int
    frame_size: int
    q: float
    video_tokens: int
    retained_tokens: int
    samples: dict[str, Samples] = field(default_factory=lambda: {WITH_EVS: Samples(), WITHOUT_EVS: Samples()})
    profile_us: dict[str, float] = field(default_factory=dict)  # "selection" (EVS) / "tower" (encoder) kernel us


def kernel_time(profile_events: list[dict]) -> float:
    """Sum of node kernel times (microseconds) in an ORT profile."""
    return sum(float(e["dur"]) for e in profile_events
               if e.get("cat") == "Node" and e.get("name", "").endswith(KERNEL_SUFFIX))


def _profiled(path: str, scratch: Path, run) -> float:
    session = open_inference_session(path, profile_prefix=scratch / f"{Path(path).stem}_profile")
    run(session)
    profile = Path(session.end_profiling())
    try:
        return kernel_time(json.loads(profile.read_text()))
    finally:
        profile.unlink(missing_ok=True)


def run_evs_overhead(config: BenchConfig, graphs: BenchGraphs, progress: Progress) -> OverheadResult:
    clip = synthetic_clip(graphs.preprocess, config.overhead_frames, config.frame_size, config.seed)
    t, h, w = graphs.family.merged_grid(clip.grid_thw)
    k = evs.retained_token_count(h * w, t, config.window_rate)
    video = clip.video
    pipeline = graphs.vision_pipeline()
    result = OverheadResult(config.overhead_frames, config.frame_size, config.window_rate, t * h * w, k)
    progress(f"EVS overhead: {config.overhead_frames} frames, warm-up run")
    pipeline.encode(video, k)
    for rep in range(config.overhead_repeats):
        merged = timed(lambda: pipeline.merged_rows(video), result.samples[WITHOUT_EVS])
        selection = Samples()
        timed(lambda: pipeline.prune(video, merged, k), selection)
        result.samples[WITH_EVS].add(result.samples[WITHOUT_EVS].wall[-1] + selection.wall[-1],
                                     result.samples[WITHOUT_EVS].cpu[-1] + selection.cpu[-1])
        progress(f"EVS overhead rep {rep + 1}/{config.overhead_repeats}: encoder CPU "
                 f"{result.samples[WITHOUT_EVS].cpu[-1]:.2f} s, EVS graph CPU {selection.cpu[-1]:.3f} s")
    progress("EVS overhead: profiling both graphs' nodes")
    scratch = Path(graphs.files["evs"]).parent

    def encode(session) -> None:
        VisionPipeline(graphs.family, OrtEncoderSession(session), pipeline.evs, pipeline.frames_per_call) \
            .merged_rows(video)

    def select(session) -> None:
        VisionPipeline(graphs.family, pipeline.encoder, OrtEVSSession(session), pipeline.frames_per_call) \
            .prune(video, merged, k)

    result.profile_us = {"tower": _profiled(graphs.files["encoder"], scratch, encode),
                         "selection": _profiled(graphs.files["evs"], scratch, select)}
    return result
