"""Window sweep: vision rows sent per prefill chunk, ``user_vision_size`` against the QEfficient way.

Both ways run the same language ONNX (``vision_size`` is a graph symbol) on the same prompts:

* ``user_vision_size`` (this project, DESIGN §6): each chunk gets only its window's rows,
  zero-padded to U, with ``image_idx = 0``;
* ``qefficient``: ``vision_size`` = the prompt's whole retained row count K, all K rows go with
  every chunk, and ``image_idx`` advances by the media tokens of the chunks before.

Per chunk the bytes of the vision input(s) fed to the graph and the graph's run time are recorded;
the two ways run interleaved chunk by chunk. Both ways must produce the same first-token logits
(checked and reported).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from qeff_evs import evs
from qeff_evs.bench.config import BenchConfig
from qeff_evs.bench.graphs import BenchGraphs
from qeff_evs.bench.pruning import prefill_steps
from qeff_evs.runtime.backends.ort import OrtLanguageSession
from qeff_evs.bench.timing import ChunkedRun, Samples, alternating, run_interleaved
from qeff_evs.bench.workload import first_special_id, language_prompt, question_ids, synthetic_clip
from qeff_evs.runtime.backends.base import LanguageInputs
from qeff_evs.runtime.engine.steps import prefill_step
from qeff_evs.runtime.engine.request import PreparedPrompt
from qeff_evs.runtime.engine.window import prefill_chunks

Progress = Callable[[str], None]

USER_VISION_SIZE = "user_vision_size"
QEFFICIENT = "qefficient"
WAYS = (USER_VISION_SIZE, QEFFICIENT)


@dataclass
class WayMeasurement:
    vision_size: int
    bytes_per_chunk: list[int] = field(default_factory=list)  # per chunk of one prefill
    chunks: Samples = field(default_factory=Samples)  # every (repetition, chunk) call
    first_token_logits: np.ndarray | None = field(default=None, repr=False)


@dataclass
class WindowPoint:
    frames: int
    video_tokens: int
    retained_tokens: int
    prompt_tokens: int
    chunks: int
    ways: dict[str, WayMeasurement]
    logits_max_abs_diff: float = float("nan")  # between the two ways' first-token logits


@dataclass
class WindowSweep:
    frame_size: int
    q: float
    prefill_seq_len: int
    points: list[WindowPoint]


def media_before(prompt: PreparedPrompt, position: int, media_ids: tuple[int, ...]) -> int:
    """How many media tokens precede prompt position ``position`` (QEfficient's ``image_idx``)."""
    return int(np.isin(prompt.ids[:position], media_ids).sum())


def qefficient_steps(prompt: PreparedPrompt, config: BenchConfig, hidden: int, extras: Mapping[str, int],
                     media_ids: tuple[int, ...]) -> list[LanguageInputs]:
    """Every prefill chunk the QEfficient way: all K rows each time, ``image_idx`` = rows consumed so far."""
    encoded = prompt.encoded[0]
    rows = np.ascontiguousarray(encoded.rows[None], dtype=np.float32)
    extra = {name: np.ascontiguousarray(value[:, None]) for name, value in encoded.extras.items()}
    steps = []
    for computed, scheduled in prefill_chunks(len(prompt.ids), config.prefill_seq_len):
        # ids and positions exactly as in our way; only the vision inputs differ.
        base = prefill_step(prompt, computed, scheduled, config.prefill_seq_len, rows.shape[1], hidden, extras)
        image_idx = np.array([[media_before(prompt, computed, media_ids)]], dtype=np.int64)
        steps.append(dataclasses.replace(base, vision_embeds=rows, extras=extra, image_idx=image_idx,
                                         vision_rows=rows.shape[1]))
    return steps


def vision_bytes(step: LanguageInputs) -> int:
    """Bytes of the vision inputs a chunk sends to the graph."""
    return int(step.vision_embeds.nbytes) + sum(int(value.nbytes) for value in step.extras.values())


def run_window_sweep(config: BenchConfig, graphs: BenchGraphs, progress: Progress) -> WindowSweep:
    family, shape, merge = graphs.family, graphs.language_shape, graphs.merge_size
    media_ids = family.special_tokens().media_pads
    question = question_ids(config.question_tokens, first_special_id(family), config.seed)
    q = config.window_rate
    plans = []
    for frames in config.window_frames:
        clip = synthetic_clip(graphs.preprocess, frames, config.frame_size, config.seed)
        prompt = language_prompt(family, clip, q, question, shape.hidden, shape.extras, merge, config.seed)
        t, h, w = family.merged_grid(clip.grid_thw)
        k = evs.retained_token_count(h * w, t, q)
        steps = {USER_VISION_SIZE: prefill_steps(prompt, config, shape.hidden, shape.extras),
                 QEFFICIENT: qefficient_steps(prompt, config, shape.hidden, shape.extras, media_ids)}
        ways = {way: WayMeasurement(vision_size=steps[way][0].vision_embeds.shape[1],
                                    bytes_per_chunk=[vision_bytes(s) for s in steps[way]]) for way in WAYS}
        sessions = {way: OrtLanguageSession(graphs.language, graphs.with_vision_size(ways[way].vision_size))
                    for way in WAYS}
        point = WindowPoint(frames, t * h * w, k, len(prompt.ids), len(steps[USER_VISION_SIZE]), ways)
        plans.append((point, steps, sessions))

    progress("window sweep: warm-up run")
    warm_steps, warm_sessions = plans[0][1], plans[0][2]
    run_interleaved([ChunkedRun(warm_sessions[way], warm_steps[way][:1]) for way in WAYS])
    for rep in range(config.repeats):
        for number, (point, steps, sessions) in enumerate(alternating(plans, rep)):
            # The two ways chunk by chunk, in turn: a load change hits both alike.
            ways = alternating(WAYS, rep + number)
            runs = [ChunkedRun(sessions[way], steps[way]) for way in ways]
            run_interleaved(runs)
            for way, run in zip(ways, runs):
                point.ways[way].chunks.extend(run.samples)
                point.ways[way].first_token_logits = run.logits
            diff = np.abs(point.ways[USER_VISION_SIZE].first_token_logits - point.ways[QEFFICIENT].first_token_logits)
            point.logits_max_abs_diff = float(diff.max())
            progress(f"window sweep rep {rep + 1}/{config.repeats}: {point.frames} frames, K={point.retained_tokens}, "
                     f"{point.chunks} chunks, logits max abs diff between ways {point.logits_max_abs_diff:.2e}")
    return WindowSweep(config.frame_size, q, config.prefill_seq_len, [plan[0] for plan in plans])
