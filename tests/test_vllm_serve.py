"""``vllm serve`` on an export, through the OpenAI API (issues 12 and 16).

One server (a child process on 127.0.0.1 only, stopped whatever happens) serves a tiny Qwen2.5-VL
export with 4 KV rows. Through the ``openai`` client: a ``video_url`` chat completion gives exactly the
tokens of ``qeff-evs run`` on the same file (a 3-frame clip and a 90-frame clip, longer than the export's
largest frame bucket, included); an ``image_url`` one those of our engine on the same image; streaming gives
the same text; 32 concurrent requests all complete; a request the processor refuses gets HTTP 400 naming the
problem and the next request succeeds; a client that disconnects mid-generation frees its KV row (4 requests
afterwards run at once and complete). The same export served again at other rates and with the other method
(``--video-pruning-rate``, ``--video-pruning-method``) answers as ``qeff-evs run`` with those settings.
"""

from __future__ import annotations

import base64
import contextlib
import io
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm.v1.worker.worker_base")
openai = pytest.importorskip("openai")
# vLLM's server imports more than its pure-Python oracles; scripts/install.sh --test installs it all.
pytest.importorskip("uvicorn", reason="vLLM's server packages are missing: run bash scripts/install.sh --test")

from qeff_evs.runtime.engine.request import PromptPiece  # noqa: E402
from qeff_evs.runtime.inputs.synthetic import moving_square_video  # noqa: E402
from qeff_evs.runtime.runner import answer, build_engine, image_from_array, open_export, stop_ids, video_from_file  # noqa: E402

from conftest import SERVED_CTX_LEN as CTX_LEN, SERVED_FULL_BATCH as FULL_BATCH  # noqa: E402
QUESTION = "What happens in this video?"
START_TIMEOUT_S = 240
REQUEST_TIMEOUT_S = 120


def write_mkv(path: Path, frames: np.ndarray, fps: int) -> Path:
    """Lossless (ffv1, RGB) Matroska: PyAV and vLLM's OpenCV loader decode the same pixels."""
    import av

    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("ffv1", rate=fps)
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "bgr0"
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    return path


def data_url(path: Path, mime: str) -> str:
    return f"data:{mime};base64," + base64.b64encode(path.read_bytes()).decode()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def export(served_export) -> Path:
    return served_export("qwen2_5_vl")[1]


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve_media")
    from PIL import Image

    image = folder / "image.png"
    Image.fromarray(moving_square_video(1, 112, 168, seed=5)[0]).save(image)
    return dict(clip=write_mkv(folder / "clip.mkv", moving_square_video(8, 120, 120, seed=3), fps=2),
                other=write_mkv(folder / "other.mkv", moving_square_video(4, 112, 170, seed=4), fps=2),
                three=write_mkv(folder / "three.mkv", moving_square_video(3, 120, 120, seed=6), fps=2),
                # 90 frames at 30 fps: sampled down as vLLM's processor does at the export's maximum (8 frames)
                long=write_mkv(folder / "long.mkv", moving_square_video(90, 112, 150, seed=7), fps=30),
                image=image)


@contextlib.contextmanager
def vllm_server(export: Path, folder: Path, *flags: str):
    """``vllm serve EXPORT FLAGS...`` on a free local port until the block ends: an ``openai`` client."""
    port = free_port()
    log = folder / "server.log"
    env = dict(os.environ, QEFF_EVS_BACKEND="ort")
    argv = [str(Path(sys.executable).with_name("vllm")), "serve", str(export), "--host", "127.0.0.1", "--port",
            str(port), *flags, "--max-num-seqs",
            # No --max-model-len, no --no-enable-prefix-caching: the export's config and the platform set them.
            str(FULL_BATCH), "--served-model-name", "tiny"]
    with open(log, "w") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if process.poll() is not None:
                pytest.fail(f"vllm serve exited with {process.returncode}:\n{log.read_text()[-5000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vllm serve not ready after {START_TIMEOUT_S} s:\n{log.read_text()[-5000:]}")
            time.sleep(1)
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=REQUEST_TIMEOUT_S,
                            max_retries=0)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=30)


@pytest.fixture(scope="module")
def server(export, tmp_path_factory):
    with vllm_server(export, tmp_path_factory.mktemp("serve_log"), "--video-pruning-rate", "0.5",
                     "--trust-request-mm-kwargs") as client:  # per-request mm_processor_kwargs reach our processor
        yield client


def video_message(path: Path, question: str = QUESTION) -> list[dict]:
    return [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": data_url(path, "video/x-matroska")}},
                                         {"type": "text", "text": question}]}]


def chat(client, messages, max_tokens: int = 6, extra_body: dict | None = None, **kwargs):
    return client.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=max_tokens,
                                          extra_body={"return_token_ids": True, **(extra_body or {})}, **kwargs)


def run_answer(export: Path, path: Path, pruning=None):
    """``qeff-evs run`` on the file: the export's rate and method, or ``pruning``'s."""
    bundle = open_export(export)
    engine = build_engine(bundle, "ort", max_new_tokens=6, pruning=pruning)
    return answer(bundle, engine, video_from_file(path, bundle), QUESTION)


@pytest.mark.parametrize("clip", ["clip", "three", "long"])
def test_video_url_equals_qeff_evs_run(server, export, media, clip):
    expected = run_answer(export, media[clip])
    response = chat(server, video_message(media[clip]))
    assert response.choices[0].token_ids == expected.generated_token_ids
    assert response.prompt_token_ids == expected.prompt_token_ids


def test_image_url_equals_our_engine(server, export, media):
    from PIL import Image

    bundle = open_export(export)
    image = image_from_array(np.asarray(Image.open(media["image"]).convert("RGB")), bundle)
    text = bundle.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "describe it"}]}], tokenize=False,
        add_generation_prompt=True)
    before, after = text.split("<|image_pad|>")
    pieces = [PromptPiece(ids=tuple(bundle.tokenizer.encode(before, add_special_tokens=False))), PromptPiece(video=0),
              PromptPiece(ids=tuple(bundle.tokenizer.encode(after, add_special_tokens=False)))]
    engine = build_engine(bundle, "ort", max_new_tokens=6)
    expected = engine.generate(engine.prepare(pieces, [image]), eos_ids=stop_ids(bundle))
    response = chat(server, [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(media["image"], "image/png")}},
        {"type": "text", "text": "describe it"}]}])
    assert response.choices[0].token_ids == expected.generated_token_ids


def test_streaming_gives_the_same_text(server, media):
    whole = chat(server, video_message(media["other"]), max_tokens=8).choices[0].message.content
    chunks = [c.choices[0].delta.content or "" for c in chat(server, video_message(media["other"]), max_tokens=8,
                                                             stream=True) if c.choices]
    assert len(chunks) > 2 and "".join(chunks) == whole


def test_32_concurrent_requests_complete(server, media):
    def one(n: int):
        path = media["clip"] if n % 2 else media["other"]
        return chat(server, video_message(path, f"question number {n}"), max_tokens=4).choices[0]

    with ThreadPoolExecutor(32) as pool:
        choices = list(pool.map(one, range(32)))
    assert all(c.finish_reason == "length" and len(c.token_ids) == 4 for c in choices)


def test_unservable_video_is_a_400_and_the_server_goes_on(server, media):
    with pytest.raises(openai.BadRequestError) as error:  # HF's processor refuses fps with num_frames too
        chat(server, video_message(media["clip"]), extra_body={"mm_processor_kwargs": {"fps": 2, "num_frames": 4}})
    assert error.value.status_code == 400
    assert "num_frames and fps are mutually exclusive" in str(error.value)
    assert chat(server, video_message(media["clip"])).choices[0].finish_reason == "length"


def test_disconnected_client_frees_its_kv_row(server, media):
    stream = chat(server, video_message(media["clip"]), max_tokens=120, stream=True)
    for number, _ in enumerate(stream):
        if number == 3:
            break
    stream.close()  # the client goes away mid-generation; vLLM aborts the request
    time.sleep(1)

    def one(n: int):
        return chat(server, video_message(media["other"], f"after the disconnect {n}"), max_tokens=20).choices[0]

    # Every KV row is free again: as many long requests as rows run at once and finish.
    with ThreadPoolExecutor(FULL_BATCH) as pool:
        choices = list(pool.map(one, range(FULL_BATCH)))
    assert all(c.finish_reason == "length" and len(c.token_ids) == 20 for c in choices)


@pytest.mark.parametrize("q, method", [(0.25, "evs"), (0.75, "vidcom2")])
def test_rate_and_method_chosen_at_serve_time(export, media, tmp_path, q, method):
    """The same export served at another rate and method; each answer (q 0.25 and 0.75, EVS and VidCom2, on two
    clips) equals ``qeff-evs run`` with those settings, and the other settings' answers differ in length."""
    from qeff_evs.models.pruning import VideoPruning

    other = {"evs": "vidcom2", "vidcom2": "evs"}[method]
    with vllm_server(export, tmp_path, "--video-pruning-rate", str(q), "--video-pruning-method", method) as client:
        for clip in ("clip", "long"):
            for rate, name in ((q, method), (1 - q, other)):
                expected = run_answer(export, media[clip], VideoPruning(name, rate))
                if name == method and rate == q:
                    response = chat(client, video_message(media[clip]))
                    assert response.choices[0].token_ids == expected.generated_token_ids, clip
                    assert response.prompt_token_ids == expected.prompt_token_ids, clip
                    served = len(response.prompt_token_ids)
                else:
                    assert len(expected.prompt_token_ids) != served  # another rate: another count of video pads
