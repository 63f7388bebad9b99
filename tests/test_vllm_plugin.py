"""The real vLLM engine serves qeff-evs exports through the plugin: ``LLM.generate``.

Each family's export (4 KV rows, 16-token prefill chunks) gets one vLLM engine, in a child process
(``tests/vllm_child.py``: vLLM picks its platform once per process), over 8 greedy requests: videos of
different lengths and sizes, an image, a video with an image, text only. The token budget (16) is
smaller than a video's placeholder and there are more requests than KV rows, so vLLM's scheduler
cuts chunks inside placeholders and runs prefill chunks beside decodes. Each request's tokens must
equal ``qeff-evs run`` of that request alone (our single-request engine, same export, same backend).
The same engine also answers sampled requests (seeded, temperature > 0, logprobs) through vLLM's
sampler. The PyTorch reference backend through the same plugin gives the same greedy tokens.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm.v1.worker.worker_base")
# vLLM's engine imports more than its pure-Python oracles; scripts/install.sh --test installs it all.
pytest.importorskip("blake3", reason="vLLM's engine packages are missing: run bash scripts/install.sh --test")

from conftest import SERVED_CTX_LEN as CTX_LEN, SERVED_FULL_BATCH as FULL_BATCH  # noqa: E402
from conftest import SERVED_PREFILL, SERVED_RESOLUTIONS as RESOLUTIONS  # noqa: E402
from qeff_evs.runtime.engine.executor import kept_count  # noqa: E402
from qeff_evs.runtime.engine.request import PromptPiece, plan_prompt  # noqa: E402
from qeff_evs.runtime.inputs.prompt import chat_pieces  # noqa: E402
from qeff_evs.runtime.builders import answer, build_engine, stop_ids, video_pruning  # noqa: E402
from qeff_evs.runtime.export_bundle import open_export  # noqa: E402
from qeff_evs.runtime.media import image_from_array, video_from_file  # noqa: E402
from qeff_evs.runtime.sessions import sessions_for  # noqa: E402
from qeff_evs.runtime.inputs.synthetic import moving_square_video  # noqa: E402

CHILD = Path(__file__).with_name("vllm_child.py")
BUDGET = SERVED_PREFILL  # vLLM's token budget per step: smaller than a video placeholder
NEW_TOKENS = 6
ENGINE_ARGS = dict(max_model_len=CTX_LEN, max_num_seqs=FULL_BATCH, max_num_batched_tokens=BUDGET,
                   enable_prefix_caching=False, video_pruning_rate=0.5, seed=0)


def vllm_child(tmp_path: Path, export: Path, backend: str, requests: list[dict], engine: dict,
               timeout: int = 600) -> subprocess.CompletedProcess:
    job = tmp_path / f"job_{backend}.json"
    job.write_text(json.dumps(dict(export=str(export), backend=backend, engine=engine, requests=requests)))
    env = {k: v for k, v in os.environ.items() if k != "QEFF_EVS_BACKEND"}
    return subprocess.run([sys.executable, str(CHILD), str(job), str(job.with_suffix(".result.json"))], env=env,
                          capture_output=True, text=True, timeout=timeout)


def run_vllm(tmp_path: Path, export: Path, backend: str, requests: list[dict]) -> list[dict]:
    done = vllm_child(tmp_path, export, backend, requests, ENGINE_ARGS)
    assert done.returncode == 0, done.stderr[-6000:]
    return json.loads((tmp_path / f"job_{backend}.result.json").read_text())["generate"]


def vllm_prompt_ids(pieces: list[PromptPiece], media, family) -> list[int]:
    """What a client sends vLLM: the template's ids with one pad per media item (vLLM expands it)."""
    pads = family.special_tokens()
    ids = []
    for piece in pieces:
        ids += list(piece.ids) if piece.media_item is None else [
            pads.image_pad if media[piece.media_item].kind == "image" else pads.video_pad]
    return ids


class Served:
    """One family's export, its media and requests, and vLLM's answers."""

    def __init__(self, export: Path, folder: Path):
        self.export = export
        self.bundle = open_export(self.export)
        (h0, w0), (h1, w1) = RESOLUTIONS[self.bundle.manifest.family]
        clips = dict(long=(16, h0, w0), eight=(8, h1, w1), four=(4, h0, w0), short=(3, h1, w1))
        self.videos = {}
        for n, (name, (frames, h, w)) in enumerate(clips.items()):
            path = folder / f"{name}.npy"
            np.save(path, moving_square_video(frames, h + 8, w, seed=n))
            self.videos[name] = path
        self.image = folder / "image.npy"
        np.save(self.image, moving_square_video(1, h1, w1, seed=9)[0])
        tok = self.bundle.tokenizer
        video, image, text = {"type": "video"}, {"type": "image"}, lambda s: {"type": "text", "text": s}
        # (content, videos, images) in prompt order
        self.requests = [
            ([video, text("what moves here?")], ["eight"], []),
            ([video, text("the square")], ["four"], []),
            ([video, text("why left or right")], ["long"], []),
            ([image, text("describe the picture")], [], ["image"]),
            ([text("no media at all, just text")], [], []),
            ([text("first"), video, text("then"), image, text("compare")], ["four"], ["image"]),
            ([video, text("colour?")], ["short"], []),
            ([video, text("frame 7 why")], ["eight"], []),
        ]
        self.pieces = [chat_pieces(tok, content, self.bundle.family.token_strings) for content, _, _ in self.requests]

    def media(self, index: int):
        _, videos, images = self.requests[index]
        return ([video_from_file(self.videos[v], self.bundle) for v in videos]
                + [image_from_array(np.load(self.image), self.bundle) for _ in images])

    def job(self, index: int, **sampling) -> dict:
        _, videos, images = self.requests[index]
        ids = vllm_prompt_ids(self.pieces[index], self.media(index), self.bundle.family)
        return dict(prompt_token_ids=ids, video=[str(self.videos[v]) for v in videos],
                    image=[str(self.image) for _ in images],
                    sampling=dict(dict(temperature=0.0, max_tokens=NEW_TOKENS), **sampling))

    def alone(self, index: int) -> tuple[list[int], list[int]]:
        """``qeff-evs run`` of request ``index`` alone: (prompt ids, generated ids)."""
        bundle, m = self.bundle, self.bundle.manifest
        media = self.media(index)
        engine = build_engine(bundle, "ort", max_new_tokens=NEW_TOKENS)
        if [p.media_item for p in self.pieces[index]] == [None, 0, None] and media[0].kind == "video" and len(media) == 1:
            question = self.requests[index][0][1]["text"]
            result = answer(bundle, engine, media[0], question)  # exactly the CLI's path
        else:
            result = engine.generate(engine.prepare(self.pieces[index], media), eos_ids=stop_ids(bundle))
        plan = plan_prompt(self.pieces[index], media, [kept_count(bundle.family, x, video_pruning(bundle))
                                                       for x in media], bundle.family)
        return plan.ids.tolist(), result.generated_token_ids


@pytest.fixture(scope="module")
def build(served_export, tmp_path_factory):
    """One ``Served`` per family for the module, whichever test asks first."""
    made: dict[str, Served] = {}

    def get(family: str) -> Served:
        if family not in made:
            made[family] = Served(served_export(family)[1], tmp_path_factory.mktemp(f"plugin_{family}"))
        return made[family]
    return get


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl", "qwen3_5"])
def served(request, build):
    return build(request.param)


@pytest.fixture(scope="module")
def qwen2_5(build):
    return build("qwen2_5_vl")


SAMPLED = dict(seeded=dict(temperature=1.0, seed=1234, max_tokens=8),
               hot=dict(temperature=1.5, top_p=0.9, top_k=50, max_tokens=8),
               logprobs=dict(temperature=0.0, max_tokens=4, logprobs=3))


@pytest.fixture(scope="module")
def answers(served, tmp_path_factory):
    requests = [served.job(i) for i in range(len(served.requests))]
    requests += [served.job(0, **SAMPLED["seeded"]), served.job(0, **SAMPLED["seeded"]),
                 served.job(0, **SAMPLED["hot"]), served.job(1, **SAMPLED["logprobs"])]
    return run_vllm(tmp_path_factory.mktemp("vllm"), served.export, "ort", requests)


def test_llm_generate_equals_each_request_alone(served, answers):
    m = served.bundle.manifest
    # More requests than KV rows (prefills beside decodes), and videos longer than the budget (chunks
    # that end inside a placeholder).
    assert len(served.requests) > m.language_shape.full_batch_size
    largest = max(kept_count(served.bundle.family, x, video_pruning(served.bundle))
                  for i in range(len(served.requests)) for x in served.media(i))
    assert largest > BUDGET
    for index in range(len(served.requests)):
        prompt_ids, tokens = served.alone(index)
        assert answers[index]["prompt_token_ids"] == prompt_ids, index
        assert answers[index]["token_ids"] == tokens, index


def test_vllm_sampler_runs_on_our_logits(served, answers):
    greedy = answers[0]["token_ids"]
    first, second, hot, logprobs = answers[len(served.requests):]
    assert first["token_ids"] == second["token_ids"]  # same seed, same tokens, whatever else ran beside them
    assert len(first["token_ids"]) == 8
    assert first["token_ids"][:NEW_TOKENS] != greedy  # sampled, not silently greedy
    assert hot["token_ids"][:NEW_TOKENS] != greedy
    assert logprobs["token_ids"] == answers[1]["token_ids"][:4]
    for token, step in zip(logprobs["token_ids"], logprobs["logprobs"]):
        assert len(step) >= 3 and str(token) in step
        assert step[str(token)] == max(step.values()) and all(v <= 0 for v in step.values())


def test_a_seeded_request_draws_the_same_tokens_on_another_engine_alone(qwen2_5, tmp_path_factory):
    """vLLM 0.34's seeded noise depends on (seed, position, token) only: the same seeded request, alone on a second
    engine, draws what it drew beside a batch on the first."""
    seeded = qwen2_5.job(0, **SAMPLED["seeded"])
    batched = run_vllm(tmp_path_factory.mktemp("first"), qwen2_5.export, "ort",
                       [qwen2_5.job(i) for i in range(3)] + [seeded])[-1]
    alone = run_vllm(tmp_path_factory.mktemp("second"), qwen2_5.export, "ort", [seeded])[0]
    assert alone["token_ids"] == batched["token_ids"] and len(alone["token_ids"]) == 8


def test_torch_backend_through_the_plugin_gives_the_same_tokens(qwen2_5, tmp_path):
    """``QEFF_EVS_BACKEND=torch``: the PyTorch reference on the export's checkpoint, same plugin, same tokens."""
    indices = [0, 3, 5]  # a video, an image, a video with an image
    torch_answers = run_vllm(tmp_path, qwen2_5.export, "torch", [qwen2_5.job(i) for i in indices])
    assert [a["token_ids"] for a in torch_answers] == [qwen2_5.alone(i)[1] for i in indices]


def test_start_up_refuses_what_the_export_cannot_serve(qwen2_5, tmp_path):
    engine = dict(ENGINE_ARGS, max_num_seqs=2 * FULL_BATCH)
    done = vllm_child(tmp_path, qwen2_5.export, "ort", [qwen2_5.job(4)], engine)
    assert done.returncode != 0
    assert f"max_num_seqs {2 * FULL_BATCH} is above the export's full batch size {FULL_BATCH}" in done.stderr


def test_start_up_refuses_an_export_that_did_not_finish(qwen2_5, tmp_path):
    """A folder without its completion record (an export killed before it wrote manifest.json) is not served."""
    unfinished = tmp_path / "unfinished"
    shutil.copytree(qwen2_5.export, unfinished)
    (unfinished / "manifest.json").unlink()
    done = vllm_child(tmp_path, unfinished, "ort", [qwen2_5.job(4)], ENGINE_ARGS)
    assert done.returncode != 0
    assert f"the export into {unfinished} did not finish" in done.stderr, done.stderr[-3000:]


def test_start_up_refuses_another_kv_connector_in_one_line(qwen2_5, tmp_path):
    """KV transfer is served through qeff-evs's connector only (tests/test_vllm_pd.py serves it); vLLM's own are
    refused at start-up, one line naming the connector and the fix."""
    engine = dict(ENGINE_ARGS, kv_transfer_config={"kv_connector": "ExampleConnector", "kv_role": "kv_producer"})
    done = vllm_child(tmp_path, qwen2_5.export, "ort", [qwen2_5.job(4)], engine)
    assert done.returncode != 0
    [line] = [line for line in done.stderr.splitlines() if line.startswith("  - ")]  # vLLM's wrapper may follow
    assert line.startswith("  - kv_connector 'ExampleConnector': an export's KV rows live in its language graph's "
                           "retained state, which only qeff-evs's connector reads and writes; pass \"kv_connector\": "
                           "\"QeffEvsKVConnector\" (it speaks the kv_transfer_params of vllm-router's PD mode)"), line
