"""``vllm serve`` on a Nemotron-H vision-language export (RADIO tower, Mamba2 / attention / MoE language graph).

vLLM's own class for these checkpoints (``NemotronH_Nano_VL_V2``) needs torchvision and a remote-code config;
the export's ``config.json`` names our interface class instead, so nothing of vLLM's model code runs. A
``video_url`` chat completion gives exactly the tokens of ``qeff-evs run`` on the same file, its prompt is the one
vLLM's processor lays out before encoding (``<video>``, four text tokens of the tiny tokenizer, replaced by the
lumped frame-separator layout), two requests served at once (two KV rows, each row's conv and SSM states its own)
give each its own tokens; images (``image_url``, tiled as vLLM tiles them, ``max_num_tiles`` per request) beside a
video give the tokens of ``qeff-evs run``; VidCom2, which vLLM refuses for this model, a bad tile count and audio
(not built) are refused per request (HTTP 400); row reuse follows Qwen3.5's rule (a Mamba2 state cannot be rewound: a row is reused
only when its whole history is a prefix). A module of its own so this server never runs beside another test
module's.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("vllm.v1.worker.worker_base")
openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn", reason="vLLM's server packages are missing: run bash scripts/install.sh --test")

import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402

from qeff_evs.models.pruning import VideoPruning  # noqa: E402
from qeff_evs.runtime.builders import answer, answer_media, build_engine, stop_ids  # noqa: E402
from qeff_evs.runtime.engine.request import PromptPiece  # noqa: E402
from qeff_evs.runtime.engine.executor import kept_count  # noqa: E402
from qeff_evs.runtime.engine.request import plan_prompt  # noqa: E402
from qeff_evs.runtime.export_bundle import open_export  # noqa: E402
from qeff_evs.runtime.inputs.prompt import video_question_pieces  # noqa: E402
from qeff_evs.runtime.inputs.synthetic import moving_square_video  # noqa: E402
from qeff_evs.runtime.media import image_from_array, video_from_file  # noqa: E402
from conftest import SERVED_FULL_BATCH as FULL_BATCH  # noqa: E402
from helpers.vllm_server import openai_client, vllm_servers  # noqa: E402
from test_vllm_serve import (  # noqa: E402
    MKV, QUESTION, REQUEST_TIMEOUT_S, chat, media_message, video_message, write_mkv,
)

NEW_TOKENS = 8
Q = 0.75


@pytest.fixture(scope="module")
def export(served_export) -> Path:
    return served_export("nemotron_h_omni")[1]


@pytest.fixture(scope="module")
def server(export, tmp_path_factory):
    log = tmp_path_factory.mktemp("nemotron_serve") / "server.log"
    arguments = [str(export), "--video-pruning-rate", str(Q), "--max-num-seqs", str(FULL_BATCH),
                 "--served-model-name", "tiny", "--trust-request-mm-kwargs", "--enable-prompt-tokens-details"]
    with vllm_servers([(arguments, {"QEFF_EVS_BACKEND": "ort"}, log, None)]) as (server,):
        yield openai_client(server.url, REQUEST_TIMEOUT_S)


def test_video_url_equals_qeff_evs_run(server, export, tmp_path):
    clip = write_mkv(tmp_path / "clip.mkv", moving_square_video(8, 120, 180, seed=3), fps=2)
    bundle = open_export(export)
    video = video_from_file(clip, bundle)
    assert video.grid_thw == (4, 4, 6) and video.frame_indices == tuple(range(8))
    questions = (QUESTION, "Describe the moving square.")
    pruning = VideoPruning("evs", Q)
    expected = {q: answer(bundle, build_engine(bundle, "ort", max_new_tokens=NEW_TOKENS, pruning=pruning), video, q)
                for q in questions}
    pieces = video_question_pieces(bundle.tokenizer, QUESTION, bundle.family.token_strings)
    planned = plan_prompt(pieces, [video], [kept_count(bundle.family, video, pruning)], bundle.family).ids.tolist()
    response = chat(server, video_message(clip), max_tokens=NEW_TOKENS)
    with ThreadPoolExecutor(2) as pool:
        together = list(pool.map(lambda q: chat(server, video_message(clip, q), max_tokens=NEW_TOKENS), questions))
    assert len(set(expected[QUESTION].generated_token_ids)) > 1
    assert response.choices[0].token_ids == expected[QUESTION].generated_token_ids
    assert response.prompt_token_ids == planned
    for question, got in zip(questions, together):
        assert got.choices[0].token_ids == expected[question].generated_token_ids, question


def test_vidcom2_is_refused_per_request(server, tmp_path):
    clip = write_mkv(tmp_path / "clip.mkv", moving_square_video(4, 64, 64, seed=1), fps=2)
    with pytest.raises(openai.BadRequestError, match="vidcom2"):
        chat(server, video_message(clip), extra_body={"mm_processor_kwargs": {"video_pruning_method": "vidcom2"}})


def test_images_and_a_video_equal_qeff_evs_run(server, export, tmp_path):
    """Two ``image_url`` parts (tiled as vLLM tiles them) then a ``video_url``, and an image asked with fewer tiles
    (``max_num_tiles`` per request, as vLLM takes it): the tokens and prompt of ``qeff-evs run`` on the same files."""
    rng = np.random.default_rng(4)
    images = []
    for number, (height, width) in enumerate(((100, 150), (64, 64))):
        path = tmp_path / f"image{number}.png"
        Image.fromarray(rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)).save(path)
        images.append(path)
    clip = write_mkv(tmp_path / "clip.mkv", moving_square_video(8, 120, 180, seed=3), fps=2)
    bundle = open_export(export)
    engine = build_engine(bundle, "ort", max_new_tokens=NEW_TOKENS, pruning=VideoPruning("evs", Q))

    def run(paths, kwargs=None, video=True):
        media = [image_from_array(np.asarray(Image.open(path).convert("RGB")), bundle, kwargs) for path in paths]
        return answer_media(bundle, engine, media + ([video_from_file(clip, bundle)] if video else []), QUESTION)

    parts = [("image_url", path, "image/png") for path in images] + [("video_url", clip, MKV)]
    response = chat(server, media_message(parts), max_tokens=NEW_TOKENS)
    expected = run(images)
    assert response.prompt_token_ids == expected.prompt_token_ids
    assert response.choices[0].token_ids == expected.generated_token_ids and len(set(expected.generated_token_ids)) > 1
    fewer = chat(server, media_message(parts[:1]), max_tokens=NEW_TOKENS,
                 extra_body={"mm_processor_kwargs": {"max_num_tiles": 2}})
    expected = run(images[:1], {"max_num_tiles": 2}, video=False)
    assert fewer.prompt_token_ids == expected.prompt_token_ids
    assert fewer.choices[0].token_ids == expected.generated_token_ids
    assert len(fewer.prompt_token_ids) < len(response.prompt_token_ids)


def test_bad_tiles_and_audio_are_refused_per_request(server, tmp_path):
    image = tmp_path / "image.png"
    Image.new("RGB", (64, 64), (200, 30, 30)).save(image)
    with pytest.raises(openai.BadRequestError, match="max_num_tiles must be a positive int, got 0"):
        chat(server, media_message([("image_url", image, "image/png")]),
             extra_body={"mm_processor_kwargs": {"max_num_tiles": 0}})
    with pytest.raises(openai.BadRequestError, match="At most 0 audio"):
        chat(server, media_message([("input_audio", image, "")]))
    response = chat(server, [{"role": "user", "content": "still serving?"}])  # the server keeps serving
    assert response.choices[0].token_ids


def test_a_row_is_reused_only_when_its_whole_history_is_a_prefix(server, export):
    """Token-id prompts (Qwen3.5's test): a request that starts with a finished request's whole history reuses its
    row (cached tokens), one that shares only its prompt reuses nothing; both equal our engine alone."""
    bundle = open_export(export)
    engine = build_engine(bundle, "ort", max_new_tokens=NEW_TOKENS)

    def complete(ids: list[int], max_tokens: int = NEW_TOKENS):
        return server.completions.create(model="tiny", prompt=ids, max_tokens=max_tokens, temperature=0,
                                         extra_body={"return_token_ids": True})

    prompt = bundle.tokenizer.encode("A red square moves left, then a blue circle", add_special_tokens=False)
    more = bundle.tokenizer.encode(" and what happens next?", add_special_tokens=False)
    first = complete(prompt, 3)
    computed = prompt + first.choices[0].token_ids[:-1]
    for ids, reused in ((computed + more, len(computed)), (prompt + more, 0)):
        response = complete(ids)
        expected = engine.generate(engine.prepare([PromptPiece(ids=tuple(ids))], []), eos_ids=stop_ids(bundle))
        assert response.choices[0].token_ids == expected.generated_token_ids
        assert (response.usage.prompt_tokens_details.cached_tokens or 0) == reused


def test_a_video_follow_up_reuses_the_row_of_a_one_token_turn(server, export, tmp_path):
    """A turn about a video answered with one token leaves its row holding exactly its prompt (a Mamba2 state is
    whole), so the follow-up (the video, that answer, a new question) reuses the row past the video: the video item
    is wholly inside the reused prefix, is planned without its pixels and is not encoded again. Tokens equal our
    engine on the whole conversation, alone."""
    from test_vllm_serve import follow_up

    from qeff_evs.runtime.inputs.prompt import conversation_pieces

    bundle = open_export(export)
    clip = write_mkv(tmp_path / "clip.mkv", moving_square_video(6, 120, 120, seed=7), fps=2)
    first = chat(server, video_message(clip), max_tokens=1)
    question = "And what colour is the square?"
    second = chat(server, follow_up(clip, first.choices[0].message.content, question), max_tokens=NEW_TOKENS)
    pieces = conversation_pieces(bundle.tokenizer, follow_up(None, first.choices[0].message.content, question),
                                 bundle.family.token_strings)
    engine = build_engine(bundle, "ort", max_new_tokens=NEW_TOKENS, pruning=VideoPruning("evs", Q))
    expected = engine.generate(engine.prepare(pieces, [video_from_file(clip, bundle)]), eos_ids=stop_ids(bundle))
    assert second.prompt_token_ids == expected.prompt_token_ids
    assert second.prompt_token_ids[:len(first.prompt_token_ids)] == first.prompt_token_ids
    assert second.usage.prompt_tokens_details.cached_tokens == len(first.prompt_token_ids)
    assert second.choices[0].token_ids == expected.generated_token_ids
