"""``vllm serve`` on the MoE exports (Qwen3-VL-MoE and Qwen3.5-MoE), through qeff-evs's interface classes.

vLLM 0.32's own Qwen3.5-MoE class crashes as soon as a video pruning rate is set (vllm #54170); the exports'
``config.json`` names our interface classes instead, so nothing of vLLM's model code runs. One server per family,
both started at once (one start-up wait): a ``video_url`` chat completion at q = 0.5 gives exactly the tokens of
``qeff-evs run`` (the engine over the same export and file), and vLLM reports the prompt our processor planned.
A module of its own so these servers never run beside another module's.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.v1.worker.worker_base")
openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn", reason="vLLM's server packages are missing: run bash scripts/install.sh --test")

from qeff_evs.models.pruning import DEFAULT_METHOD, VideoPruning  # noqa: E402
from qeff_evs.runtime.builders import answer, build_engine  # noqa: E402
from qeff_evs.runtime.engine.executor import kept_count  # noqa: E402
from qeff_evs.runtime.engine.request import plan_prompt  # noqa: E402
from qeff_evs.runtime.export_bundle import open_export  # noqa: E402
from qeff_evs.runtime.inputs.prompt import video_question_pieces  # noqa: E402
from qeff_evs.runtime.inputs.synthetic import moving_square_video  # noqa: E402
from qeff_evs.runtime.media import video_from_file  # noqa: E402
from conftest import SERVED_FULL_BATCH as FULL_BATCH  # noqa: E402
from helpers.vllm_server import openai_client, vllm_servers  # noqa: E402
from test_vllm_serve import QUESTION, REQUEST_TIMEOUT_S, chat, video_message, write_mkv  # noqa: E402

FAMILIES = ("qwen3_vl_moe", "qwen3_5_moe")
NEW_TOKENS = 8


def test_video_url_equals_qeff_evs_run(served_export, tmp_path):
    clip = write_mkv(tmp_path / "clip.mkv", moving_square_video(8, 120, 120, seed=3), fps=2)
    exports = {family: served_export(family)[1] for family in FAMILIES}
    expected, planned = {}, {}
    for family, export in exports.items():
        bundle = open_export(export)
        assert bundle.family.name == family
        video = video_from_file(clip, bundle)
        expected[family] = answer(bundle, build_engine(bundle, "ort", max_new_tokens=NEW_TOKENS), video, QUESTION)
        # vLLM reports the prompt it scheduled: the video's placeholder as planned before encoding.
        pieces = video_question_pieces(bundle.tokenizer, QUESTION, bundle.family.token_strings)
        kept = kept_count(bundle.family, video, VideoPruning(DEFAULT_METHOD, bundle.manifest.video_pruning_rate))
        planned[family] = plan_prompt(pieces, [video], [kept], bundle.family).ids.tolist()
    specs = [([str(export), "--video-pruning-rate", "0.5", "--max-num-seqs", str(FULL_BATCH),
               "--served-model-name", "tiny"], {"QEFF_EVS_BACKEND": "ort"}, tmp_path / f"{family}.log", None)
             for family, export in exports.items()]
    with vllm_servers(specs) as servers:
        responses = {family: chat(openai_client(server.url, REQUEST_TIMEOUT_S), video_message(clip),
                                  max_tokens=NEW_TOKENS)
                     for family, server in zip(exports, servers)}
    for family, response in responses.items():
        assert len(expected[family].generated_token_ids) > 1, family
        assert response.choices[0].token_ids == expected[family].generated_token_ids, family
        assert response.prompt_token_ids == planned[family], family
