"""Prefill chunk time against the chunk's length: what a short prefill specialization saves
(docs/design.md#specializations).

One prefill chunk of each length of ``--prefill-lengths`` (text tokens, KV slots from ``--prefill-lengths-at``),
through the bench export's language graph and the runtime's ORT session, alternating lengths per repetition. A
chunk of ``n`` tokens padded to a length ``L`` costs the ``L`` row; the default short length
(``specializations.sets.DEFAULT_SHORT_PREFILL_LEN``) is read off this table: the shortest length whose chunk still
costs clearly less than the full one, at the prompt tails the pruning sweep produces.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from qeff_evs.bench.config import BenchConfig
from qeff_evs.bench.phase import MS, Option, Phase, Progress, fmt, measured_in
from qeff_evs.bench.timing import CLOCKS, CPU, WALL, Samples, alternating, median, timed
from qeff_evs.models.graph_io import PAD_POSITION
from qeff_evs.runtime.backends.base import LanguageInputs
from qeff_evs.runtime.backends.ort import OrtLanguageSession

if TYPE_CHECKING:
    from qeff_evs.bench.graphs import BenchGraphs

NAME = "prefill_lengths"


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(",") if v.strip())


@dataclass
class PrefillLengths:
    lengths: tuple[int, ...]
    first_slot: int
    samples: dict[int, Samples] = field(default_factory=dict)


def chunk(length: int, first_slot: int, vision_size: int, hidden: int, extras: dict[str, int]) -> LanguageInputs:
    """A text chunk of ``length`` tokens at KV slots ``first_slot``.. (its window all zeros)."""
    ids = np.full((1, length), 100, dtype=np.int64)
    positions = np.full((4, 1, length), PAD_POSITION, dtype=np.int64)
    positions[:, 0, :] = first_slot + np.arange(length)
    window = np.zeros((1, vision_size, hidden), np.float32)
    extra = {name: np.zeros((levels, 1, vision_size, hidden), np.float32) for name, levels in extras.items()}
    return LanguageInputs(ids, positions, window, extra, np.zeros((1, 1), np.int64), 0)


def run_prefill_lengths(config: BenchConfig, graphs: BenchGraphs, progress: Progress) -> PrefillLengths:
    shape = graphs.language_shape
    lengths = tuple(sorted(n for n in config.option("prefill_lengths") if n <= shape.vision_size))
    first = config.option("prefill_lengths_at")
    session = OrtLanguageSession(graphs.language, shape)
    steps = {n: chunk(n, first, shape.vision_size, shape.hidden, dict(shape.extras)) for n in lengths}
    result = PrefillLengths(lengths, first, {n: Samples() for n in lengths})
    for n in lengths:  # warm-up
        session.run(steps[n])
    for rep in range(config.repeats * 3):
        for n in alternating(lengths, rep):
            timed(lambda: session.run(steps[n]), result.samples[n])
    progress("prefill lengths: " + ", ".join(f"{n}: {median(result.samples[n].cpu) * MS:.0f} ms CPU" for n in lengths))
    return result


def section(result: PrefillLengths) -> dict:
    ms = {n: {clock: median(result.samples[n].clock(clock)) * MS for clock in CLOCKS} for n in result.lengths}
    longest = max(result.lengths)
    return {"lengths": list(result.lengths), "first_slot": result.first_slot,
            "rows": [{"seq_len": n, "ms": ms[n], "over_longest": {c: ms[n][c] / ms[longest][c] for c in CLOCKS}}
                     for n in result.lengths],
            "samples": {str(n): asdict(result.samples[n]) for n in result.lengths}}


def load(saved: dict) -> PrefillLengths:
    return PrefillLengths(tuple(saved["lengths"]), saved["first_slot"],
                          {n: Samples(**saved["samples"][str(n)]) for n in saved["lengths"]})


def markdown(results: dict) -> list[str]:
    pl = results[NAME]
    lines = ["", f"### Prefill chunk time against its length (KV slots from {pl['first_slot']})", "",
             measured_in(results, NAME), "",
             "| seq_len | CPU ms | wall ms | CPU / longest |", "|---|---|---|---|"]
    for r in pl["rows"]:
        lines.append(f"| {r['seq_len']} | {fmt(r['ms'][CPU], 1)} | {fmt(r['ms'][WALL], 1)} | "
                     f"{r['over_longest'][CPU]:.2f} |")
    return lines


PHASE = Phase(NAME, run_prefill_lengths, section=section, load=load, markdown=markdown,
              options=(
                  Option("prefill_lengths", _ints, {"full": (8, 16, 32, 64, 128), "smoke": (4, 8, 16)},
                         "prefill chunk lengths to time (at most the window)"),
                  Option("prefill_lengths_at", int, {"full": 256, "smoke": 16}, "KV slot of each chunk's first token"),
              ))
