"""A Qwen3.5 Gated DeltaNet layer over retained state against transformers' own layer (the reference).

transformers runs each request alone through ``Qwen3_5GatedDeltaNet`` with a ``DynamicCache``: prefill
chunks of the same lengths (the last one shorter: transformers has no right padding) then one token at
a time. Our step runs the same tokens as chunks of the compiled length, right-padded, and decodes with
``seq_len = 1``, eagerly and as exported ONNX graphs on ONNX Runtime. States start as NaN, as a buffer
nobody wrote; the reset rule (slot 0 starts a request) must clear them.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from transformers.cache_utils import DynamicCache

from qeff_evs.export.onnx_graph import check_static_ops, legacy_export
from qeff_evs.models.graph_io import PAD_BATCH_INDEX
from qeff_evs.models.linear_attention import (
    ExportableLinearAttention, GatedDeltaNetStep, linear_state_spec, state_names,
)
from qeff_evs.specializations import RETAINED_SUFFIX
from tests.helpers.qwen3_5_tiny import linear_layers, load_qwen3_5, save_tiny_qwen3_5

ROWS = 4  # full_batch_size: state rows under continuous batching
OUT_ATOL, STATE_ATOL = 1e-4, 1e-5
DECODE_STEPS = 32
LAYER = 0  # the first linear layer (index 0 of the text model)

Call = Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_qwen3_5(save_tiny_qwen3_5(tmp_path_factory.mktemp("qwen3_5")))


@pytest.fixture(scope="module")
def gdn(model):
    return linear_layers(model)[LAYER]


def _tokens(length: int, hidden: int, seed: int) -> torch.Tensor:
    return torch.randn(length, hidden, generator=torch.Generator().manual_seed(seed))


def hf_request(gdn, model, tokens: torch.Tensor, prompt_len: int, chunk: int):
    """transformers alone: ``(outputs (T, hidden), conv state (conv_dim, K - 1), recurrent state)``."""
    cache = DynamicCache(config=model.config.text_config)
    outputs = []
    with torch.no_grad():
        for start in range(0, prompt_len, chunk):
            outputs.append(gdn(tokens[None, start:min(start + chunk, prompt_len)], cache_params=cache)[0])
        for t in range(prompt_len, len(tokens)):
            outputs.append(gdn(tokens[None, t:t + 1], cache_params=cache)[0])
    layer = cache.layers[gdn.layer_idx]
    # transformers keeps K conv columns; the first is never read again (ours keeps the K - 1 others).
    return torch.cat(outputs), layer.conv_states[0][0, :, 1:], layer.recurrent_states[0][0]


class StateRows:
    """The state buffers of one layer and the calls that update them (eager or ORT, by seq_len)."""

    def __init__(self, spec, rows: int, calls: dict[int, Call], layer_idx: int, cb: bool):
        self.conv, self.recurrent = (np.full(shape, np.nan, np.float32)
                                     for shape in (spec.conv_shape(rows), spec.recurrent_shape(rows)))
        self.calls, self.names, self.cb = calls, state_names(layer_idx), cb

    def step(self, seq_len: int, hidden: np.ndarray, slots: np.ndarray, batch_index: np.ndarray | None):
        feeds = {"hidden_states": hidden.astype(np.float32), "position_ids": np.repeat(slots[None], 4, axis=0),
                 self.names[0]: self.conv, self.names[1]: self.recurrent}
        if self.cb:
            feeds["batch_index"] = batch_index
        before = (self.conv.copy(), self.recurrent.copy())
        out = self.calls[seq_len](feeds)
        self.conv = out[self.names[0] + RETAINED_SUFFIX]
        self.recurrent = out[self.names[1] + RETAINED_SUFFIX]
        if self.cb:  # rows no real batch row names come back bit for bit (NaN included)
            named = {int(r) for r, s in zip(batch_index[:, 0], slots) if (s >= 0).any()}
            for row in set(range(self.conv.shape[0])) - named:
                np.testing.assert_array_equal(self.conv[row], before[0][row])
                np.testing.assert_array_equal(self.recurrent[row], before[1][row])
        return out["layer_output"]


def _chunk(tokens: torch.Tensor, start: int, end: int, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Tokens ``start..end`` right-padded to ``seq_len`` (padding rows are garbage, slots -1)."""
    hidden = np.random.default_rng(start).normal(size=(seq_len, tokens.shape[1])).astype(np.float32) * 1e3
    hidden[:end - start] = tokens[start:end].numpy()
    slots = np.full(seq_len, -1, np.int64)
    slots[:end - start] = np.arange(start, end)
    return hidden, slots


def run_alone(rows: StateRows, row: int, tokens: torch.Tensor, prompt_len: int, chunk: int) -> np.ndarray:
    """One request in state row ``row``: prefill chunks of ``chunk`` tokens (right-padded), then decode."""
    outputs = []
    index = np.array([[row]], np.int64)
    for start in range(0, prompt_len, chunk):
        end = min(start + chunk, prompt_len)
        hidden, slots = _chunk(tokens, start, end, chunk)
        outputs.append(rows.step(chunk, hidden[None], slots[None], index)[0, :end - start])
    for t in range(prompt_len, len(tokens)):
        outputs.append(rows.step(1, tokens[None, t:t + 1].numpy(), np.array([[t]]), index)[0])
    return np.concatenate(outputs)


def eager_calls(gdn, layer_idx: int, cb: bool, lengths=(16, 64, 1)) -> dict[int, Call]:
    graph = ExportableLinearAttention(GatedDeltaNetStep(gdn), layer_idx, continuous_batching=cb)

    def call(feeds):
        return {name: value.numpy() for name, value in graph.run(feeds).items()}
    return {length: call for length in lengths}


def export_layer(gdn, layer_idx: int, seq_len: int, path, cb: bool, prefill_seq_len: int | None = None):
    graph = ExportableLinearAttention(GatedDeltaNetStep(gdn, prefill_seq_len=prefill_seq_len), layer_idx,
                                      continuous_batching=cb)
    spec, batch = linear_state_spec(gdn), 2
    rows = ROWS if cb else batch
    slots = torch.arange(seq_len).expand(batch, seq_len)
    inputs = [torch.randn(batch, seq_len, gdn.hidden_size), slots[None].expand(4, -1, -1).contiguous(),
              torch.zeros(spec.conv_shape(rows)), torch.zeros(spec.recurrent_shape(rows))]
    if cb:
        inputs.append(torch.tensor([[1], [3]]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        legacy_export(graph, inputs, path, input_names=graph.input_names, output_names=graph.output_names,
                      dynamic_axes=graph.dynamic_axes)
    check_static_ops(onnx.load(str(path)), f"linear attention S={seq_len}")
    return path


def ort_call(path) -> Call:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return lambda feeds: dict(zip(names, session.run(None, feeds)))


@pytest.fixture(scope="module")
def ort_graphs(gdn, tmp_path_factory):
    """CB layer graphs for S = 16, 64 (prefill) and 1 (decode), and one prefill+decode graph for S <= 64."""
    folder = tmp_path_factory.mktemp("gdn_onnx")
    calls = {s: ort_call(export_layer(gdn, LAYER, s, folder / f"s{s}.onnx", cb=True)) for s in (16, 64, 1)}
    both = ort_call(export_layer(gdn, LAYER, 64, folder / "both.onnx", cb=True, prefill_seq_len=64))
    return {"per_length": calls, "one_graph": {64: both, 1: both}}


def _assert_request(out, rows: StateRows, row: int, reference):
    ref_out, ref_conv, ref_recurrent = reference
    np.testing.assert_allclose(out, ref_out.numpy(), atol=OUT_ATOL, rtol=0)
    np.testing.assert_allclose(rows.conv[row], ref_conv.numpy(), atol=STATE_ATOL, rtol=0)
    np.testing.assert_allclose(rows.recurrent[row], ref_recurrent.numpy(), atol=STATE_ATOL, rtol=0)


@pytest.mark.parametrize("chunk", [16, 64])
def test_prefill_chunks_then_decode_match_transformers(model, chunk):
    # 150 prompt tokens: 10 chunks of 16 or 3 of 64, the last one right-padded; then 32 decode steps.
    # Every linear layer of the tiny model, each with its own weights.
    for layer_idx, layer in zip((0, 1, 3), linear_layers(model)):
        tokens = _tokens(150 + DECODE_STEPS, layer.hidden_size, seed=layer_idx)
        rows = StateRows(linear_state_spec(layer), ROWS, eager_calls(layer, layer_idx, cb=True), layer_idx, cb=True)
        out = run_alone(rows, 2, tokens, 150, chunk)
        _assert_request(out, rows, 2, hf_request(layer, model, tokens, 150, chunk))


def test_without_batch_index_every_batch_row_owns_its_state_row(gdn, model):
    # Two requests side by side (batch 2, no continuous batching): 40 and 23 prompt tokens in chunks of 16.
    lengths = (40, 23)
    tokens = [_tokens(n + 4, gdn.hidden_size, seed=10 + i) for i, n in enumerate(lengths)]
    rows = StateRows(linear_state_spec(gdn), 2, eager_calls(gdn, LAYER, cb=False), LAYER, cb=False)
    outs = [[], []]
    for start in range(0, max(lengths), 16):
        parts = [_chunk(t, min(start, n), min(start + 16, n), 16) for t, n in zip(tokens, lengths)]
        out = rows.step(16, np.stack([p[0] for p in parts]), np.stack([p[1] for p in parts]), None)
        for i, n in enumerate(lengths):
            outs[i].append(out[i, :max(0, min(start + 16, n) - start)])
    for t in range(4):
        out = rows.step(1, np.stack([tok[n + t][None].numpy() for tok, n in zip(tokens, lengths)]),
                        np.array([[n + t] for n in lengths]), None)
        for i in range(2):
            outs[i].append(out[i])
    for i, n in enumerate(lengths):
        _assert_request(np.concatenate(outs[i]), rows, i, hf_request(gdn, model, tokens[i], n, 16))


def run_continuous_batching(rows: StateRows, requests: list[tuple[torch.Tensor, int]], chunk: int):
    """A scheduler: requests take free rows in order; each step prefills one chunk of every prefilling
    row (one call, its rows padded separately), then decodes every decoding row in one call of ``ROWS``
    rows. Unused decode rows are padding: ``batch_index`` -1, or a row a prefilling request owns.
    Returns ``{request: (outputs, conv state, recurrent state, row)}`` at each request's end."""
    waiting = list(range(len(requests)))
    owner: dict[int, int] = {}  # row -> request
    done = {}
    progress = {r: 0 for r in waiting}
    outputs = {r: [] for r in waiting}
    step_count = 0
    while waiting or owner:
        for row in range(ROWS):
            if row not in owner and waiting:
                owner[row] = waiting.pop(0)
        prefilling = [row for row, r in owner.items() if progress[r] < requests[r][1]]
        if prefilling:
            parts, index = [], []
            for row in prefilling:
                r = owner[row]
                tokens, prompt = requests[r]
                parts.append(_chunk(tokens, progress[r], min(progress[r] + chunk, prompt), chunk))
                index.append([row])
            out = rows.step(chunk, np.stack([p[0] for p in parts]), np.stack([p[1] for p in parts]),
                            np.array(index, np.int64))
            for b, row in enumerate(prefilling):
                r = owner[row]
                valid = min(progress[r] + chunk, requests[r][1]) - progress[r]
                outputs[r].append(out[b, :valid])
                progress[r] += valid
        decoding = [row for row, r in owner.items() if row not in prefilling]
        if decoding:
            hidden = np.zeros((ROWS, 1, requests[0][0].shape[1]), np.float32)
            slots = np.full((ROWS, 1), -1, np.int64)
            spare = prefilling[0] if prefilling and step_count % 2 else PAD_BATCH_INDEX
            index = np.full((ROWS, 1), spare, np.int64)
            for b, row in enumerate(decoding):
                r = owner[row]
                hidden[b, 0] = requests[r][0][progress[r]].numpy()
                slots[b, 0] = progress[r]
                index[b, 0] = row
            out = rows.step(1, hidden, slots, index)
            for b, row in enumerate(decoding):
                r = owner[row]
                outputs[r].append(out[b])
                progress[r] += 1
                if progress[r] == len(requests[r][0]):
                    done[r] = (np.concatenate(outputs[r]), rows.conv[row].copy(), rows.recurrent[row].copy(), row)
                    del owner[row]
        step_count += 1
    return done


def _continuous_batching_case(gdn, model, calls: dict[int, Call], chunk: int):
    # Six requests on four rows: the two shortest finish first and their rows are reused. Each request
    # compares with itself run alone through transformers, so an old state leaking would show.
    prompts = (37, 70, 16, 9, 45, 20)
    requests = [(_tokens(n + 5, gdn.hidden_size, seed=100 + i), n) for i, n in enumerate(prompts)]
    rows = StateRows(linear_state_spec(gdn), ROWS, calls, LAYER, cb=True)
    done = run_continuous_batching(rows, requests, chunk)
    reused = {row for r, (*_, row) in done.items() if r >= ROWS}
    assert len(done) == len(prompts) and reused, "the schedule must reuse rows"
    for r, (out, conv, recurrent, row) in done.items():
        ref_out, ref_conv, ref_recurrent = hf_request(gdn, model, *requests[r], chunk)
        np.testing.assert_allclose(out, ref_out.numpy(), atol=OUT_ATOL, rtol=0, err_msg=f"request {r}")
        np.testing.assert_allclose(conv, ref_conv.numpy(), atol=STATE_ATOL, rtol=0, err_msg=f"request {r}")
        np.testing.assert_allclose(recurrent, ref_recurrent.numpy(), atol=STATE_ATOL, rtol=0, err_msg=f"request {r}")


def test_continuous_batching_reused_rows_start_clean(gdn, model):
    _continuous_batching_case(gdn, model, eager_calls(gdn, LAYER, cb=True), chunk=16)


def test_without_the_reset_a_reused_row_would_leak(gdn, model):
    # The same request twice in one row: the second run only matches transformers because slot 0
    # cleared the first run's state; started at slot 1 instead (no reset), it differs.
    tokens = _tokens(30, gdn.hidden_size, seed=7)
    rows = StateRows(linear_state_spec(gdn), ROWS, eager_calls(gdn, LAYER, cb=True), LAYER, cb=True)
    run_alone(rows, 1, tokens, 30, 16)
    again = run_alone(rows, 1, tokens, 30, 16)
    ref = hf_request(gdn, model, tokens, 30, 16)
    np.testing.assert_allclose(again, ref[0].numpy(), atol=OUT_ATOL, rtol=0)
    hidden, slots = _chunk(tokens, 0, 16, 16)
    leaked = rows.step(16, hidden[None], (slots + 1)[None], np.array([[1]]))[0]
    assert np.abs(leaked - ref[0][:16].numpy()).max() > 1e-2


@pytest.mark.parametrize("chunk", [16, 64])
def test_onnx_runtime_prefill_and_decode_graphs_match_transformers(gdn, model, ort_graphs, chunk):
    calls = ort_graphs["per_length"]
    tokens = _tokens(150 + DECODE_STEPS, gdn.hidden_size, seed=0)
    rows = StateRows(linear_state_spec(gdn), ROWS, calls, LAYER, cb=True)
    out = run_alone(rows, 2, tokens, 150, chunk)
    _assert_request(out, rows, 2, hf_request(gdn, model, tokens, 150, chunk))
    eager = StateRows(linear_state_spec(gdn), ROWS, eager_calls(gdn, LAYER, cb=True), LAYER, cb=True)
    np.testing.assert_allclose(out, run_alone(eager, 2, tokens, 150, chunk), atol=1e-5, rtol=0)
    np.testing.assert_allclose(rows.recurrent[2], eager.recurrent[2], atol=1e-6, rtol=0)


def test_onnx_runtime_continuous_batching(gdn, model, ort_graphs):
    _continuous_batching_case(gdn, model, ort_graphs["per_length"], chunk=64)


@pytest.mark.parametrize("chunk", [16, 64])
def test_one_graph_serves_prefill_and_decode(gdn, model, ort_graphs, chunk):
    # seq_len is a graph symbol: the same ONNX file (traced at 64) runs chunks of 64 or 16 and decode tokens.
    both = ort_graphs["one_graph"][1]
    _continuous_batching_case(gdn, model, {chunk: both, 1: both}, chunk=chunk)


def test_left_padding_is_refused(gdn):
    step = GatedDeltaNetStep(gdn)
    spec = linear_state_spec(gdn)
    slots = torch.tensor([[-1, -1, 0, 1]])
    with pytest.raises(ValueError, match="pad on the right"):
        step(torch.zeros(1, 4, gdn.hidden_size), slots, torch.zeros(spec.conv_shape(1)),
             torch.zeros(spec.recurrent_shape(1)))


def test_chunk_longer_than_the_graph_is_refused(gdn):
    step = GatedDeltaNetStep(gdn, prefill_seq_len=16)
    spec = linear_state_spec(gdn)
    with pytest.raises(ValueError, match="prefill_seq_len 16"):
        step(torch.zeros(1, 32, gdn.hidden_size), torch.arange(32)[None], torch.zeros(spec.conv_shape(1)),
             torch.zeros(spec.recurrent_shape(1)))


def test_state_shapes_are_checked(gdn):
    step = GatedDeltaNetStep(gdn)
    spec = linear_state_spec(gdn)
    with pytest.raises(ValueError, match="states must be"):
        step(torch.zeros(1, 4, gdn.hidden_size), torch.arange(4)[None], torch.zeros(1, spec.conv_dim, 4),
             torch.zeros(spec.recurrent_shape(1)))
