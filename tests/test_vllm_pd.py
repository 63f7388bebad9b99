"""Prefill/decode disaggregation through vllm-router: qeff-evs's KV connector between real instances.

Per family (Qwen2.5-VL, Qwen3-VL, Qwen3.5, their MoE, Nemotron-H), one prefill instance (``kv_producer``: vision
graphs and the language graph's prefill calls) and one decode instance (``kv_consumer``: one-token calls, no vision
graph) of the tiny served export, behind the real ``vllm-router --vllm-pd-disaggregation``. Checks:

* greedy tokens equal ``qeff-evs run`` on the same file (what one instance gives: ``test_vllm_serve``), at q 0 and
  0.75 on the same instances (per-request ``mm_processor_kwargs``);
* each hand-over carries exactly the prompt's first N-1 slots of every KV layer (and, for the hybrid families, every
  layer's state: Qwen3.5's conv and recurrent, Nemotron-H's conv and SSM): its bytes follow the kept tokens;
* a request aborted on the decode instance while its pull is in flight ends there, the instance writes nothing and
  serves the next requests (tokens equal);
* a decode instance killed mid-stream and started again: the next requests through the router are served.
Without servers: the hand-over's arrays against the row they came from, the outbox's lease, the start-up and
per-request refusals.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import threading
import time
import types
from pathlib import Path

import numpy as np
import pytest

from qeff_evs.manifest import LanguageShape, LayerState
from qeff_evs.models.graph_io import state_shapes
from qeff_evs.vllm.kv_connector import handover as kv_handover
from qeff_evs.vllm.kv_connector import transport as kv_transport

FAMILIES = ("qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_vl_moe", "qwen3_5_moe", "nemotron_h_omni")
RATES = (0.0, 0.75)
NEW_TOKENS = 5
KV = '"kv_connector": "QeffEvsKVConnector"'


# --------------------------------------------------------------------------------------------------
# the hand-over without servers


def shape(layer_states: bool = False) -> LanguageShape:
    states = (LayerState("conv_state", (1,), (6, 3)), LayerState("recurrent_state", (1,), (2, 4, 4), "float32"))
    return LanguageShape(num_layers=2, kv_heads=2, head_dim=4, hidden=8, ctx_len=32, vision_size=16,
                         full_batch_size=3, kv_layers=(0,) if layer_states else None,
                         layer_states=states if layer_states else ())


@pytest.mark.parametrize("layer_states", [False, True])
def test_a_hand_over_is_the_rows_first_slots_and_its_layer_states(layer_states):
    s = shape(layer_states)
    rng = np.random.default_rng(0)
    state = {name: rng.standard_normal(dims).astype(np.float32) for name, dims in state_shapes(s).items()}
    handover = kv_handover.from_bytes(kv_handover.to_bytes(kv_handover.take_row(state, s, 1, range(7))))
    kv_names = [f"past_key.{i}" for i in ((0,) if layer_states else (0, 1))]
    for name in kv_names:
        np.testing.assert_array_equal(handover.arrays[name], state[name][1, :, :7])
    if layer_states:
        assert sorted(handover.arrays) == ["conv_state.1", "past_key.0", "past_value.0", "recurrent_state.1"]
        np.testing.assert_array_equal(handover.arrays["recurrent_state.1"], state["recurrent_state.1"][1])
    # per slot: keys and values of every KV layer; plus each layer state whole
    per_slot = 2 * len(kv_names) * s.kv_heads * s.head_dim * 4
    assert handover.nbytes == 7 * per_slot + (4 * (6 * 3 + 2 * 4 * 4) if layer_states else 0)
    target = {name: np.zeros_like(a) for name, a in state.items()}
    kv_handover.put_row(target, s, 2, handover)
    for name in handover.arrays:
        written = target[name][2, :, :7] if name.startswith("past_") else target[name][2]
        np.testing.assert_array_equal(written, handover.arrays[name])
        assert not target[name][[0, 1]].any()  # no other row touched
        if name.startswith("past_"):
            assert not target[name][2, :, 7:].any()  # nothing past the hand-over's slots


def test_a_hand_over_of_another_export_is_refused_before_anything_is_written():
    s = shape()
    state = {name: np.zeros(dims, np.float32) for name, dims in state_shapes(s).items()}
    handover = kv_handover.take_row(state, s, 0, range(5))
    wider = dict(handover.arrays, **{"past_key.1": np.zeros((2, 5, 8), np.float32)})
    with pytest.raises(ValueError, match=r"past_key.1: the prefill instance handed over float32\[2, 5, 8\], a row "
                                         r"here takes float32\[2, 5, 4\]"):
        kv_handover.put_row(state, s, 1, kv_handover.RowHandover(handover.token_ids, wider))
    with pytest.raises(ValueError, match=r"handed over \['past_key.0', 'past_value.0'\], this export's rows hold"):
        kv_handover.put_row(state, s, 1, kv_handover.RowHandover(handover.token_ids, {
            k: v for k, v in handover.arrays.items() if k.endswith(".0")}))
    with pytest.raises(ValueError, match="not 'qeff-evs kv row 1': serve qeff-evs's QeffEvsKVConnector"):
        from safetensors.numpy import save

        kv_handover.from_bytes(save({"x": np.zeros(1)}, metadata={"format": "other"}))


def test_the_outbox_serves_a_hand_over_once_and_drops_what_nobody_pulls():
    outbox = kv_transport.Outbox(lease_s=0.3)
    server = kv_transport.OutboxServer(outbox, "127.0.0.1", 0)
    try:
        outbox.put("a", b"x" * 100_000)
        outbox.put("b", b"y")
        assert kv_transport.pull("127.0.0.1", server.port, "a", 5) == b"x" * 100_000
        with pytest.raises(ConnectionError, match="holds no hand-over for a: never kept, pulled already, or older"):
            kv_transport.pull("127.0.0.1", server.port, "a", 5)  # one pull per request
        assert outbox.held == {"b": 1}
        time.sleep(0.5)
        assert outbox.held == {}  # nobody pulled b: its lease ran out, with no pull or step to notice it
        outbox.put("c", b"z")
        outbox.discard(["c"])  # an aborted prompt
        with pytest.raises(ConnectionError, match="holds no hand-over for c"):
            kv_transport.pull("127.0.0.1", server.port, "c", 5)
    finally:
        server.close()
    with pytest.raises(ConnectionError, match=f"hand-over server 127.0.0.1:{server.port} failed for d: "
                                              "ConnectionRefusedError"):
        kv_transport.pull("127.0.0.1", server.port, "d", 5)


def vllm_config(connector: str = "QeffEvsKVConnector", role: str = "kv_producer", dp: int = 1, ec: bool = False):
    kv = types.SimpleNamespace(kv_connector=connector, kv_role=role)
    return types.SimpleNamespace(kv_transfer_config=kv, parallel_config=types.SimpleNamespace(data_parallel_size=dp),
                                 ec_transfer_config=types.SimpleNamespace(ec_connector="QeffEvsECConnector") if ec
                                 else None)


def test_what_prefill_decode_disaggregation_cannot_serve_is_refused_one_line_each():
    from qeff_evs.vllm.kv_connector.config import kv_refusals

    assert kv_refusals(vllm_config(), "ort") == [] and kv_refusals(vllm_config(role="kv_consumer"), "torch") == []
    assert kv_refusals(types.SimpleNamespace(kv_transfer_config=None), "qaic") == []
    [line] = kv_refusals(vllm_config("NixlConnector"), "ort")
    assert line.startswith("kv_connector 'NixlConnector': an export's KV rows live in its language graph's retained "
                           "state, which only qeff-evs's connector reads and writes; pass \"kv_connector\": "
                           "\"QeffEvsKVConnector\"")
    [line] = kv_refusals(vllm_config(role="kv_both"), "ort")
    assert line.startswith("kv_role 'kv_both': a qeff-evs instance either prefills")
    [line] = kv_refusals(vllm_config(), "qaic")
    assert line.startswith("KV transfer on the qaic backend:")
    assert len(kv_refusals(vllm_config(dp=2, ec=True), "ort")) == 2


def test_each_side_refuses_what_it_cannot_run_per_request():
    from vllm import SamplingParams

    from qeff_evs.vllm.engine.platform import kv_role_refusals

    asked = {"do_remote_decode": True}
    assert kv_role_refusals("kv_producer", SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": asked})) == []
    [line] = kv_role_refusals("kv_producer", SamplingParams(max_tokens=5, extra_args={"kv_transfer_params": asked}))
    assert line.startswith("max_tokens=5: this instance is a kv_producer (prefill programs only)")
    [line] = kv_role_refusals("kv_producer", SamplingParams(max_tokens=1))
    assert line.startswith("kv_transfer_params None: this kv_producer hands each prompt's KV row")
    [line] = kv_role_refusals("kv_consumer", SamplingParams(max_tokens=5))
    assert "kv_consumer (one-token programs only) and computes no prompt" in line
    answer = {"do_remote_prefill": True, "remote_host": "h", "remote_port": 1, "remote_request_id": "r"}
    assert kv_role_refusals("kv_consumer", SamplingParams(max_tokens=5, extra_args={"kv_transfer_params": answer})) == []
    [line] = kv_role_refusals("kv_consumer", SamplingParams(max_tokens=5, extra_args={"kv_transfer_params": {
        "do_remote_prefill": True, "remote_host": "h"}}))
    assert "(do_remote_prefill with remote_host, remote_port, remote_request_id)" in line
    assert kv_role_refusals(None, SamplingParams(max_tokens=5)) == []


ALL_FAMILIES = ("qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_vl_moe", "qwen3_5_moe", "nemotron_h_omni")


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_every_family_decodes_from_a_hand_over_as_one_instance(family, served_export, tmp_path):
    """The hand-over without vLLM, every family (MoE and Nemotron-H included): a prefill-side executor runs the
    prompt's first N-1 tokens (vision graphs, pruning, chunks) and hands its row over, through the wire form, into
    another row of a decode-side session (Qwen3.5: the decode-only graph); that one runs the last prompt token as a
    one-token call and decodes. Tokens equal ``qeff-evs run`` at q 0 and 0.75; every layer state is handed over."""
    from test_vllm_serve import write_mkv

    from qeff_evs.models.pruning import VideoPruning
    from qeff_evs.runtime.builders import answer, build_engine, engine_config
    from qeff_evs.runtime.engine.executor import Executor
    from qeff_evs.runtime.export_bundle import open_export
    from qeff_evs.runtime.inputs.prompt import video_question_pieces
    from qeff_evs.runtime.inputs.synthetic import moving_square_video
    from qeff_evs.runtime.media import video_from_file
    from qeff_evs.runtime.sessions import language_session, vision_pipeline

    bundle = open_export(served_export(family)[1])
    shape = bundle.language_shape
    question = "What happens in this video?"
    clip = write_mkv(tmp_path / "clip.mkv", moving_square_video(8, 128, 128, seed=5), fps=2)
    media = video_from_file(clip, bundle)
    pieces = video_question_pieces(bundle.tokenizer, question, bundle.family.token_strings)
    for rate in RATES:
        config = engine_config(bundle, VideoPruning("evs", rate))
        prefill = Executor(bundle.family, vision_pipeline(bundle, "ort"),
                           language_session(bundle, "ort", programs="prefill"), config)
        decode = Executor(bundle.family, None, language_session(bundle, "ort", programs="decode"), config)
        plan = prefill.plan(pieces, [media])
        n = len(plan.ids) - 1
        prefill.add("r", plan, [media], prefill.media_hashes([media]))
        prefill.encode("r", 0)
        for start in range(0, n, config.prefill_seq_len):
            prefill.prefill_logits("r", start, min(config.prefill_seq_len, n - start), cache_row=1)
        handover = kv_handover.take_row(prefill.language.state, shape, 1, plan.ids[:n])
        decode.add("r", decode.plan(pieces, [media]), [media], decode.media_hashes([media]))
        kv_handover.put_row(decode.language.state, shape, 2, kv_handover.from_bytes(kv_handover.to_bytes(handover)))
        tokens = [int(np.argmax(decode.prompt_tail_logits("r", n, cache_row=2)))]
        decode.accept("r", tokens[0])
        while len(tokens) < NEW_TOKENS:
            tokens.append(decode.decode([("r", n + len(tokens))])["r"])
        engine = build_engine(bundle, "ort", max_new_tokens=NEW_TOKENS, pruning=VideoPruning("evs", rate))
        expected = answer(bundle, engine, media, question)
        assert expected.generated_token_ids and tokens[:len(expected.generated_token_ids)] == \
            expected.generated_token_ids, (family, rate)
        states = {f"{state.name}.{i}" for state in shape.layer_states for i in state.layers}
        assert states <= set(handover.arrays), (family, states - set(handover.arrays))


class Request(types.SimpleNamespace):
    """What the connector reads of a vLLM ``Request``."""


def connector(role: str, rows=None):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from qeff_evs.vllm.kv_connector.connector import QeffEvsKVConnector

    kv = types.SimpleNamespace(kv_connector="QeffEvsKVConnector", kv_role=role, engine_id="engine-p",
                               is_kv_producer=role == "kv_producer", kv_connector_extra_config={"kv_port": 4242})
    made = QeffEvsKVConnector(types.SimpleNamespace(kv_transfer_config=kv), KVConnectorRole.SCHEDULER)
    made.rows = rows
    return made


def test_the_scheduler_side_speaks_the_routers_kv_transfer_params():
    """Prefill side: a request asked with do_remote_decode is cut at N-1 and answered with where its hand-over waits
    (NIXL's key names, which vllm-router copies to the decode side); an aborted one is dropped from the outbox.
    Decode side: the hit is N-1 tokens, loaded asynchronously into the row the scheduler claimed (held there), once."""
    from vllm.v1.request import RequestStatus

    from qeff_evs.vllm.engine.kv_rows import RowBook

    p = connector("kv_producer")
    asked = Request(request_id="a", num_prompt_tokens=40, kv_transfer_params={"do_remote_decode": True},
                    status=RequestStatus.FINISHED_LENGTH_CAPPED)
    assert p.get_num_new_matched_tokens(asked, 0) == (0, False)
    p.update_state_after_alloc(asked, None, 0)
    assert p.build_connector_meta(None).keep == {"a": 39} and p.build_connector_meta(None).keep == {}
    delay, params = p.request_finished(asked, [1])
    assert not delay and params == dict(do_remote_prefill=True, do_remote_decode=False, remote_engine_id="engine-p",
                                        remote_request_id="a", remote_host="127.0.0.1", remote_port=4242,
                                        remote_block_ids=[], remote_num_tokens=39, tp_size=1)
    aborted = Request(request_id="b", num_prompt_tokens=40, kv_transfer_params={"do_remote_decode": True},
                      status=RequestStatus.FINISHED_ABORTED)
    assert p.request_finished(aborted, [2]) == (False, None)
    assert p.build_connector_meta(None).drop == ["b"]
    plain = Request(request_id="c", num_prompt_tokens=4, kv_transfer_params=None, status=RequestStatus.FINISHED_STOPPED)
    assert p.request_finished(plain, [3]) == (False, None)

    book = RowBook(2, rewindable=True, reuse=True)
    d = connector("kv_consumer", book)
    remote = Request(request_id="r", num_prompt_tokens=40, prompt_token_ids=list(range(40)), all_token_ids=list(
        range(40)), mm_features=[], cache_salt=None, kv_transfer_params=dict(params))
    assert d.get_num_new_matched_tokens(remote, 0) == (39, True)
    book.claim(remote)
    d.update_state_after_alloc(remote, None, 39)
    [(rid, pull)] = d.build_connector_meta(None).pulls.items()
    assert rid == "r" and (pull.row, pull.host, pull.port, pull.remote_request_id, pull.num_tokens) == (
        0, "127.0.0.1", 4242, "a", 39) and pull.token_ids == tuple(range(39))
    assert book.held == {"r": 0} and book.pulling == {"r"}
    assert remote.kv_transfer_params["do_remote_prefill"] is False  # one transfer per request
    assert d.get_num_new_matched_tokens(Request(request_id="x", num_prompt_tokens=9, kv_transfer_params=None), 0) == (
        0, False)


# --------------------------------------------------------------------------------------------------
# the real servers and router


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    from test_vllm_serve import write_mkv

    from qeff_evs.runtime.inputs.synthetic import moving_square_video

    folder = tmp_path_factory.mktemp("pd_media")
    return [write_mkv(folder / f"clip{n}.mkv", moving_square_video(frames, 128, width, seed=40 + n), fps=2)
            for n, (frames, width) in enumerate([(8, 128), (6, 192)])]


def kv_args(export: Path, role: str) -> list[str]:
    from conftest import SERVED_FULL_BATCH

    return [str(export), "--max-num-seqs", str(SERVED_FULL_BATCH), "--served-model-name", "tiny",
            "--trust-request-mm-kwargs", "--kv-transfer-config",
            '{%s, "kv_role": "%s", "kv_connector_extra_config": {"pull_timeout_s": 8}}' % (KV, role)]


@pytest.fixture(scope="module", params=FAMILIES)
def pd(request, served_export, tmp_path_factory):
    """A prefill and a decode instance of one family's export behind vllm-router's PD mode."""
    pytest.importorskip("uvicorn", reason="vLLM's server packages are missing: run bash scripts/install.sh --test")
    from helpers.vllm_server import vllm_servers

    from qeff_evs.bench.server_process import free_port, start_router, stop

    family = request.param
    export = served_export(family)[1]
    folder = tmp_path_factory.mktemp(f"pd_{family}")
    env = {"QEFF_EVS_BACKEND": "ort"}
    ports = [free_port(), free_port()]
    with vllm_servers([(kv_args(export, "kv_producer"), env, folder / "prefill.log", None),
                       (kv_args(export, "kv_consumer"), env, folder / "decode.log", None)], ports) as (p, d):
        router, url = start_router(["--vllm-pd-disaggregation", "--prefill", p.url, "--decode", d.url,
                                    "--policy", "round_robin", "--disable-circuit-breaker", "--disable-retries",
                                    "--health-check-interval-secs", "1"], folder / "router.log")
        try:
            yield types.SimpleNamespace(family=family, export=export, p=p, d=d, url=url, folder=folder,
                                        decode_port=ports[1])
        finally:
            stop(router)


def chat_body(clip: Path, rate: float, question: str, max_tokens: int = NEW_TOKENS, **extra) -> dict:
    from test_vllm_serve import video_message

    return {"model": "tiny", "messages": video_message(clip, question), "temperature": 0, "max_tokens": max_tokens,
            "return_token_ids": True, "mm_processor_kwargs": {"video_pruning_rate": rate}, **extra}


def expected_tokens(export: Path, clip: Path, rate: float, question: str) -> list[int]:
    from qeff_evs.models.pruning import VideoPruning
    from qeff_evs.runtime.builders import answer, build_engine
    from qeff_evs.runtime.export_bundle import open_export
    from qeff_evs.runtime.media import video_from_file

    bundle = open_export(export)
    engine = build_engine(bundle, "ort", max_new_tokens=NEW_TOKENS, pruning=VideoPruning("evs", rate))
    return answer(bundle, engine, video_from_file(clip, bundle), question).generated_token_ids


def post(url: str, body: dict, timeout: float = 300):
    import requests

    reply = requests.post(f"{url}/v1/chat/completions", json=body, timeout=timeout)
    assert reply.status_code == 200, reply.text
    return reply.json()


def handed_over(log: str) -> list[tuple[int, int]]:
    """(tokens, array bytes) of every hand-over the prefill instance logged, in order."""
    return [(int(n), int(b)) for n, b in
            re.findall(r"qeff-evs KV: handing over \S+: (\d+) tokens, \d+ bytes \(arrays (\d+) B;", log)]


def test_tokens_equal_one_instance(pd, clips):
    from qeff_evs.runtime.export_bundle import open_export

    questions = ("What happens in this video?", "Describe the square.")
    for rate in RATES:
        for clip, question in zip(clips, questions):
            before = len(handed_over(pd.p.log_text()))
            reply = post(pd.url, chat_body(clip, rate, question))
            assert reply["choices"][0]["token_ids"] == expected_tokens(pd.export, clip, rate, question), (rate, clip)
            prompt = len(reply["prompt_token_ids"])
            [(tokens, nbytes)] = handed_over(pd.p.log_text())[before:]
            assert tokens == prompt - 1  # the decode instance computes the last prompt token
            shape = open_export(pd.export).language_shape
            kv_layers = len(kv_handover.kv_names(shape)) // 2
            states = sum(int(np.prod(s.row_shape)) * len(s.layers) for s in shape.layer_states)
            assert nbytes == tokens * 2 * kv_layers * shape.kv_heads * shape.head_dim * 4 + 4 * states
    sizes = handed_over(pd.p.log_text())
    assert sizes[2][1] < sizes[0][1] and sizes[3][1] < sizes[1][1]  # q 0.75 hands over fewer slots than q 0
    assert "loaded the language graph for one-token calls only" in pd.d.log_text()
    assert "loaded the vision graphs and the language graph for prefill calls" in pd.p.log_text()


class SilentPrefill:
    """A 'prefill instance' that accepts the pull and never answers (the hand-over stays in flight)."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.port = self.sock.getsockname()[1]
        self.accepted: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        try:
            while True:
                self.accepted.append(self.sock.accept()[0])
        except OSError:
            return

    def close(self):
        for conn in self.accepted:
            conn.close()
        self.sock.close()


def test_a_request_aborted_while_its_kv_is_in_flight_ends_and_the_decode_instance_goes_on(pd, clips):
    import requests

    silent = SilentPrefill()
    body = chat_body(clips[0], 0.0, "Describe the square.", kv_transfer_params={
        "do_remote_prefill": True, "do_remote_decode": False, "remote_host": "127.0.0.1",
        "remote_port": silent.port, "remote_request_id": "never-answered", "remote_engine_id": "x"})
    try:
        with pytest.raises(requests.exceptions.ReadTimeout):
            requests.post(f"{pd.d.url}/v1/chat/completions", json=body, timeout=3)  # the client gives up: an abort
        deadline = time.monotonic() + 30
        while not silent.accepted and time.monotonic() < deadline:
            time.sleep(0.1)
        assert silent.accepted, "the decode instance never started its pull"
    finally:
        silent.close()  # the pull ends (failed), which vLLM waits for before it frees the aborted request's row
    deadline = time.monotonic() + 30
    while f"gets no hand-over from 127.0.0.1:{silent.port}" not in pd.d.log_text():  # the ended pull was reported
        assert time.monotonic() < deadline, pd.d.log_text()[-3000:]
        time.sleep(0.2)
    assert not re.findall(r"qeff-evs KV: received (\S+)", pd.d.log_text().split("never-answered")[-1])
    reply = post(pd.url, chat_body(clips[1], 0.75, "Describe the square."))
    assert reply["choices"][0]["token_ids"] == expected_tokens(pd.export, clips[1], 0.75, "Describe the square.")


@pytest.mark.parametrize("pd", ["qwen2_5_vl"], indirect=True)  # one family shows it: the hand-over is the same
def test_a_decode_instance_restarted_mid_stream_serves_the_next_requests(pd, clips):
    import requests
    from helpers.vllm_server import vllm_servers

    from qeff_evs.bench.server_process import stop

    body = chat_body(clips[0], 0.0, "What happens in this video?", max_tokens=200, stream=True, ignore_eos=True)
    with requests.post(f"{pd.url}/v1/chat/completions", json=body, stream=True, timeout=300) as reply:
        chunks = reply.iter_lines()
        first = [next(chunks) for _ in range(4)]
        assert any(line.startswith(b"data: {") for line in first)
        os.killpg(pd.d.process.pid, signal.SIGKILL)  # the decode instance dies mid-stream
        with pytest.raises(requests.exceptions.ChunkedEncodingError):
            for _ in chunks:  # the router ends the stream early
                pass
    stop(pd.d.process)
    with vllm_servers([(kv_args(pd.export, "kv_consumer"), {"QEFF_EVS_BACKEND": "ort"},
                        pd.folder / "decode_again.log", None)], [pd.decode_port]) as (again,):
        pd.d = again
        deadline = time.monotonic() + 30
        while True:  # the router's health check sees the instance again
            try:
                reply = post(pd.url, chat_body(clips[1], 0.0, "Describe the square."), timeout=120)
                break
            except AssertionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(1)
        assert reply["choices"][0]["token_ids"] == expected_tokens(pd.export, clips[1], 0.0, "Describe the square.")
        reply = post(pd.url, chat_body(clips[0], 0.75, "What happens in this video?"))
        assert reply["choices"][0]["token_ids"] == expected_tokens(pd.export, clips[0], 0.75,
                                                                   "What happens in this video?")

