"""``vllm serve`` on a Qwen3.5 export (a hybrid language graph: linear-attention state on the device).

vLLM 0.32's own Qwen3.5 class crashes as soon as a video pruning rate is set (vllm #54170); the export's
``config.json`` names our interface class instead, so nothing of vLLM's model code runs. A ``video_url``
chat completion gives exactly the tokens of ``qeff-evs run`` on the same file, and so do two requests
served at once (two KV rows, each row's conv and recurrent state its own). A module of its own so this
server never runs beside ``test_vllm_serve.py``'s.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("vllm.v1.worker.worker_base")
openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn", reason="vLLM's server packages are missing: run bash scripts/install.sh --test")

from qeff_evs.models.pruning import DEFAULT_METHOD, VideoPruning  # noqa: E402
from qeff_evs.runtime.engine.executor import kept_count  # noqa: E402
from qeff_evs.runtime.engine.request import plan_prompt  # noqa: E402
from qeff_evs.runtime.inputs.prompt import video_question_pieces  # noqa: E402
from qeff_evs.runtime.inputs.synthetic import moving_square_video  # noqa: E402
from qeff_evs.runtime.builders import answer, build_engine  # noqa: E402
from qeff_evs.runtime.export_bundle import open_export  # noqa: E402
from qeff_evs.runtime.media import video_from_file  # noqa: E402
from conftest import SERVED_FULL_BATCH as FULL_BATCH  # noqa: E402
from helpers.vllm_server import openai_client, vllm_servers  # noqa: E402
from test_vllm_serve import QUESTION, REQUEST_TIMEOUT_S, chat, video_message, write_mkv  # noqa: E402

NEW_TOKENS = 8


@pytest.fixture(scope="module")
def export(served_export) -> Path:
    return served_export("qwen3_5")[1]


def test_video_url_equals_qeff_evs_run(export, tmp_path):
    clip = write_mkv(tmp_path / "clip.mkv", moving_square_video(8, 120, 120, seed=3), fps=2)
    bundle = open_export(export)
    video = video_from_file(clip, bundle)
    questions = (QUESTION, "Describe the moving square.")
    expected = {q: answer(bundle, build_engine(bundle, "ort", max_new_tokens=NEW_TOKENS), video, q) for q in questions}
    # vLLM reports the prompt it scheduled: the video's placeholder as planned before encoding.
    pieces = video_question_pieces(bundle.tokenizer, QUESTION, bundle.family.token_strings)
    kept = kept_count(bundle.family, video, VideoPruning(DEFAULT_METHOD, bundle.manifest.video_pruning_rate))
    planned = plan_prompt(pieces, [video], [kept], bundle.family).ids.tolist()
    arguments = [str(export), "--video-pruning-rate", "0.5", "--max-num-seqs", str(FULL_BATCH),
                 "--served-model-name", "tiny"]
    with vllm_servers([(arguments, {"QEFF_EVS_BACKEND": "ort"}, tmp_path / "server.log", None)]) as (server,):
        client = openai_client(server.url, REQUEST_TIMEOUT_S)
        response = chat(client, video_message(clip), max_tokens=NEW_TOKENS)
        with ThreadPoolExecutor(2) as pool:
            together = list(pool.map(lambda q: chat(client, video_message(clip, q), max_tokens=NEW_TOKENS), questions))
    assert len(expected[QUESTION].generated_token_ids) > 1
    assert response.choices[0].token_ids == expected[QUESTION].generated_token_ids
    assert response.prompt_token_ids == planned
    for question, got in zip(questions, together):
        assert got.choices[0].token_ids == expected[question].generated_token_ids, question
