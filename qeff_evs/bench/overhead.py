"""EVS overhead: the EVS graph's cost against the encoder's, on one clip (docs/design.md#the-three-graphs).

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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from qeff_evs import evs
from qeff_evs.bench.config import BenchConfig
from qeff_evs.bench.phase import MS, Phase, Progress, fmt, fmt_percent, section_head, table_head
from qeff_evs.bench.sessions import open_inference_session
from qeff_evs.bench.timing import CLOCKS, CPU, WALL, Samples, median, timed
from qeff_evs.bench.workload import synthetic_clip
from qeff_evs.models.pruning import VideoPruning
from qeff_evs.runtime.backends.ort import OrtEncoderSession, OrtPruningSession
from qeff_evs.runtime.backends.vision import VisionPipeline

if TYPE_CHECKING:
    from qeff_evs.bench.graphs import BenchGraphs

NAME = "evs_overhead"
WITH_EVS = "with_evs"
WITHOUT_EVS = "without_evs"
KERNEL_SUFFIX = "_kernel_time"


@dataclass
class OverheadResult:
    frames: int
    frame_size: int
    q: float
    video_tokens: int
    kept_tokens: int
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
    k = evs.kept_token_count(h * w, t, config.window_rate)
    pruning = VideoPruning("evs", config.window_rate)
    video = clip.video
    pipeline = graphs.vision_pipeline()
    result = OverheadResult(config.overhead_frames, config.frame_size, config.window_rate, t * h * w, k)
    progress(f"EVS overhead: {config.overhead_frames} frames, warm-up run")
    pipeline.encode(video, pruning)
    for rep in range(config.overhead_repeats):
        merged = timed(lambda: pipeline.merged_rows(video), result.samples[WITHOUT_EVS])
        selection = Samples()
        timed(lambda: pipeline.prune(video, merged, pruning), selection)
        result.samples[WITH_EVS].add(result.samples[WITHOUT_EVS].wall[-1] + selection.wall[-1],
                                     result.samples[WITHOUT_EVS].cpu[-1] + selection.cpu[-1])
        progress(f"EVS overhead rep {rep + 1}/{config.overhead_repeats}: encoder CPU "
                 f"{result.samples[WITHOUT_EVS].cpu[-1]:.2f} s, EVS graph CPU {selection.cpu[-1]:.3f} s")
    progress("EVS overhead: profiling both graphs' nodes")
    scratch = Path(graphs.files["evs"]).parent

    def encode(session) -> None:
        VisionPipeline(graphs.family, OrtEncoderSession(session), pipeline.pruning, pipeline.frames_per_call,
                       pipeline.buckets).merged_rows(video)

    def select(session) -> None:
        VisionPipeline(graphs.family, pipeline.encoder, {"evs": OrtPruningSession(session)}, pipeline.frames_per_call,
                       pipeline.buckets).prune(video, merged, pruning)

    result.profile_us = {"tower": _profiled(graphs.files["encoder"], scratch, encode),
                         "selection": _profiled(graphs.files["evs"], scratch, select)}
    return result


# ---- results.json and results.md --------------------------------------------------------------------


def overhead_summary(result: OverheadResult) -> dict:
    """The EVS graph's share of the encoder's time: (encoder + EVS) / encoder - 1, per repetition's medians."""
    with_ms = {clock: median(result.samples[WITH_EVS].clock(clock)) * MS for clock in CLOCKS}
    without_ms = {clock: median(result.samples[WITHOUT_EVS].clock(clock)) * MS for clock in CLOCKS}
    fraction = {clock: (with_ms[clock] - without_ms[clock]) / without_ms[clock] for clock in CLOCKS}
    profile = result.profile_us
    profiled = profile["selection"] / profile["tower"] if profile.get("tower") else None
    return {"frames": result.frames, "frame_size": result.frame_size, "q": result.q,
            "video_tokens": result.video_tokens, "kept_tokens": result.kept_tokens,
            "with_evs_ms": with_ms, "without_evs_ms": without_ms,
            "overhead_fraction": fraction,
            "profiled_selection_us": profile.get("selection"), "profiled_tower_us": profile.get("tower"),
            "profiled_overhead_fraction": profiled}


def section(result: OverheadResult) -> dict:
    return {**overhead_summary(result), "samples": {name: asdict(v) for name, v in result.samples.items()}}


def load(saved: dict) -> OverheadResult:
    return OverheadResult(saved["frames"], saved["frame_size"], saved["q"], saved["video_tokens"],
                          saved["kept_tokens"], {name: Samples(**v) for name, v in saved["samples"].items()},
                          {"selection": saved["profiled_selection_us"], "tower": saved["profiled_tower_us"]})


def markdown(results: dict) -> list[str]:
    ov = results[NAME]
    samples = len(ov["samples"][WITH_EVS]["wall"])
    return [
        *section_head(results, NAME, f"EVS overhead: {ov['frames']} frames {ov['frame_size']}x{ov['frame_size']}, "
                      f"q={ov['q']:g} (K={ov['kept_tokens']} of {ov['video_tokens']}), {samples} runs"),
        *table_head("| vision side | CPU ms | wall ms |"),
        f"| encoder calls + EVS graph | {fmt(ov['with_evs_ms'][CPU])} | {fmt(ov['with_evs_ms'][WALL])} |",
        f"| encoder calls alone | {fmt(ov['without_evs_ms'][CPU])} | {fmt(ov['without_evs_ms'][WALL])} |",
        f"| EVS graph / encoder (medians) | {fmt_percent(ov['overhead_fraction'][CPU], 2)} | "
        f"{fmt_percent(ov['overhead_fraction'][WALL], 2)} |",
        f"| EVS graph nodes / encoder nodes (ORT profiler) | {fmt_percent(ov['profiled_overhead_fraction'])} | |",
    ]


PHASE = Phase(NAME, run_evs_overhead, section=section, load=load, markdown=markdown, language=False)
