"""``vllm serve`` on a Qwen3.5 export (a hybrid language graph: linear-attention state on the device).

vLLM 0.32's own Qwen3.5 class crashes as soon as a video pruning rate is set (vllm #54170); the export's
``config.json`` names our interface class instead, so nothing of vLLM's model code runs. A ``video_url``
chat completion gives exactly the tokens of ``qeff-evs run`` on the same file, and so do two requests
served at once (two KV rows, each row's conv and recurrent state its own). Row reuse: the
linear-attention state cannot be rewound, so a row is reused only when its whole history is a prefix of the new
request. A module of its own so this server never runs beside ``test_vllm_serve.py``'s.
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
from qeff_evs.runtime.builders import answer, build_engine, stop_ids  # noqa: E402
from qeff_evs.runtime.engine.request import PromptPiece  # noqa: E402
from qeff_evs.runtime.export_bundle import open_export  # noqa: E402
from qeff_evs.runtime.media import video_from_file  # noqa: E402
from conftest import SERVED_FULL_BATCH as FULL_BATCH  # noqa: E402
from helpers.vllm_server import openai_client, vllm_servers  # noqa: E402
from test_vllm_serve import QUESTION, REQUEST_TIMEOUT_S, chat, video_message, write_mkv  # noqa: E402

NEW_TOKENS = 8


@pytest.fixture(scope="module")
def export(served_export) -> Path:
    return served_export("qwen3_5")[1]


@pytest.fixture(scope="module")
def server(export, tmp_path_factory):
    log = tmp_path_factory.mktemp("qwen3_5_serve") / "server.log"
    arguments = [str(export), "--video-pruning-rate", "0.5", "--max-num-seqs", str(FULL_BATCH),
                 "--served-model-name", "tiny", "--enable-prompt-tokens-details"]
    with vllm_servers([(arguments, {"QEFF_EVS_BACKEND": "ort"}, log, None)]) as (server,):
        yield openai_client(server.url, REQUEST_TIMEOUT_S)


def test_video_url_equals_qeff_evs_run(server, export, tmp_path):
    clip = write_mkv(tmp_path / "clip.mkv", moving_square_video(8, 120, 120, seed=3), fps=2)
    bundle = open_export(export)
    video = video_from_file(clip, bundle)
    questions = (QUESTION, "Describe the moving square.")
    expected = {q: answer(bundle, build_engine(bundle, "ort", max_new_tokens=NEW_TOKENS), video, q) for q in questions}
    # vLLM reports the prompt it scheduled: the video's placeholder as planned before encoding.
    pieces = video_question_pieces(bundle.tokenizer, QUESTION, bundle.family.token_strings)
    kept = kept_count(bundle.family, video, VideoPruning(DEFAULT_METHOD, bundle.manifest.video_pruning_rate))
    planned = plan_prompt(pieces, [video], [kept], bundle.family).ids.tolist()
    response = chat(server, video_message(clip), max_tokens=NEW_TOKENS)
    with ThreadPoolExecutor(2) as pool:
        together = list(pool.map(lambda q: chat(server, video_message(clip, q), max_tokens=NEW_TOKENS), questions))
    assert len(expected[QUESTION].generated_token_ids) > 1
    assert response.choices[0].token_ids == expected[QUESTION].generated_token_ids
    assert response.prompt_token_ids == planned
    for question, got in zip(questions, together):
        assert got.choices[0].token_ids == expected[question].generated_token_ids, question


def test_a_row_is_reused_only_when_its_whole_history_is_a_prefix(server, export):
    """Token-id prompts, so what a row holds is known exactly: turn 1 leaves its prompt and all but its last generated
    token. A request that starts with all of it reuses it (cached tokens), one that shares only the prompt reuses
    nothing (its row would need the state after the prompt alone); both equal our engine alone on the same ids."""
    bundle = open_export(export)
    engine = build_engine(bundle, "ort", max_new_tokens=NEW_TOKENS)

    def complete(ids: list[int], max_tokens: int = NEW_TOKENS):
        return server.completions.create(model="tiny", prompt=ids, max_tokens=max_tokens, temperature=0,
                                         extra_body={"return_token_ids": True})

    prompt = bundle.tokenizer.encode("A red square moves left, then a blue circle", add_special_tokens=False)
    more = bundle.tokenizer.encode(" and what happens next?", add_special_tokens=False)
    first = complete(prompt, 3)
    computed = prompt + first.choices[0].token_ids[:-1]
    whole, part = computed + more, prompt + more
    for ids, reused in ((whole, len(computed)), (part, 0)):
        response = complete(ids)
        expected = engine.generate(engine.prepare([PromptPiece(ids=tuple(ids))], []), eos_ids=stop_ids(bundle))
        assert response.choices[0].token_ids == expected.generated_token_ids
        assert (response.usage.prompt_tokens_details.cached_tokens or 0) == reused
