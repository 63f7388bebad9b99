"""Where each graph's program runs: its cores (fixed when it is compiled) and its device ids (chosen when it is loaded).

A deployment loads every program of the export (``manifest.GRAPHS``: the encoder, the pruning graph, the
language graph) once and keeps them all activated for as long as it serves: a server interleaves encoder
calls with prefill chunks and decode steps, and swapping programs per request (QEfficient's VLM flow
deactivates vision to activate language) would stall everyone. An activated program holds its compiled
core count on each of its devices, so the programs that share a device must fit its cores together; a
placement that does not is refused here, before anything is loaded, naming the numbers and the fix.

Values are keyed by graph role (``manifest.GRAPHS``), never by file. The text forms, shared by
``qeff-evs compile --num-cores/--num-devices``, ``qeff-evs run --device-ids`` and ``QEFF_EVS_DEVICE_IDS``:

* cores or devices: ``16`` (every graph) or ``encoder=6,language=9`` (the graphs named; the others keep
  their default);
* device ids: ``0`` or ``0+1`` (every graph on these ids) or ``encoder=1,pruning=1,language=0+2`` (the graphs
  named; the others on ``0 .. num_devices-1``). A program compiled for N devices opens on exactly N ids.

``qeff-evs compile`` records each graph's cores and devices in ``placement.json`` at the export's top
(written with ``compile.sh``, from the same options), which the QAIC backend reads to check a placement.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from qeff_evs.manifest import EXPORT_FILES, GRAPHS

# NSP cores of one Cloud AI 100 device (an SoC: "up to 16 NSPs"; an AI 100 Ultra card shows 4 such
# devices). The Standard SKU has 14: compile with fewer cores there.
DEVICE_CORES = 16
# Defaults that keep all three programs active on one 16-core device; docs/deploying.md#one-card gives
# the reasoning (the language graph runs every step, the encoder once per video, pruning is tiny).
DEFAULT_GRAPH_CORES: Mapping[str, int] = {"encoder": 6, "pruning": 1, "language": 9}
DEFAULT_GRAPH_DEVICES: Mapping[str, int] = dict.fromkeys(GRAPHS, 1)
PLACEMENT_FILE = EXPORT_FILES["placement"]
DEVICE_SEPARATOR = "+"  # between the ids of one multi-device program: "language=0+1"

PerGraph = int | Mapping[str, int]  # one value for every graph, or values by graph role
DeviceIds = tuple[int, ...]
DeviceIdsSpec = DeviceIds | Mapping[str, DeviceIds]  # every graph on these ids, or ids by graph role


def _positive(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must be a positive integer, got {value!r}")
    return value


def _check_roles(roles: Iterable[str], what: str) -> None:
    unknown = sorted(set(roles) - set(GRAPHS))
    if unknown:
        raise ValueError(f"{what} names {unknown}, which are not graphs of an export; the graphs are "
                         f"{', '.join(GRAPHS)}")


def per_graph(value: PerGraph | None, defaults: Mapping[str, int], what: str) -> dict[str, int]:
    """``value`` for every graph role: an int for all, a mapping for the roles it names (the rest from
    ``defaults``), None for ``defaults``. Every value a positive integer; every role a graph of ``GRAPHS``."""
    if value is None:
        resolved = dict(defaults)
    elif isinstance(value, Mapping):
        _check_roles(value, what)
        resolved = {**defaults, **value}
    else:
        resolved = dict.fromkeys(GRAPHS, _positive(value, what))
    return {graph: _positive(resolved[graph], f"{what} of the {graph} graph") for graph in GRAPHS}


def _split_roles(text: str, what: str) -> tuple[str | None, dict[str, str]]:
    """``"v"`` -> ``("v", {})``; ``"a=1,b=2"`` -> ``(None, {"a": "1", "b": "2"})``."""
    entries = [e.strip() for e in text.split(",") if e.strip()]
    if not entries:
        raise ValueError(f"{what} is empty; give a value for every graph or role=value pairs")
    if len(entries) == 1 and "=" not in entries[0]:
        return entries[0], {}
    pairs: dict[str, str] = {}
    for entry in entries:
        role, sep, value = (part.strip() for part in entry.partition("="))
        if not sep or not role or not value:
            raise ValueError(f"{what} {text!r}: {entry!r} is not role=value (e.g. "
                             f"{GRAPHS[0]}=1,{GRAPHS[-1]}=2); or give one value for every graph")
        if role in pairs:
            raise ValueError(f"{what} {text!r} names the {role} graph twice")
        pairs[role] = value
    _check_roles(pairs, f"{what} {text!r}")
    return None, pairs


def _int(text: str, what: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{what}: {text!r} is not an integer") from None


def parse_per_graph(text: str, what: str) -> PerGraph:
    """``"16"`` -> 16; ``"encoder=6,language=9"`` -> ``{"encoder": 6, "language": 9}`` (checked)."""
    every, pairs = _split_roles(text, what)
    if every is not None:
        return _positive(_int(every, what), what)
    return {role: _positive(_int(value, what), f"{what} of the {role} graph") for role, value in pairs.items()}


def _device_list(value: object, what: str) -> DeviceIds:
    if isinstance(value, str):
        parts = [p.strip() for p in value.split(DEVICE_SEPARATOR)]
        value = [_int(p, what) for p in parts]
    elif isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    if not isinstance(value, Sequence) or not value:
        raise ValueError(f"{what} must be device ids (e.g. 0, or 0{DEVICE_SEPARATOR}1), got {value!r}")
    ids = []
    for v in value:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{what}: device id {v!r} is not a non-negative integer")
        ids.append(v)
    if len(set(ids)) != len(ids):
        raise ValueError(f"{what} lists device {ids} with a repeat; a program's devices are distinct")
    return tuple(ids)


def parse_device_ids(value: str | int | Sequence[int] | Mapping[str, object], what: str = "device ids"
                     ) -> DeviceIdsSpec:
    """Device ids from text (``"0"``, ``"0+1"``, ``"encoder=1,language=0+2"``), an int, a list of ints, or
    a mapping of graph role to any of those (``--additional-config``'s JSON)."""
    if isinstance(value, Mapping):
        _check_roles(value, what)
        return {role: _device_list(ids, f"{what} of the {role} graph") for role, ids in value.items()}
    if isinstance(value, str):
        every, pairs = _split_roles(value, what)
        if every is not None:
            return _device_list(every, what)
        return {role: _device_list(ids, f"{what} of the {role} graph") for role, ids in pairs.items()}
    return _device_list(value, what)


@dataclass(frozen=True)
class CompiledGraph:
    """What one graph's program was compiled for (``placement.json``)."""

    num_cores: int  # -aic-num-cores: cores it holds on each of its devices while activated
    num_devices: int = 1  # > 1: a multi-device (MDP) program, opened on that many device ids


def write_placement_record(export_dir: str | Path, cores: Mapping[str, int], devices: Mapping[str, int]) -> Path:
    """``placement.json``: each graph's cores and devices, as ``compile.sh`` compiles it."""
    record = {"graphs": {graph: {"num_cores": cores[graph], "num_devices": devices[graph]} for graph in GRAPHS}}
    path = Path(export_dir) / PLACEMENT_FILE
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path


def read_placement_record(export_dir: str | Path) -> dict[str, CompiledGraph]:
    """The cores and devices each graph was compiled for; ValueError naming the fix when unknown."""
    path = Path(export_dir) / PLACEMENT_FILE
    if not path.is_file():
        raise ValueError(f"{path} not found: the export does not say how many cores each program was compiled "
                         f"for; run `qeff-evs compile {export_dir}` again (it writes {PLACEMENT_FILE} with "
                         "compile.sh)")
    graphs = json.loads(path.read_text())["graphs"]
    missing = [graph for graph in GRAPHS if graph not in graphs]
    if missing:
        raise ValueError(f"{path} lists no cores for the {', '.join(missing)} graph(s); run "
                         f"`qeff-evs compile {export_dir}` again")
    return {graph: CompiledGraph(_positive(graphs[graph]["num_cores"], f"{path}: num_cores of {graph}"),
                                 _positive(graphs[graph]["num_devices"], f"{path}: num_devices of {graph}"))
            for graph in GRAPHS}


@dataclass(frozen=True)
class ProgramPlacement:
    """One program on its devices: it holds ``num_cores`` cores on each of ``device_ids`` while active."""

    graph: str
    num_cores: int
    device_ids: DeviceIds


def place_programs(compiled: Mapping[str, CompiledGraph], device_ids: DeviceIdsSpec | None = None,
                   graphs: Sequence[str] = GRAPHS) -> list[ProgramPlacement]:
    """The placement of ``graphs``: device ids as given, else ``0 .. num_devices-1``; each program on as
    many ids as it was compiled for."""
    if isinstance(device_ids, Mapping):
        _check_roles(device_ids, "device ids")
    placements = []
    for graph in graphs:
        program = compiled[graph]
        default = tuple(range(program.num_devices))
        ids = (device_ids.get(graph, default) if isinstance(device_ids, Mapping)
               else default if device_ids is None else tuple(device_ids))
        if len(ids) != program.num_devices:
            raise ValueError(
                f"the {graph} program was compiled for {program.num_devices} device(s) but is given "
                f"{len(ids)}: {DEVICE_SEPARATOR.join(map(str, ids))}; give it {program.num_devices} id(s) "
                f"(e.g. {graph}={DEVICE_SEPARATOR.join(map(str, default))}) or compile it with "
                f"--num-devices {graph}={len(ids)}")
        placements.append(ProgramPlacement(graph, program.num_cores, ids))
    return placements


def check_device_cores(placements: Sequence[ProgramPlacement], device_cores: int = DEVICE_CORES) -> None:
    """Refuse a placement whose programs need more cores on a device than it has (all stay active)."""
    load: dict[int, list[ProgramPlacement]] = {}
    for placement in placements:
        for device in placement.device_ids:
            load.setdefault(device, []).append(placement)
    for device, programs in sorted(load.items()):
        used = sum(p.num_cores for p in programs)
        if used > device_cores:
            parts = " + ".join(f"{p.graph} {p.num_cores}" for p in programs)
            moved = programs[-1]  # e.g. the last one to the next free ids, as many as it was compiled for
            elsewhere = DEVICE_SEPARATOR.join(str(max(load) + 1 + i) for i in range(len(moved.device_ids)))
            raise ValueError(
                f"device {device} would hold {parts} = {used} cores, but a device has {device_cores}; every "
                f"program stays active while serving, so the programs on one device must fit its cores "
                f"together: compile with fewer cores per graph (qeff-evs compile EXPORT --num-cores "
                f"{','.join(f'{g}={c}' for g, c in DEFAULT_GRAPH_CORES.items())} fits one device), or give "
                f"the graphs other devices (--device-ids / QEFF_EVS_DEVICE_IDS, e.g. {moved.graph}={elsewhere})")
