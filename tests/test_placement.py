"""Placement of the export's programs (``qeff_evs.specializations.placement``): per-graph cores at compile time,
device ids at run time, and the per-device core check that refuses an over-subscribed placement.

Compile runs the real ``qeff-evs compile`` (no SDK here: it writes ``compile.sh`` and ``placement.json`` and
prints the commands); the check is read against hand-computed sums. The QAIC backend's use of all this,
on a fake card, is ``test_qaic_placement.py``.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
from pathlib import Path

import pytest

from qeff_evs.cli import main
from qeff_evs.manifest import GRAPHS, graph_role
from qeff_evs.runtime.export_bundle import open_export
from qeff_evs.runtime.sessions import sessions_for
from qeff_evs.specializations import CompileOptions
from qeff_evs.specializations.placement import (
    DEFAULT_GRAPH_CORES,
    DEVICE_CORES,
    CompiledGraph,
    ProgramPlacement,
    check_device_cores,
    parse_device_ids,
    parse_per_graph,
    place_programs,
    read_placement_record,
)


@pytest.fixture
def build(tiny_export, tmp_path) -> Path:
    folder = tmp_path / "build"
    shutil.copytree(tiny_export, folder)  # compile rewrites compile.sh, placement.json and the compile inputs
    return folder


def compiled_cores(build: Path) -> dict[str, tuple[int, str | None]]:
    """Per graph role of compile.sh: its -aic-num-cores and its -mdp-load-partition-config (None: one device);
    every method's pruning graph compiles with its role's values."""
    found = {}
    for line in (build / "compile.sh").read_text().splitlines():
        if "$QAIC_COMPILE" not in line or line.startswith("QAIC_COMPILE="):
            continue
        options = dict(a.split("=", 1) for a in shlex.split(line) if a.startswith("-") and "=" in a)
        role = graph_role(Path(options["-m"]).stem)
        partition = options.get("-mdp-load-partition-config")
        values = (int(options["-aic-num-cores"]), partition and partition.replace(Path(options["-m"]).stem, role))
        assert found.setdefault(role, values) == values, line
        found[role] = values
    return found


# --------------------------------------------------------------------------------------------------
# compile time: cores and devices per graph role


def test_default_split_fits_one_device_together():
    assert set(DEFAULT_GRAPH_CORES) == set(GRAPHS)  # keyed by graph role: a renamed graph must be placed too
    assert sum(DEFAULT_GRAPH_CORES.values()) <= DEVICE_CORES
    check_device_cores(place_programs({g: CompiledGraph(c) for g, c in DEFAULT_GRAPH_CORES.items()}))
    assert CompileOptions().cores == DEFAULT_GRAPH_CORES


def test_compile_writes_each_graphs_cores_into_compile_sh_and_placement_json(build, capsys):
    assert main(["compile", str(build)]) == 0, capsys.readouterr().err
    assert compiled_cores(build) == {graph: (cores, None) for graph, cores in DEFAULT_GRAPH_CORES.items()}
    assert read_placement_record(build) == {g: CompiledGraph(c, 1) for g, c in DEFAULT_GRAPH_CORES.items()}

    assert main(["compile", str(build), "--num-cores", "language=12,encoder=3", "--num-devices", "language=2"]) == 0
    err = capsys.readouterr().err
    assert "encoder 3 cores, pruning 1 cores, language 12 cores on each of 2 devices" in err
    assert compiled_cores(build) == {"encoder": (3, None), "pruning": (1, None),
                                     "language": (12, "language/mdp_ts_2.json")}
    partition = json.loads((build / "language" / "mdp_ts_2.json").read_text())["partitions"][0]
    assert partition["devices"] == [{"deviceId": 0, "numCores": 12}, {"deviceId": 1, "numCores": 12}]
    assert read_placement_record(build) == {"encoder": CompiledGraph(3, 1), "pruning": CompiledGraph(1, 1),
                                            "language": CompiledGraph(12, 2)}

    assert main(["compile", str(build), "--num-cores", "16"]) == 0  # one value: every graph (one per device)
    assert {cores for cores, _ in compiled_cores(build).values()} == {16}


def test_export_writes_the_same_record_as_its_compile_sh(tiny_export):
    cores = {graph: value for graph, (value, _) in compiled_cores(tiny_export).items()}
    assert {g: CompiledGraph(c, 1) for g, c in cores.items()} == read_placement_record(tiny_export)


@pytest.mark.parametrize("argv, message", [
    (["--num-cores", "vision=4"], r"--num-cores 'vision=4' names \['vision'\], which are not graphs of an export; "
                                  r"the graphs are encoder, pruning, language"),
    (["--num-cores", "language=0"], r"--num-cores of the language graph must be a positive integer, got 0"),
    (["--num-cores", "language=two"], r"--num-cores: 'two' is not an integer"),
    (["--num-cores", "language"], r"--num-cores: 'language' is not an integer"),
    (["--num-cores", "encoder=4,language"], r"'language' is not role=value"),
    (["--num-cores", "encoder=4,encoder=5"], r"names the encoder graph twice"),
    (["--num-devices", "0"], r"--num-devices must be a positive integer, got 0"),
])
def test_bad_per_graph_values_exit_2_naming_the_value(build, capsys, argv, message):
    assert main(["compile", str(build), *argv]) == 2
    err = capsys.readouterr().err
    assert re.search(message, err), err


def test_record_missing_names_the_fix(build):
    (build / "placement.json").unlink()
    with pytest.raises(ValueError, match=r"placement.json not found.*qeff-evs compile"):
        read_placement_record(build)


# --------------------------------------------------------------------------------------------------
# run time: device ids, and the per-device core check


def test_device_ids_text_and_json_forms():
    assert parse_device_ids("0") == (0,)
    assert parse_device_ids("0+1") == (0, 1)
    assert parse_device_ids(" encoder=1, pruning=1 ,language=0+2") == {"encoder": (1,), "pruning": (1,),
                                                                        "language": (0, 2)}
    assert parse_device_ids({"encoder": [1], "language": "0+2", "pruning": 1}) == {"encoder": (1,), "language": (0, 2),
                                                                                    "pruning": (1,)}
    assert parse_device_ids([3]) == (3,)
    for bad, message in [("-1", "not a non-negative integer"), ("0+0", "with a repeat"), ("gpu=0", "not graphs"),
                         ("", "is empty"), ({"language": []}, "must be device ids"), ("a", "not an integer")]:
        with pytest.raises(ValueError, match=message):
            parse_device_ids(bad)


def test_placement_defaults_and_id_counts():
    compiled = {"encoder": CompiledGraph(6), "pruning": CompiledGraph(1), "language": CompiledGraph(9, 2)}
    assert place_programs(compiled) == [ProgramPlacement("encoder", 6, (0,)), ProgramPlacement("pruning", 1, (0,)),
                                        ProgramPlacement("language", 9, (0, 1))]
    assert [p.device_ids for p in place_programs(compiled, {"encoder": (3,), "language": (2, 5)})] == \
        [(3,), (0,), (2, 5)]
    with pytest.raises(ValueError, match=r"the language program was compiled for 2 device\(s\) but is given 1: 4; "
                                         r"give it 2 id\(s\) \(e.g. language=0\+1\)"):
        place_programs(compiled, {"language": (4,)})
    with pytest.raises(ValueError, match=r"the language program was compiled for 2 device\(s\) but is given 1"):
        place_programs(compiled, (0,))  # one id for every graph: the two-device program cannot take it


def test_over_subscribed_device_is_refused_naming_the_numbers_and_the_fix():
    placements = [ProgramPlacement("encoder", 8, (0,)), ProgramPlacement("pruning", 1, (0,)),
                  ProgramPlacement("language", 9, (0, 1))]
    with pytest.raises(ValueError) as error:
        check_device_cores(placements)
    message = str(error.value)
    assert "device 0 would hold encoder 8 + pruning 1 + language 9 = 18 cores, but a device has 16" in message
    assert "--num-cores encoder=6,pruning=1,language=9" in message
    assert "(--device-ids / QEFF_EVS_DEVICE_IDS, e.g. language=2+3)" in message  # as many ids as it needs
    check_device_cores(placements[1:])  # 10 on device 0, 9 on device 1
    check_device_cores(placements, device_cores=18)  # exactly full is fine


def test_device_ids_on_a_host_backend_are_refused(tiny_export, capsys, video_npy):
    with pytest.raises(ValueError, match=r"the ort backend does not use them: drop --device-ids"):
        sessions_for(open_export(tiny_export), "ort", device_ids=(0,))
    code = main(["run", str(tiny_export), "--video", str(video_npy), "--prompt", "hi", "--device-ids", "1"])
    assert code == 2 and "drop --device-ids" in capsys.readouterr().err
