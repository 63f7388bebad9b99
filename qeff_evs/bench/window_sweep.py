"""Window sweep: vision rows sent per prefill chunk, ``user_vision_size`` against the QEfficient way.

Both ways run the same language ONNX (``vision_size`` is a graph symbol) on the same prompts:

* ``user_vision_size`` (this project, docs/design.md#specializations): each chunk gets only its window's rows,
  zero-padded to U, with ``image_idx = 0``;
* ``qefficient``: ``vision_size`` = the prompt's whole kept row count K, all K rows go with
  every chunk, and ``image_idx`` advances by the media tokens of the chunks before.

Per chunk the bytes of the vision input(s) fed to the graph and the graph's run time are recorded;
the two ways run interleaved chunk by chunk. Both ways must produce the same first-token logits
(checked and reported).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from qeff_evs import evs
from qeff_evs.bench import plots
from qeff_evs.bench.config import BenchConfig
from qeff_evs.bench.phase import MIB, MS, Phase, Progress, fmt, fmt_bytes, section_head, table_head
from qeff_evs.bench.pruning import prefill_steps
from qeff_evs.bench.timing import CLOCKS, CPU, WALL, ChunkedRun, Samples, alternating, median, run_interleaved
from qeff_evs.bench.workload import first_special_id, language_prompt, question_ids, synthetic_clip
from qeff_evs.runtime.backends.base import LanguageInputs
from qeff_evs.runtime.backends.ort import OrtLanguageSession
from qeff_evs.runtime.engine.request import PreparedPrompt
from qeff_evs.runtime.engine.steps import prefill_step
from qeff_evs.runtime.engine.window import prefill_chunks

if TYPE_CHECKING:
    from qeff_evs.bench.graphs import BenchGraphs

NAME = "window_sweep"

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
    kept_tokens: int
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
        k = evs.kept_token_count(h * w, t, q)
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
            progress(f"window sweep rep {rep + 1}/{config.repeats}: {point.frames} frames, K={point.kept_tokens}, "
                     f"{point.chunks} chunks, logits max abs diff between ways {point.logits_max_abs_diff:.2e}")
    return WindowSweep(config.frame_size, q, config.prefill_seq_len, [plan[0] for plan in plans])


# ---- results.json, results.md and the plot ----------------------------------------------------------


def window_rows(sweep: WindowSweep) -> list[dict]:
    rows = []
    for p in sweep.points:
        row = {"frames": p.frames, "video_tokens": p.video_tokens, "kept_tokens": p.kept_tokens,
               "prompt_tokens": p.prompt_tokens, "chunks": p.chunks, "logits_max_abs_diff": p.logits_max_abs_diff}
        for way in WAYS:
            m = p.ways[way]
            row[way] = {
                "vision_size": m.vision_size,
                "bytes_per_chunk": max(m.bytes_per_chunk),
                "bytes_per_chunk_constant": len(set(m.bytes_per_chunk)) == 1,
                "ms_per_chunk": {clock: median(m.chunks.clock(clock)) * MS for clock in CLOCKS},
                "chunk_samples": len(m.chunks.wall),
            }
        rows.append(row)
    return rows


def _sample(point: WindowPoint) -> dict:
    """A point's raw samples, without the logits (bulky; only their difference is kept)."""
    data = asdict(point)
    for way in data["ways"].values():
        way.pop("first_token_logits", None)
    return data


def section(sweep: WindowSweep) -> dict:
    return {"frame_size": sweep.frame_size, "q": sweep.q, "prefill_seq_len": sweep.prefill_seq_len,
            "rows": window_rows(sweep), "samples": [_sample(point) for point in sweep.points]}


def load(saved: dict) -> WindowSweep:
    points = []
    for sample in saved["samples"]:
        ways = {way: WayMeasurement(**{**m, "chunks": Samples(**m["chunks"])}) for way, m in sample["ways"].items()}
        points.append(WindowPoint(**{**sample, "ways": ways}))
    return WindowSweep(saved["frame_size"], saved["q"], saved["prefill_seq_len"], points)


def markdown(results: dict) -> list[str]:
    cfg, ws = results["config"], results[NAME]
    u = cfg["user_vision_size"] or cfg["prefill_seq_len"]
    lines = [
        *section_head(results, NAME, f"Window sweep: q={ws['q']:g}, {ws['frame_size']}x{ws['frame_size']}, "
                      f"prefill chunks of {ws['prefill_seq_len']}"),
        f"Bytes: the vision inputs sent with each chunk (fp32 here; fp16 custom IO on AI 100 halves both). "
        f"user_vision_size (U): {u} window rows, image_idx=0. QEfficient (QEff): vision_size=K, all rows every "
        "chunk, image_idx advancing. Times are medians over every chunk of every repetition.",
        "",
        *table_head("| frames | V | K | prompt tokens | chunks | bytes/chunk U | CPU ms/chunk U | wall ms/chunk U "
                    "| bytes/chunk QEff | CPU ms/chunk QEff | wall ms/chunk QEff | logits max abs diff |"),
    ]
    for r in ws["rows"]:
        ours, theirs = r[USER_VISION_SIZE], r[QEFFICIENT]
        lines.append(
            f"| {r['frames']} | {r['video_tokens']} | {r['kept_tokens']} | {r['prompt_tokens']} | {r['chunks']} | "
            f"{fmt_bytes(ours['bytes_per_chunk'])} | {fmt(ours['ms_per_chunk'][CPU])} | "
            f"{fmt(ours['ms_per_chunk'][WALL])} | {fmt_bytes(theirs['bytes_per_chunk'])} | "
            f"{fmt(theirs['ms_per_chunk'][CPU])} | {fmt(theirs['ms_per_chunk'][WALL])} | "
            f"{r['logits_max_abs_diff']:.1e} |")
    return lines


def plot_window_sweep(results: dict, path: Path) -> Path:
    """Vision bytes and language time per chunk against frames, both ways."""
    ws = results[NAME]
    rows = ws["rows"]
    frames = [r["frames"] for r in rows]
    figure, left, right = plots.side_by_side()
    labels = {USER_VISION_SIZE: "user_vision_size (window rows)", QEFFICIENT: "QEfficient (all rows)"}
    for way, marker in ((USER_VISION_SIZE, "o-"), (QEFFICIENT, "s--")):
        left.plot(frames, [r[way]["bytes_per_chunk"] / MIB for r in rows], marker, label=labels[way])
        line, = right.plot(frames, [r[way]["ms_per_chunk"][CPU] for r in rows], marker, label=f"{labels[way]}, CPU")
        right.plot(frames, [r[way]["ms_per_chunk"][WALL] for r in rows], marker, color=line.get_color(), alpha=0.3,
                   label=f"{labels[way]}, wall")
    plots.frames_axis(left, frames)
    plots.finish(left, ylabel="vision input per chunk (MiB)", legend_size=7, from_zero=False)
    plots.frames_axis(right, frames)
    plots.finish(right, ylabel="language time per chunk (ms)", legend_size=6)
    figure.suptitle(f"Prefill chunks of {ws['prefill_seq_len']}, q={ws['q']:g}, {ws['frame_size']}x{ws['frame_size']}",
                    fontsize=10)
    return plots.save(figure, path)


PHASE = Phase(NAME, run_window_sweep, section=section, load=load, markdown=markdown,
              plots={"window_sweep.png": plot_window_sweep})
