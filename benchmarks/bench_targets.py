#!/usr/bin/env python
"""The bench's published targets, judged on a saved ``qeff-evs bench`` results.json (the verdicts published in
``benchmarks/README.md`` and docs/performance.md).

The bench measures; this script holds the target numbers and says which a run met::

    python benchmarks/bench_targets.py bench_out/results.json
    python benchmarks/bench_targets.py bench_out/results.json --whole-video whole_video/whole_video.json

Verdicts use process CPU time (the work done; it stays steady when other programs share the cores),
the other clock is quoted beside. The vision speedup target compares the encoder with the whole-video
graph it replaced, measured by ``benchmarks/whole_video_baseline.py`` (a results.json from before the
baseline left the bench carries it in its vision sweep rows).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

# The pruning and window sweeps, the EVS overhead.
PROPORTIONAL_TOLERANCE = 0.15
SPEEDUP_RATE = 0.75
SPEEDUP_TARGET = 3.4
WINDOW_TIME_TOLERANCE = 0.10
EVS_OVERHEAD_LIMIT = 0.03
# Both ways feed the same rows to the same graph: their logits must agree to fp32 noise.
LOGITS_TOLERANCE = 1e-4
# The vision side per temporal patch (the per-frame encoder).
TIME_TOLERANCE = 0.10  # time per temporal patch within +-10% from the shortest to the longest video
MEMORY_TOLERANCE = 0.10  # peak above the loaded graphs <= (one call's peak + accumulated rows) + 10%
SPEEDUP_FRAMES, SPEEDUP_MIN = 16, 2.5  # at 16 frames, >= 2.5x less time per patch than the whole-video graph

CPU, WALL = "cpu", "wall"
CLOCKS = (WALL, CPU)
VERDICT_CLOCK = CPU
ENCODER, WHOLE_VIDEO = "encoder", "whole_video"
USER_VISION_SIZE, QEFFICIENT = "user_vision_size", "qefficient"
MIB = 1024 * 1024


@dataclass(frozen=True)
class Target:
    name: str
    requirement: str
    measured: str
    met: bool | None  # None: not measured in this run


def _bytes(count: int) -> str:
    return f"{count / MIB:.2f} MiB" if count >= MIB else f"{count / 1024:.1f} KiB"


def _percent(fraction: float | None, digits: int = 3) -> str:
    return "n/a" if fraction is None else f"{fraction:+.{digits}%}"


def _fmt(value, digits: int = 0) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def pruning_targets(rows: list[dict]) -> list[Target]:
    pruned = [r for r in rows if r["q"] > 0]
    if pruned:
        def deviations(clock: str) -> str:
            return ", ".join(f"q={r['q']:g}: {r[clock]['prefill_over_proportional']:.2f}" for r in pruned)

        proportional = Target(
            "pruning: prefill vs proportional limit",
            f"every q within {PROPORTIONAL_TOLERANCE:.0%} of (K+text)/(V+text) x unpruned prefill",
            f"prefill / limit, CPU: {deviations(CPU)}; wall: {deviations(WALL)}",
            all(abs(r[VERDICT_CLOCK]["prefill_over_proportional"] - 1) <= PROPORTIONAL_TOLERANCE for r in pruned))
    else:
        proportional = Target("pruning: prefill vs proportional limit", "needs a q > 0", "not measured", None)
    at_rate = [r for r in rows if math.isclose(r["q"], SPEEDUP_RATE)]
    if at_rate:
        row = at_rate[0]
        fast = Target(f"pruning: q={SPEEDUP_RATE:g} prefill speedup",
                      f">= {SPEEDUP_TARGET}x faster language prefill than q=0",
                      f"CPU {row[CPU]['prefill_speedup']:.2f}x, wall {row[WALL]['prefill_speedup']:.2f}x "
                      f"(chunk count ratio {rows[0]['prefill_chunks'] / row['prefill_chunks']:.2f}x)",
                      row[VERDICT_CLOCK]["prefill_speedup"] >= SPEEDUP_TARGET)
    else:
        fast = Target(f"pruning: q={SPEEDUP_RATE:g} prefill speedup", f"needs q={SPEEDUP_RATE:g} in the sweep",
                      "not measured", None)
    return [proportional, fast]


def _spread(ours: list[dict], clock: str) -> list[float]:
    base = ours[0]["ms_per_chunk"][clock]
    return [o["ms_per_chunk"][clock] / base - 1 for o in ours]


def window_targets(rows: list[dict]) -> list[Target]:
    ours = [r[USER_VISION_SIZE] for r in rows]
    theirs = [r[QEFFICIENT] for r in rows]
    frames = f"{rows[0]['frames']} to {rows[-1]['frames']} frames"
    sizes = sorted({o["bytes_per_chunk"] for o in ours})
    constant = len(sizes) == 1 and all(o["bytes_per_chunk_constant"] for o in ours)
    worst = {clock: max(_spread(ours, clock), key=abs) for clock in CLOCKS}
    per_chunk = ", ".join(f"{o['ms_per_chunk'][CPU]:.0f}" for o in ours)
    grows_bytes = (all(b["bytes_per_chunk"] >= a["bytes_per_chunk"] for a, b in zip(theirs, theirs[1:]))
                   and theirs[-1]["bytes_per_chunk"] > theirs[0]["bytes_per_chunk"])
    growth = {clock: theirs[-1]["ms_per_chunk"][clock] / theirs[0]["ms_per_chunk"][clock] - 1 for clock in CLOCKS}
    return [
        Target("window: bytes per chunk, user_vision_size", f"constant from {frames}",
               f"{', '.join(_bytes(s) for s in sizes)} per chunk", constant),
        Target("window: time per chunk, user_vision_size", f"within +-{WINDOW_TIME_TOLERANCE:.0%} from {frames}",
               f"worst vs {rows[0]['frames']} frames: CPU {worst[CPU]:+.1%} ({per_chunk} ms), wall {worst[WALL]:+.1%}",
               all(abs(s) <= WINDOW_TIME_TOLERANCE for s in _spread(ours, VERDICT_CLOCK))),
        Target("window: QEfficient way, bytes per chunk", f"grow from {frames}",
               f"{_bytes(theirs[0]['bytes_per_chunk'])} to {_bytes(theirs[-1]['bytes_per_chunk'])} "
               f"(x{theirs[-1]['bytes_per_chunk'] / theirs[0]['bytes_per_chunk']:.1f})", grows_bytes),
        Target("window: QEfficient way, time per chunk",
               f"grows from {frames} by more than the +-{WINDOW_TIME_TOLERANCE:.0%} band",
               f"CPU {growth[CPU]:+.1%}, wall {growth[WALL]:+.1%}", growth[VERDICT_CLOCK] > WINDOW_TIME_TOLERANCE),
    ]


def overhead_target(summary: dict) -> Target:
    fraction, profiled = summary["overhead_fraction"], summary["profiled_overhead_fraction"]
    requirement = f"EVS graph < {EVS_OVERHEAD_LIMIT:.0%} of the encoder's time at {summary['frames']} frames"
    return Target("EVS overhead", requirement,
                  f"CPU {_percent(fraction[CPU], 2)}, wall {_percent(fraction[WALL], 2)}; profiled nodes "
                  f"{_percent(profiled)}", fraction[VERDICT_CLOCK] < EVS_OVERHEAD_LIMIT)


def parity_check(rows: list[dict]) -> Target:
    worst = max(r["logits_max_abs_diff"] for r in rows)
    return Target("check: both ways give the same first-token logits", f"max abs diff <= {LOGITS_TOLERANCE:g}",
                  f"{worst:.2e}", worst <= LOGITS_TOLERANCE)


def memory_target(last: dict, call_peak: float | None) -> Target:
    """The vision side's memory: "one batch's activations plus the accumulated rows", + the tolerance."""
    name = f"vision: peak memory at {last['frames']} frames"
    peak, rows_mb = last[ENCODER]["peak_above_start_mb"], last["accumulated_mb"]
    if call_peak is None:
        return Target(name, f"above the loaded graphs <= (one encoder call's peak + accumulated rows) "
                            f"+ {MEMORY_TOLERANCE:.0%}", f"{_fmt(peak)} MB; one call's peak not recorded", None)
    limit = (call_peak + rows_mb) * (1 + MEMORY_TOLERANCE)
    return Target(name, f"above the loaded graphs <= (one encoder call's peak + accumulated rows) "
                        f"+ {MEMORY_TOLERANCE:.0%} ({limit:.0f} MB)",
                  f"{_fmt(peak)} MB (one call {call_peak:.0f} MB, rows {rows_mb:.0f} MB)",
                  None if peak is None else peak <= limit)


def vision_targets(rows: list[dict], call_peak: float | None, baseline: list[dict]) -> list[Target]:
    """``baseline``: rows holding both the encoder's and the whole-video graph's time per patch."""
    clock = f"{VERDICT_CLOCK}_s_per_patch"
    base, last = rows[0], rows[-1]
    spread = [r[ENCODER][clock] / base[ENCODER][clock] - 1 for r in rows]
    worst = max(spread, key=abs)
    per_patch = ", ".join(f"{r['frames']}: {r[ENCODER][clock]:.2f}" for r in rows)
    at = next((r for r in baseline if r["frames"] == SPEEDUP_FRAMES), None)
    ratios = ", ".join(f"{r['frames']} frames: {r[WHOLE_VIDEO][clock] / r[ENCODER][clock]:.1f}x" for r in baseline)
    speedup = Target(f"vision: {SPEEDUP_FRAMES} frames vs the whole-video graph",
                     f">= {SPEEDUP_MIN:g}x less CPU per temporal patch",
                     ratios or "whole-video graph not run",
                     None if at is None else at[WHOLE_VIDEO][clock] / at[ENCODER][clock] >= SPEEDUP_MIN)
    if at is None and baseline:
        speedup = Target(speedup.name, speedup.requirement,
                         f"not measured at {SPEEDUP_FRAMES} frames (whole-video graph run up to "
                         f"{baseline[-1]['frames']}: it does not fit memory beyond); {ratios}", None)
    return [
        Target("vision: time per temporal patch", f"within +-{TIME_TOLERANCE:.0%} from {base['frames']} to "
               f"{last['frames']} frames", f"worst vs {base['frames']} frames: CPU {worst:+.1%} ({per_patch} s)",
               all(abs(s) <= TIME_TOLERANCE for s in spread)),
        memory_target(last, call_peak),
        speedup,
    ]


def evaluate(results: dict, whole_video: dict | None = None) -> list[Target]:
    """Every target of a bench results.json; ``whole_video``: the baseline script's JSON, if run."""
    vision = results["vision_sweep"]
    baseline = (whole_video["rows"] if whole_video is not None
                else [r for r in vision["rows"] if WHOLE_VIDEO in r])
    window = results["window_sweep"]["rows"]
    return [*pruning_targets(results["pruning_sweep"]["rows"]), *window_targets(window),
            *vision_targets(vision["rows"], vision.get("call_peak_mb"), baseline),
            overhead_target(results["evs_overhead"]), parity_check(window)]


def markdown(targets: list[Target]) -> str:
    verdict = {True: "met", False: "**missed**", None: "not measured"}
    lines = ["| target | requirement | measured | verdict |", "|---|---|---|---|"]
    lines += [f"| {t.name} | {t.requirement} | {t.measured} | {verdict[t.met]} |" for t in targets]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", type=Path, help="a results.json written by qeff-evs bench")
    parser.add_argument("--whole-video", type=Path, default=None,
                        help="whole_video.json of benchmarks/whole_video_baseline.py (the vision speedup target)")
    parser.add_argument("--json", action="store_true", help="print the targets as JSON instead of Markdown")
    args = parser.parse_args(argv)
    results = json.loads(args.results.read_text())
    baseline = json.loads(args.whole_video.read_text()) if args.whole_video else None
    targets = evaluate(results, baseline)
    print(json.dumps([asdict(t) for t in targets], indent=1) if args.json else markdown(targets), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
