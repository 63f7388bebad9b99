"""Measuring helpers: wall and CPU time of a call, medians, the alternating order, chunk interleaving.

Two clocks are kept for every sample. Wall time is what a user waits for. Process CPU time (all
threads; ORT's spinning is off, so idle threads burn nothing) is the work done, and it stays
steady when other programs share the cores, where wall time does not. The published verdicts use
CPU time; the tables show both.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")

WALL = "wall"
CPU = "cpu"
CLOCKS = (WALL, CPU)


@dataclass
class Samples:
    """Repeated measurements of one thing, seconds on both clocks (same length, same order)."""

    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)

    def add(self, wall: float, cpu: float) -> None:
        self.wall.append(wall)
        self.cpu.append(cpu)

    def extend(self, other: Samples) -> None:
        self.wall.extend(other.wall)
        self.cpu.extend(other.cpu)

    def total(self) -> tuple[float, float]:
        return sum(self.wall), sum(self.cpu)

    def clock(self, name: str) -> list[float]:
        return {WALL: self.wall, CPU: self.cpu}[name]


def timed(call: Callable[[], T], into: Samples) -> T:
    """Run ``call`` once, append its wall and process-CPU seconds to ``into``, return its result."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = call()
    into.add(time.perf_counter() - wall, time.process_time() - cpu)
    return result


def median(values: Sequence[float]) -> float:
    if not values:
        raise ValueError("median of no measurements; run at least one repetition")
    return float(statistics.median(values))


def alternating(items: Sequence[T], repetition: int) -> list[T]:
    """Forward on even repetitions, backward on odd ones: no configuration always runs first or last.

    Slow drifts of the machine (thermal, other processes) then hit every configuration alike.
    """
    return list(items) if repetition % 2 == 0 else list(reversed(items))


@dataclass
class ChunkedRun:
    """One request's prefill as a list of calls: ``session.run(step)`` per step, samples per call."""

    session: Any  # a LanguageSession (reset() / run(step))
    steps: list
    samples: Samples = field(default_factory=Samples)
    logits: Any = None


def run_interleaved(runs: Sequence[ChunkedRun]) -> None:
    """Advance every run one chunk at a time, round-robin, from a fresh cache until all are done.

    Like a scheduler interleaving requests: a change of load on the machine lands on all of them
    instead of on whichever happened to run at that moment.
    """
    for run in runs:
        run.session.reset()
    longest = max((len(run.steps) for run in runs), default=0)
    for index in range(longest):
        for run in runs:
            if index < len(run.steps):
                run.logits = timed(lambda: run.session.run(run.steps[index]), run.samples)
