"""Pruning sweep: what EVS at rate q buys on one video + question.

Per q: the vision side (encoder calls, then the EVS graph) on the vision clip, and the whole language prefill (chunks of
``prefill_seq_len``, each with its ``user_vision_size`` window) of the language clip. The first
token comes out of the last prefill chunk, so time to first token = vision + prefill (each
request's own calls, as if it ran alone).

Order of work: one pass per q alone, untimed, which warms up and records peak resident memory;
then per repetition the vision runs (q in alternating order) and the prefills of all q
interleaved chunk by chunk (``run_interleaved``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from qeff_evs import evs
from qeff_evs.bench import memory
from qeff_evs.bench.config import BenchConfig
from qeff_evs.bench.graphs import BenchGraphs
from qeff_evs.models.protocol import MediaInput
from qeff_evs.runtime.backends.ort import OrtLanguageSession
from qeff_evs.runtime.backends.vision import VisionPipeline
from qeff_evs.bench.timing import ChunkedRun, Samples, alternating, run_interleaved, timed
from qeff_evs.bench.workload import Clip, first_special_id, language_prompt, question_ids, synthetic_clip
from qeff_evs.runtime.backends.base import LanguageInputs
from qeff_evs.runtime.engine.steps import prefill_step
from qeff_evs.runtime.engine.request import PreparedPrompt
from qeff_evs.runtime.engine.window import prefill_chunks

Progress = Callable[[str], None]


@dataclass
class PruningPoint:
    q: float
    video_tokens: int  # V: merged tokens of the unpruned language clip
    retained_tokens: int  # K
    text_tokens: int
    prompt_tokens: int
    prefill_chunks: int
    vision_video_tokens: int  # the same two on the vision clip
    vision_retained_tokens: int
    encoder_cache_bytes: int  # K rows of float32 the host holds between vision and language
    vision: Samples = field(default_factory=Samples)  # one per repetition
    prefill: Samples = field(default_factory=Samples)  # one per repetition: the sum of its chunks
    peak_rss_mb: float | None = None  # during the q's pass alone (vision + prefill)
    peak_above_start_mb: float | None = None
    vision_kept_per_frame: list[int] = field(default_factory=list)
    vision_retained_indices: list[int] = field(default_factory=list)


@dataclass
class PruningSweep:
    language_clip: tuple[int, int]  # (frames, size)
    vision_clip: tuple[int, int]
    vision_merged_grid: tuple[int, int, int]
    points: list[PruningPoint]


def sweep_rates(config: BenchConfig) -> list[float]:
    """The configured rates, ascending, always with q = 0 (the unpruned reference)."""
    return sorted({0.0, *(float(q) for q in config.pruning_rates)})


def prefill_steps(prompt: PreparedPrompt, config: BenchConfig, hidden: int,
                  extras: Mapping[str, int]) -> list[LanguageInputs]:
    """Every prefill chunk of ``prompt`` with its ``user_vision_size`` window (runtime.chunks)."""
    return [prefill_step(prompt, computed, scheduled, config.prefill_seq_len, config.vision_rows_per_chunk,
                         hidden, extras)
            for computed, scheduled in prefill_chunks(len(prompt.ids), config.prefill_seq_len)]


@dataclass
class _Case:
    point: PruningPoint
    steps: list[LanguageInputs]
    vision_k: int


def _cases(config: BenchConfig, graphs: BenchGraphs, language_clip: Clip, vision_clip: Clip) -> list[_Case]:
    family, shape, merge = graphs.family, graphs.language_shape, graphs.merge_size
    question = question_ids(config.question_tokens, first_special_id(family), config.seed)
    lt, lh, lw = family.merged_grid(language_clip.grid_thw)
    vt, vh, vw = family.merged_grid(vision_clip.grid_thw)
    cases = []
    for q in sweep_rates(config):
        prompt = language_prompt(family, language_clip, q, question, shape.hidden, shape.extras,
                                 merge, config.seed)
        k = evs.retained_token_count(lh * lw, lt, q)
        vision_k = evs.retained_token_count(vh * vw, vt, q)
        steps = prefill_steps(prompt, config, shape.hidden, shape.extras)
        point = PruningPoint(
            q=q, video_tokens=lt * lh * lw, retained_tokens=k, text_tokens=len(prompt.ids) - k,
            prompt_tokens=len(prompt.ids), prefill_chunks=len(steps),
            vision_video_tokens=vt * vh * vw, vision_retained_tokens=vision_k,
            encoder_cache_bytes=k * shape.hidden * 4 * (1 + sum(shape.extras.values())),
        )
        cases.append(_Case(point, steps, vision_k))
    return cases


def _memory_pass(case: _Case, vision: VisionPipeline, language: OrtLanguageSession, video: MediaInput,
                 merged_grid: tuple[int, int, int]) -> None:
    """The q's vision run and prefill alone: warm-up, kept indices and peak resident memory."""
    start_mb = memory.resident_mb()
    memory.reset_peak()
    result = vision.encode(video, case.vision_k)
    run_interleaved([ChunkedRun(language, case.steps)])
    peak = memory.peak_mb()
    point = case.point
    if peak is not None and start_mb is not None:
        point.peak_rss_mb, point.peak_above_start_mb = peak, peak - start_mb
    t, h, w = merged_grid
    indices = result.retained_indices.astype(np.int64)
    point.vision_retained_indices = indices.tolist()
    point.vision_kept_per_frame = evs.tokens_per_frame_kept(indices, t, h * w)


def run_pruning_sweep(config: BenchConfig, graphs: BenchGraphs, progress: Progress) -> PruningSweep:
    spec = graphs.preprocess
    language_clip = synthetic_clip(spec, config.frames, config.frame_size, config.seed)
    vision_clip = synthetic_clip(spec, config.vision_frames, config.vision_frame_size, config.seed)
    cases = _cases(config, graphs, language_clip, vision_clip)
    vision = graphs.vision_pipeline()
    video = vision_clip.video
    merged_grid = graphs.family.merged_grid(vision_clip.grid_thw)

    for case in cases:
        progress(f"pruning sweep: q={case.point.q:g} alone (warm-up, peak memory)")
        _memory_pass(case, vision, OrtLanguageSession(graphs.language, graphs.language_shape), video, merged_grid)
    for rep in range(config.repeats):
        order = alternating(cases, rep)
        for case in order:
            timed(lambda: vision.encode(video, case.vision_k), case.point.vision)
        runs = [ChunkedRun(OrtLanguageSession(graphs.language, graphs.language_shape), case.steps)
                for case in order]
        run_interleaved(runs)
        for case, run in zip(order, runs):
            case.point.prefill.add(*run.samples.total())
        progress(f"pruning sweep rep {rep + 1}/{config.repeats}: prefill CPU s "
                 + ", ".join(f"q={c.point.q:g}: {c.point.prefill.cpu[-1]:.1f}" for c in cases))
    return PruningSweep(
        language_clip=(config.frames, config.frame_size),
        vision_clip=(config.vision_frames, config.vision_frame_size),
        vision_merged_grid=merged_grid,
        points=[case.point for case in cases],
    )
