"""ONNX Runtime's language session keeps its retained state in place (docs/design.md#the-runtime).

Each KV cache and layer state is one host buffer, bound as the graph's input ``X`` and as its output
``X_RetainedState``, so the graph writes into it and nothing is copied in or out per call. Checked here:

* the same calls (prefill chunks into different cache rows, padded decode batches) give bit for bit the
  logits and states of ONNX Runtime's plain ``run`` with the state fed in and read back, the way the session
  worked before (an independent loop over ``InferenceSession.run``, not the session's code);
* after every call each buffer is still the array the session made at start-up (same data pointer) and
  shows the call's writes: a copy in or out would leave a pointer changed or the write elsewhere;
* in ONNX Runtime's optimised graph every KV output (and Qwen3.5's recurrent state) comes straight out of a
  ``ScatterND`` whose data is the graph input itself, so the kernel sees input and output as one buffer and
  skips its copy; a node that copied between them would fail this;
* one buffer as input and output is safe only if everything that reads ``X`` runs before the node that writes
  ``X_RetainedState``: in that graph every reader of each state is the writer itself, one of its ancestors
  (which ONNX Runtime runs first) or a ``Shape``, which reads no data.

Qwen3.5's conv state is the exception: its write goes through an ``Unsqueeze``/``Gather`` pair around the
scatter (the whole-row ``CtxScatterCB`` is four-dimensional), so ONNX Runtime copies it inside the graph
(72 KiB a row and layer at 0.8B widths, against 1 MiB for the recurrent state); it is still bound in place.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from qeff_evs.models.graph_io import LOGITS_ROWS, RETAINED_SUFFIX
from qeff_evs.runtime.backends.base import DecodeRow, LanguageInputs, decode_batch
from qeff_evs.runtime.backends.ort import OrtLanguageSession
from qeff_evs.runtime.export_bundle import open_export

TEXT_IDS = (20, 400)


@pytest.fixture(scope="module", params=("qwen2_5_vl", "qwen2_5_vl_cb", "qwen3_5_cb"))
def bundle(request, tiny_export, served_export):
    """The session's exports: batch 1, and continuous batching over 4 rows (KV; KV and layer states)."""
    if request.param == "qwen2_5_vl":
        return open_export(tiny_export)
    return open_export(served_export(request.param.removesuffix("_cb"))[1])


def prefill_chunk(bundle, start: int, length: int, seed: int) -> LanguageInputs:
    """Text tokens ``[start, start + length)`` padded to the prefill length, with an empty window."""
    shape, seq_len = bundle.language_shape, bundle.manifest.prefill_seq_len
    rng = np.random.default_rng(seed)
    ids = np.zeros((1, seq_len), np.int64)
    ids[0, :length] = rng.integers(*TEXT_IDS, size=length)
    positions = np.full((4, 1, seq_len), -1, np.int64)
    positions[:, 0, :length] = np.arange(start, start + length)
    window = rng.standard_normal((1, shape.vision_size, shape.hidden)).astype(np.float32)
    extras = {name: rng.standard_normal((levels, 1, shape.vision_size, shape.hidden)).astype(np.float32)
              for name, levels in shape.extras.items()}
    return LanguageInputs(ids, positions, window, extras, np.zeros((1, 1), np.int64), 0)


class PlainRun:
    """The reference: ``InferenceSession.run`` with every retained input fed and every output read back."""

    def __init__(self, path, session: OrtLanguageSession):
        self.session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        self.state = {name: np.zeros_like(value) for name, value in session.state.items()}
        self.outputs = [o.name for o in self.session.get_outputs()]

    def call(self, step: LanguageInputs, batch_index) -> np.ndarray:
        feeds = {**self.state, "input_ids": step.input_ids, "position_ids": step.position_ids,
                 "image_idx": step.image_idx}
        if batch_index is not None:
            feeds["batch_index"] = np.asarray(batch_index, np.int64).reshape(-1, 1)
        if LOGITS_ROWS in {i.name for i in self.session.get_inputs()}:  # one row: the logits the test compares
            feeds[LOGITS_ROWS] = np.zeros(1, np.int64)
        if step.vision_embeds is not None:
            feeds["vision_embeds"] = step.vision_embeds
        feeds.update(step.extras)
        results = dict(zip(self.outputs, self.session.run(None, feeds)))
        for name in self.state:
            self.state[name] = results[name + RETAINED_SUFFIX]
        return results["logits"]


def calls(bundle):
    """``(label, run on the session, the same call's (step, batch_index) for the reference)``."""
    cb = bundle.language_shape.continuous_batching
    seq_len = bundle.manifest.prefill_seq_len
    prompts = {0: 2 * seq_len - 3, 2: seq_len + 5} if cb else {0: 2 * seq_len - 3}
    out = []
    for row, length in prompts.items():
        for start in range(0, length, seq_len):
            step = prefill_chunk(bundle, start, min(seq_len, length - start), seed=10 * row + start)
            out.append((f"prefill row {row} from {start}", row, step))
    for t in range(3):
        rows = [DecodeRow(row, 30 + t, length + t, length + t) for row, length in prompts.items()]
        out.append((f"decode {t}", rows, None))
    return out


def test_state_is_written_in_place_and_equals_a_plain_run(bundle):
    path = bundle.manifest.path(bundle.export_dir, "language")
    session = OrtLanguageSession(path, bundle.language_shape)
    reference = PlainRun(path, session)
    buffers = {name: (value, value.ctypes.data) for name, value in session.state.items()
               if name not in ("vision_embeds", *bundle.language_shape.extras)}  # the window is a per-call feed
    assert buffers and not any(value.any() for value, _ in buffers.values())  # zeroed once, at start-up
    shape = bundle.language_shape
    for label, rows, step in calls(bundle):
        if step is not None:
            cache_row = rows if shape.continuous_batching else None
            logits = session.prefill(rows, step) if cache_row is not None else session.run(step)
            expected = reference.call(step, None if cache_row is None else [cache_row])
        else:
            width = shape.decode_rows if shape.continuous_batching else 1
            ref_step, batch_index = decode_batch(rows, width, shape.full_batch_size)
            logits = session.decode(rows) if shape.continuous_batching else session.run(ref_step)[:, 0]
            expected = reference.call(ref_step, batch_index if shape.continuous_batching else None)[: len(rows), 0]
        np.testing.assert_array_equal(logits, expected, err_msg=label)
        for name, (value, pointer) in buffers.items():
            assert session.state[name] is value and value.ctypes.data == pointer, f"{name} moved after {label}"
            np.testing.assert_array_equal(value, reference.state[name], err_msg=f"{name} after {label}")
    for name, (value, _) in buffers.items():
        assert value.any(), f"{name} shows no write"
        if shape.continuous_batching:  # rows 1 and 3 were never named; the padding rows wrote nothing
            assert not value[[1, 3]].any(), name


def optimized_graph(path, folder) -> onnx.ModelProto:
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(folder / "optimized.onnx")
    options.log_severity_level = 3
    ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return onnx.load(options.optimized_model_filepath, load_external_data=False)  # the graph, not its weights


def test_kv_writes_alias_their_input_in_the_optimized_graph(bundle, tmp_path):
    graph = optimized_graph(bundle.manifest.path(bundle.export_dir, "language"), tmp_path).graph
    producer = {name: node for node in graph.node for name in node.output}
    checked = []
    for output in graph.output:
        name = output.name.removesuffix(RETAINED_SUFFIX)
        if not name.startswith(("past_key.", "past_value.", "recurrent_state.")):
            continue
        node = producer[output.name]
        ok = node.op_type == "ScatterND" and node.input[0] == name
        # Without continuous batching a layer state is a Where over the whole buffer: element-wise, in place too.
        ok = ok or (node.op_type == "Where" and name in node.input and not bundle.language_shape.continuous_batching)
        assert ok, f"{output.name} comes from {node.op_type}({', '.join(node.input)}), not a write into {name}"
        checked.append(name)
    assert len(checked) >= 2


def test_every_read_of_a_state_comes_before_its_write(bundle, tmp_path):
    graph = optimized_graph(bundle.manifest.path(bundle.export_dir, "language"), tmp_path).graph
    nodes = list(graph.node)
    producer = {name: at for at, node in enumerate(nodes) for name in node.output}
    window = {"vision_embeds", *bundle.language_shape.extras}  # written by an Identity of the same values
    checked = 0
    for output in graph.output:
        name = output.name.removesuffix(RETAINED_SUFFIX)
        if name == output.name or name in window:
            continue
        writer = producer[output.name]
        ancestors, todo = set(), [writer]
        while todo:
            for value in nodes[todo.pop()].input:
                at = producer.get(value)
                if at is not None and at not in ancestors:
                    ancestors.add(at)
                    todo.append(at)
        late = [nodes[at].op_type for at, node in enumerate(nodes)
                if name in node.input and at != writer and node.op_type != "Shape" and at not in ancestors]
        assert not late, f"{late} read {name} but need not run before {nodes[writer].op_type} writes it"
        checked += 1
    assert checked >= 2
