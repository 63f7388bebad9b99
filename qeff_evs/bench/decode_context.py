"""Decode time against position: an export with compute context lengths against one without
(docs/design.md#specializations).

The bench's checkpoint's language graph is exported twice at ``--decode-ctx-len`` (default 32k): once with the
default ladder of compute context lengths (``specializations.comp_ctx_lengths``: ctx_len / 4^k down to 2048), once
with the one length. For each position of ``--decode-positions`` both sessions run decode steps at that KV slot,
alternating (a drift of the machine hits both alike), from one zeroed cache each; the step's cost is its median.
A request at position p pays for the smallest length holding p with the ladder, for all of ctx_len without it:
the two meet at the top.

Both run through the runtime's ``OrtLanguageSession`` (the host feeds the KV rows in and reads them back every
call, as the embedded path does until the cache is bound in place), so the part of a step that grows with ctx_len
regardless of the ladder (those copies) is in both columns.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from qeff_evs.bench import plots
from qeff_evs.bench.config import BenchConfig
from qeff_evs.bench.phase import MS, Option, Phase, Progress, fmt, section_head, table_head
from qeff_evs.bench.sessions import open_inference_session
from qeff_evs.bench.timing import CLOCKS, CPU, WALL, Samples, alternating, median, timed
from qeff_evs.runtime.backends.base import DecodeRow, decode_batch
from qeff_evs.runtime.backends.ort import OrtLanguageSession
from qeff_evs.specializations import comp_ctx_lengths

if TYPE_CHECKING:
    from qeff_evs.bench.graphs import BenchGraphs

NAME = "decode_context"
LADDER, SINGLE = "ladder", "single"
WAYS = (LADDER, SINGLE)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(",") if v.strip())


@dataclass
class DecodeContext:
    ctx_len: int
    lengths: tuple[int, ...]  # the ladder's compute context lengths
    positions: tuple[int, ...]
    samples: dict[str, list[Samples]] = field(default_factory=dict)  # way -> one Samples per position


def _language_graphs(config: BenchConfig, graphs: BenchGraphs, ctx_len: int, progress: Progress) -> dict[str, Path]:
    """The checkpoint's language graph with (``ladder``) and without (``single``) the comp_ctx_lengths input."""
    from qeff_evs.export.language import export_language_graph
    from qeff_evs.models.checkpoint import load_checkpoint

    model = load_checkpoint(graphs.checkpoint_dir).model
    folder = Path(graphs.files["language"]).parent
    paths = {}
    for way in WAYS:
        progress(f"decode context: exporting the language graph ({way})")
        paths[way] = export_language_graph(
            model, folder / f"decode_{way}" / "language.onnx", media_token_ids=graphs.family.special_tokens().media_pads,
            rope_positions=ctx_len, prefill_seq_len=config.prefill_seq_len, comp_ctx_lengths=way == LADDER)
    return paths


def run_decode_context(config: BenchConfig, graphs: BenchGraphs, progress: Progress) -> DecodeContext:
    ctx_len = config.option("decode_ctx_len")
    positions = tuple(p for p in config.option("decode_positions") if p < ctx_len)
    if not positions:
        raise ValueError(f"--decode-positions has no position below --decode-ctx-len {ctx_len}")
    lengths = comp_ctx_lengths(config.option("decode_ctx_lengths") or None, ctx_len, config.prefill_seq_len)
    if not lengths:
        raise ValueError(f"--decode-ctx-len {ctx_len} has one compute context length; pass --decode-ctx-lengths")
    base = dataclasses.replace(graphs.language_shape, ctx_len=ctx_len, rope_positions=ctx_len,
                               full_batch_size=1, continuous_batching=False, comp_ctx_lengths=(),
                               logits_rows=False)  # its graphs compute every call's logits
    sessions = {way: OrtLanguageSession(open_inference_session(path),
                                        dataclasses.replace(base, comp_ctx_lengths=lengths if way == LADDER else ()))
                for way, path in _language_graphs(config, graphs, ctx_len, progress).items()}
    result = DecodeContext(ctx_len, lengths, positions, {way: [] for way in WAYS})
    steps = config.option("decode_steps")
    for position in positions:
        step, _ = decode_batch([DecodeRow(0, 1, position, position)], 1, 1)
        per_way = {way: Samples() for way in WAYS}
        sessions[LADDER].run(step), sessions[SINGLE].run(step)  # warm-up at this position
        for rep in range(steps):
            for way in alternating(WAYS, rep):
                timed(lambda: sessions[way].run(step), per_way[way])
        for way in WAYS:
            result.samples[way].append(per_way[way])
        progress(f"decode context: position {position}: ladder {median(per_way[LADDER].cpu) * MS:.1f} ms CPU, "
                 f"one length {median(per_way[SINGLE].cpu) * MS:.1f} ms CPU")
    return result


# ---- results.json and results.md --------------------------------------------------------------------


def rows(result: DecodeContext) -> list[dict]:
    out = []
    for i, position in enumerate(result.positions):
        ms = {way: {clock: median(result.samples[way][i].clock(clock)) * MS for clock in CLOCKS} for way in WAYS}
        length = next(n for n in result.lengths if n > position)
        out.append({"position": position, "comp_ctx_len": length, "ladder_ms": ms[LADDER], "single_ms": ms[SINGLE],
                    "single_over_ladder": {clock: ms[SINGLE][clock] / ms[LADDER][clock] for clock in CLOCKS}})
    return out


def section(result: DecodeContext) -> dict:
    return {"ctx_len": result.ctx_len, "lengths": list(result.lengths), "positions": list(result.positions),
            "rows": rows(result),
            "samples": {way: [asdict(s) for s in result.samples[way]] for way in WAYS}}


def load(saved: dict) -> DecodeContext:
    return DecodeContext(saved["ctx_len"], tuple(saved["lengths"]), tuple(saved["positions"]),
                         {way: [Samples(**s) for s in saved["samples"][way]] for way in WAYS})


def markdown(results: dict) -> list[str]:
    dc = results[NAME]
    lines = [
        *section_head(results, NAME, f"Decode step against position: ctx_len {dc['ctx_len']}, compute context "
                      f"lengths {', '.join(str(n) for n in dc['lengths'])} vs one length"),
        "Median of alternating decode steps at each KV slot, ORT with the KV rows fed in and read back every call "
        "(both columns).",
        "",
        *table_head("| position | comp_ctx_len | ladder CPU ms | one length CPU ms | one length / ladder (CPU) "
                    "| ladder wall ms | one length wall ms |"),
    ]
    for r in dc["rows"]:
        lines.append(f"| {r['position']} | {r['comp_ctx_len']} | {fmt(r['ladder_ms'][CPU], 1)} | "
                     f"{fmt(r['single_ms'][CPU], 1)} | {r['single_over_ladder'][CPU]:.2f}x | "
                     f"{fmt(r['ladder_ms'][WALL], 1)} | {fmt(r['single_ms'][WALL], 1)} |")
    return lines


def plot_decode_context(results: dict, path: Path) -> Path:
    dc = results[NAME]
    positions = [r["position"] for r in dc["rows"]]
    figure = plots.figure(6.4, 4.0)
    axes = figure.add_subplot()
    axes.plot(positions, [r["ladder_ms"][CPU] for r in dc["rows"]], "o-",
              label=f"compute context lengths {', '.join(str(n) for n in dc['lengths'])}")
    axes.plot(positions, [r["single_ms"][CPU] for r in dc["rows"]], "s-", label=f"one length ({dc['ctx_len']})")
    axes.set_xscale("log")
    plots.finish(axes, "KV slot of the decoded token", "ms per step, CPU time (median)",
                 f"Decode step vs position (ctx_len {dc['ctx_len']})")
    return plots.save(figure, path)


PHASE = Phase(NAME, run_decode_context, section=section, load=load, markdown=markdown,
              plots={"decode_context.png": plot_decode_context},
              options=(
                  Option("decode_ctx_len", int, {"full": 32768, "quick": 8192, "smoke": 256},
                         "ctx_len of the decode-context exports"),
                  Option("decode_positions", _ints,
                         {"full": (256, 1024, 2000, 4096, 8000, 12000, 16384, 24000, 30000),
                          "quick": (256, 1024, 2000, 4096, 8000), "smoke": (16, 100, 200)},
                         "KV slots the decode steps run at, e.g. 256,2000,30000"),
                  Option("decode_ctx_lengths", _ints, {"full": (), "smoke": (64,)},
                         "the ladder's lengths (default: the export's default ladder for --decode-ctx-len)"),
                  Option("decode_steps", int, {"full": 7, "quick": 3, "smoke": 1}, "decode steps timed per position"),
              ))
