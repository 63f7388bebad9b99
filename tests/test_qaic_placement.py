"""The QAIC backend places the export's programs on the fake card of ``test_qaic_session.py`` (devices with
cores and memory; every load, activation, deactivation and unload recorded).

Checks: every program is loaded and activated once and stays active across requests, then is deactivated
and unloaded on close (single-request engine, ``qeff-evs run``, the vLLM worker's shutdown); an
over-subscribed placement is refused before anything is loaded, and the same programs spread over two
devices run; the fake card itself refuses an activation past a device's cores and a load past its memory
(so a placement the host check missed would still fail here); a program compiled for two devices opens on
two ids (``devMapping``); the data-path timeout is set on every program.
"""

from __future__ import annotations

import shutil
import sys
import types
from pathlib import Path

import pytest

from qeff_evs.cli import main
from qeff_evs.manifest import graph_role
from qeff_evs.runtime.backends.qaic import QaicProgram, load_sdk, qpc_dir
from qeff_evs.runtime.backends.qaic_device import DATA_PATH_TIMEOUT_MS
from qeff_evs.runtime.builders import answer, build_engine
from qeff_evs.runtime.export_bundle import open_export
from qeff_evs.runtime.media import video_from_file
from qeff_evs.runtime.sessions import sessions_for
from qeff_evs.specializations.placement import DEFAULT_GRAPH_CORES
from test_qaic_session import DEVICE_MEMORY, FakeDevice, build_fake_sdk, fake_compile

QUESTION = "What happens in this video?"
# The roles a deployment loads, in load order: the encoder, its method's pruning graph (evs by default), language.
GRAPH_ORDER = ("encoder", "pruning", "language")
COMPILED = ("encoder", "pruning_evs", "pruning_vidcom2", "language")  # every graph of the export


def compile_for_the_card(export: Path, *compile_args: str) -> Path:
    """``qeff-evs compile`` (no SDK here: it writes compile.sh and placement.json), then the fake's compile."""
    assert main(["compile", str(export), *compile_args]) == 0
    for graph in COMPILED:
        fake_compile(export, graph)
    return export


@pytest.fixture
def build(tiny_export, tmp_path) -> Path:
    """The session export, compiled with the default split (every program on one 16-core device)."""
    folder = tmp_path / "build"
    shutil.copytree(tiny_export, folder)
    return compile_for_the_card(folder)


@pytest.fixture
def device(monkeypatch) -> FakeDevice:
    fake = FakeDevice()
    rt, api = build_fake_sdk(fake)
    monkeypatch.setitem(sys.modules, "qaicrt", rt)
    monkeypatch.setitem(sys.modules, "QAicApi_pb2", api)
    return fake


def events_by_graph(device: FakeDevice) -> list[tuple[str, str, tuple[int, ...]]]:
    """``(what, role, devices)`` of every program event, graphs named by their QPC folder's role."""
    def graph(qpc: str) -> str:
        name = Path(qpc).name
        return "language" if name == "qpc" else graph_role(name.removesuffix("_qpc"))
    return [(what, graph(qpc), devices) for what, qpc, devices in device.events]


def opened(device: FakeDevice, placement: dict[str, tuple[int, ...]]) -> list[tuple[str, str, tuple[int, ...]]]:
    return [(what, graph, placement[graph]) for graph in GRAPH_ORDER for what in ("load", "activate")]


def released(device: FakeDevice, placement: dict[str, tuple[int, ...]]) -> list[tuple[str, str, tuple[int, ...]]]:
    return [(what, graph, placement[graph]) for graph in GRAPH_ORDER for what in ("deactivate", "unload")]


def test_programs_stay_active_across_requests_and_are_released_on_close(build, device, video_npy):
    bundle = open_export(build)
    engine = build_engine(bundle, "qaic", max_new_tokens=4)
    on_device_0 = dict.fromkeys(GRAPH_ORDER, (0,))
    assert events_by_graph(device) == opened(device, on_device_0)
    assert device.cores_used == {0: sum(DEFAULT_GRAPH_CORES.values())} == {0: 16}
    assert device.timeouts == [DATA_PATH_TIMEOUT_MS] * 3
    video = video_from_file(video_npy, bundle)
    first = answer(bundle, engine, video, QUESTION)
    second = answer(bundle, engine, video, QUESTION)
    assert second.generated_token_ids == first.generated_token_ids
    assert events_by_graph(device) == opened(device, on_device_0)  # no swapping between or within requests
    engine.close()
    assert events_by_graph(device)[6:] == released(device, on_device_0)
    assert device.cores_used == {0: 0} and device.memory_used == {0: 0}
    engine.close()  # idempotent
    assert len(device.events) == 12
    with pytest.raises(ValueError, match=r"was released \(close\)"):
        answer(bundle, engine, video, QUESTION)


def test_over_subscribed_placement_is_refused_before_loading_and_runs_spread(build, device, video_npy):
    compile_for_the_card(build, "--num-cores", "encoder=8")  # 8 + 1 + 9 = 18 cores on device 0
    bundle = open_export(build)
    with pytest.raises(ValueError, match=r"device 0 would hold encoder 8 \+ pruning 1 \+ language 9 = 18 cores, but a "
                                         r"device has 16.*--num-cores.*e\.g\. language=1\)"):
        sessions_for(bundle, "qaic")
    assert device.events == [] and device.calls == []  # nothing was loaded

    spread = {"encoder": (0,), "pruning": (0,), "language": (1,)}
    expected = answer(bundle, build_engine(bundle, "ort", max_new_tokens=4), video_from_file(video_npy, bundle),
                      QUESTION)
    engine = build_engine(bundle, "qaic", max_new_tokens=4, device_ids={"language": (1,)})
    assert events_by_graph(device) == opened(device, spread)
    assert device.cores_used == {0: 9, 1: 9}
    got = answer(bundle, engine, video_from_file(video_npy, bundle), QUESTION)
    assert got.generated_token_ids == expected.generated_token_ids
    engine.close()
    assert device.cores_used == {0: 0, 1: 0}


def test_the_fake_card_refuses_past_a_devices_cores_and_memory(build, device):
    """Without the host's check, the card itself fails the activation that over-subscribes a device."""
    compile_for_the_card(build, "--num-cores", "encoder=8")
    bundle, sdk = open_export(build), load_sdk()
    programs = [QaicProgram(qpc_dir(bundle, graph), sdk) for graph in ("encoder", "pruning_evs")]  # 9 of 16 cores
    with pytest.raises(RuntimeError, match=r"activating .*language/qpc on device\(s\) \[0\] failed .*lack free "
                                           r"memory or cores"):
        QaicProgram(qpc_dir(bundle, "language"), sdk)
    assert device.cores_used == {0: 9}
    assert events_by_graph(device)[-1] == ("unload", "language", (0,))  # the failed one gave its memory back
    for program in programs:
        program.close()

    fake_compile(build, "language", size_bytes=DEVICE_MEMORY + 1)
    with pytest.raises(RuntimeError, match=r"loading .*language/qpc onto device\(s\) \[1\] failed"):
        QaicProgram(qpc_dir(bundle, "language"), sdk, (1,))
    assert device.memory_used == {0: 0}  # nothing taken on device 1 either


def test_multi_device_program_opens_on_as_many_ids(build, device, video_npy):
    compile_for_the_card(build, "--num-devices", "language=2")
    bundle = open_export(build)
    with pytest.raises(ValueError, match=r"the language program was compiled for 2 device\(s\) but is given 1"):
        sessions_for(bundle, "qaic", device_ids={"language": (1,)})
    assert device.events == []
    engine = build_engine(bundle, "qaic", max_new_tokens=4)  # default ids: 0 for one device, 0+1 for two
    placement = {"encoder": (0,), "pruning": (0,), "language": (0, 1)}
    assert events_by_graph(device) == opened(device, placement)
    assert device.cores_used == {0: 16, 1: 9}
    expected = answer(bundle, build_engine(bundle, "ort", max_new_tokens=4), video_from_file(video_npy, bundle),
                      QUESTION)
    got = answer(bundle, engine, video_from_file(video_npy, bundle), QUESTION)
    assert got.generated_token_ids == expected.generated_token_ids
    engine.close()


def test_run_command_places_by_device_ids_and_releases(build, device, video_npy, capsys):
    code = main(["run", str(build), "--video", str(video_npy), "--prompt", QUESTION, "--backend", "qaic",
                 "--device-ids", "encoder=1,pruning=1,language=0", "--max-new-tokens", "3", "--json"])
    assert code == 0, capsys.readouterr().err
    placement = {"encoder": (1,), "pruning": (1,), "language": (0,)}
    assert events_by_graph(device) == opened(device, placement) + released(device, placement)
    assert main(["run", str(build), "--video", str(video_npy), "--prompt", QUESTION, "--backend", "qaic",
                 "--device-ids", "language=0+1"]) == 2
    assert "compiled for 1 device(s) but is given 2" in capsys.readouterr().err


def test_vllm_worker_places_by_config_and_releases_on_shutdown(build, device, monkeypatch):
    pytest.importorskip("vllm.v1.worker.worker_base")
    from qeff_evs.vllm.engine.worker import QeffEvsWorker, configured_device_ids

    monkeypatch.setenv("QEFF_EVS_BACKEND", "qaic")
    monkeypatch.delenv("QEFF_EVS_DEVICE_IDS", raising=False)
    worker = QeffEvsWorker.__new__(QeffEvsWorker)  # vLLM's engine would build it; only load and shutdown run here
    pruning = types.SimpleNamespace(video_pruning_method="evs", video_pruning_rate=0.5)  # vLLM's settings
    worker.model_config = types.SimpleNamespace(model=str(build), multimodal_config=pruning)
    worker.vllm_config = types.SimpleNamespace(additional_config={"device_ids": {"encoder": [1], "pruning": "1"}})
    worker.load_model()
    placement = {"encoder": (1,), "pruning": (1,), "language": (0,)}
    assert events_by_graph(device) == opened(device, placement)
    worker.shutdown()
    assert events_by_graph(device)[6:] == released(device, placement)
    worker.shutdown()  # vLLM may call it again: nothing left to release
    assert len(device.events) == 12

    monkeypatch.setenv("QEFF_EVS_DEVICE_IDS", "language=1")
    with pytest.raises(ValueError, match=r"device ids are given twice.*keep one"):
        configured_device_ids(worker.vllm_config)
    assert configured_device_ids(types.SimpleNamespace(additional_config={})) == {"language": (1,)}
