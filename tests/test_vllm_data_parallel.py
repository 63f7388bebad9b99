"""vLLM data parallel over an export: ``vllm serve EXPORT --data-parallel-size N``.

Through the real server (a child process): two ranks over a tiny ORT export serve 16 concurrent video requests from
the OpenAI client (Qwen2.5-VL, whose ranks vLLM runs apart; Qwen3-VL-MoE and Nemotron-H, whose configs name experts,
so vLLM steps the ranks in lockstep and a rank without requests runs a dummy batch), each one's greedy tokens equal
to our single-request engine on the same file (the reference ``test_vllm_serve`` holds the one-rank server to), and
both ranks served: vLLM's own ``/metrics`` counts requests per rank (``engine="0"``, ``engine="1"``) and each rank
logs its own process.

Without a server: device groups per rank (``QEFF_EVS_DEVICE_IDS='0;1'``) parsed, chosen by the rank vLLM
starts, and refused when missing on QAIC, miscounted, or over-subscribing a device across ranks; on the fake
card of ``test_qaic_session.py`` two ranks' workers load every program, each on its own device.
"""

from __future__ import annotations

import re
import types
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from qeff_evs.manifest import GRAPHS
from qeff_evs.specializations.placement import CompiledGraph, DEFAULT_GRAPH_CORES
from qeff_evs.vllm.engine.data_parallel import (
    RANKS_KEY,
    configured_device_ids,
    data_parallel_refusals,
    local_rank,
    local_ranks,
    parse_device_groups,
    record_local_ranks,
)
from test_qaic_placement import build, device, events_by_graph  # noqa: F401  (fixtures)

QUESTIONS = ("What happens in this video?", "Describe the square.", "Which way does it move?", "Count the frames.")


def config(rank: int, ranks: int, **additional) -> types.SimpleNamespace:
    """What a rank's engine-core process sees: vLLM made it a replica of size 1; the platform recorded the ranks."""
    parallel = types.SimpleNamespace(data_parallel_rank_local=rank, data_parallel_size=1, data_parallel_size_local=1)
    return types.SimpleNamespace(additional_config={RANKS_KEY: ranks, **additional}, parallel_config=parallel)


# --------------------------------------------------------------------------------------------------
# device groups


def test_groups_are_one_per_rank_in_rank_order():
    assert parse_device_groups("0;1", "x") == ((0,), (1,))
    assert parse_device_groups("encoder=0,pruning=0,language=1; encoder=2,pruning=2,language=3", "x") == (
        {"encoder": (0,), "pruning": (0,), "language": (1,)}, {"encoder": (2,), "pruning": (2,), "language": (3,)})
    assert parse_device_groups("language=0+1", "x") == ({"language": (0, 1)},)  # no ';': one group
    with pytest.raises(ValueError, match=r"'0;;1' has an empty device group; give one group per data-parallel rank"):
        parse_device_groups("0;;1", "x")


def test_each_rank_takes_its_group(monkeypatch):
    monkeypatch.setenv("QEFF_EVS_DEVICE_IDS", "0;1")
    assert configured_device_ids(config(0, 2)) == (0,)
    assert configured_device_ids(config(1, 2)) == (1,)
    with pytest.raises(ValueError, match=r"names 2 device group\(s\) for 1 data-parallel rank\(s\) on this host"):
        configured_device_ids(config(0, 1))
    monkeypatch.delenv("QEFF_EVS_DEVICE_IDS")
    assert configured_device_ids(config(1, 2, device_ids="encoder=2;language=3")) == {"language": (3,)}
    assert configured_device_ids(config(0, 1)) is None


def test_the_ranks_the_platform_saw_reach_every_rank():
    parallel = types.SimpleNamespace(data_parallel_size=4, data_parallel_size_local=2, data_parallel_rank_local=None)
    frontend = types.SimpleNamespace(additional_config={}, parallel_config=parallel)
    assert local_ranks(frontend) == 2  # this host runs 2 of the 4 ranks
    record_local_ranks(frontend)
    rank = config(1, 0)  # in rank 1's process vLLM has made the rank a replica of size 1
    rank.additional_config = frontend.additional_config  # vLLM hands its config to the processes it starts
    assert local_ranks(rank) == 2 and local_rank(rank) == 1
    single = types.SimpleNamespace(additional_config={}, parallel_config=types.SimpleNamespace(
        data_parallel_size=1, data_parallel_size_local=1, data_parallel_rank_local=0))
    assert local_ranks(single) == 1 and local_rank(single) == 0


COMPILED = {graph: CompiledGraph(DEFAULT_GRAPH_CORES[graph]) for graph in GRAPHS}  # 6 + 1 + 9 = 16 cores


@pytest.mark.parametrize("backend, groups, expected", [
    ("qaic", None, r"--data-parallel-size 2 on qaic: each rank loads every program .* QEFF_EVS_DEVICE_IDS='0;1'"),
    ("qaic", ((0,),), r"names 1 device group\(s\) for 2 data-parallel rank\(s\) .* '0;1'; repeat a group"),
    ("qaic", ((0,), (0,)), r"device 0 would hold rank 0's encoder 6 \+ rank 0's pruning 1 \+ rank 0's language 9 \+ "
                           r"rank 1's encoder 6 .* = 32 cores, but a device has 16"),
    ("qaic", ((0,), (0, 1)), r"the encoder program was compiled for 1 device\(s\) but is given 2"),
])
def test_a_placement_two_ranks_cannot_share_is_refused(backend, groups, expected):
    problems = data_parallel_refusals(backend, 2, groups, "QEFF_EVS_DEVICE_IDS", COMPILED, GRAPHS)
    assert len(problems) == 1 and re.search(expected, problems[0]), problems


def test_placements_that_fit_pass():
    assert data_parallel_refusals("qaic", 2, ((0,), (1,)), "x", COMPILED, GRAPHS) == []
    small = {graph: CompiledGraph(cores) for graph, cores in dict(encoder=3, pruning=1, language=4).items()}
    assert data_parallel_refusals("qaic", 2, ((0,), (0,)), "x", small, GRAPHS) == []  # 2 x 8 cores on one device
    assert data_parallel_refusals("ort", 2, None, "", None, GRAPHS) == []  # host backends: each rank its sessions
    assert data_parallel_refusals("qaic", 1, None, "", COMPILED, GRAPHS) == []


def test_the_platform_reads_ranks_and_groups_from_vllm_config(build, monkeypatch):  # noqa: F811
    from qeff_evs.vllm.engine.data_parallel import data_parallel_problems

    def serve(size: int, local: int | None = None, **additional):
        parallel = types.SimpleNamespace(data_parallel_size=size, data_parallel_size_local=local or size,
                                         data_parallel_rank_local=None)
        return types.SimpleNamespace(parallel_config=parallel, additional_config=additional,
                                     model_config=types.SimpleNamespace(model=str(build)))

    monkeypatch.setenv("QEFF_EVS_BACKEND", "qaic")
    monkeypatch.delenv("QEFF_EVS_DEVICE_IDS", raising=False)
    [line] = data_parallel_problems(serve(2))
    assert line.startswith("--data-parallel-size 2 on qaic: each rank loads every program")
    [line] = data_parallel_problems(serve(2, device_ids="0;0"))  # build's placement.json: 6 + 1 + 9 per rank
    assert line.startswith("device 0 would hold rank 0's encoder 6") and "= 32 cores" in line
    assert data_parallel_problems(serve(2, device_ids="0;1")) == []
    [line] = data_parallel_problems(serve(4, 2, device_ids="0;1;2;3"))  # this host runs 2 of the 4 ranks
    assert "names 4 device group(s) for 2 data-parallel rank(s) on this host" in line
    assert data_parallel_problems(serve(1, device_ids="0")) == []
    [line] = data_parallel_problems(serve(1, device_ids="0;1"))  # two groups, one engine
    assert "names 2 device group(s) for 1 data-parallel rank(s) on this host" in line
    monkeypatch.setenv("QEFF_EVS_BACKEND", "ort")
    assert data_parallel_problems(serve(2)) == []


def test_two_ranks_load_every_program_each_on_its_own_device(build, device, monkeypatch):  # noqa: F811
    pytest.importorskip("vllm.v1.worker.worker_base")
    from qeff_evs.vllm.engine.worker import QeffEvsWorker

    monkeypatch.setenv("QEFF_EVS_BACKEND", "qaic")
    monkeypatch.setenv("QEFF_EVS_DEVICE_IDS", "0;1")
    workers = []
    for rank in (0, 1):  # what vLLM's two engine-core processes do, here on one fake card
        worker = QeffEvsWorker.__new__(QeffEvsWorker)
        worker.model_config = types.SimpleNamespace(model=str(build), multimodal_config=None)  # pruning off
        worker.vllm_config = config(rank, 2)
        worker.load_model()
        workers.append(worker)
    loads = [(graph, devices) for what, graph, devices in events_by_graph(device) if what == "activate"]
    assert loads == [(graph, (0,)) for graph in GRAPHS] + [(graph, (1,)) for graph in GRAPHS]
    assert device.cores_used == {0: 16, 1: 16}
    for worker in workers:
        worker.shutdown()
    assert device.cores_used == {0: 0, 1: 0}


# --------------------------------------------------------------------------------------------------
# the real server: two ranks


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    from test_vllm_serve import write_mkv

    from qeff_evs.runtime.inputs.synthetic import moving_square_video

    folder = tmp_path_factory.mktemp("dp_media")
    return [write_mkv(folder / f"clip{n}.mkv", moving_square_video(frames, 120, width, seed=10 + n), fps=2)
            for n, (frames, width) in enumerate([(8, 120), (4, 170), (8, 170), (4, 120)])]


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl_moe", "nemotron_h_omni"])
def two_ranks(request, served_export, tmp_path_factory):
    pytest.importorskip("uvicorn", reason="vLLM's server packages are missing: run bash scripts/install.sh --test")
    from helpers.vllm_server import vllm_servers

    from conftest import SERVED_FULL_BATCH

    export = served_export(request.param)[1]
    log = tmp_path_factory.mktemp(f"dp_{request.param}") / "server.log"
    arguments = [str(export), "--video-pruning-rate", "0.5", "--max-num-seqs", str(SERVED_FULL_BATCH),
                 "--served-model-name", "tiny", "--data-parallel-size", "2", "--api-server-count", "1"]
    with vllm_servers([(arguments, {"QEFF_EVS_BACKEND": "ort"}, log, None)]) as (server,):
        yield export, server


def test_two_ranks_serve_16_concurrent_videos_with_single_request_tokens(two_ranks, clips):
    pytest.importorskip("openai")
    from helpers.vllm_server import openai_client
    from test_vllm_serve import video_message

    from qeff_evs.runtime.builders import answer, build_engine
    from qeff_evs.runtime.export_bundle import open_export
    from qeff_evs.runtime.media import video_from_file

    export, server = two_ranks
    client = openai_client(server.url, 300)
    requests = [(clips[n % len(clips)], QUESTIONS[n // len(clips)]) for n in range(16)]

    def one(request):
        clip, question = request
        return client.chat.completions.create(model="tiny", messages=video_message(clip, question), temperature=0,
                                              max_tokens=5, extra_body={"return_token_ids": True}).choices[0]

    with ThreadPoolExecutor(16) as pool:
        choices = list(pool.map(one, requests))

    bundle = open_export(export)
    engine = build_engine(bundle, "ort", max_new_tokens=5)
    expected = [answer(bundle, engine, video_from_file(clip, bundle), question).generated_token_ids
                for clip, question in requests]
    assert [c.token_ids for c in choices] == expected

    # Both ranks served: vLLM's per-engine request counters, and each rank's own process.
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as response:
        metrics = response.read().decode()
    served = {}
    for line in metrics.splitlines():
        if line.startswith("vllm:request_success_total{"):
            rank = re.search(r'engine="(\d+)"', line).group(1)
            served[rank] = served.get(rank, 0) + float(line.rsplit(" ", 1)[1])
    assert set(served) == {"0", "1"} and sum(served.values()) == 16 and min(served.values()) > 0, served
    pids = dict(re.findall(r"qeff-evs data-parallel rank (\d) \(pid (\d+)\)", server.log_text()))
    assert set(pids) == {"0", "1"} and pids["0"] != pids["1"]
