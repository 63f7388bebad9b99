"""``vllm serve`` on an export, through the OpenAI API.

One server (a child process on 127.0.0.1 only, stopped whatever happens) serves a tiny Qwen2.5-VL
export with 4 KV rows. Through the ``openai`` client: a ``video_url`` chat completion gives exactly the
tokens of ``qeff-evs run`` on the same file (a 3-frame clip and a 90-frame clip, longer than the export's
largest frame bucket, included); an ``image_url`` one those of our engine on the same image;
streaming gives the same text; 32 concurrent requests all complete; a client that disconnects
mid-generation frees its KV row (4 requests afterwards run at once and complete).

Nothing a request carries can stop the server: each kind of bad request (media pad tokens in
the text, more pads than media, too many media, positions past the RoPE tables, corrupt and truncated
videos, a PNG sent as ``video_url``, an unsupported media type, a huge image, refused parameters) gets a 4xx
naming the value and the limit, and the next request succeeds. vLLM's own benchmark client (``vllm bench
serve``, ShareGPT-style dataset with local videos) runs with 0 failures. Videos that come to one frame are
padded in time as vLLM does and served, a one-frame file included (the plugin's video loader; the soak
sends them as good requests). The same export served again at other rates and with the other method
(``--video-pruning-rate``, ``--video-pruning-method``) answers as ``qeff-evs run`` with those settings.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm.v1.worker.worker_base")
openai = pytest.importorskip("openai")
# vLLM's server imports more than its pure-Python oracles; scripts/install.sh --test installs it all.
pytest.importorskip("uvicorn", reason="vLLM's server packages are missing: run bash scripts/install.sh --test")

from qeff_evs.bench.server_process import free_port, healthy, stop  # noqa: E402
from qeff_evs.bench.serving import write_video as write_mkv  # noqa: E402 (lossless ffv1: the server decodes these pixels)
from qeff_evs.models.pruning import VideoPruning  # noqa: E402
from qeff_evs.runtime.engine.executor import kept_count  # noqa: E402
from qeff_evs.runtime.engine.request import PromptPiece, plan_prompt  # noqa: E402
from qeff_evs.runtime.request_pruning import rate_for_at_most  # noqa: E402
from qeff_evs.runtime.inputs.prompt import chat_pieces  # noqa: E402
from qeff_evs.runtime.inputs.synthetic import moving_square_video  # noqa: E402
from helpers.vllm_server import openai_client  # noqa: E402
from qeff_evs.runtime.builders import answer, build_engine, stop_ids  # noqa: E402
from qeff_evs.runtime.export_bundle import open_export  # noqa: E402
from qeff_evs.runtime.media import image_from_array, video_from_file  # noqa: E402

from conftest import SERVED_CTX_LEN as CTX_LEN, SERVED_FULL_BATCH as FULL_BATCH  # noqa: E402

QUESTION = "What happens in this video?"
START_TIMEOUT_S = 240
REQUEST_TIMEOUT_S = 120
MEDIA_LIMIT = {"video": 2, "image": 2}


def data_url(path: Path, mime: str) -> str:
    return f"data:{mime};base64," + base64.b64encode(path.read_bytes()).decode()


@pytest.fixture(scope="module")
def export(served_export) -> Path:
    return served_export("qwen2_5_vl")[1]


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve_media")
    from PIL import Image

    image = folder / "image.png"
    Image.fromarray(moving_square_video(1, 112, 168, seed=5)[0]).save(image)
    Image.new("RGB", (20000, 20000)).save(folder / "huge.png")  # 400 M pixels: a 1.2 MB file
    clip = write_mkv(folder / "clip.mkv", moving_square_video(8, 120, 120, seed=3), fps=2)
    (folder / "truncated.mkv").write_bytes(clip.read_bytes()[:200])  # the container's header, no frame
    (folder / "corrupt.mp4").write_bytes(b"\x00\x01 not a video " * 100)
    return dict(folder=folder, clip=clip, image=image, huge=folder / "huge.png", truncated=folder / "truncated.mkv",
                corrupt=folder / "corrupt.mp4",
                other=write_mkv(folder / "other.mkv", moving_square_video(4, 112, 170, seed=4), fps=2),
                # 2 frames at 4 fps: 1 frame at the 2 fps the checkpoint samples at, fewer than any exported count
                too_short=write_mkv(folder / "short.mkv", moving_square_video(2, 120, 120, seed=6), fps=4),
                # 8 frames 600 s apart: Qwen2.5-VL's temporal positions follow the timestamps, far past the RoPE tables
                sparse=write_mkv(folder / "sparse.mkv", moving_square_video(8, 120, 120, seed=8), fps=Fraction(1, 600)),
                three=write_mkv(folder / "three.mkv", moving_square_video(3, 120, 120, seed=6), fps=2),
                # one frame: vLLM 0.32's own qwen2_vl loader divides by zero on it (HTTP 500); the plugin's loader serves it
                one_frame=write_mkv(folder / "one.mkv", moving_square_video(1, 120, 120, seed=9), fps=2),
                # 90 frames at 30 fps: sampled down as vLLM's processor does at the export's maximum (8 frames)
                long=write_mkv(folder / "long.mkv", moving_square_video(90, 112, 150, seed=7), fps=30))


@contextlib.contextmanager
def vllm_server(export: Path, folder: Path, *flags: str, backend: str = "ort"):
    """``vllm serve EXPORT FLAGS...`` on a free local port until the block ends: an ``openai`` client."""
    port = free_port()
    log = folder / "server.log"
    env = dict(os.environ, QEFF_EVS_BACKEND=backend)
    argv = [str(Path(sys.executable).with_name("vllm")), "serve", str(export), "--host", "127.0.0.1", "--port",
            str(port), *flags, "--max-num-seqs",
            # No --max-model-len, no --no-enable-prefix-caching: the export's config and the platform set them.
            str(FULL_BATCH), "--served-model-name", "tiny", "--limit-mm-per-prompt", json.dumps(MEDIA_LIMIT)]
    with open(log, "w") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if process.poll() is not None:
                pytest.fail(f"vllm serve exited with {process.returncode}:\n{log.read_text()[-5000:]}")
            if healthy(f"http://127.0.0.1:{port}"):
                break
            if time.monotonic() > deadline:
                pytest.fail(f"vllm serve not ready after {START_TIMEOUT_S} s:\n{log.read_text()[-5000:]}")
            time.sleep(1)
        client = openai_client(f"http://127.0.0.1:{port}", REQUEST_TIMEOUT_S)
        client.port, client.pid, client.log = port, process.pid, log
        yield client
    finally:
        stop(process)


@pytest.fixture(scope="module")
def server(export, media, tmp_path_factory):
    with vllm_server(export, tmp_path_factory.mktemp("serve_log"), "--video-pruning-rate", "0.5",
                     "--allowed-local-media-path", str(media["folder"]),
                     "--enable-prompt-tokens-details",  # usage.prompt_tokens_details.cached_tokens: row reuse's count
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
    pieces = [PromptPiece(ids=tuple(bundle.tokenizer.encode(before, add_special_tokens=False))), PromptPiece(media_item=0),
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


def text_message(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def media_message(parts: list[tuple[str, Path, str]], text: str = QUESTION) -> list[dict]:
    """``(kind, file, mime)`` parts then the text: kind "video_url", "image_url" or "input_audio"."""
    content = []
    for kind, path, mime in parts:
        if kind == "input_audio":
            content.append({"type": kind, "input_audio": {"data": base64.b64encode(path.read_bytes()).decode(),
                                                          "format": "wav"}})
        else:
            content.append({"type": kind, kind: {"url": data_url(path, mime)}})
    return [{"role": "user", "content": content + [{"type": "text", "text": text}]}]


MKV = "video/x-matroska"
# kind -> (messages from the media, extra request fields, what the 4xx must say)
BAD_REQUESTS = {
    "image pad in the text": (lambda m: text_message("look <|image_pad|> here"), {},
                              "1 media pad token(s) <|image_pad|> that no attached image or video fills"),
    "marker and video pad in the text": (lambda m: text_message("see <|vision_start|><|video_pad|> it"), {},
                                         "<|video_pad|> that no attached image or video fills"),
    "more pads than media": (lambda m: media_message([("video_url", m["clip"], MKV)], "and <|video_pad|> too"), {},
                             "1 video(s) attached but the prompt has 2 <|video_pad|>"),
    "more media than allowed": (lambda m: media_message([("video_url", m["clip"], MKV)] * 3), {},
                                "At most 2 video(s) may be provided in one prompt"),
    "positions past the RoPE tables": (lambda m: media_message([("video_url", m["sparse"], MKV)]), {},
                                       "; its prompt alone passes them"),
    "a corrupt video": (lambda m: media_message([("video_url", m["corrupt"], "video/mp4")]), {},
                        "video_url: no video frame can be decoded from the video's"),
    "a truncated video": (lambda m: media_message([("video_url", m["truncated"], MKV)]), {},
                          "video_url: no video frame can be decoded from the video's 200 bytes"),
    # vLLM 0.32's own loader: "upper bound and lower bound inconsistent with step sign" (HTTP 500)
    "an image sent as video_url": (lambda m: media_message([("video_url", m["image"], "video/mp4")]), {},
                                   "they hold a PNG image, not a video; send it as image_url"),
    "an unsupported media type": (lambda m: media_message([("input_audio", m["image"], "")]), {},
                                  "At most 0 audio(s) may be provided in one prompt"),
    "not an image": (lambda m: media_message([("image_url", m["corrupt"], "image/png")]), {},
                     "Failed to load image"),
    "a huge image": (lambda m: media_message([("image_url", m["huge"], "image/png")]), {},
                     "Image dimensions 20000x20000 (400000000 pixels) exceed the maximum"),
    "prompt_logprobs": (lambda m: text_message("hello"), {"prompt_logprobs": 1},
                        "prompt_logprobs=1: the language graph returns the last position's logits only"),
    "a pruning rate past the RoPE tables": (lambda m: media_message([("video_url", m["clip"], MKV)]),
                                            {"mm_processor_kwargs": {"video_pruning_rate": 0.99}},
                                            "video 0: video_pruning_rate: video pruning rate 0.99 reaches"),
    "an unknown pruning method": (lambda m: media_message([("video_url", m["clip"], MKV)]),
                                  {"mm_processor_kwargs": {"video_pruning_method": "tome"}},
                                  "video pruning method 'tome' is not one this export carries"),
    "mm_processor_kwargs": (lambda m: media_message([("video_url", m["clip"], MKV)]),
                            # the server trusts request kwargs (--trust-request-mm-kwargs); HF's processor refuses these
                            {"mm_processor_kwargs": {"fps": 2, "num_frames": 4}},
                            "num_frames and fps are mutually exclusive"),
}

# Videos that come to one frame at the checkpoint's rate: kind -> (media key, what the 4xx says while refused).
ONE_FRAME_VIDEOS = {
    "a video sampled to one frame": ("too_short", "exported frame count [2, 4, 8]"),
    # vLLM 0.32's own qwen2_vl loader divides by zero on it in the frontend (HTTP 500, as on a GPU); the plugin's
    # video loader delivers its frame
    "a one-frame video file": ("one_frame", "division by zero"),
}
# vLLM pads such a video in time, and so does qeff-evs: a kind not in this list leaves BAD_REQUESTS and the
# soak sends it as a good request (its tokens equal to the request alone).
ONE_FRAME_REFUSED: list[str] = []  # served since qeff-evs pads in time (the one-frame file since the plugin's loader)
BAD_REQUESTS.update({kind: (lambda m, key=key: media_message([("video_url", m[key], MKV)]), {}, says)
                     for kind, (key, says) in ONE_FRAME_VIDEOS.items() if kind in ONE_FRAME_REFUSED})


def bad_request(client, messages, extra: dict):
    """The error of a request expected to fail (openai raises APIStatusError subclasses with the status)."""
    with pytest.raises(openai.APIStatusError) as error:
        client.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=4,
                                       extra_body=dict(extra))
    return error.value


@pytest.mark.parametrize("kind", list(BAD_REQUESTS))
def test_bad_request_is_a_400_and_the_server_goes_on(server, media, kind):
    build, extra, says = BAD_REQUESTS[kind]
    error = bad_request(server, build(media), extra)
    assert 400 <= error.status_code < 500, (kind, error.status_code, str(error))
    assert says in str(error), (kind, str(error))
    assert chat(server, text_message("next one"), max_tokens=2).choices[0].finish_reason == "length"


def test_truncate_prompt_tokens_as_vllm_documents(server, export, media):
    """vLLM's frontend truncates the prompt to the last N tokens, and refuses a limit that would cut a media item
    (vLLM truncates before the placeholders expand, then refuses an expanded prompt whose items the limit cuts)."""
    reply = server.chat.completions.create(model="tiny", temperature=0, max_tokens=2, extra_body={
        "truncate_prompt_tokens": 6}, messages=text_message("a question long enough to be cut down to six tokens"))
    assert reply.usage.prompt_tokens == 6
    prompt = chat(server, video_message(media["clip"]), max_tokens=1).prompt_token_ids
    pads = [n for n, token in enumerate(prompt) if token == open_export(export).family.special_tokens().video_pad]
    after = len(prompt) - pads[-1] - 1
    # The video's one pad token and what follows it survive the first cut; its expanded placeholder does not.
    error = bad_request(server, video_message(media["clip"]), {"truncate_prompt_tokens": after + 1})
    assert error.status_code == 400, str(error)
    assert f"truncate_prompt_tokens={after + 1} would split or drop a(n) video item" in str(error)
    reply = server.chat.completions.create(model="tiny", temperature=0, max_tokens=1, messages=video_message(
        media["clip"]), extra_body={"truncate_prompt_tokens": len(prompt) - pads[0]})
    assert reply.usage.prompt_tokens == len(prompt) - pads[0]  # a limit that keeps the video cuts only the text


def test_a_refused_request_does_not_spoil_its_media_for_the_next(server, tmp_path):
    """A request refused after its video was processed (here: prompt_logprobs) never reaches the engine; the same
    video in the next request is served (vLLM 0.32's API-server cache would have sent it without its data)."""
    path = write_mkv(tmp_path / "fresh.mkv", moving_square_video(8, 120, 120, seed=21), fps=2)
    error = bad_request(server, video_message(path), {"prompt_logprobs": 1})
    assert error.status_code == 400
    for _ in range(2):
        assert chat(server, video_message(path)).choices[0].finish_reason == "length"


def slow_clip(bundle, folder: Path, seconds_apart: int) -> tuple[Path, int]:
    """8 frames ``seconds_apart`` apart and where the worker's own prompt plan ends its positions."""
    path = write_mkv(folder / f"slow{seconds_apart}.mkv", moving_square_video(8, 120, 120, seed=9),
                     fps=Fraction(1, seconds_apart))
    video = video_from_file(path, bundle)
    pieces = chat_pieces(bundle.tokenizer, [{"type": "video"}, {"type": "text", "text": QUESTION}])
    kept = kept_count(bundle.family, video, VideoPruning("evs", 0.5))
    return path, plan_prompt(pieces, [video], [kept], bundle.family).decode_start


def test_max_tokens_past_the_rope_tables_names_the_largest_that_fits(server, export, tmp_path):
    """8 frames far apart: Qwen2.5-VL's temporal positions follow the timestamps, so the spacing is chosen (from two
    probes, positions grow linearly with it) to end the prompt's unpruned positions ~99 short of the RoPE tables (the
    worker's own prompt plan says where); then 150 new tokens is a 400 naming the largest max_tokens, which is served."""
    bundle = open_export(export)
    table = bundle.manifest.language_shape.rope_positions
    (_, end32), (_, end64) = slow_clip(bundle, tmp_path, 32), slow_clip(bundle, tmp_path, 64)
    seconds = 32 + round((table - 99 - end32) * 32 / (end64 - end32))
    path, end = slow_clip(bundle, tmp_path, seconds)
    room = table - end
    assert 0 < room < 150
    with pytest.raises(openai.BadRequestError) as error:
        chat(server, video_message(path), max_tokens=150)
    assert f"positions up to {end + 149}" in str(error.value) and f"ask for at most max_tokens={room}," in str(error.value)
    reply = chat(server, video_message(path), max_tokens=room)
    assert reply.choices[0].finish_reason in ("length", "stop") and len(reply.choices[0].token_ids) <= room


def test_each_request_chooses_its_pruning(server, export, media):
    """Three requests with the same video at once, on a server at q 0.5: q 0, q 0.75 and at most N video tokens
    (mm_processor_kwargs). Each equals ``qeff-evs run`` at its own setting (prompt and generated ids), and each
    response's ``usage.prompt_tokens`` counts its own kept tokens."""
    bundle = open_export(export)
    t, h, w = bundle.family.merged_grid(video_from_file(media["clip"], bundle).grid_thw)
    at_most = h * w * t // 3
    cases = {"q 0": ({"video_pruning_rate": 0}, VideoPruning("evs", 0.0)),
             "q 0.75": ({"video_pruning_rate": 0.75}, VideoPruning("evs", 0.75)),
             "max_video_tokens": ({"max_video_tokens": at_most},
                                  VideoPruning("evs", rate_for_at_most("evs", at_most, h * w, t)))}

    def one(kwargs):
        return chat(server, video_message(media["clip"]), extra_body={"mm_processor_kwargs": kwargs})

    with ThreadPoolExecutor(len(cases)) as pool:
        responses = dict(zip(cases, pool.map(one, [kwargs for kwargs, _ in cases.values()])))
    for name, (_, pruning) in cases.items():
        expected = run_answer(export, media["clip"], pruning)
        response = responses[name]
        assert response.choices[0].token_ids == expected.generated_token_ids, name
        assert response.prompt_token_ids == expected.prompt_token_ids, name
        assert response.usage.prompt_tokens == len(expected.prompt_token_ids), name
    assert len({r.usage.prompt_tokens for r in responses.values()}) == len(cases)
    kept = cases["max_video_tokens"][1].kept_token_count(h * w, t)
    assert kept <= at_most < VideoPruning("evs", 0.5).kept_token_count(h * w, t)


def conversation_answer(export: Path, path: Path, messages: list[dict], pruning=None):
    """Our single-request engine on a whole conversation about one video (``messages`` in OpenAI form, the video as
    ``{"type": "video"}``): the reference a server that reuses no row must equal."""
    bundle = open_export(export)
    text = bundle.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    before, after = text.split("<|video_pad|>")
    pieces = [PromptPiece(ids=tuple(bundle.tokenizer.encode(before, add_special_tokens=False))), PromptPiece(media_item=0),
              PromptPiece(ids=tuple(bundle.tokenizer.encode(after, add_special_tokens=False)))]
    engine = build_engine(bundle, "ort", max_new_tokens=6, pruning=pruning)
    return engine.generate(engine.prepare(pieces, [video_from_file(path, bundle)]), eos_ids=stop_ids(bundle))


def follow_up(path: Path | None, answer_text: str, question: str) -> list[dict]:
    """Turn 1 (the video and ``QUESTION``), its answer and a new question; ``path`` None: the video as the chat
    template sees it."""
    video = {"type": "video"} if path is None else {"type": "video_url", "video_url": {
        "url": data_url(path, "video/x-matroska")}}
    return [{"role": "user", "content": [video, {"type": "text", "text": QUESTION}]},
            {"role": "assistant", "content": answer_text}, {"role": "user", "content": question}]


def common_prefix(a, b) -> int:
    return next((n for n, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_a_follow_up_reuses_its_conversations_row_with_the_same_tokens(server, export, media, tmp_path):
    """Row reuse (on by default as vLLM's prefix caching): a follow-up (the same video, the answer and a
    new question) runs in the row that holds turn 1, so its cached tokens are what turn 1 computed (prompt and answer
    but its last token) up to where the follow-up's ids differ; its tokens equal our engine's on the whole
    conversation, alone. The same conversation about another video of the same size (equal placeholder ids), or the
    same video pruned otherwise, reuses at most the text before the video; another ``cache_salt`` reuses nothing."""
    bundle = open_export(export)
    video_pad = bundle.tokenizer.convert_tokens_to_ids("<|video_pad|>")
    clip = media["three"]
    first = chat(server, video_message(clip))
    computed = first.prompt_token_ids + first.choices[0].token_ids[:-1]  # what turn 1 left in its row
    answer_text = first.choices[0].message.content
    question = "And what colour is the square?"

    second = chat(server, follow_up(clip, answer_text, question))
    expected = conversation_answer(export, clip, follow_up(None, answer_text, question))
    assert second.prompt_token_ids == expected.prompt_token_ids
    assert second.choices[0].token_ids == expected.generated_token_ids
    reused = common_prefix(computed, second.prompt_token_ids)
    assert reused > len(first.prompt_token_ids) - 2  # past the video: turn 1's whole prompt at least
    assert second.usage.prompt_tokens_details.cached_tokens == reused

    before_video = second.prompt_token_ids.index(video_pad)
    twin = write_mkv(tmp_path / "twin.mkv", moving_square_video(3, 120, 120, seed=11), fps=2)  # same size as clip
    other = chat(server, follow_up(twin, answer_text, question))
    expected = conversation_answer(export, twin, follow_up(None, answer_text, question))
    assert other.choices[0].token_ids == expected.generated_token_ids
    assert other.prompt_token_ids == expected.prompt_token_ids
    assert other.usage.prompt_tokens_details.cached_tokens <= before_video

    q0 = chat(server, follow_up(clip, answer_text, question), extra_body={"mm_processor_kwargs": {"video_pruning_rate": 0}})
    expected = conversation_answer(export, clip, follow_up(None, answer_text, question), VideoPruning("evs", 0.0))
    assert q0.choices[0].token_ids == expected.generated_token_ids
    assert q0.usage.prompt_tokens_details.cached_tokens <= before_video

    salted = chat(server, follow_up(clip, answer_text, question), extra_body={"cache_salt": "another user"})
    assert salted.choices[0].token_ids == second.choices[0].token_ids
    assert salted.usage.prompt_tokens_details.cached_tokens == 0


def test_one_frame_video_file_equals_qeff_evs_run(server, export, media):
    """A one-frame file through the plugin's video loader: HTTP 200, padded in time as ``qeff-evs run`` pads it."""
    expected = run_answer(export, media["one_frame"])
    response = chat(server, video_message(media["one_frame"]))
    assert response.choices[0].token_ids == expected.generated_token_ids
    assert response.prompt_token_ids == expected.prompt_token_ids


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


def test_vllm_bench_serve_runs_with_no_failed_request(server, export, media):
    """vLLM's own benchmark client with ``--model <export>`` (its tokenizer from the export's top) over a local
    ShareGPT-style file whose entries carry local videos (sent as file:// video_url): every request completes."""
    from qeff_evs.bench.serving import ServingLoad, ServingTarget, bench_command, write_sharegpt_videos

    folder = media["folder"]
    dataset = write_sharegpt_videos(folder / "sharegpt.json", [media["clip"], media["other"]], 8)
    load = ServingLoad(num_prompts=8, max_concurrency=4, output_len=4)
    result = folder / "bench_result.json"
    argv = bench_command(ServingTarget(export, 0.5), server.port, dataset, load, result)
    argv[argv.index("--served-model-name") + 1] = "tiny"
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    measured = json.loads(result.read_text())
    assert measured["completed"] == 8 and measured["failed"] == 0
    assert measured["total_output_tokens"] == 8 * 4 and measured["median_ttft_ms"] > 0


# --- soak -------------------------------------------------------------------------------------------------

SOAK_REQUESTS = 300
SOAK_CONCURRENCY = 8
SOAK_BAD_EVERY = 10  # ~10% bad requests, every kind in BAD_REQUESTS
SOAK_DISCONNECT_EVERY = 20  # streaming clients that go away after two chunks


def server_rss(pid: int) -> int:
    """Resident bytes of the server: the API server and every process under it (the engine core)."""
    import psutil

    root = psutil.Process(pid)
    total = 0
    for process in [root, *root.children(recursive=True)]:
        try:
            total += process.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


@pytest.fixture(scope="module")
def soak_media(media, tmp_path_factory):
    folder = tmp_path_factory.mktemp("soak_media")
    from PIL import Image

    clips = {f"video_{frames}x{size}": write_mkv(folder / f"v{frames}_{size}.mkv",
                                                 moving_square_video(frames, 120, size, seed=frames + size), fps=2)
             for frames, size in ((2, 120), (4, 170), (8, 120), (16, 120))}
    images = {}
    for n, (height, width) in enumerate(((112, 168), (300, 200))):
        images[f"image_{height}x{width}"] = folder / f"i{n}.png"
        Image.fromarray(moving_square_video(1, height, width, seed=40 + n)[0]).save(images[f"image_{height}x{width}"])
    return dict(clips, **images)


def soak_good_requests(soak_media, media) -> dict[str, tuple[list[dict], int]]:
    """The distinct good requests (messages, max_tokens): videos of 4 lengths/sizes, images, text, a mix, and the
    one-frame videos once served (ONE_FRAME_REFUSED)."""
    good = {kind: (media_message([("video_url", media[key], MKV)]), 4)
            for kind, (key, _) in ONE_FRAME_VIDEOS.items() if kind not in ONE_FRAME_REFUSED}
    for n, (name, path) in enumerate(soak_media.items()):
        kind, mime = ("video_url", MKV) if name.startswith("video") else ("image_url", "image/png")
        good[name] = (media_message([(kind, path, mime)], f"what is in {name}?"), 4 + n % 4)
    for n, text in enumerate(("hello there", "count from one to ten", "a longer question about squares and frames")):
        good[f"text_{n}"] = (text_message(text), 5 + n)
    good["video_and_image"] = (media_message([("video_url", soak_media["video_4x170"], MKV),
                                              ("image_url", soak_media["image_112x168"], "image/png")]), 6)
    return good


def test_soak_mixed_load_with_faults(server, media, soak_media):
    """300 requests at concurrency 8: videos of 4 lengths, images, text, a video with an image, ~10% bad requests
    of every kind, streaming clients that disconnect. Every good answer equals the same request run alone on
    the same server; every bad one is a 4xx naming its problem; no 5xx; the server is healthy at the end and
    its resident memory grows less than 5% over the last two thirds of the run."""
    import random
    import threading

    log_start = len(server.log.read_text())  # earlier tests' lines are theirs
    good = soak_good_requests(soak_media, media)
    names, bad_kinds = list(good), list(BAD_REQUESTS)
    jobs = []
    for n in range(SOAK_REQUESTS):
        if n % SOAK_BAD_EVERY == SOAK_BAD_EVERY - 1:
            jobs.append(("bad", bad_kinds[(n // SOAK_BAD_EVERY) % len(bad_kinds)]))
        elif n % SOAK_DISCONNECT_EVERY == 3:
            jobs.append(("disconnect", names[n % len(names)]))
        else:
            jobs.append(("good", names[n % len(names)]))
    random.Random(0).shuffle(jobs)

    def run(job):
        kind, name = job
        if kind == "bad":
            build, extra, says = BAD_REQUESTS[name]
            error = bad_request(server, build(media), extra)
            return kind, name, (error.status_code, says in str(error), str(error)[:300])
        messages, max_tokens = good[name]
        if kind == "disconnect":
            stream = server.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=64,
                                                    stream=True)
            for number, _ in enumerate(stream):
                if number == 2:
                    break
            stream.close()
            return kind, name, None
        reply = chat(server, messages, max_tokens=max_tokens)
        return kind, name, reply.choices[0].token_ids

    samples, done, stop = [], [0], threading.Event()

    def sample_rss():
        while not stop.is_set():
            samples.append((done[0], server_rss(server.pid)))
            stop.wait(0.5)

    sampler = threading.Thread(target=sample_rss, daemon=True)
    sampler.start()
    results = []
    with ThreadPoolExecutor(SOAK_CONCURRENCY) as pool:
        for result in pool.map(run, jobs):
            results.append(result)
            done[0] += 1
    samples.append((done[0], server_rss(server.pid)))
    stop.set()
    sampler.join()

    alone = {name: chat(server, messages, max_tokens=max_tokens).choices[0].token_ids
             for name, (messages, max_tokens) in good.items()}
    counts = {"good": 0, "bad": 0, "disconnect": 0}
    for kind, name, outcome in results:
        counts[kind] += 1
        if kind == "good":
            assert outcome == alone[name], name
        elif kind == "bad":
            status, named, text = outcome
            assert 400 <= status < 500 and named, (name, status, text)
    assert sum(counts.values()) == SOAK_REQUESTS and counts["bad"] >= SOAK_REQUESTS // 10 - 1
    assert len({name for kind, name, _ in results if kind == "bad"}) >= 8
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/health", timeout=10) as response:
        assert response.status == 200
    soak_log = server.log.read_text()[log_start:]
    assert " 500 " not in soak_log and " 503 " not in soak_log
    third = [rss for finished, rss in samples if finished >= SOAK_REQUESTS // 3][0]
    growth = samples[-1][1] / third - 1
    print(f"soak: {counts}, {len(set(bad_kinds))} bad kinds, RSS {third / 2**20:.0f} -> {samples[-1][1] / 2**20:.0f} "
          f"MiB ({growth:+.1%}) over the last two thirds")
    assert growth < 0.05


@pytest.mark.parametrize("q, method", [(0.25, "evs"), (0.75, "vidcom2")])
def test_rate_and_method_chosen_at_serve_time(export, media, tmp_path, q, method):
    """The same export served at another rate and method; each answer (q 0.25 and 0.75, EVS and VidCom2, on two
    clips) equals ``qeff-evs run`` with those settings, and the other settings' answers differ in length."""
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


def test_openvino_backend_serves_what_ort_answers(export, media, tmp_path):
    """``QEFF_EVS_BACKEND=openvino``: the same graphs on OpenVINO, served; the answers are ``qeff-evs run``'s on ONNX
    Runtime (fp32 both: the same prompt and tokens)."""
    pytest.importorskip("openvino")
    with vllm_server(export, tmp_path, "--video-pruning-rate", "0.5", backend="openvino") as client:
        for clip in ("clip", "long"):
            expected = run_answer(export, media[clip], VideoPruning("evs", 0.5))
            response = chat(client, video_message(media[clip]))
            assert response.prompt_token_ids == expected.prompt_token_ids, clip
            assert response.choices[0].token_ids == expected.generated_token_ids, clip
