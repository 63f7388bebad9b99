"""Encoder disaggregation with pruning on the encoder side, through the real vLLM servers.

One encoder instance (``ec_role: ec_producer``: encoder + pruning graphs) and one prefill/decode instance
(``ec_consumer``: the language graph) serve the tiny Qwen3-VL export with qeff-evs's EC connector over a shared
folder, behind the protocol of vLLM's disaggregated-encoder proxy (``disagg_epd_proxy.py``): each media item
alone, text removed, to an encoder instance; once every encoder request answered, the original request to the
prefill/decode instance; the same for the Nemotron-H export. Checks:

* greedy tokens equal our single-request engine on the same file (what one instance gives: ``test_vllm_serve``);
* each video ships exactly its K kept rows (K = vLLM's ``compute_retained_tokens_count``), their indices, per-frame
  counts and extra rows (Qwen3-VL: deepstack), bit-equal to the ORT vision pipeline's on the same pixels, and
  nothing else: the bytes are K/(T*h*w) of the unpruned rows vLLM's disaggregation would ship;
* the consumer never runs a vision graph: it serves from a copy of the export without them (under the same
  path, as on its own host: vLLM hashes the model path into ``mm_hash``), and says it loaded the language
  graph only; a video already shipped is not encoded again;
* a video the encoder never saw fails alone after the connector's wait (HTTP 500, vLLM's retryable error) and
  the instance goes on.
Without servers: the kept-row arrays, the start-up refusals and the consumer's wait, against hand-made inputs.
"""

from __future__ import annotations

import re
import shutil
import time
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from qeff_evs.runtime.engine import kept_rows
from qeff_evs.runtime.engine.request import EncodedMedia

PAYLOAD_WAIT_S = 3
QUESTION = "What happens in this video?"


# --------------------------------------------------------------------------------------------------
# kept rows as arrays


def encoded(k: int = 5, hidden: int = 4, levels: int = 2, frames: int = 3) -> EncodedMedia:
    rng = np.random.default_rng(0)
    indices = np.sort(rng.choice(frames * 4, size=k, replace=False)).astype(np.int64)
    kept = tuple(int(c) for c in np.bincount(indices // 4, minlength=frames))
    return EncodedMedia(rng.standard_normal((k, hidden)).astype(np.float32), indices,
                        {"deepstack_features": rng.standard_normal((levels, k, hidden)).astype(np.float32)}, kept)


def test_kept_rows_round_trip_by_name():
    item = encoded()
    arrays = kept_rows.to_arrays(item)
    assert sorted(arrays) == ["extra.deepstack_features", "kept_indices", "kept_per_frame", "rows"]
    back = kept_rows.from_arrays(arrays)
    np.testing.assert_array_equal(back.rows, item.rows)
    np.testing.assert_array_equal(back.kept_indices, item.kept_indices)
    np.testing.assert_array_equal(back.extras["deepstack_features"], item.extras["deepstack_features"])
    assert back.kept_per_frame == item.kept_per_frame
    assert kept_rows.nbytes(arrays) == 5 * 4 * 4 + 2 * 5 * 4 * 4 + 5 * 8 + 3 * 8
    assert kept_rows.unpruned_nbytes(arrays, 12) == 12 * 4 * 4 * 3  # rows and deepstack of all 12 tokens
    plain = kept_rows.to_arrays(EncodedMedia(item.rows, item.kept_indices, {}, item.kept_per_frame))
    assert sorted(plain) == ["kept_indices", "kept_per_frame", "rows"] and kept_rows.from_arrays(plain).extras == {}


def test_kept_rows_that_do_not_fit_together_are_refused():
    arrays = kept_rows.to_arrays(encoded())
    with pytest.raises(ValueError, match=r"missing \['kept_per_frame'\], unknown \['pixels'\]"):
        kept_rows.from_arrays({**{k: v for k, v in arrays.items() if k != "kept_per_frame"}, "pixels": arrays["rows"]})
    with pytest.raises(ValueError, match="do not describe the same K tokens"):
        kept_rows.from_arrays({**arrays, "rows": arrays["rows"][:4]})
    short = arrays["extra.deepstack_features"][:, :4]
    with pytest.raises(ValueError, match=r"\{'deepstack_features': \(2, 4, 4\)\} are not \(levels, 5, hidden\)"):
        kept_rows.from_arrays({**arrays, "extra.deepstack_features": short})
    with pytest.raises(ValueError, match="strictly ascending"):
        kept_rows.from_arrays({**arrays, "kept_indices": arrays["kept_indices"][::-1].copy()})


# --------------------------------------------------------------------------------------------------
# start-up refusals and the consumer's wait, without an engine


def vllm_config(role: str | None, connector: str = "QeffEvsECConnector", encoder_only: bool = False,
                data_parallel: int = 1, storage: str = "/tmp", wait_s: float = PAYLOAD_WAIT_S):
    from vllm.config import ECTransferConfig

    ec = None if role is None else ECTransferConfig(
        ec_connector=connector, ec_role=role,
        ec_connector_extra_config={"shared_storage_path": storage, "payload_wait_s": wait_s})
    mm = types.SimpleNamespace(mm_encoder_only=encoder_only, video_pruning_rate=0.5)
    return types.SimpleNamespace(ec_transfer_config=ec, model_config=types.SimpleNamespace(multimodal_config=mm),
                                 parallel_config=types.SimpleNamespace(data_parallel_size=data_parallel))


def test_what_encoder_disaggregation_cannot_serve_is_refused_one_line_each():
    pytest.importorskip("vllm.config")
    from qeff_evs.vllm.ec_connector.config import ec_refusals, ec_worker_class

    assert ec_refusals(vllm_config("ec_producer", encoder_only=True)) == []
    assert ec_refusals(vllm_config("ec_consumer")) == []
    assert ec_refusals(vllm_config(None)) == [] and ec_worker_class(vllm_config(None)) is None
    assert ec_worker_class(vllm_config("ec_consumer")) == "qeff_evs.vllm.ec_connector.worker.QeffEvsECWorker"
    [line] = ec_refusals(vllm_config("ec_producer", connector="ECExampleConnector"))
    assert line.startswith("ec_connector 'ECExampleConnector': qeff-evs instances ship each video's kept rows")
    [line] = ec_refusals(vllm_config(None, encoder_only=True))
    assert line.startswith("--mm-encoder-only without an encoder-disaggregation config ships its encoder outputs")
    [line] = ec_refusals(vllm_config("ec_consumer", encoder_only=True))
    assert "an encoder-only instance is an ec_producer" in line
    [line] = ec_refusals(vllm_config("ec_both"))
    assert line.startswith("ec_role 'ec_both': qeff-evs instances either encode")
    [line] = ec_refusals(vllm_config("ec_consumer", data_parallel=2))
    assert line.startswith("--data-parallel-size 2 with encoder disaggregation")


def request(request_id: str, mm_hash: str, rows: int, offset: int = 3, length: int = 10):
    feature = types.SimpleNamespace(identifier=mm_hash, mm_position=types.SimpleNamespace(offset=offset, length=length))
    return types.SimpleNamespace(request_id=request_id, mm_features=[feature], get_num_encoder_embeds=lambda i: rows)


def test_a_consumer_waits_for_kept_rows_then_fails_the_request(tmp_path):
    pytest.importorskip("vllm.distributed.ec_transfer")
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole

    from qeff_evs.vllm.ec_connector.connector import QeffEvsECConnector

    consumer = QeffEvsECConnector(vllm_config("ec_consumer", storage=str(tmp_path), wait_s=0.3),
                                  ECConnectorRole.SCHEDULER)
    producer = QeffEvsECConnector(vllm_config("ec_producer", storage=str(tmp_path)), ECConnectorRole.WORKER)
    assert not consumer.ensure_cache_available(request("a", "h1", 5), 0)  # not shipped yet: wait
    producer.save_caches({"h1": encoded()}, "h1")
    assert consumer.ensure_cache_available(request("a", "h1", 5), 0)  # shipped: go
    assert consumer.ensure_cache_available(request("b", "h2", 5), 20)  # its placeholder is behind: nothing to load

    assert not consumer.ensure_cache_available(request("c", "h3", 5), 0)
    assert consumer.take_unavailable_requests() == set()
    time.sleep(0.4)
    assert not consumer.ensure_cache_available(request("c", "h3", 5), 0)
    assert consumer.take_unavailable_requests() == {"c"}  # vLLM's scheduler fails it; the instance goes on

    assert not consumer.ensure_cache_available(request("d", "h1", 7), 0)  # another K: at once
    assert consumer.take_unavailable_requests() == {"d"}
    assert producer.ensure_cache_available(request("e", "h9", 5), 0)  # an encoding instance never waits


def test_each_payload_records_what_chose_its_own_rows(tmp_path):
    """Requests prune their videos their own way: each file's header says what its rows are (K, the item's kind, a
    video's method and rate), not the server's default rate; the consumer loads the rows exactly as written and names
    the shipped item's pruning when a placeholder expects another K."""
    pytest.importorskip("vllm.distributed.ec_transfer")
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole

    from qeff_evs.models.pruning import VideoPruning
    from qeff_evs.vllm.ec_connector.connector import QeffEvsECConnector, payload_path, read_header, read_payload

    producer = QeffEvsECConnector(vllm_config("ec_producer", storage=str(tmp_path)), ECConnectorRole.WORKER)
    items = {"q75": (encoded(5), "video", VideoPruning("evs", 0.75)),
             "q0": (encoded(12), "video", VideoPruning("evs", 0.0)),
             "vc": (encoded(3), "video", VideoPruning("vidcom2", 0.9)),
             "img": (encoded(4, frames=1), "image", None)}
    cache = {mm_hash: item for mm_hash, (item, _, _) in items.items()}
    for mm_hash, (_, kind, pruning) in items.items():
        producer.save_caches(cache, mm_hash, kind=kind, pruning=pruning)
    headers = {mm_hash: read_header(payload_path(tmp_path, mm_hash)) for mm_hash in items}
    assert headers["q75"] == {"format": "qeff-evs kept rows 1", "rows": "5", "kind": "video",
                              "video_pruning_method": "evs", "video_pruning_rate": "0.75"}
    assert (headers["q0"]["rows"], headers["q0"]["video_pruning_rate"]) == ("12", "0.0")  # not the server's 0.5
    assert (headers["vc"]["video_pruning_method"], headers["vc"]["video_pruning_rate"]) == ("vidcom2", "0.9")
    assert headers["img"] == {"format": "qeff-evs kept rows 1", "rows": "4", "kind": "image"}
    for mm_hash, (item, _, _) in items.items():  # the consumer's rows are the producer's, bit for bit
        back = kept_rows.from_arrays(read_payload(payload_path(tmp_path, mm_hash)))
        np.testing.assert_array_equal(back.rows, item.rows)
        np.testing.assert_array_equal(back.kept_indices, item.kept_indices)
        assert back.kept_per_frame == item.kept_per_frame

    consumer = QeffEvsECConnector(vllm_config("ec_consumer", storage=str(tmp_path)), ECConnectorRole.SCHEDULER)
    assert consumer.ensure_cache_available(request("a", "q75", 5), 0)
    assert not consumer.ensure_cache_available(request("b", "q75", 7), 0)
    assert consumer.take_unavailable_requests() == {"b"}
    assert consumer._mismatch("q75", 7).startswith(
        "the encoder instance shipped 5 kept rows for q75 (a video pruned by evs at rate 0.75) but the request's "
        "placeholder here holds 7")
    assert "(an image, every row)" in consumer._mismatch("img", 9)


# --------------------------------------------------------------------------------------------------
# the real servers


def via_proxy(encoder_url: str, pd_url: str, body: dict) -> tuple[dict, list[str]]:
    """The disaggregated-encoder proxy's protocol: every media item alone (its text removed) to the encoder
    instance, then, once all answered, the original request to the prefill/decode instance.

    Returns the prefill/decode response and the ``mm_hash`` of each item the encoder reported.
    """
    import requests

    items = [part for message in body["messages"] if isinstance(message.get("content"), list)
             for part in message["content"] if part.get("type") in ("image_url", "video_url", "audio_url")]
    hashes = []
    for item in items:
        reply = requests.post(f"{encoder_url}/v1/chat/completions", timeout=300, json={
            "model": body["model"], "messages": [{"role": "user", "content": [item]}], "max_tokens": 1})
        reply.raise_for_status()
        hashes += list(reply.json()["ec_transfer_params"])
    reply = requests.post(f"{pd_url}/v1/chat/completions", json=body, timeout=300)
    reply.raise_for_status()
    return reply.json(), hashes


def chat_body(clip: Path, question: str = QUESTION, max_tokens: int = 5) -> dict:
    from test_vllm_serve import video_message

    return {"model": "tiny", "messages": video_message(clip, question), "temperature": 0, "max_tokens": max_tokens,
            "return_token_ids": True}


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    from test_vllm_serve import write_mkv

    from qeff_evs.runtime.inputs.synthetic import moving_square_video

    folder = tmp_path_factory.mktemp("epd_media")
    return [write_mkv(folder / f"clip{n}.mkv", moving_square_video(frames, 130, width, seed=20 + n), fps=2)
            for n, (frames, width) in enumerate([(8, 130), (4, 200), (8, 200), (4, 130)])]


@pytest.fixture(scope="module", params=["qwen3_vl", "nemotron_h_omni"])
def epd(request, served_export, tmp_path_factory):
    """An encoder and a prefill/decode instance of one family's export (Qwen3-VL: deepstack rows ride with the kept
    rows; Nemotron-H: EVS only, a video-only family), each on its own "host" folder where the export sits at the same
    relative path; the prefill/decode host's copy has no vision graphs."""
    pytest.importorskip("uvicorn", reason="vLLM's server packages are missing: run bash scripts/install.sh --test")
    from helpers.vllm_server import vllm_servers

    from conftest import SERVED_FULL_BATCH
    from qeff_evs.manifest import read_manifest

    export = served_export(request.param)[1]
    root = tmp_path_factory.mktemp(f"epd_{request.param}")
    storage = root / "ec_storage"
    encoder_host, pd_host = root / "encoder_host", root / "pd_host"
    shutil.copytree(export, encoder_host / "export")
    shutil.copytree(export, pd_host / "export")
    manifest = read_manifest(export)
    for graph in [name for name in ("encoder", "pruning_evs", "pruning_vidcom2") if name in manifest.files]:
        for path in manifest.path(pd_host / "export", graph).parent.glob(manifest.files[graph].split("/")[-1] + "*"):
            path.unlink()
    assert not manifest.path(pd_host / "export", "encoder").exists()

    def role(name: str) -> list[str]:
        config = ('{"ec_connector": "QeffEvsECConnector", "ec_role": "%s", "ec_connector_extra_config": '
                  '{"shared_storage_path": "%s", "payload_wait_s": %d}}' % (name, storage, PAYLOAD_WAIT_S))
        return ["export", "--video-pruning-rate", "0.5", "--max-num-seqs", str(SERVED_FULL_BATCH),
                "--served-model-name", "tiny", "--ec-transfer-config", config]

    env = {"QEFF_EVS_BACKEND": "ort"}
    with vllm_servers([(role("ec_producer"), env, root / "encoder.log", encoder_host),
                       (role("ec_consumer"), env, root / "pd.log", pd_host)]) as (encoder, pd):
        yield types.SimpleNamespace(export=export, storage=storage, encoder=encoder, pd=pd)


@pytest.fixture(scope="module")
def answers(epd, clips):
    """Four requests through the proxy at once (one video twice), with what the single-request engine says."""
    asked = [(clips[0], QUESTION), (clips[1], "Describe the square."), (clips[2], QUESTION),
             (clips[0], "Which way does it move?")]
    with ThreadPoolExecutor(len(asked)) as pool:
        replies = list(pool.map(lambda a: via_proxy(epd.encoder.url, epd.pd.url, chat_body(*a)), asked))
    return answers_for(epd, asked, replies)


def answers_for(epd, asked, replies=None):
    """``(asked, replies, expected)``: what the single-request engine says for each (clip, question)."""
    from qeff_evs.runtime.builders import answer, build_engine
    from qeff_evs.runtime.export_bundle import open_export
    from qeff_evs.runtime.media import video_from_file

    bundle = open_export(epd.export)
    engine = build_engine(bundle, "ort", max_new_tokens=5)
    expected = [answer(bundle, engine, video_from_file(clip, bundle), question).generated_token_ids
                for clip, question in asked]
    return asked, replies, expected


def test_tokens_equal_a_single_instance(answers):
    asked, replies, expected = answers
    assert [reply["choices"][0]["token_ids"] for reply, _ in replies] == expected


def test_each_video_ships_only_its_kept_rows(epd, answers):
    from safetensors.numpy import load_file

    from qeff_evs.models.pruning import VideoPruning
    from qeff_evs.runtime.export_bundle import open_export
    from qeff_evs.runtime.media import video_from_file
    from qeff_evs.runtime.sessions import vision_pipeline
    from qeff_evs.vllm.ec_connector.connector import payload_path

    from vllm.multimodal.video_prune.evs import compute_retained_tokens_count

    asked, replies, _ = answers
    bundle = open_export(epd.export)
    vision = vision_pipeline(bundle, "ort")
    shape = bundle.language_shape
    for (clip, _), (_, [mm_hash]) in zip(asked, replies):
        path = Path(payload_path(epd.storage, mm_hash))
        arrays = load_file(path)
        media = video_from_file(clip, bundle)
        t, h, w = bundle.family.merged_grid(media.grid_thw)
        k = compute_retained_tokens_count(h * w, t, 0.5)
        reference = vision.encode(media, VideoPruning("evs", 0.5))  # the encoder and pruning graphs, here
        np.testing.assert_array_equal(arrays["rows"], reference.rows)
        np.testing.assert_array_equal(arrays["kept_indices"], reference.kept_indices)
        assert sorted(reference.extras) == sorted(bundle.family.extras)  # Qwen3-VL: deepstack_features
        for name, rows in reference.extras.items():
            np.testing.assert_array_equal(arrays[f"extra.{name}"], rows)
        np.testing.assert_array_equal(arrays["kept_per_frame"], np.bincount(reference.kept_indices // (h * w),
                                                                            minlength=t))
        row_bytes = shape.hidden * 4 * (1 + sum(shape.extras.values()))  # fp32 rows and their extra rows
        assert kept_rows.nbytes(arrays) == k * row_bytes + k * 8 + t * 8
        assert path.stat().st_size - kept_rows.nbytes(arrays) < 1024  # the safetensors header
        assert kept_rows.unpruned_nbytes(arrays, t * h * w) == t * h * w * row_bytes
        assert k / (t * h * w) == pytest.approx(0.5, abs=1 / (h * w))


def test_the_consumer_never_runs_a_vision_graph(epd, answers):
    asked, replies, _ = answers
    consumer_log, encoder_log = epd.pd.log_text(), epd.encoder.log_text()
    assert "qeff-evs ec_consumer instance: loaded the language graph of export only" in consumer_log
    assert "qeff-evs ec_producer instance: loaded the encoder and pruning graphs of export only" in encoder_log
    shipped = re.findall(r"qeff-evs EC: shipped ([0-9a-f]+):", encoder_log)
    distinct = {mm_hash for _, hashes in replies for mm_hash in hashes}
    assert len(distinct) == 3 and sorted(shipped) == sorted(distinct)  # the repeated video was shipped once
    assert "qeff-evs EC: shipped" not in consumer_log


def test_a_video_the_encoder_never_saw_fails_alone(epd, clips, answers):
    import requests

    started = time.monotonic()
    reply = requests.post(f"{epd.pd.url}/v1/chat/completions", json=chat_body(clips[3]), timeout=300)
    assert reply.status_code == 500 and time.monotonic() - started >= PAYLOAD_WAIT_S
    assert re.search(r"qeff-evs EC: request \S+ fails: no kept rows for \['[0-9a-f]+'\] in .* after 3 s; this "
                     "instance is an EC consumer and runs no vision graph", epd.pd.log_text())
    reply, _ = via_proxy(epd.encoder.url, epd.pd.url, chat_body(clips[3]))
    assert reply["choices"][0]["finish_reason"] == "length"


def test_qeff_evs_epd_proxy_in_front_of_the_router_serves_as_vllms_proxy_did(epd, clips, tmp_path):
    """``qeff-evs epd-proxy`` (no file from vLLM's source tree) sends the media to the encoder instance, then the
    request to vllm-router in front of the prefill/decode instance: tokens equal one instance, streamed too."""
    import json
    import subprocess
    import sys

    import requests

    from qeff_evs.bench.server_process import free_port, healthy, start_router, stop

    router, router_url = start_router(["--worker-urls", epd.pd.url, "--policy", "consistent_hash"],
                                      tmp_path / "router.log")
    port = free_port()
    proxy = subprocess.Popen([str(Path(sys.executable).with_name("qeff-evs")), "epd-proxy", "--encoder",
                              epd.encoder.url, "--language", router_url, "--port", str(port)],
                             stdout=open(tmp_path / "proxy.log", "w"), stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while not healthy(url):
            assert proxy.poll() is None and time.monotonic() < deadline, (tmp_path / "proxy.log").read_text()
            time.sleep(0.3)
        question = "Which way does it move?"
        reply = requests.post(f"{url}/v1/chat/completions", json=chat_body(clips[2], question),
                              headers={"X-Session-ID": "s1"}, timeout=300)
        assert reply.status_code == 200, reply.text
        _, _, expected = answers_for(epd, [(clips[2], question)])
        assert reply.json()["choices"][0]["token_ids"] == expected[0]
        streamed = requests.post(f"{url}/v1/chat/completions", json={**chat_body(clips[2], question), "stream": True},
                                 timeout=300)
        tokens = [json.loads(line[6:])["choices"][0].get("token_ids") or [] for line in streamed.iter_lines()
                  if line.startswith(b"data: {")]
        assert [t for chunk in tokens for t in chunk] == expected[0]
    finally:
        stop(proxy)
        stop(router)
