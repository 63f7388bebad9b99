"""Pruning sweep: what EVS at rate q buys on one video + question.

Per q: the vision side (encoder calls, then the EVS graph) on the vision clip, and the whole language prefill (chunks of
``prefill_seq_len``, each with its ``user_vision_size`` window, as the engines run them: the tail in the export's
shortest prefill length holding it, logits from the last chunk only) of the language clip. The first
token comes out of the last prefill chunk, so time to first token = vision + prefill (each
request's own calls, as if it ran alone).

With ``--sound-seconds S`` (a family with audio: Nemotron-H Omni) the clip has a sound track of S seconds: its rows
follow the video block in the language prompt as vLLM's ``use_audio_in_video`` lays them, never pruned, and the
vision side encodes it too (the audio encoder graph, once per q): what pruning buys when the audio tokens stay.

Order of work: one pass per q alone, untimed, which warms up and records peak resident memory;
then per repetition the vision runs (q in alternating order) and the prefills of all q
interleaved chunk by chunk (``run_interleaved``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from qeff_evs import evs
from qeff_evs.bench import kept_tokens, memory, plots
from qeff_evs.bench.config import BenchConfig
from qeff_evs.bench.phase import MS, Option, Phase, Progress, fmt, fmt_seconds, section_head, table_head
from qeff_evs.bench.timing import CLOCKS, CPU, WALL, ChunkedRun, Samples, alternating, median, run_interleaved, timed
from qeff_evs.bench.workload import (Clip, first_special_id, language_prompt, question_ids, synthetic_clip,
                                     synthetic_sound)
from qeff_evs.models.protocol import MediaInput, audio_rows
from qeff_evs.models.pruning import VideoPruning
from qeff_evs.runtime.backends.base import LanguageInputs
from qeff_evs.runtime.backends.ort import OrtLanguageSession
from qeff_evs.runtime.backends.vision import VisionPipeline
from qeff_evs.runtime.engine.request import PreparedPrompt
from qeff_evs.runtime.engine.steps import prefill_step
from qeff_evs.runtime.engine.window import prefill_chunks
from qeff_evs.specializations.sets import chunk_seq_len

if TYPE_CHECKING:
    from qeff_evs.bench.graphs import BenchGraphs

NAME = "pruning_sweep"


@dataclass
class PruningPoint:
    q: float
    video_tokens: int  # V: merged tokens of the unpruned language clip
    kept_tokens: int  # K
    text_tokens: int
    prompt_tokens: int
    prefill_chunks: int
    vision_video_tokens: int  # the same two on the vision clip
    vision_kept_tokens: int
    encoder_cache_bytes: int  # K rows of float32 the host holds between vision and language
    vision: Samples = field(default_factory=Samples)  # one per repetition
    prefill: Samples = field(default_factory=Samples)  # one per repetition: the sum of its chunks
    peak_rss_mb: float | None = None  # during the q's pass alone (vision + prefill)
    peak_above_start_mb: float | None = None
    vision_kept_per_frame: list[int] = field(default_factory=list)
    vision_kept_indices: list[int] = field(default_factory=list)
    sound_rows: int = 0  # the sound track's rows in the prompt (never pruned); 0 without one


@dataclass
class PruningSweep:
    language_clip: tuple[int, int]  # (frames, size)
    vision_clip: tuple[int, int]
    vision_merged_grid: tuple[int, int, int]
    points: list[PruningPoint]
    sound_seconds: float = 0.0  # the clip's sound track, 0 for none


def sweep_rates(config: BenchConfig) -> list[float]:
    """The configured rates, ascending, always with q = 0 (the unpruned reference)."""
    return sorted({0.0, *(float(q) for q in config.pruning_rates)})


def prefill_steps(prompt: PreparedPrompt, config: BenchConfig, hidden: int,
                  extras: Mapping[str, int]) -> list[LanguageInputs]:
    """Every prefill chunk of ``prompt`` with its ``user_vision_size`` window (runtime.chunks), each padded to
    ``prefill_seq_len`` and computing its logits (the one-length graph, as the window sweep compares it)."""
    return [prefill_step(prompt, computed, scheduled, config.prefill_seq_len, config.effective_user_vision_size,
                         hidden, extras)
            for computed, scheduled in prefill_chunks(len(prompt.ids), config.prefill_seq_len)]


def engine_prefill_steps(prompt: PreparedPrompt, config: BenchConfig, graphs: BenchGraphs) -> list[LanguageInputs]:
    """Every prefill chunk of ``prompt`` as the engines run it on the bench export: the tail in the shortest prefill
    length holding it (``chunk_seq_len``), logits only from the last chunk (``LanguageInputs.wants_logits``)."""
    shape, chunks = graphs.language_shape, prefill_chunks(len(prompt.ids), config.prefill_seq_len)
    return [prefill_step(prompt, computed, scheduled,
                         chunk_seq_len(scheduled, config.prefill_seq_len, graphs.short_prefill_lens),
                         config.effective_user_vision_size, shape.hidden, shape.extras,
                         wants_logits=number == len(chunks) - 1)
            for number, (computed, scheduled) in enumerate(chunks)]


@dataclass
class _Case:
    point: PruningPoint
    steps: list[LanguageInputs]
    vision_k: int


def _cases(config: BenchConfig, graphs: BenchGraphs, language_clip: Clip, vision_clip: Clip,
           sound: MediaInput | None) -> list[_Case]:
    family, shape, merge = graphs.family, graphs.language_shape, graphs.merge_size
    question = question_ids(config.question_tokens, first_special_id(family), config.seed)
    lt, lh, lw = family.merged_grid(language_clip.grid_thw)
    vt, vh, vw = family.merged_grid(vision_clip.grid_thw)
    cases = []
    for q in sweep_rates(config):
        prompt = language_prompt(family, language_clip, q, question, shape.hidden, shape.extras,
                                 merge, config.seed, sound)
        k = evs.kept_token_count(lh * lw, lt, q)
        heard = 0 if sound is None else audio_rows(family.audio_features(), sound.clip_frames)
        vision_k = evs.kept_token_count(vh * vw, vt, q)
        steps = engine_prefill_steps(prompt, config, graphs)
        point = PruningPoint(
            q=q, video_tokens=lt * lh * lw, kept_tokens=k, text_tokens=len(prompt.ids) - k - heard, sound_rows=heard,
            prompt_tokens=len(prompt.ids), prefill_chunks=len(steps),
            vision_video_tokens=vt * vh * vw, vision_kept_tokens=vision_k,
            encoder_cache_bytes=k * shape.hidden * 4 * (1 + sum(shape.extras.values())),
        )
        cases.append(_Case(point, steps, vision_k))
    return cases


def _encode(vision: VisionPipeline, video: MediaInput, sound: MediaInput | None, q: float):
    """The vision side of one request: the video's rows pruned at ``q``, and its sound's rows (the first's result)."""
    result = vision.encode(video, VideoPruning("evs", q))
    if sound is not None:
        vision.encode(sound, VideoPruning("evs", q))
    return result


def _memory_pass(case: _Case, vision: VisionPipeline, language: OrtLanguageSession, video: MediaInput,
                 sound: MediaInput | None, merged_grid: tuple[int, int, int]) -> None:
    """The q's vision run and prefill alone: warm-up, kept indices and peak resident memory."""
    start_mb = memory.resident_mb()
    memory.reset_peak()
    result = _encode(vision, video, sound, case.point.q)
    run_interleaved([ChunkedRun(language, case.steps)])
    peak = memory.peak_mb()
    point = case.point
    if peak is not None and start_mb is not None:
        point.peak_rss_mb, point.peak_above_start_mb = peak, peak - start_mb
    t, h, w = merged_grid
    indices = result.kept_indices.astype(np.int64)
    point.vision_kept_indices = indices.tolist()
    point.vision_kept_per_frame = evs.tokens_per_frame_kept(indices, t, h * w)


def run_pruning_sweep(config: BenchConfig, graphs: BenchGraphs, progress: Progress) -> PruningSweep:
    spec = graphs.preprocess
    language_clip = synthetic_clip(spec, config.frames, config.frame_size, config.seed)
    vision_clip = synthetic_clip(spec, config.vision_frames, config.vision_frame_size, config.seed)
    seconds = float(config.options.get("sound_seconds", 0.0))
    sound = synthetic_sound(graphs.family, seconds, config.seed) if seconds else None
    cases = _cases(config, graphs, language_clip, vision_clip, sound)
    vision = graphs.vision_pipeline()
    video = vision_clip.video
    merged_grid = graphs.family.merged_grid(vision_clip.grid_thw)

    for case in cases:
        progress(f"pruning sweep: q={case.point.q:g} alone (warm-up, peak memory)")
        _memory_pass(case, vision, OrtLanguageSession(graphs.language, graphs.language_shape), video, sound,
                     merged_grid)
    for rep in range(config.repeats):
        order = alternating(cases, rep)
        for case in order:
            timed(lambda: _encode(vision, video, sound, case.point.q), case.point.vision)
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
        sound_seconds=seconds,
    )


# ---- results.json, results.md and the plots ---------------------------------------------------------


def pruning_rows(sweep: PruningSweep) -> list[dict]:
    """Per q: medians, and the unpruned prefill scaled by tokens (proportional) and by chunks."""
    reference = next(p for p in sweep.points if p.q == 0.0)
    rows = []
    for p in sweep.points:
        row = {
            "q": p.q, "video_tokens": p.video_tokens, "kept_tokens": p.kept_tokens,
            "text_tokens": p.text_tokens, "prompt_tokens": p.prompt_tokens, "prefill_chunks": p.prefill_chunks,
            "vision_kept_tokens": p.vision_kept_tokens, "sound_rows": p.sound_rows, "peak_rss_mb": p.peak_rss_mb,
            "peak_above_start_mb": p.peak_above_start_mb, "encoder_cache_bytes": p.encoder_cache_bytes,
        }
        for clock in CLOCKS:
            reference_ms = median(reference.prefill.clock(clock)) * MS
            prefill_ms = median(p.prefill.clock(clock)) * MS
            proportional_ms = reference_ms * p.prompt_tokens / reference.prompt_tokens
            ttft = [v + f for v, f in zip(p.vision.clock(clock), p.prefill.clock(clock))]
            row[clock] = {
                "vision_ms": median(p.vision.clock(clock)) * MS,
                "prefill_ms": prefill_ms,
                "ttft_ms": median(ttft) * MS,
                "proportional_ms": proportional_ms,
                "chunk_limit_ms": reference_ms * p.prefill_chunks / reference.prefill_chunks,
                "prefill_over_proportional": prefill_ms / proportional_ms,
                "prefill_speedup": reference_ms / prefill_ms,
            }
        rows.append(row)
    return rows


def section(sweep: PruningSweep) -> dict:
    return {"language_clip": list(sweep.language_clip), "vision_clip": list(sweep.vision_clip),
            "vision_merged_grid": list(sweep.vision_merged_grid), "sound_seconds": sweep.sound_seconds,
            "rows": pruning_rows(sweep),
            "samples": [asdict(point) for point in sweep.points]}


def load(saved: dict) -> PruningSweep:
    points = [PruningPoint(**{**sample, "vision": Samples(**sample["vision"]), "prefill": Samples(**sample["prefill"])})
              for sample in saved["samples"]]
    return PruningSweep(tuple(saved["language_clip"]), tuple(saved["vision_clip"]), tuple(saved["vision_merged_grid"]),
                        points, saved.get("sound_seconds", 0.0))


def markdown(results: dict) -> list[str]:
    cfg, ps = results["config"], results[NAME]
    lf, ls = ps["language_clip"]
    vf, vs = ps["vision_clip"]
    heard = ps.get("sound_seconds", 0.0)
    sound = f" with {heard:g} s of its sound ({ps['rows'][0]['sound_rows']} rows, kept)" if heard else ""
    lines = [
        *section_head(results, NAME, f"Pruning sweep: {lf} frames {ls}x{ls}{sound} + {cfg['question_tokens']}-token "
                      f"question, prefill chunks of {cfg['prefill_seq_len']}, ctx_len {cfg['ctx_len']}"),
        f"proportional = q=0 prefill x (K+text)/(V+text); chunk limit = q=0 prefill x chunks/chunks(q=0). "
        f"Vision side (encoder calls of {cfg['frames_per_call']} temporal patches, then the EVS graph"
        f"{', then the audio encoder on the sound' if heard else ''}) timed on {vf} frames {vs}x{vs}; TTFT = that "
        f"vision time + prefill. Peak RSS: the q's vision run and prefill alone.",
        "",
        *table_head("| q | K | prompt tokens | chunks | prefill CPU s | proportional CPU s | chunk limit CPU s "
                    "| CPU / proportional | speedup CPU | prefill wall s | speedup wall | vision wall s (K) "
                    "| TTFT wall s | peak RSS MB | peak above start MB |"),
    ]
    for r in ps["rows"]:
        c, w = r[CPU], r[WALL]
        lines.append(
            f"| {r['q']:g} | {r['kept_tokens']} | {r['prompt_tokens']} | {r['prefill_chunks']} | "
            f"{fmt_seconds(c['prefill_ms'])} | {fmt_seconds(c['proportional_ms'])} | "
            f"{fmt_seconds(c['chunk_limit_ms'])} | {c['prefill_over_proportional']:.2f} | "
            f"{c['prefill_speedup']:.2f}x | {fmt_seconds(w['prefill_ms'])} | {w['prefill_speedup']:.2f}x | "
            f"{fmt_seconds(w['vision_ms'])} ({r['vision_kept_tokens']}) | {fmt_seconds(w['ttft_ms'])} | "
            f"{fmt(r['peak_rss_mb'])} | {fmt(r['peak_above_start_mb'])} |")
    return lines


def plot_latency_vs_q(results: dict, path: Path) -> Path:
    """Prefill and vision time against q, with the proportional and chunk limits."""
    rows = results[NAME]["rows"]
    q = [r["q"] for r in rows]
    figure = plots.figure(6.4, 4.0)
    axes = figure.add_subplot()
    axes.plot(q, [r[CPU]["prefill_ms"] / MS for r in rows], "o-", label="language prefill, CPU time")
    axes.plot(q, [r[CPU]["proportional_ms"] / MS for r in rows], "--", label="proportional limit (K+text)/(V+text)")
    axes.plot(q, [r[CPU]["chunk_limit_ms"] / MS for r in rows], ":", label="chunk-count limit")
    axes.plot(q, [r[WALL]["prefill_ms"] / MS for r in rows], "o-", alpha=0.35, label="language prefill, wall time")
    axes.plot(q, [r[WALL]["vision_ms"] / MS for r in rows], "s-", label="vision graph, wall (smaller clip)")
    frames, size = results[NAME]["language_clip"]
    heard = results[NAME].get("sound_seconds", 0.0)
    sound = f" + {heard:g} s of sound, kept" if heard else ""
    plots.finish(axes, "video pruning rate q", "seconds (median)",
                 f"Prefill vs EVS pruning rate ({frames} frames {size}x{size}{sound})")
    return plots.save(figure, path)


def plot_kept_tokens(results: dict, path: Path) -> Path:
    """Which merged tokens each temporal patch of the vision clip kept, per q (from the vision graph)."""
    sweep = results[NAME]
    kept = {s["q"]: np.asarray(s["vision_kept_indices"]) for s in sweep["samples"]}
    return kept_tokens.plot_for_config(BenchConfig.from_json(results["config"]), tuple(sweep["vision_merged_grid"]),
                                       kept, path)


def sound_seconds(text: str) -> float:
    """``--sound-seconds``: a finite number of seconds >= 0 (argparse names the flag and the value otherwise)."""
    value = float(text)
    if not 0 <= value < float("inf"):
        raise ValueError(text)
    return value


PHASE = Phase(NAME, run_pruning_sweep, section=section, load=load, markdown=markdown,
              plots={"latency_vs_q.png": plot_latency_vs_q, "kept_tokens.png": plot_kept_tokens},
              options=(Option("sound_seconds", sound_seconds, {"full": 0.0},
                              "seconds of sound with the clip (a family with audio): its rows after the video's, "
                              "never pruned; 0 for none"),))
