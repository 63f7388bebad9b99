"""Continuous batching in the language graph: ``batch_index`` rows over a ``full_batch_size`` KV cache.

Several requests of different lengths are prefilled one by one (chunked, windowed, batch 1) into
different cache rows, interleaved with decode calls of the requests already running, then decoded
together. Every request's decode logits must equal the same request run alone through the batch-1
graph (exported without continuous batching), and its greedy tokens must equal transformers' own
text model run over the whole, unpadded sequence. Tiny real checkpoints from ``qeff_evs.models.tiny``.
"""

from __future__ import annotations

import collections
import dataclasses
from dataclasses import dataclass, field

import numpy as np
import onnx
import pytest
import torch

from qeff_evs.export.language import export_language_graph
from qeff_evs.models.graph_io import language_io_names
from qeff_evs.models.language import ExportableLanguageGraph
from qeff_evs.models.language import LanguageGraph, language_spec
from qeff_evs.models.tiny import build_tiny_model, build_tokenizer
from qeff_evs.manifest import LanguageShape
from qeff_evs.runtime.backends.base import DecodeRow, LanguageInputs, decode_batch
from qeff_evs.runtime.backends.ort import OrtLanguageSession
from qeff_evs.runtime.backends.torch_reference import TorchLanguageSession
from qeff_evs.specializations import check_specializations, language_specializations

ATOL = 1e-4
SEQ_LEN = 8  # prefill chunk = user_vision_size
CTX_LEN = 64
FULL_BATCH = 3
TEXT_IDS = (20, 400)  # ordinary BPE ids, far from the special tokens


# --------------------------------------------------------------------------------------------------
# Requests laid out by hand: text, <vs> video pads <ve>, text; M-RoPE positions as in docs/design.md#positions


@dataclass(frozen=True)
class Request:
    ids: np.ndarray  # (L,) int64
    mrope: np.ndarray  # (3, L) int64
    rows: np.ndarray  # (num_media, hidden) vision rows in prompt order
    deepstack: np.ndarray  # (levels, num_media, hidden)

    @property
    def decode_start(self) -> int:
        return int(self.mrope.max()) + 1


def make_request(tokens: dict, hidden: int, levels: int, seed: int, before: int, frames: int, after: int) -> Request:
    """``before`` text, a video of ``frames`` 2x2 frames (frame 1 pruned to 2 tokens), ``after`` text."""
    rng = np.random.default_rng(seed)
    ids, pos = [], []

    def text(n):
        start = max(max(p) for p in pos) + 1 if pos else 0
        for i in range(n):
            ids.append(int(rng.integers(*TEXT_IDS)))
            pos.append((start + i,) * 3)

    text(before)
    if frames:
        ids.append(tokens["vision_start_token_id"])
        pos.append((max(max(p) for p in pos) + 1,) * 3)
        start = pos[-1][0] + 1
        block = [(start + t, start + r, start + c) for t in range(frames) for r in range(2) for c in range(2)]
        kept = [i for i in range(len(block)) if not (frames > 1 and i in (4, 6))]  # EVS-like holes
        for i in kept:
            ids.append(tokens["video_token_id"])
            pos.append(block[i])
        ids.append(tokens["vision_end_token_id"])
        pos.append((max(max(p) for p in block) + 1,) * 3)
    text(after)
    media = sum(1 for i in ids if i == tokens["video_token_id"])
    gen = torch.Generator().manual_seed(seed + 1000)
    rows = torch.randn(media, hidden, generator=gen).numpy()
    deep = torch.randn(levels, media, hidden, generator=gen).numpy()
    return Request(np.array(ids, np.int64), np.array(pos, np.int64).T.copy(), rows, deep)


def prefill_chunks(request: Request, video_id: int, hidden: int, levels: int) -> list[LanguageInputs]:
    """Chunks of SEQ_LEN tokens (last one padded with -1 positions), each with its own vision window."""
    steps = []
    is_media = request.ids == video_id
    for start in range(0, len(request.ids), SEQ_LEN):
        stop = min(start + SEQ_LEN, len(request.ids))
        n = stop - start
        ids = np.zeros((1, SEQ_LEN), np.int64)
        ids[0, :n] = request.ids[start:stop]
        positions = np.full((4, 1, SEQ_LEN), -1, np.int64)
        positions[0, 0, :n] = np.arange(start, stop)
        positions[1:, 0, :n] = request.mrope[:, start:stop]
        first, last = int(is_media[:start].sum()), int(is_media[:stop].sum())
        window = np.zeros((1, SEQ_LEN, hidden), np.float32)
        window[0, : last - first] = request.rows[first:last]
        deep = None
        if levels:
            deep = np.zeros((levels, 1, SEQ_LEN, hidden), np.float32)
            deep[:, 0, : last - first] = request.deepstack[:, first:last]
        extras = {} if deep is None else {"deepstack_features": deep}
        steps.append(LanguageInputs(ids, positions, window, extras, np.zeros((1, 1), np.int64), last - first))
    return steps


def decode_row(request: Request, cache_row: int, token: int, step: int) -> DecodeRow:
    return DecodeRow(cache_row, token, len(request.ids) + step, request.decode_start + step)


def single_decode_step(row: DecodeRow) -> LanguageInputs:
    positions = np.array([row.kv_slot] + [row.mrope_position] * 3, np.int64).reshape(4, 1, 1)
    return LanguageInputs(np.array([[row.token_id]], np.int64), positions, None, {}, np.zeros((1, 1), np.int64), 0)


# --------------------------------------------------------------------------------------------------
# Independent reference: transformers' text model over the whole sequence, no cache


@torch.no_grad()
def hf_greedy(model, request: Request, video_id: int, steps: int) -> list[int]:
    text_model = model.model.language_model
    ids, mrope, tokens = request.ids, request.mrope, []
    for step in range(steps):
        input_ids = torch.from_numpy(ids)[None]
        embeds = text_model.embed_tokens(input_ids).clone()
        media = input_ids == video_id
        embeds[media] = torch.from_numpy(request.rows)
        kwargs = {}
        if request.deepstack.shape[0]:
            kwargs = dict(visual_pos_masks=media, deepstack_visual_embeds=list(torch.from_numpy(request.deepstack)))
        hidden = text_model(inputs_embeds=embeds, position_ids=torch.from_numpy(mrope)[:, None], **kwargs)
        token = int(model.lm_head(hidden.last_hidden_state[0, -1]).argmax())
        tokens.append(token)
        ids = np.append(ids, token)
        mrope = np.concatenate([mrope, np.full((3, 1), request.decode_start + step)], axis=1)
    return tokens


# --------------------------------------------------------------------------------------------------
# One tiny model per family, exported twice (batch-1 and continuous batching)


@dataclass
class Family:
    model: torch.nn.Module
    tokens: dict
    hidden: int
    levels: int
    layers: int
    single_onnx: object
    cb_onnx: object

    @property
    def video_id(self) -> int:
        return self.tokens["video_token_id"]

    def shape(self, full_batch_size: int = 1, decode_batch_size: int | None = None) -> LanguageShape:
        spec = language_spec(self.model)
        return LanguageShape(spec.num_layers, spec.kv_heads, spec.head_dim, spec.hidden_size, CTX_LEN, SEQ_LEN,
                             spec.extras, full_batch_size, decode_batch_size)

    def request(self, seed: int, before: int, frames: int, after: int) -> Request:
        return make_request(self.tokens, self.hidden, self.levels, seed, before, frames, after)

    def chunks(self, request: Request) -> list[LanguageInputs]:
        return prefill_chunks(request, self.video_id, self.hidden, self.levels)


def build_family(name: str, tmp_path_factory) -> Family:
    tokenizer = build_tokenizer()
    model = build_tiny_model(name, tokenizer, seed=3)
    config = model.config
    tokens = {k: int(getattr(config, k)) for k in ("video_token_id", "vision_start_token_id", "vision_end_token_id")}
    spec = language_spec(model)
    folder = tmp_path_factory.mktemp(f"cb_{name}")
    single = export_language_graph(model, folder / "single.onnx")
    cb = export_language_graph(model, folder / "cb.onnx", continuous_batching=True)
    return Family(model, tokens, spec.hidden_size, spec.extras.get("deepstack_features", 0), spec.num_layers, single, cb)


@pytest.fixture(scope="module")
def q25(tmp_path_factory) -> Family:
    return build_family("qwen2_5_vl", tmp_path_factory)


@pytest.fixture(scope="module")
def q25_requests(q25) -> dict[str, Request]:
    """Three prompts of different lengths (28, 19 and 11 tokens); C is text only."""
    return {
        "A": q25.request(seed=1, before=5, frames=4, after=7),
        "B": q25.request(seed=2, before=3, frames=3, after=4),
        "C": q25.request(seed=3, before=11, frames=0, after=0),
    }


# --------------------------------------------------------------------------------------------------
# The batch-1 path and a v1-style continuous-batching schedule


def run_alone(session: OrtLanguageSession, family: Family, request: Request, steps: int):
    """Chunked prefill then greedy decode through ``session.run`` (the single-request API)."""
    session.reset()
    for step in family.chunks(request):
        logits = session.run(step)[0, 0]
    tokens, decode_logits = [int(np.argmax(logits))], []
    for j in range(steps):
        logits = session.run(single_decode_step(decode_row(request, 0, tokens[-1], j)))[0, 0]
        decode_logits.append(logits)
        tokens.append(int(np.argmax(logits)))
    return tokens, decode_logits


@dataclass
class Running:
    request: Request
    cache_row: int
    tokens: list[int] = field(default_factory=list)
    decode_logits: list[np.ndarray] = field(default_factory=list)

    def next_row(self) -> DecodeRow:
        return decode_row(self.request, self.cache_row, self.tokens[-1], len(self.decode_logits))


def decode_together(session: OrtLanguageSession, running: list[Running]) -> None:
    logits = session.decode([r.next_row() for r in running])
    for r, row_logits in zip(running, logits):
        r.decode_logits.append(row_logits)
        r.tokens.append(int(np.argmax(row_logits)))


def prefill_into(session: OrtLanguageSession, family: Family, running: Running, between=None) -> None:
    """Prefill one request chunk by chunk into its row; ``between()`` runs after every chunk but the last."""
    chunks = family.chunks(running.request)
    for number, step in enumerate(chunks):
        logits = session.prefill(running.cache_row, step)[0, 0]
        if between is not None and number < len(chunks) - 1:
            between()
    running.tokens.append(int(np.argmax(logits)))


def continuous_schedule(session: OrtLanguageSession, family: Family, requests: dict[str, Request]) -> dict:
    """A in row 2; B prefilled into row 0 between A's decodes; C into row 1; all decode; A leaves."""
    session.reset()
    run = {"A": Running(requests["A"], 2), "B": Running(requests["B"], 0), "C": Running(requests["C"], 1)}
    prefill_into(session, family, run["A"])
    decode_together(session, [run["A"]])  # one request in a call of FULL_BATCH rows: two padding rows
    prefill_into(session, family, run["B"], between=lambda: decode_together(session, [run["A"]]))
    decode_together(session, [run["B"], run["A"]])
    prefill_into(session, family, run["C"])
    for _ in range(3):
        decode_together(session, [run["A"], run["B"], run["C"]])
    for _ in range(2):  # A is done; its row becomes the padding row
        decode_together(session, [run["C"], run["B"]])
    return run


@pytest.fixture(scope="module")
def q25_continuous(q25, q25_requests):
    return continuous_schedule(OrtLanguageSession(q25.cb_onnx, q25.shape(FULL_BATCH)), q25, q25_requests)


@pytest.fixture(scope="module")
def q25_alone(q25, q25_requests, q25_continuous):
    session = OrtLanguageSession(q25.single_onnx, q25.shape())
    return {name: run_alone(session, q25, request, len(q25_continuous[name].decode_logits))
            for name, request in q25_requests.items()}


def assert_same_as_alone(continuous: dict, alone: dict) -> None:
    for name, run in continuous.items():
        tokens, logits = alone[name]
        assert len(run.decode_logits) >= 4, name
        assert run.tokens == tokens, name
        for step, (ours, ref) in enumerate(zip(run.decode_logits, logits)):
            np.testing.assert_allclose(ours, ref, atol=ATOL, rtol=0, err_msg=f"request {name} decode step {step}")


# --------------------------------------------------------------------------------------------------
# Graph contract


def test_cb_graph_io_and_symbols(q25):
    model = onnx.load(str(q25.cb_onnx))
    dims = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
            for v in [*model.graph.input, *model.graph.output]}
    inputs, outputs = language_io_names(q25.layers, extras=(), continuous_batching=True)
    assert [v.name for v in model.graph.input] == inputs
    assert [v.name for v in model.graph.output] == outputs
    assert inputs[-1] == "batch_index" and outputs == language_io_names(q25.layers, extras=())[1]
    assert dims["batch_index"] == ["batch_size", 1]
    assert model.graph.input[-1].type.tensor_type.elem_type == onnx.TensorProto.INT64
    spec = language_spec(q25.model)
    kv = ["full_batch_size", spec.kv_heads, "ctx_len", spec.head_dim]
    for i in range(q25.layers):
        for kind in ("key", "value"):
            assert dims[f"past_{kind}.{i}"] == dims[f"past_{kind}.{i}_RetainedState"] == kv
    assert dims["input_ids"] == ["batch_size", "seq_len"]
    assert dims["logits"] == ["batch_size", 1, spec.vocab_size]


def test_cb_graph_has_no_data_dependent_ops_and_scatters_only_new_vectors(q25):
    ops = collections.Counter(node.op_type for node in onnx.load(str(q25.cb_onnx)).graph.node)
    assert not {"NonZero", "Compress", "Unique", "Loop", "If"} & set(ops)
    functions = collections.Counter(node.op_type for node in onnx.load(str(q25.cb_onnx)).graph.node
                                    if node.domain == "com.qualcomm.cloud")
    assert functions == {"CtxScatterCB": 2 * q25.layers, "CtxGatherCB": 2 * q25.layers}
    assert ops["ScatterElements"] == 0


def test_cb_specializations_bind_every_symbol(q25):
    specs = language_specializations(SEQ_LEN, CTX_LEN, full_batch_size=FULL_BATCH)
    check_specializations(q25.cb_onnx, specs)
    check_specializations(q25.cb_onnx, language_specializations(SEQ_LEN, CTX_LEN, full_batch_size=4,
                                                                decode_batch_size=2))
    # full_batch_size is a live symbol: the batch-1 set leaves it unbound.
    with pytest.raises(ValueError, match="'full_batch_size'"):
        check_specializations(q25.cb_onnx, language_specializations(SEQ_LEN, CTX_LEN))
    check_specializations(q25.single_onnx, language_specializations(SEQ_LEN, CTX_LEN))


# --------------------------------------------------------------------------------------------------
# Numerics


def test_requests_have_different_lengths_and_chunk_counts(q25, q25_requests):
    lengths = [len(r.ids) for r in q25_requests.values()]
    assert len(set(lengths)) == 3 and all(n % SEQ_LEN for n in lengths)  # every last chunk is padded
    assert len({len(q25.chunks(r)) for r in q25_requests.values()}) > 1


def test_batch1_path_matches_transformers(q25, q25_requests, q25_alone):
    for name, request in q25_requests.items():
        tokens, _ = q25_alone[name]
        assert tokens == hf_greedy(q25.model, request, q25.video_id, len(tokens)), name


def test_continuous_batching_decode_equals_each_request_alone(q25_continuous, q25_alone):
    assert_same_as_alone(q25_continuous, q25_alone)


def test_decode_batch_smaller_than_full_batch(q25, q25_requests, q25_alone):
    """Decode calls of 2 rows over 3 cache rows: three requests take two calls, one of them padded."""
    session = OrtLanguageSession(q25.cb_onnx, q25.shape(FULL_BATCH, decode_batch_size=2))
    assert_same_as_alone(continuous_schedule(session, q25, q25_requests), q25_alone)


def test_torch_session_equals_onnx_runtime(q25, q25_requests, q25_continuous):
    module = ExportableLanguageGraph(LanguageGraph(q25.model), continuous_batching=True)
    eager = continuous_schedule(TorchLanguageSession(module, q25.shape(FULL_BATCH)), q25, q25_requests)
    for name, run in eager.items():
        assert run.tokens == q25_continuous[name].tokens
        for ours, theirs in zip(run.decode_logits, q25_continuous[name].decode_logits):
            np.testing.assert_allclose(ours, theirs, atol=ATOL, rtol=0)


def test_single_request_api_on_a_cb_graph_equals_the_batch1_graph(q25, q25_requests, q25_alone):
    """``run(step)`` (what the engine calls) works unchanged on a CB session: it uses cache row 0."""
    session = OrtLanguageSession(q25.cb_onnx, q25.shape(FULL_BATCH))
    tokens, logits = run_alone(session, q25, q25_requests["B"], 4)
    assert tokens == q25_alone["B"][0][:5]
    for ours, ref in zip(logits, q25_alone["B"][1]):
        np.testing.assert_allclose(ours, ref, atol=ATOL, rtol=0)
    assert not session.state["past_key.0"][1:].any()  # rows 1 and 2 were never touched


# --------------------------------------------------------------------------------------------------
# Row isolation (exact: other rows come back bit for bit)


def _kv(session) -> dict[str, np.ndarray]:
    return {k: v.copy() for k, v in session.state.items() if k.startswith("past_")}


def test_prefill_into_one_row_leaves_the_others_untouched(q25, q25_requests):
    session = OrtLanguageSession(q25.cb_onnx, q25.shape(FULL_BATCH))
    prefill_into(session, q25, Running(q25_requests["A"], 0))
    prefill_into(session, q25, Running(q25_requests["B"], 2))
    before = _kv(session)
    assert all(v[[0, 2]].any() for v in before.values())
    prefill_into(session, q25, Running(q25_requests["C"], 1))
    after = _kv(session)
    for name in before:
        np.testing.assert_array_equal(after[name][[0, 2]], before[name][[0, 2]])
        assert not np.array_equal(after[name][1], before[name][1])


def test_padded_decode_writes_only_its_rows(q25, q25_requests):
    session = OrtLanguageSession(q25.cb_onnx, q25.shape(FULL_BATCH))
    a, c = Running(q25_requests["A"], 0), Running(q25_requests["C"], 2)
    prefill_into(session, q25, a)
    prefill_into(session, q25, c)
    before = _kv(session)
    step, batch_index = decode_batch([c.next_row()], FULL_BATCH, FULL_BATCH)
    assert batch_index == [2, 0, 0]  # padding rows take the lowest row the call does not use
    assert step.position_ids[:, 1:].tolist() == np.full((4, 2, 1), -1).tolist()
    decode_together(session, [c])
    after = _kv(session)
    slot = len(c.request.ids)
    for name in before:
        # Row 2: only the new token's slot changed.
        changed = np.flatnonzero((after[name][2] != before[name][2]).any(axis=(0, 2)))
        assert changed.tolist() == [slot], name
        # Row 0 (the padding rows' target) and row 1: untouched, padding writes are skipped.
        np.testing.assert_array_equal(after[name][[0, 1]], before[name][[0, 1]])
    # A still decodes exactly as alone after the padding named its row.
    decode_together(session, [a, c])
    alone = OrtLanguageSession(q25.single_onnx, q25.shape())
    _, ref = run_alone(alone, q25, q25_requests["A"], 1)
    np.testing.assert_allclose(a.decode_logits[0], ref[0], atol=ATOL, rtol=0)


def vllm_qaic_padded(session, rows: list[DecodeRow]) -> np.ndarray:
    """One decode call padded the way vllm-qaic pads: unused rows get batch_index, ids and positions -1."""
    width = session.shape.decode_rows
    step, batch_index = decode_batch(rows, width, session.cache_rows)
    ids = step.input_ids.copy()
    ids[len(rows):] = -1
    batch_index = batch_index[: len(rows)] + [-1] * (width - len(rows))
    return session.run_rows(dataclasses.replace(step, input_ids=ids), batch_index)[: len(rows), 0]


@pytest.mark.parametrize("backend", ["ort", "torch"])
def test_vllm_qaic_padding_rows_equal_our_padding(q25, q25_requests, backend):
    """batch_index = -1, ids -1, positions -1 on unused rows: same logits and tokens, no cache row touched."""
    def session():
        if backend == "ort":
            return OrtLanguageSession(q25.cb_onnx, q25.shape(FULL_BATCH))
        return TorchLanguageSession(ExportableLanguageGraph(LanguageGraph(q25.model), continuous_batching=True),
                                    q25.shape(FULL_BATCH))

    ours, theirs = session(), session()
    runs = {}
    for label, target in (("ours", ours), ("theirs", theirs)):
        a, c = Running(q25_requests["A"], 2), Running(q25_requests["C"], 0)
        prefill_into(target, q25, a)
        prefill_into(target, q25, c)
        runs[label] = (a, c)
    for _ in range(4):
        a, c = runs["ours"]
        decode_together(ours, [a, c])
        a, c = runs["theirs"]
        before = _kv(theirs)
        logits = vllm_qaic_padded(theirs, [a.next_row(), c.next_row()])
        after = _kv(theirs)
        for name in before:  # row 1 (no request) and everything but the two new slots stay as they were
            np.testing.assert_array_equal(after[name][1], before[name][1])
        for r, row_logits in zip((a, c), logits):
            r.decode_logits.append(row_logits)
            r.tokens.append(int(np.argmax(row_logits)))
    for mine, vllm in zip(runs["ours"], runs["theirs"]):
        assert mine.tokens == vllm.tokens
        np.testing.assert_array_equal(np.stack(mine.decode_logits), np.stack(vllm.decode_logits))
    for name, value in _kv(ours).items():
        np.testing.assert_array_equal(value, _kv(theirs)[name])


@torch.no_grad()
def hf_logits_after(model, request: Request, video_id: int, generated: int) -> np.ndarray:
    """transformers' logits after the prompt plus one generated token, that token embedded as text."""
    text_model = model.model.language_model
    prompt = torch.from_numpy(request.ids)[None]
    input_ids = torch.cat([prompt, torch.tensor([[generated]])], dim=1)
    embeds = text_model.embed_tokens(input_ids).clone()
    media = torch.cat([prompt == video_id, torch.zeros(1, 1, dtype=torch.bool)], dim=1)
    embeds[media] = torch.from_numpy(request.rows)
    mrope = np.concatenate([request.mrope, np.full((3, 1), request.decode_start)], axis=1)
    hidden = text_model(inputs_embeds=embeds, position_ids=torch.from_numpy(mrope)[:, None])
    return model.lm_head(hidden.last_hidden_state[0, -1]).numpy()


@pytest.mark.parametrize("backend", ["ort", "torch"])
def test_generated_media_pad_in_decode_is_text(q25, q25_requests, backend):
    """A decode step whose token is a video (or image) pad embeds it as text, as HF does; no vision row."""
    request = q25_requests["A"]
    if backend == "ort":
        session = OrtLanguageSession(q25.single_onnx, q25.shape())
    else:
        session = TorchLanguageSession(ExportableLanguageGraph(LanguageGraph(q25.model)), q25.shape())
    image_id = int(q25.model.config.image_token_id)
    for pad in (q25.video_id, image_id):
        session.reset()
        for step in q25.chunks(request):
            session.run(step)
        logits = session.run(single_decode_step(decode_row(request, 0, pad, 0)))[0, 0]
        np.testing.assert_allclose(logits, hf_logits_after(q25.model, request, q25.video_id, pad), atol=ATOL, rtol=0)


# --------------------------------------------------------------------------------------------------
# Errors


def test_bad_batch_index_is_rejected(q25, q25_requests):
    session = OrtLanguageSession(q25.cb_onnx, q25.shape(FULL_BATCH))
    step = q25.chunks(q25_requests["C"])[0]
    with pytest.raises(ValueError, match=r"full_batch_size=3"):
        session.prefill(3, step)
    two = DecodeRow(1, 30, 5, 5)
    with pytest.raises(ValueError, match="share KV cache rows"):
        session.decode([two, two])
    bad_step, _ = decode_batch([two], FULL_BATCH, FULL_BATCH)
    for pads in ([1, -2, 0], [1, 0, FULL_BATCH]):
        with pytest.raises(ValueError, match="padding rows"):
            session.run_rows(bad_step, pads)
    with pytest.raises(ValueError, match=r"outside \[0, full_batch_size=3\)"):
        session.run_rows(bad_step, [-1, 0, 2])  # -1 is for padding rows only
    single = OrtLanguageSession(q25.single_onnx, q25.shape())
    with pytest.raises(ValueError, match="no batch_index input.*--full-batch-size"):
        single.prefill(0, step)
    with pytest.raises(ValueError, match="--full-batch-size 3"):
        OrtLanguageSession(q25.single_onnx, q25.shape(FULL_BATCH))
    two_rows = decode_batch([two, DecodeRow(0, 31, 5, 5)], 2, FULL_BATCH)[0]
    with pytest.raises(ValueError, match="2 sequences.*--full-batch-size"):
        single.run(two_rows)
    with pytest.raises(ValueError, match="decode_batch_size=4"):
        q25.shape(FULL_BATCH, decode_batch_size=4)


def test_eager_graph_rejects_bad_batch_index(q25):
    graph = LanguageGraph(q25.model)
    spec = graph.spec
    cache = [torch.zeros(2, spec.kv_heads, 16, spec.head_dim)] * spec.num_layers
    ids = torch.full((2, 1), 30, dtype=torch.int64)
    positions = torch.tensor([[[3], [-1]]] * 4, dtype=torch.int64)  # row 1 is padding
    args = (ids, torch.zeros(1, 4, spec.hidden_size), positions, torch.zeros(1, 1, dtype=torch.int64), cache, cache)
    graph(*args, batch_index=torch.tensor([[1], [0]]))  # fine
    graph(*args, batch_index=torch.tensor([[1], [1]]))  # padding may name a live row: it writes nothing
    graph(*args, batch_index=torch.tensor([[1], [-1]]))  # vllm-qaic's padding row
    for batch_index, message in (
        (torch.tensor([[2], [0]]), r"\[0, full_batch_size=2\)"),
        (torch.tensor([[1]]), r"\(batch_size, 1\) = \(2, 1\)"),
        (torch.tensor([[1], [-2]]), "padding rows"),
        (torch.tensor([[1], [0]], dtype=torch.int32), "int64"),
    ):
        with pytest.raises(ValueError, match=message):
            graph(*args, batch_index=batch_index)
    both_real = positions.clone()
    both_real[0, 1, 0] = 4
    with pytest.raises(ValueError, match="two requests"):
        graph(ids, args[1], both_real, args[3], cache, cache, batch_index=torch.tensor([[0], [0]]))


# --------------------------------------------------------------------------------------------------
# Qwen3-VL: deepstack rows through the same continuous batching


def test_qwen3_vl_continuous_batching_equals_alone(tmp_path_factory):
    q3 = build_family("qwen3_vl", tmp_path_factory)
    assert q3.levels == 1
    requests = {"A": q3.request(seed=5, before=4, frames=3, after=5),
                "B": q3.request(seed=6, before=2, frames=2, after=3),
                "C": q3.request(seed=7, before=6, frames=0, after=3)}
    continuous = continuous_schedule(OrtLanguageSession(q3.cb_onnx, q3.shape(FULL_BATCH)), q3, requests)
    session = OrtLanguageSession(q3.single_onnx, q3.shape())
    alone = {name: run_alone(session, q3, request, len(continuous[name].decode_logits))
             for name, request in requests.items()}
    assert_same_as_alone(continuous, alone)
    assert alone["A"][0] == hf_greedy(q3.model, requests["A"], q3.video_id, len(alone["A"][0]))
