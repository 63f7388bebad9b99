"""What one measurement of ``qeff-evs bench`` declares: a ``Phase`` (and the ``Option`` settings it adds).

A phase is one module of ``qeff_evs.bench`` defining ``PHASE = Phase(...)``, listed once in
``phases.PHASES`` (the run and report order). The suite exports and opens the graphs once, calls every
phase's ``measure``, stores ``section(raw)`` under the phase's name in results.json, and builds
results.md and the plots from the saved sections. ``--only NAME --base RESULTS`` measures some phases
again and keeps the others as saved; ``--render`` rebuilds the sections from their raw samples (``load``).

Example (a phase with one setting of its own)::

    def measure(config, graphs, progress):
        samples = Samples()
        for _ in range(config.option("decode_steps")):
            timed(lambda: ..., samples)
        return {"samples": asdict(samples), "median_ms": median(samples.cpu) * 1e3}

    def markdown(results):
        section = results["decode_steps"]
        return ["", "### Decode steps", "", measured_in(results, "decode_steps"), "",
                f"median {section['median_ms']:.1f} ms CPU"]

    PHASE = Phase("decode_steps", measure, markdown=markdown,
                  options=(Option("decode_steps", int, {"full": 32, "quick": 8, "smoke": 2},
                                  "decode calls to time"),))
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qeff_evs.bench.config import Progress

if TYPE_CHECKING:
    from qeff_evs.bench.config import BenchConfig
    from qeff_evs.bench.graphs import BenchGraphs
    from qeff_evs.models.protocol import NormalizedConfig

PRESET_NAMES = ("full", "quick", "smoke")


def as_section(raw: Any) -> dict:
    """The default ``Phase.section``: ``measure`` already returned the JSON-ready section."""
    if not isinstance(raw, dict):
        raise TypeError(f"a phase without a section function must measure a dict, got {type(raw).__name__}")
    return raw


def no_markdown(results: dict) -> list[str]:
    return []


@dataclass(frozen=True)
class Option:
    """A setting one phase adds to the bench: ``--NAME`` (underscores as dashes) and its value per preset.

    The value is ``BenchConfig.option(name)``; results.json keeps it under ``config.options``.
    """

    name: str
    parse: Callable[[str], Any]  # the flag's argparse ``type``
    presets: Mapping[str, Any]  # preset name -> value; presets not named take "full"'s
    help: str = ""

    def value(self, preset: str) -> Any:
        if "full" not in self.presets:
            raise ValueError(f"option {self.name!r} names no value for the full preset")
        return self.presets.get(preset, self.presets["full"])


@dataclass(frozen=True)
class Phase:
    """One measurement: how to run it, what results.json keeps, what results.md and the plots show.

    ``measure(config, graphs, progress)`` returns raw measurements; ``section(raw)`` makes the
    JSON-ready results.json section (the raw samples and the numbers derived from them); ``load(section)``
    gives the raw measurements back from a saved section, so that ``--render`` and ``--only`` recompute
    derived numbers with today's code (``None``: a saved section is kept as it is). ``markdown(results)``
    returns the phase's lines of results.md and ``plots`` maps a PNG name to ``draw(results, path)``;
    both get the whole results dict and run only when it holds the phase. ``language``: the phase runs
    the language graph (vision-only runs do not open it). ``check(config, normalized_config)`` refuses
    a configuration before anything is exported.
    """

    name: str
    measure: Callable[[BenchConfig, BenchGraphs, Progress], Any]
    section: Callable[[Any], dict] = as_section
    load: Callable[[dict], Any] | None = None
    markdown: Callable[[dict], list[str]] = no_markdown
    plots: Mapping[str, Callable[[dict, Path], Path]] = field(default_factory=dict)
    language: bool = True
    options: tuple[Option, ...] = ()
    check: Callable[[BenchConfig, NormalizedConfig], None] | None = None

    def rebuilt(self, section: dict) -> dict:
        """A saved section with its derived numbers recomputed (as saved when the phase has no ``load``)."""
        return section if self.load is None else self.section(self.load(section))


# ---- what a phase's results.md lines share ----------------------------------------------------------

MS = 1e3
MIB = 1024 * 1024


def fmt(value, digits: int = 0) -> str:
    """A number with thousands separators, or "n/a" for a reading this machine could not take."""
    return "n/a" if value is None else f"{value:,.{digits}f}"


def fmt_bytes(count: int) -> str:
    return f"{count / MIB:.2f} MiB" if count >= MIB else f"{count / 1024:.1f} KiB"


def fmt_percent(fraction: float | None, digits: int = 3) -> str:
    return "n/a" if fraction is None else f"{fraction:+.{digits}%}"


def fmt_seconds(ms: float) -> str:
    return f"{ms / MS:.2f}"


def section_head(results: dict, name: str, title: str, note: str = "") -> list[str]:
    """A section's first lines: its ``###`` ``title``, then when it was measured (and ``note`` after that)."""
    return ["", f"### {title}", "", measured_in(results, name) + note, ""]


def table_head(header: str) -> list[str]:
    """A results.md table's header row (``"| a | b |"``) and the separator under it."""
    return [header, "|" + "---|" * (header.count("|") - 1)]


def measured_in(results: dict, name: str) -> str:
    """The line under a section's title: when its phase was measured and how loaded the machine was."""
    run = results["phase_runs"][name]
    when = f"{run['finished_utc']} UTC" if run.get("finished_utc") else "an earlier run (time not recorded)"
    return f"Measured: {when}, load average (1/5/15 min) {run.get('load_average')}."
