"""Data-parallel replicas behind vllm-router with session affinity.

Two ``vllm serve`` replicas of the tiny Qwen2.5-VL export behind the real ``vllm-router --policy consistent_hash``:
four conversations, each with its own ``X-Session-ID``, each a video question then a follow-up (the answer and a
new question). The router hashes the header, so a conversation's follow-up reaches the replica that served its
first turn and reuses that turn's KV row: its ``usage.prompt_tokens_details.cached_tokens`` (the server's own
count of prompt tokens it did not compute) is everything turn 1 left in the row up to where the ids differ; the
tokens equal our single-request engine on the whole conversation. Each replica's ``/metrics`` counts the turns it
served: every conversation's two turns on one replica.
"""

from __future__ import annotations

import re
import urllib.request

import pytest

SESSIONS = ("alice", "bob", "carol", "dave")


@pytest.fixture(scope="module")
def replicas(served_export, tmp_path_factory):
    pytest.importorskip("uvicorn", reason="vLLM's server packages are missing: run bash scripts/install.sh --test")
    from conftest import SERVED_FULL_BATCH
    from helpers.vllm_server import vllm_servers

    from qeff_evs.bench.server_process import start_router, stop

    export = served_export("qwen2_5_vl")[1]
    folder = tmp_path_factory.mktemp("router_dp")
    arguments = [str(export), "--video-pruning-rate", "0.5", "--max-num-seqs", str(SERVED_FULL_BATCH),
                 "--served-model-name", "tiny", "--enable-prompt-tokens-details"]
    env = {"QEFF_EVS_BACKEND": "ort"}
    with vllm_servers([(arguments, env, folder / f"replica{n}.log", None) for n in range(2)]) as servers:
        router, url = start_router(["--worker-urls", *[s.url for s in servers], "--policy", "consistent_hash"],
                                   folder / "router.log")
        try:
            yield export, servers, url
        finally:
            stop(router)


def served_by(server) -> int:
    """Requests a replica finished, from its own /metrics."""
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as response:
        text = response.read().decode()
    return int(sum(float(v) for v in re.findall(r'^vllm:request_success_total\{[^}]*\} ([0-9.e+]+)$', text, re.M)))


def test_a_sessions_follow_up_reaches_its_replica_and_reuses_its_row(replicas, tmp_path):
    from helpers.vllm_server import openai_client
    from test_vllm_serve import (QUESTION, REQUEST_TIMEOUT_S, chat, common_prefix, conversation_answer, follow_up,
                                 video_message, write_mkv)

    from qeff_evs.runtime.inputs.synthetic import moving_square_video

    export, servers, url = replicas
    client = openai_client(url, REQUEST_TIMEOUT_S)
    question = "And what colour is the square?"
    for n, session in enumerate(SESSIONS):
        clip = write_mkv(tmp_path / f"{session}.mkv", moving_square_video(3 + n % 2, 120, 120, seed=60 + n), fps=2)
        headers = {"X-Session-ID": session}
        before = [served_by(s) for s in servers]
        first = chat(client, video_message(clip), extra_headers=headers)
        after_first = [served_by(s) for s in servers]
        computed = first.prompt_token_ids + first.choices[0].token_ids[:-1]  # what turn 1 left in its row
        second = chat(client, follow_up(clip, first.choices[0].message.content, question), extra_headers=headers)
        after_second = [served_by(s) for s in servers]
        [replica] = [i for i in range(2) if after_first[i] > before[i]]
        assert after_second[replica] == after_first[replica] + 1, session  # the follow-up went where turn 1 ran
        assert after_second[1 - replica] == after_first[1 - replica]
        reused = common_prefix(computed, second.prompt_token_ids)
        assert reused > len(first.prompt_token_ids) - 2  # turn 1's whole prompt, the video included
        assert second.usage.prompt_tokens_details.cached_tokens == reused, session
        if n == 0:  # the reused row gives the tokens of the whole conversation computed alone
            expected = conversation_answer(export, clip, follow_up(None, first.choices[0].message.content, question))
            assert second.choices[0].token_ids == expected.generated_token_ids
    assert QUESTION
