"""``vllm serve`` on a Nemotron-H vision-language export (RADIO tower, Mamba2 / attention / MoE language graph).

vLLM's own class for these checkpoints (``NemotronH_Nano_VL_V2``) needs torchvision and a remote-code config;
the export's ``config.json`` names our interface class instead, so nothing of vLLM's model code runs. A
``video_url`` chat completion gives exactly the tokens of ``qeff-evs run`` on the same file, its prompt is the one
vLLM's processor lays out before encoding (``<video>``, four text tokens of the tiny tokenizer, replaced by the
lumped frame-separator layout), two requests served at once (two KV rows, each row's conv and SSM states its own)
give each its own tokens; images (``image_url``, tiled as vLLM tiles them, ``max_num_tiles`` per request) beside a
video give the tokens of ``qeff-evs run``, as do audio clips (``input_audio``) and a video with its sound
(``use_audio_in_video``); VidCom2, which vLLM refuses for this model, a bad tile count, audio at another rate and a
malformed ``use_audio_in_video`` are refused per request (HTTP 400); row reuse follows Qwen3.5's rule (a Mamba2 state cannot be rewound: a row is reused
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


def tone(seconds: float, seed: int) -> np.ndarray:
    t = np.arange(int(16000 * seconds)) / 16000
    return (0.4 * np.sin(2 * np.pi * (300 + 50 * seed) * t)
            + 0.1 * np.random.default_rng(seed).standard_normal(t.shape)).astype(np.float32)


def write_wav(path: Path, samples: np.ndarray, rate: int = 16000) -> Path:
    """16-bit PCM, ``(n,)`` or ``(n, channels)``."""
    import wave

    samples = samples.reshape(len(samples), -1)
    with wave.open(str(path), "wb") as wav:
        wav.setnchannels(samples.shape[1])
        wav.setsampwidth(2)
        wav.setframerate(rate)
        wav.writeframes(np.round(np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes())
    return path


def test_audio_and_a_video_with_its_sound_equal_qeff_evs_run(server, export, tmp_path):
    """``input_audio`` parts (a mono and a stereo WAV, 0.96 s and 2.3 s) then a video, and a ``video_url`` whose
    soundtrack is asked for (``use_audio_in_video`` per request: vLLM reads the track from the URL and lays it out
    after the video): the tokens and prompt of ``qeff-evs run`` on the same files."""
    from qeff_evs.bench.serving import write_video
    from qeff_evs.runtime.inputs.audio_features import audio_from_file, video_sound

    bundle = open_export(export)
    features = bundle.family.audio_features()
    speech = write_wav(tmp_path / "speech.wav", tone(0.96, 1))
    stereo = write_wav(tmp_path / "stereo.wav", np.stack([tone(2.3, 2), tone(2.3, 3)], axis=1))
    clip = write_mkv(tmp_path / "clip.mkv", moving_square_video(8, 120, 180, seed=3), fps=2)
    sounding = write_video(tmp_path / "sounding.mkv", moving_square_video(8, 120, 180, seed=5), 2, sound=tone(4.0, 4))
    engine = build_engine(bundle, "ort", max_new_tokens=NEW_TOKENS, pruning=VideoPruning("evs", Q))
    audios = [audio_from_file(path, features) for path in (speech, stereo)]

    response = chat(server, media_message([("input_audio", speech, ""), ("input_audio", stereo, ""),
                                           ("video_url", clip, MKV)]), max_tokens=NEW_TOKENS)
    expected = answer_media(bundle, engine, [*audios, video_from_file(clip, bundle)], QUESTION)
    assert response.prompt_token_ids == expected.prompt_token_ids
    assert response.choices[0].token_ids == expected.generated_token_ids and len(set(expected.generated_token_ids)) > 1

    with_sound = chat(server, media_message([("video_url", sounding, MKV)]), max_tokens=NEW_TOKENS,
                      extra_body={"mm_processor_kwargs": {"use_audio_in_video": True}})
    sound = video_sound(sounding, features)
    assert sound is not None and sound.clip_frames == (400,)
    expected = answer_media(bundle, engine, [video_from_file(sounding, bundle), sound], QUESTION,
                            use_audio_in_video=True)
    assert with_sound.prompt_token_ids == expected.prompt_token_ids
    assert with_sound.choices[0].token_ids == expected.generated_token_ids
    silent = chat(server, media_message([("video_url", sounding, MKV)]), max_tokens=NEW_TOKENS)
    assert len(silent.prompt_token_ids) == len(with_sound.prompt_token_ids) - 52  # <so_start>, 50 rows, <so_end>


def test_bad_tiles_audio_and_sound_are_refused_per_request(server, tmp_path):
    image = tmp_path / "image.png"
    Image.new("RGB", (64, 64), (200, 30, 30)).save(image)
    with pytest.raises(openai.BadRequestError, match="max_num_tiles must be a positive int, got 0"):
        chat(server, media_message([("image_url", image, "image/png")]),
             extra_body={"mm_processor_kwargs": {"max_num_tiles": 0}})
    fast = write_wav(tmp_path / "fast.wav", tone(0.5, 1), rate=44100)
    with pytest.raises(openai.BadRequestError, match="audio sampled at 44100 Hz: .* takes 16000 Hz"):
        chat(server, media_message([("input_audio", fast, "")]))
    from qeff_evs.bench.serving import write_video

    silent = write_mkv(tmp_path / "silent.mkv", moving_square_video(4, 64, 64, seed=1), fps=2)
    with pytest.raises(openai.BadRequestError, match="No audio stream found"):  # vLLM's own line
        chat(server, media_message([("video_url", silent, MKV)]),
             extra_body={"mm_processor_kwargs": {"use_audio_in_video": True}})
    sounding = write_video(tmp_path / "sounding.mkv", moving_square_video(4, 64, 64, seed=1), 2, sound=tone(1.0, 2))
    with pytest.raises(openai.BadRequestError, match="use_audio_in_video must be true or false, got 'yes'"):
        chat(server, media_message([("video_url", sounding, MKV)]),
             extra_body={"mm_processor_kwargs": {"use_audio_in_video": "yes"}})
    response = chat(server, [{"role": "user", "content": "still serving?"}])  # the server keeps serving
    assert response.choices[0].token_ids


def test_a_server_wide_use_audio_in_video_without_the_sound_names_the_requests_flag(export):
    """A server-wide use_audio_in_video reaches the processor with no audio item (vLLM's chat API reads a video's
    track only when the request asks): one line naming the request's flag, not vLLM's 22.05 kHz bytes fallback."""
    from types import SimpleNamespace

    from qeff_evs.vllm.processing.processor import QeffEvsProcessor
    from qeff_evs.vllm.surface import VLLMValidationError

    processor = SimpleNamespace(info=SimpleNamespace(serves_audio=True))
    family = open_export(export).family
    for counts, line in (({"video": 1}, 'no sound came with the video.*pass mm_processor_kwargs {"use_audio_in_video": '
                                        'true} in the request'),
                         ({"video": 2, "audio": 1}, r"needs each video's sound: 2 video\(s\) and 1 audio item")):
        inputs = SimpleNamespace(mm_data_items=SimpleNamespace(get_all_counts=lambda counts=counts: counts))
        with pytest.raises(VLLMValidationError, match=line):
            QeffEvsProcessor._with_video_sound(processor, inputs, family)


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
