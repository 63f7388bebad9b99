"""vLLM data parallel over an export: one engine core per rank, each rank on its own sessions and devices.

``vllm serve EXPORT --data-parallel-size N`` starts N engine-core processes (vLLM's ``EngineCore_DP<r>``)
behind one API server that balances requests over them. The export is not a mixture-of-experts model, so
vLLM runs the ranks independently (each one a whole replica: its own scheduler, KV rows and sessions) and
they never talk to each other. On ONNX Runtime and torch each rank simply opens its own sessions. On QAIC
each rank loads every program of the export on its own **device group**:

* ``QEFF_EVS_DEVICE_IDS`` (or ``--additional-config '{"device_ids": ...}'``) names one group per rank on this
  host, separated by ``;``, in rank order: ``"0;1"`` puts rank 0 on device 0 and rank 1 on device 1;
  ``"encoder=0,pruning=0,language=1;encoder=2,pruning=2,language=3"`` gives each rank two devices. Each group is
  any form ``placement.parse_device_ids`` reads. Without ``;`` the value is the one group of a single rank.
* the r-th rank vLLM starts on this host (its local data-parallel rank) takes the r-th group;
* refused before anything starts, one line each: several ranks on QAIC without groups, a number of groups
  that is not the number of ranks on this host (one group for N ranks would stack N copies of every program
  on the same devices: write the group N times if that is meant), and groups whose programs need more cores
  on a device than it has, all ranks' programs counted together (``placement.check_device_cores``'s rule).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from qeff_evs.manifest import GRAPHS
from qeff_evs.specializations.placement import (
    DEVICE_CORES,
    PLACEMENT_FILE,
    CompiledGraph,
    DeviceIdsSpec,
    ProgramPlacement,
    parse_device_ids,
    place_programs,
    read_placement_record,
)
from qeff_evs.vllm.activation import active_backend, logger
from qeff_evs.vllm.plugin import DEVICE_IDS_ENV, DEVICE_IDS_KEY, RANKS_KEY

RANK_SEPARATOR = ";"  # between the device groups of data-parallel ranks: "0;1"


def parse_device_groups(value: object, what: str) -> tuple[DeviceIdsSpec, ...]:
    """One device-ids spec per rank: ``"0;1"`` -> ``((0,), (1,))``; a value without ``;`` is one group."""
    if isinstance(value, str) and RANK_SEPARATOR in value:
        parts = [part.strip() for part in value.split(RANK_SEPARATOR)]
        if any(not part for part in parts):
            raise ValueError(f"{what} {value!r} has an empty device group; give one group per data-parallel rank, "
                             f"separated by '{RANK_SEPARATOR}' (e.g. 0{RANK_SEPARATOR}1)")
        return tuple(parse_device_ids(part, f"{what} (group {rank})") for rank, part in enumerate(parts))
    return (parse_device_ids(value, what),)


def configured_device_groups(vllm_config) -> tuple[tuple[DeviceIdsSpec, ...], str] | None:
    """The device groups of ``QEFF_EVS_DEVICE_IDS`` or of ``--additional-config``'s ``device_ids`` (not both),
    with the name of where they came from; None when neither is given."""
    from_env = os.environ.get(DEVICE_IDS_ENV, "").strip()
    additional = getattr(vllm_config, "additional_config", None)
    from_config = additional.get(DEVICE_IDS_KEY) if isinstance(additional, dict) else None
    if from_env and from_config is not None:
        raise ValueError(f"device ids are given twice, {DEVICE_IDS_ENV}={from_env!r} and --additional-config "
                         f"{DEVICE_IDS_KEY}={from_config!r}; keep one")
    if from_env:
        return parse_device_groups(from_env, DEVICE_IDS_ENV), DEVICE_IDS_ENV
    if from_config is not None:
        what = f"--additional-config {DEVICE_IDS_KEY}"
        return parse_device_groups(from_config, what), what
    return None


def local_ranks(vllm_config) -> int:
    """How many data-parallel ranks vLLM runs on this host (1 without data parallel), as the platform saw it.

    The platform sees the whole deployment (``--data-parallel-size-local``, which defaults to
    ``--data-parallel-size``) only where vLLM builds its config; in each rank's engine-core process vLLM makes
    the rank a replica of size 1. So :func:`record_local_ranks` writes the count into ``additional_config``,
    which vLLM hands to every process it starts, and every later reading takes it from there.
    """
    additional = getattr(vllm_config, "additional_config", None)
    if isinstance(additional, dict) and RANKS_KEY in additional:
        return int(additional[RANKS_KEY])
    parallel = getattr(vllm_config, "parallel_config", None)
    if parallel is None or parallel.data_parallel_size <= 1:
        return 1
    return parallel.data_parallel_size_local


def record_local_ranks(vllm_config) -> None:
    """Keep :func:`local_ranks` for the processes vLLM starts (the platform calls it where the config is made)."""
    if isinstance(vllm_config.additional_config, dict):
        vllm_config.additional_config.setdefault(RANKS_KEY, local_ranks(vllm_config))


def local_rank(vllm_config) -> int:
    """This engine core's data-parallel rank on this host (0 without data parallel).

    vLLM sets ``data_parallel_rank_local`` in each rank's engine-core process before it makes the rank an
    independent replica (``reconfigure_for_independent_dp_rank`` resets the sizes, not this).
    """
    parallel = getattr(vllm_config, "parallel_config", None)
    return 0 if parallel is None or local_ranks(vllm_config) <= 1 else parallel.data_parallel_rank_local


def configured_device_ids(vllm_config) -> DeviceIdsSpec | None:
    """The device ids this engine core's programs open on: its rank's group (the only group outside data
    parallel), or None when none are configured."""
    configured = configured_device_groups(vllm_config)
    if configured is None:
        return None
    groups, what = configured
    ranks = local_ranks(vllm_config)
    if len(groups) != ranks:
        raise ValueError(group_count_problem(what, len(groups), ranks))
    return groups[local_rank(vllm_config)]


def group_count_problem(what: str, groups: int, ranks: int) -> str:
    example = RANK_SEPARATOR.join(str(r) for r in range(ranks))
    return (f"{what} names {groups} device group(s) for {ranks} data-parallel rank(s) on this host; give one group "
            f"per rank, '{RANK_SEPARATOR}'-separated (e.g. '{example}'; repeat a group to share its devices on "
            "purpose)")


def log_rank(vllm_config, device_ids: DeviceIdsSpec | None) -> None:
    """One line per data-parallel rank at start-up: its index, process and devices (users find their ranks
    by it; vLLM's ``/metrics`` counts each rank's requests under ``engine="<rank>"``)."""
    if local_ranks(vllm_config) > 1:
        where = "" if device_ids is None else f" on device ids {device_ids}"
        logger.info("qeff-evs data-parallel rank %d (pid %d) opens its own %s sessions%s", local_rank(vllm_config),
                    os.getpid(), active_backend(), where)


def data_parallel_refusals(backend: str, ranks: int, groups: Sequence[DeviceIdsSpec] | None, what: str,
                           compiled: dict[str, CompiledGraph] | None, graphs: Sequence[str],
                           device_cores: int = DEVICE_CORES) -> list[str]:
    """Why ``ranks`` data-parallel ranks on this host cannot run with ``groups``; empty when they can.

    ``compiled`` (qaic: the export's ``placement.json``) and ``graphs`` (the programs each rank loads) let the
    cores of every rank's programs be summed per device.
    """
    if groups is None:
        if backend != "qaic" or ranks <= 1:
            return []
        example = RANK_SEPARATOR.join(str(r) for r in range(ranks))
        return [f"--data-parallel-size {ranks} on qaic: each rank loads every program of the export, so each needs "
                f"its own devices; name one device group per rank, e.g. {DEVICE_IDS_ENV}='{example}'"]
    if len(groups) != ranks:
        return [group_count_problem(what, len(groups), ranks)]
    if ranks <= 1 or compiled is None:
        return []
    try:
        placements = [place_programs(compiled, group, graphs) for group in groups]
    except ValueError as error:
        return [str(error)]
    problem = over_subscribed(placements, device_cores)
    return [problem] if problem else []


def over_subscribed(rank_placements: Sequence[Sequence[ProgramPlacement]],
                    device_cores: int = DEVICE_CORES) -> str | None:
    """The first device whose programs, from every rank, need more cores than it has; None when all fit."""
    load: dict[int, list[tuple[int, ProgramPlacement]]] = {}
    for rank, placements in enumerate(rank_placements):
        for placement in placements:
            for device in placement.device_ids:
                load.setdefault(device, []).append((rank, placement))
    for device, programs in sorted(load.items()):
        used = sum(p.num_cores for _, p in programs)
        if used > device_cores:
            parts = " + ".join(f"rank {rank}'s {p.graph} {p.num_cores}" for rank, p in programs)
            ranks = sorted({rank for rank, _ in programs})
            return (f"device {device} would hold {parts} = {used} cores, but a device has {device_cores}; every "
                    f"rank keeps all its programs active, so ranks {ranks} cannot share it: give each rank its own "
                    f"devices ({DEVICE_IDS_ENV}='0{RANK_SEPARATOR}1' for two ranks) or compile with fewer cores")
    return None


def data_parallel_problems(vllm_config) -> list[str]:
    """:func:`data_parallel_refusals` for the ranks vLLM runs on this host (:func:`local_ranks`) with the
    configured groups."""
    ranks = local_ranks(vllm_config)
    backend = active_backend()
    configured = configured_device_groups(vllm_config)
    groups, what = configured if configured is not None else (None, "")
    export_dir = Path(vllm_config.model_config.model)
    compiled = (read_placement_record(export_dir) if backend == "qaic" and groups is not None
                and (export_dir / PLACEMENT_FILE).is_file() else None)
    return data_parallel_refusals(backend, ranks, groups, what, compiled, GRAPHS)
