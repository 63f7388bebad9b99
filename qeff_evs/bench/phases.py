"""The bench's phases in run and report order: one module each, one line here.

Adding a phase: write ``qeff_evs/bench/<name>.py`` with ``PHASE = Phase(...)`` (``phase.py`` says what it
declares), import it below and add it to ``PHASES``. Its name becomes an ``--only`` choice and its
results.json key; its ``Option``s become flags.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from qeff_evs.bench import decode_context, overhead, prefill_lengths, pruning, ttft, vision_sweep, window_sweep
from qeff_evs.bench.config import BenchConfig
from qeff_evs.bench.phase import Option, Phase


def check_table(phases: Sequence[Phase]) -> tuple[Phase, ...]:
    """Refuse two phases of one name, or an option that two phases (or ``BenchConfig``) already use."""
    names = [phase.name for phase in phases]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"bench phases named twice: {', '.join(repeated)}; give each phase its own name")
    taken = {f.name: "BenchConfig" for f in dataclasses.fields(BenchConfig)}
    for phase in phases:
        for option in phase.options:
            if option.name in taken:
                raise ValueError(f"phase {phase.name!r} declares option {option.name!r}, which {taken[option.name]} "
                                 "already has; choose another name")
            taken[option.name] = f"phase {phase.name!r}"
    return tuple(phases)


PHASES: tuple[Phase, ...] = check_table((
    pruning.PHASE,
    ttft.PHASE,
    window_sweep.PHASE,
    vision_sweep.PHASE,
    overhead.PHASE,
    decode_context.PHASE,
    prefill_lengths.PHASE,
))


def phase_names() -> tuple[str, ...]:
    return tuple(phase.name for phase in PHASES)


def select(names: Sequence[str] | None) -> tuple[Phase, ...]:
    """The phases ``names`` (all of them for ``None``), in table order; ValueError naming the choices."""
    if names is None:
        return PHASES
    unknown = [name for name in names if name not in phase_names()]
    if unknown or not names:
        raise ValueError(f"--only takes phases among {', '.join(phase_names())}, got {', '.join(names) or 'none'}")
    return tuple(phase for phase in PHASES if phase.name in names)


def options() -> tuple[Option, ...]:
    return tuple(option for phase in PHASES for option in phase.options)


def with_option_defaults(config: BenchConfig) -> BenchConfig:
    """``config`` with every phase option it does not set at its preset's value."""
    defaults: dict[str, Any] = {option.name: option.value(config.preset) for option in options()}
    return config.replace(options={**defaults, **config.options})
