"""The KV cache is zeroed once, when a session's program is made, never per request: stale slots stay masked.

On every backend (ONNX Runtime and PyTorch keep the state on the host, QAIC on the fake card of
``test_qaic_session.py``), a session serves one request, then every KV row and the retained vision window
are filled with large finite garbage, then the next request runs in those rows. Its tokens and logits must
equal, bit for bit, the same request on a fresh session: a step reads only the slots up to its own last
position, all of which its own request wrote, and zeroes the reads past it. A control shows the garbage
is not inert: placed inside the slots a step reads, it changes the logits.
Both engine paths: the single-request engine (``build_engine``) and the serving engine (``build_serving_engine``,
a continuous-batching export, requests taking used rows, row reuse off: with it a request reads the prefix an
earlier one left in its row, which is exact because nothing but the engine writes a row).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from qeff_evs.cli import main
from qeff_evs.runtime.backends.base import DecodeRow, decode_batch
from qeff_evs.runtime.engine.serving import ServeRequest
from qeff_evs.runtime.inputs.prompt import video_question_pieces
from qeff_evs.runtime.builders import answer, build_engine, build_serving_engine
from qeff_evs.runtime.export_bundle import open_export
from qeff_evs.runtime.media import video_from_file
from test_qaic_session import FakeDevice, build_fake_sdk, fake_compile

BACKENDS = ("ort", "torch", "qaic")
QUESTIONS = ("What happens in this video?", "Describe the moving square.", "Where does the square go?",
             "What colour is the background?")
NEW_TOKENS = 5
HOST_GARBAGE, DEVICE_GARBAGE = 1e30, 6e4  # finite in fp32 / in fp16 (the card's KV dtype)


def for_the_card(export: Path, folder: Path) -> Path:
    copy = folder / "build"
    shutil.copytree(export, copy)
    assert main(["compile", str(copy)]) == 0
    for graph in ("encoder", "pruning_evs", "pruning_vidcom2", "language"):
        fake_compile(copy, graph)
    return copy


@pytest.fixture
def card(monkeypatch) -> FakeDevice:
    fake = FakeDevice()
    rt, api = build_fake_sdk(fake)
    monkeypatch.setitem(sys.modules, "qaicrt", rt)
    monkeypatch.setitem(sys.modules, "QAicApi_pb2", api)
    return fake


def retained_state(language) -> dict[str, np.ndarray]:
    """The session's retained inputs (KV per layer, vision window), where they live: the host or the card."""
    if hasattr(language, "state"):  # ONNX Runtime, PyTorch
        return language.state
    return language.program.device_program.program.state  # the fake card's copy, in its dtype


def fill_with_garbage(language, seed: int) -> None:
    rng = np.random.default_rng(seed)
    state = retained_state(language)
    for name, value in state.items():
        scale = DEVICE_GARBAGE if value.dtype == np.float16 else HOST_GARBAGE
        value[...] = rng.choice([-1.0, 1.0], size=value.shape) * scale  # in place: ONNX Runtime's are bound buffers
        assert np.isfinite(value).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_single_request_engine_in_a_used_row_equals_a_fresh_session(backend, tiny_export, video_npy, tmp_path, card):
    export = for_the_card(tiny_export, tmp_path) if backend == "qaic" else tiny_export
    bundle = open_export(export)
    video = video_from_file(video_npy, bundle)
    fresh = build_engine(bundle, backend, NEW_TOKENS)
    expected = answer(bundle, fresh, video, QUESTIONS[1])
    fresh.close()  # on the card: the fresh programs give their cores back first

    engine = build_engine(bundle, backend, NEW_TOKENS)
    answer(bundle, engine, video, QUESTIONS[0])
    fill_with_garbage(engine.language, seed=0)
    got = answer(bundle, engine, video, QUESTIONS[1])
    assert got.generated_token_ids == expected.generated_token_ids
    assert got.prefill_top_logits == expected.prefill_top_logits  # exactly: stale slots are never read
    engine.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_serving_engine_in_used_rows_equals_a_fresh_session(backend, served_export, video_npy, tmp_path, card):
    _, export = served_export("qwen2_5_vl")
    export = for_the_card(export, tmp_path) if backend == "qaic" else export
    bundle = open_export(export)
    video = video_from_file(video_npy, bundle)

    def requests(questions) -> list[ServeRequest]:
        return [ServeRequest(q, video_question_pieces(bundle.tokenizer, q), [video], NEW_TOKENS) for q in questions]

    def serve(engine, questions) -> dict[str, list[int]]:
        for request in requests(questions):
            engine.add_request(request)
        return engine.run_to_completion()

    fresh = build_serving_engine(bundle, backend)
    expected = serve(fresh, QUESTIONS[2:])
    fresh.close()

    # Row reuse off: it reads the prefix an earlier request left in a row on purpose (test_row_reuse.py), and the
    # garbage below stands for rows it must not trust; here no request may read another's slots.
    engine = build_serving_engine(bundle, backend, row_reuse=False)
    serve(engine, QUESTIONS[:2])  # rows 0 and 1 hold these requests' KV afterwards
    fill_with_garbage(engine.executor.language, seed=1)  # every row, used or not
    assert serve(engine, QUESTIONS[2:]) == expected
    engine.close()


def test_garbage_inside_the_slots_a_step_reads_changes_its_logits(tiny_export):
    """The control: the same garbage where a decode step does read (slots below its own) is not hidden."""
    bundle = open_export(tiny_export)
    engine = build_engine(bundle, "ort")
    language = engine.language
    step, _ = decode_batch([DecodeRow(cache_row=0, token_id=5, kv_slot=40, mrope_position=40)], 1, 1)
    clean = language.run(step)
    fill_with_garbage(language, seed=2)
    dirty = language.run(step)
    assert np.isfinite(clean).all() and not np.allclose(clean, dirty)
