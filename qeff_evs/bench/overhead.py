"""EVS overhead: the vision graph with the EVS selection against the same graph without it.

Two measurements:

* A/B wall time: the twin graph replaces the selection (dissimilarity, two TopK) by the same final
  Gather of the first K rows, so both return ``(K, hidden)`` rows and K indices and differ only by
  the selection's work. They run on the same clip and K, alternating; the overhead is the
  difference of the medians. On a busy machine this difference is dominated by noise.
* Profiled share: ORT's per-node profiler on the EVS graph; the selection's nodes are the
  top-level ones (named ``/...`` but not ``/visual/...``: the wrapper's own ops), the rest is the
  tower. Their kernel-time ratio is the selection's cost without run-to-run noise.
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
from qeff_evs.runtime.backends.ort import OrtVisionSession
from qeff_evs.bench.timing import Samples, alternating, timed
from qeff_evs.bench.workload import synthetic_clip

Progress = Callable[[str], None]

WITH_EVS = "with_evs"
WITHOUT_EVS = "without_evs"
TOWER_SCOPE = "/visual/"  # node-name prefix of everything the vision tower exports
KERNEL_SUFFIX = "_kernel_time"


@dataclass
class OverheadResult:
    frames: int
    frame_size: int
    q: float
    video_tokens: int
    retained_tokens: int
    samples: dict[str, Samples] = field(default_factory=lambda: {WITH_EVS: Samples(), WITHOUT_EVS: Samples()})
    profile_us: dict[str, float] = field(default_factory=dict)  # "selection" / "tower" kernel microseconds


def is_selection_node(node_name: str) -> bool:
    """The wrapper's own top-level ops; fused nodes ORT renames (no leading "/") belong to the tower."""
    return node_name.startswith("/") and not node_name.startswith(TOWER_SCOPE)


def kernel_time_split(profile_events: list[dict]) -> dict[str, float]:
    """Sum of node kernel times (microseconds) of the selection and of the tower in an ORT profile."""
    split = {"selection": 0.0, "tower": 0.0}
    for event in profile_events:
        name = event.get("name", "")
        if event.get("cat") != "Node" or not name.endswith(KERNEL_SUFFIX):
            continue
        split["selection" if is_selection_node(name[: -len(KERNEL_SUFFIX)]) else "tower"] += float(event["dur"])
    return split


def profile_selection(graph_path: str, pixels, host, runs: int, scratch: Path) -> dict[str, float]:
    session = open_inference_session(graph_path, profile_prefix=scratch / "evs_profile")
    vision = OrtVisionSession(session)
    for _ in range(runs):
        vision.run(pixels, host)
    profile = Path(session.end_profiling())
    try:
        return kernel_time_split(json.loads(profile.read_text()))
    finally:
        profile.unlink(missing_ok=True)


def run_evs_overhead(config: BenchConfig, graphs: BenchGraphs, progress: Progress) -> OverheadResult:
    clip = synthetic_clip(graphs.preprocess, config.vision_frames, config.vision_frame_size, config.seed)
    t, h, w = graphs.family.merged_grid(clip.grid_thw)
    k = evs.retained_token_count(h * w, t, config.window_rate)
    host = graphs.family.vision_host_inputs(clip.grid_thw, k)
    pixels = clip.video.pixel_values.numpy()
    sessions = {WITH_EVS: OrtVisionSession(graphs.vision), WITHOUT_EVS: OrtVisionSession(graphs.vision_without_evs)}
    result = OverheadResult(config.vision_frames, config.vision_frame_size, config.window_rate, t * h * w, k)
    progress("EVS overhead: warm-up run")
    for session in sessions.values():
        session.run(pixels, host)
    for rep in range(config.overhead_repeats):
        for name in alternating(list(sessions), rep):
            timed(lambda: sessions[name].run(pixels, host), result.samples[name])
        progress(f"EVS overhead rep {rep + 1}/{config.overhead_repeats}: CPU s "
                 + ", ".join(f"{name} {result.samples[name].cpu[-1]:.2f}" for name in sessions))
    progress("EVS overhead: profiling the selection's nodes")
    result.profile_us = profile_selection(graphs.files["vision"], pixels, host, config.overhead_repeats,
                                          Path(graphs.files["vision"]).parent)
    return result
