"""Compute context lengths (docs/design.md#specializations): an export with a ladder of lengths reads only the KV
slots a call needs and gives what the single-length export gives.

The reference is the session's serving export (``served_export("qwen2_5_vl")``: one length, ``ctx_len`` 256, no
``comp_ctx_lengths`` input, the graph as it was before the ladder existed). The same checkpoint is exported again
with ``--ctx-lengths 32,64,128`` (ladder 32, 64, 128, 256); the same requests through the serving engine
(continuous batching, chunks interleaved with decodes) and the single-request engine must give the same greedy
tokens and the same logits (1e-4) on ONNX Runtime, the PyTorch backend and the fake card, with requests whose
decode crosses from one length to the next.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from qeff_evs.export.pipeline import ExportOptions, export_checkpoint
from qeff_evs.manifest import MANIFEST_NAME, read_manifest
from qeff_evs.models.language import LanguageGraph
from qeff_evs.runtime.builders import engine_config, generate_all
from qeff_evs.runtime.engine.scheduler import SchedulerConfig
from qeff_evs.runtime.engine.serving import ServeRequest, ServingEngine
from qeff_evs.runtime.engine.single_request import Engine
from qeff_evs.runtime.export_bundle import open_export
from qeff_evs.runtime.inputs.prompt import video_question_pieces
from qeff_evs.runtime.inputs.synthetic import moving_square_video
from qeff_evs.runtime.media import video_from_file
from qeff_evs.runtime.sessions import sessions_for
from qeff_evs.specializations import comp_ctx_lengths, language_specializations, read_specializations_json
from test_kv_zero_once import card, for_the_card  # noqa: F401 (card: the fake SDK fixture)

LADDER = (32, 64, 128)
# (frames, height, width, question words, new tokens): prompts of 70, 174 and 54 tokens. r0 decodes across 128,
# r2 across 64; r1's chunks run at every length up to 256.
REQUESTS = ((4, 100, 110, 3, 64), (8, 110, 170, 9, 8), (4, 120, 150, 1, 16))


@pytest.fixture(scope="module")
def exports_of(served_export, tmp_path_factory):
    """``exports_of(family)``: (the family's single-length serving export, the same checkpoint exported with the
    ladder), made once per module."""
    made: dict[str, tuple[Path, Path]] = {}

    def get(family: str) -> tuple[Path, Path]:
        if family not in made:
            checkpoint, single = served_export(family)
            m = read_manifest(single)
            options = ExportOptions(m.video_pruning_rate, m.sampled_frame_buckets, m.resolutions, m.prefill_seq_len,
                                    m.ctx_len, full_batch_size=m.language_shape.full_batch_size, ctx_lengths=LADDER)
            folder = tmp_path_factory.mktemp(f"ctx_lengths_{family}")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                export_checkpoint(checkpoint, folder, options)
            made[family] = (single, folder)
        return made[family]
    return get


@pytest.fixture(scope="module")
def exports(exports_of) -> tuple[Path, Path]:
    return exports_of("qwen2_5_vl")


class LogitsLog:
    """A language session that keeps every logits array it returns (delegation, no class swapping)."""

    def __init__(self, inner):
        self.inner, self.logits = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _keep(self, logits):
        self.logits.append(np.array(logits))
        return logits

    def run(self, step):
        return self._keep(self.inner.run(step))

    def prefill(self, cache_row, step):
        return self._keep(self.inner.prefill(cache_row, step))

    def decode(self, rows, pad_token_id: int = 0):
        return self._keep(self.inner.decode(rows, pad_token_id))


def _requests(bundle, folder: Path) -> list[ServeRequest]:
    requests = []
    for number, (frames, height, width, words, new) in enumerate(REQUESTS):
        path = folder / f"clip_{number}.npy"
        np.save(path, moving_square_video(frames, height, width, seed=40 + number))
        question = " ".join(["what moves in the square"] * words) + "?"
        pieces = video_question_pieces(bundle.tokenizer, question, bundle.family.token_strings)
        requests.append(ServeRequest(f"r{number}", pieces, [video_from_file(path, bundle)], max_new_tokens=new))
    return requests


def _serve(export: Path, backend: str, folder: Path, language=None
           ) -> tuple[dict[str, list[int]], list[np.ndarray], dict]:
    """The requests through the serving engine (a 24-token budget: chunks share steps with decodes), no stop ids
    (random weights: every request decodes all its tokens); (tokens by request, every logits array, prompt lengths).
    ``language``: a language session to use instead of the backend's."""
    bundle = open_export(export)
    m = bundle.manifest
    vision, backend_language = sessions_for(bundle, backend)
    language = backend_language if language is None else language
    log = LogitsLog(language)
    scheduler = SchedulerConfig(max_num_batched_tokens=24, max_num_seqs=m.language_shape.full_batch_size,
                                prefill_seq_len=m.prefill_seq_len, ctx_len=m.ctx_len,
                                encoder_compute_budget=200, encoder_cache_size=200)
    engine = ServingEngine(bundle.family, vision, log, engine_config(bundle), scheduler)
    requests = _requests(bundle, folder)
    tokens = generate_all(engine, requests)
    prompts = {r.request_id: len(engine.executor.plan(r.pieces, r.media).ids) for r in requests}
    engine.close()
    return tokens, log.logits, prompts


def _assert_same(reference, ladder) -> None:
    ref_tokens, ref_logits, _ = reference
    tokens, logits, _ = ladder
    assert tokens == ref_tokens
    assert len(logits) == len(ref_logits)
    for got, want in zip(logits, ref_logits):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_ladder_resolution_and_specializations():
    assert comp_ctx_lengths(None, 32768, 128) == (2048, 8192, 32768)
    assert comp_ctx_lengths(None, 8192, 128) == (2048, 8192)
    assert comp_ctx_lengths(None, 8192, 2048, step=2) == (2048, 4096, 8192)  # export --target cpu's ladder
    assert comp_ctx_lengths(None, 256, 16) == ()  # below the default floor: one length, no input
    assert comp_ctx_lengths((128, 32, 64), 256, 16) == (32, 64, 128, 256)  # sorted, ctx_len added
    assert comp_ctx_lengths((256,), 256, 16) == ()
    with pytest.raises(ValueError, match=r"--ctx-lengths \[8\] lie outside \[prefill_seq_len=16, ctx_len=256\]"):
        comp_ctx_lengths((8, 64), 256, 16)
    with pytest.raises(ValueError, match=r"\[512\] lie outside"):
        comp_ctx_lengths((512,), 256, 16)
    specs = language_specializations(16, 256, full_batch_size=4, comp_ctx_lengths=(64, 256))
    assert [(s.name, s.symbols["seq_len"], s.symbols["comp_ctx_len"]) for s in specs] == [
        ("Prefill_64", 16, 64), ("Prefill_256", 16, 256), ("Decode_64", 1, 64), ("Decode_256", 1, 256)]


def test_export_files_follow_the_ladder(exports, tmp_path):
    single, ladder = exports
    m = read_manifest(ladder)
    assert m.language_shape.comp_ctx_lengths == (32, 64, 128, 256)
    assert read_manifest(single).language_shape.comp_ctx_lengths == ()
    names = [s.name for s in read_specializations_json(ladder / m.files["language_specializations"])]
    assert names == [f"{kind}_{n}" for kind in ("Prefill", "Decode") for n in (32, 64, 128, 256)]
    # The other layout reads back to the same names.
    flat = [s.name for s in read_specializations_json(ladder / m.files["language_specializations_named"])]
    assert flat == names
    # The smallest length holding a slot; none for a single-length export.
    shape = m.language_shape
    assert [shape.comp_ctx_len(s) for s in (0, 31, 32, 63, 64, 200, 255)] == [32, 32, 64, 64, 128, 256, 256]
    assert read_manifest(single).language_shape.comp_ctx_len(100) is None
    with pytest.raises(ValueError, match="KV slot 256 lies outside"):
        shape.comp_ctx_len(256)
    # A manifest written before the ladder (no such key) reads as one length.
    raw = json.loads((ladder / MANIFEST_NAME).read_text())
    del raw["language_shape"]["comp_ctx_lengths"]
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(raw))
    assert read_manifest(tmp_path).language_shape.comp_ctx_lengths == ()


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_5"])  # qwen3_5: KV in its full-attention layers only
def test_serving_on_ort_equals_the_single_length_export(family, exports_of, tmp_path):
    single, ladder = exports_of(family)
    reference = _serve(single, "ort", tmp_path)
    result = _serve(ladder, "ort", tmp_path)
    _assert_same(reference, result)
    # Decodes cross lengths: a request's first and last decode slots lie in different lengths.
    shape = read_manifest(ladder).language_shape
    tokens, _, prompts = result
    crossings = {rid: (shape.comp_ctx_len(prompts[rid]), shape.comp_ctx_len(prompts[rid] + len(tokens[rid]) - 2))
                 for rid in tokens}
    assert any(first != last for first, last in crossings.values()), crossings
    if family == "qwen2_5_vl":
        assert crossings["r0"] == (128, 256) and crossings["r2"] == (64, 128), crossings


def test_serving_on_the_fake_card_runs_each_step_in_its_specialization(exports, tmp_path, card):
    """compile.sh's specializations loaded on the fake card: each call matches the specialization of its length."""
    single, ladder = (for_the_card(export, tmp_path / name) for export, name in zip(exports, ("single", "ladder")))
    reference = _serve(single, "qaic", tmp_path)
    card.calls.clear()
    result = _serve(ladder, "qaic", tmp_path)
    _assert_same(reference, result)
    lengths = sorted({call.dims["comp_ctx_lengths"][0] for call in card.language_calls()})
    assert lengths == [32, 64, 128, 256]


def test_single_request_engine_on_torch_equals_the_single_length_export(exports, tmp_path):
    single, ladder = exports
    results = []
    for export in (single, ladder):
        bundle = open_export(export)
        vision, language = sessions_for(bundle, "torch")
        log = LogitsLog(language)
        engine = Engine(bundle.family, vision, log, engine_config(bundle, max_new_tokens=24))
        request = _requests(bundle, tmp_path)[0]
        prompt = engine.prepare(list(request.pieces), list(request.media))
        results.append((engine.generate(prompt, eos_ids=()).generated_token_ids, log.logits))
    (ref_tokens, ref_logits), (tokens, logits) = results
    assert tokens == ref_tokens and len(logits) == len(ref_logits)
    for got, want in zip(logits, ref_logits):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_a_step_past_its_compute_context_length_is_refused(served_export):
    checkpoint, _ = served_export("qwen2_5_vl")
    from qeff_evs.models.checkpoint import load_checkpoint

    graph = LanguageGraph(load_checkpoint(checkpoint).model)
    spec = graph.spec
    kv = [torch.zeros(1, spec.kv_heads, 64, spec.head_dim) for _ in spec.kv_layers]
    positions = torch.full((4, 1, 1), 40, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"comp_ctx_lengths has length 32 but the step's last KV slot is 40"):
        graph(torch.zeros(1, 1, dtype=torch.int64), torch.zeros(1, 16, spec.hidden_size), positions,
              torch.zeros(1, 1, dtype=torch.int64), kv, kv, comp_ctx_lengths=torch.arange(32))
