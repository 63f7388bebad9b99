"""The exported graphs in the form the AIC compiler expects (docs/design.md#numerics-on-the-card), and what that form
computes.

* Every graph of an export passes ``onnx.checker`` (with its local functions) and runs in ONNX Runtime.
* RMSNorms are ``CustomRMSNorm`` nodes; KV writes/reads are CtxScatter/CtxGather (no ScatterElements);
  the language graph has no Cos/Sin of positions (RoPE comes from tables).
* The function bodies skip exactly what the card skips (INT32_MAX / out-of-cache indices), checked
  against a NumPy reference; the RoPE tables equal transformers' rotary embedding bit for bit.
"""

from __future__ import annotations

import collections
import json
import shutil
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from qeff_evs import positions
from qeff_evs.cli import main
from qeff_evs.export.onnx_functions import (
    CTX_GATHER,
    CTX_GATHER_CB,
    CTX_SCATTER,
    CTX_SCATTER_CB,
    CUSTOM_RMS_NORM,
    KV_DOMAIN,
    RMS_NORM_DOMAIN,
    custom_functions,
)
from qeff_evs.manifest import read_manifest
from qeff_evs.models.checkpoint import load_checkpoint
from qeff_evs.models.ctx_ops import SKIP_INDEX
from qeff_evs.models.rope import RopeTable
from qeff_evs.models.tiny import build_tiny_model, build_tokenizer


def graph_paths(export_dir):
    manifest = read_manifest(export_dir)
    return {role: manifest.path(export_dir, role) for role, file in manifest.files.items() if file.endswith(".onnx")}


def rms_norm_count(module: torch.nn.Module) -> int:
    return sum(1 for m in module.modules() if type(m).__name__.endswith("RMSNorm"))


def test_every_graph_is_checked_and_runs(tiny_export):
    for role, path in graph_paths(tiny_export).items():
        model = onnx.load(str(path))
        onnx.checker.check_model(model, full_check=True)
        ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])  # every node has a kernel
        custom = {(n.domain, n.op_type) for n in model.graph.node if n.domain not in ("", "ai.onnx")}
        assert custom <= {(f.domain, f.name) for f in model.functions}, role
        assert "ScatterElements" not in {n.op_type for n in model.graph.node}, role


def test_language_graph_has_compiler_ops_and_no_trig(tiny_export, tiny_checkpoint):
    path = graph_paths(tiny_export)["language"]
    nodes = collections.Counter((n.domain, n.op_type) for n in onnx.load(str(path)).graph.node)
    layers = read_manifest(tiny_export).language_shape.num_layers
    text = load_checkpoint(tiny_checkpoint).model.model.language_model
    assert nodes[(KV_DOMAIN, CTX_SCATTER)] == nodes[(KV_DOMAIN, CTX_GATHER)] == 2 * layers
    assert nodes[(RMS_NORM_DOMAIN, CUSTOM_RMS_NORM)] == rms_norm_count(text)
    assert not {op for _, op in nodes} & {"Cos", "Sin", "Pow", "ScatterElements"}


def test_vision_rms_norms_are_custom(tiny_export, tiny_checkpoint):
    visual = load_checkpoint(tiny_checkpoint).model.model.visual
    found = sum(collections.Counter((n.domain, n.op_type) for n in onnx.load(str(path)).graph.node)
                [(RMS_NORM_DOMAIN, CUSTOM_RMS_NORM)] for role, path in graph_paths(tiny_export).items()
                if role != "language")
    assert rms_norm_count(visual) > 0 and found == rms_norm_count(visual)


# --------------------------------------------------------------------------------------------------
# The function bodies, run alone in ONNX Runtime, against NumPy


def run_function(name: str, inputs: dict[str, np.ndarray]) -> np.ndarray:
    function = custom_functions()[(RMS_NORM_DOMAIN if name == CUSTOM_RMS_NORM else KV_DOMAIN, name)]
    types = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.int64): TensorProto.INT64}
    graph = helper.make_graph(
        [helper.make_node(name, list(inputs), ["out"], domain=function.domain)], "probe",
        [helper.make_tensor_value_info(k, types[v.dtype], v.shape) for k, v in inputs.items()],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["b", "h", "l", "d"])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(function.domain, 1)],
                              functions=[function])
    onnx.checker.check_model(model, full_check=True)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, inputs)[0]


RNG = np.random.default_rng(0)
ROWS, HEADS, CTX, DIM = 3, 2, 6, 4


def test_ctx_scatter_skips_padding_and_writes_the_rest():
    data = RNG.standard_normal((ROWS, HEADS, CTX, DIM)).astype(np.float32)
    updates = RNG.standard_normal((ROWS, HEADS, 2, DIM)).astype(np.float32)
    slots = np.array([[0, 5], [SKIP_INDEX, 2], [-1, SKIP_INDEX]], np.int64)
    expected = data.copy()
    for b in range(ROWS):
        for s in range(2):
            if 0 <= slots[b, s] < CTX:
                expected[b, :, slots[b, s]] = updates[b, :, s]
    out = run_function(CTX_SCATTER, {"data": data, "position_ids": slots, "updates": updates})
    np.testing.assert_array_equal(out, expected)


def test_ctx_scatter_cb_skips_padding_rows_whatever_their_batch_index():
    data = RNG.standard_normal((ROWS, HEADS, CTX, DIM)).astype(np.float32)
    updates = RNG.standard_normal((3, HEADS, 1, DIM)).astype(np.float32)
    batch_index = np.array([[2], [-1], [2]], np.int64)  # row 1: vllm-qaic padding; row 2 pads into a live row
    slots = np.array([[4], [SKIP_INDEX], [SKIP_INDEX]], np.int64)
    expected = data.copy()
    expected[2, :, 4] = updates[0, :, 0]
    out = run_function(CTX_SCATTER_CB, {"data": data, "batch_index": batch_index, "position_ids": slots,
                                        "updates": updates})
    np.testing.assert_array_equal(out, expected)


def test_ctx_scatter_without_any_real_write_changes_nothing():
    # vllm-qaic's all-padding decode call: every row batch_index -1 (or a live row) with a skipped slot.
    data = RNG.standard_normal((ROWS, HEADS, CTX, DIM)).astype(np.float32)
    updates = RNG.standard_normal((3, HEADS, 1, DIM)).astype(np.float32)
    skipped = np.full((3, 1), SKIP_INDEX, np.int64)
    out = run_function(CTX_SCATTER_CB, {"data": data, "batch_index": np.array([[-1], [-1], [0]], np.int64),
                                        "position_ids": skipped, "updates": updates})
    np.testing.assert_array_equal(out, data)
    out = run_function(CTX_SCATTER, {"data": data, "position_ids": skipped, "updates": updates})
    np.testing.assert_array_equal(out, data)


def numpy_scatter(data, rows, slots, updates):
    expected = data.copy()
    for b in range(slots.shape[0]):
        for s in range(slots.shape[1]):
            if 0 <= rows[b] < data.shape[0] and 0 <= slots[b, s] < data.shape[2]:
                expected[rows[b], :, slots[b, s]] = updates[b, :, s]
    return expected


@pytest.mark.parametrize("seed", range(8))
def test_ctx_scatter_bodies_match_numpy_on_random_padding(seed):
    # Skipped writes before and after the real ones, rows named twice, rows out of the cache.
    rng = np.random.default_rng(seed)
    batch, seq = 4, 3
    data = rng.standard_normal((ROWS, HEADS, CTX, DIM)).astype(np.float32)
    updates = rng.standard_normal((batch, HEADS, seq, DIM)).astype(np.float32)
    slots = np.stack([rng.permutation(CTX)[:seq] for _ in range(batch)]).astype(np.int64)
    slots[rng.random((batch, seq)) < 0.4] = SKIP_INDEX
    batch_index = rng.choice([-1, 0, 1, 2, ROWS], size=(batch, 1)).astype(np.int64)
    live = [b for b in range(batch) if 0 <= batch_index[b, 0] < ROWS]
    for b in live[1:]:  # one live batch row per cache row: real writes never collide
        if batch_index[b, 0] in batch_index[live[: live.index(b)], 0]:
            slots[b] = SKIP_INDEX
    out = run_function(CTX_SCATTER_CB, {"data": data, "batch_index": batch_index, "position_ids": slots,
                                        "updates": updates})
    np.testing.assert_array_equal(out, numpy_scatter(data, batch_index[:, 0], slots, updates))
    own_slots, own_updates = slots[:ROWS], updates[:ROWS]  # CtxScatter: batch row b is cache row b
    out = run_function(CTX_SCATTER, {"data": data, "position_ids": own_slots, "updates": own_updates})
    np.testing.assert_array_equal(out, numpy_scatter(data, np.arange(ROWS), own_slots, own_updates))


def test_ctx_gather_reads_slots_and_row_zero_for_skipped():
    data = RNG.standard_normal((ROWS, HEADS, CTX, DIM)).astype(np.float32)
    indices = np.where(np.arange(CTX) > np.array([1, 3, -1])[:, None], SKIP_INDEX, np.arange(CTX))[:, None, :]
    length = np.array(CTX, np.int64)
    out = run_function(CTX_GATHER, {"data": data, "ctx_indices": indices, "comp_ctx_len": length})
    safe = np.where(indices[:, 0] == SKIP_INDEX, 0, indices[:, 0])
    expected = np.stack([data[b][:, safe[b]] for b in range(ROWS)])
    np.testing.assert_array_equal(out, expected)
    batch_index = np.array([[2], [-1], [0]], np.int64)
    out = run_function(CTX_GATHER_CB, {"data": data, "batch_index": batch_index, "ctx_indices": indices,
                                       "comp_ctx_len": length})
    rows = [2, 0, 0]
    np.testing.assert_array_equal(out, np.stack([data[rows[b]][:, safe[b]] for b in range(ROWS)]))


def test_custom_rms_norm_body_computes_in_fp32_and_matches_transformers():
    model = build_tiny_model("qwen2_5_vl", build_tokenizer(), seed=0)
    norm = model.model.language_model.norm
    hidden = torch.randn(2, 3, norm.weight.shape[0]) * 1000
    with torch.no_grad():
        norm.weight.copy_(torch.rand_like(norm.weight) + 0.5)
        expected = norm(hidden).numpy()
    function = custom_functions()[(RMS_NORM_DOMAIN, CUSTOM_RMS_NORM)]
    graph = helper.make_graph(
        [helper.make_node(CUSTOM_RMS_NORM, ["x", "w"], ["out"], domain=RMS_NORM_DOMAIN, epsilon=norm.variance_epsilon)],
        "probe", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, ["b", "s", "d"]),
                  helper.make_tensor_value_info("w", TensorProto.FLOAT16, ["d"])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT16, ["b", "s", "d"])])
    probe = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(RMS_NORM_DOMAIN, 1)],
                              functions=[function])
    session = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
    # fp16 inputs of magnitude 1e3: x^2 would overflow fp16; the body squares in fp32.
    out = session.run(None, {"x": hidden.numpy().astype(np.float16), "w": norm.weight.detach().numpy().astype(np.float16)})[0]
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out.astype(np.float32), expected, atol=2e-2, rtol=1e-2)


# --------------------------------------------------------------------------------------------------
# RoPE tables


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_rope_table_equals_transformers_rotary_at_any_position(family):
    model = build_tiny_model(family, build_tokenizer(), seed=0)
    rotary = model.model.language_model.rotary_emb
    table = RopeTable(rotary, 9000)
    gen = torch.Generator().manual_seed(1)
    mrope = torch.randint(0, 9000, (3, 2, 7), generator=gen)  # t, h, w rows differ: the layout matters
    with torch.no_grad():
        cos, sin = rotary(torch.zeros(()), mrope)
    got_cos, got_sin = table(mrope)
    torch.testing.assert_close(got_cos, cos, rtol=0, atol=0)
    torch.testing.assert_close(got_sin, sin, rtol=0, atol=0)


def test_rope_table_length_covers_unpruned_positions():
    assert positions.rope_table_length(256, 0.0) == 256
    assert positions.rope_table_length(256, 0.5) == 512
    assert positions.rope_table_length(8192, 0.9) == 81920
    assert positions.rope_table_length(100, 0.0) == 128  # rounded up to 64
    positions.check_rope_range(decode_start=500, max_new_tokens=12, table_positions=512)
    with pytest.raises(ValueError, match=r"positions up to 512 .*\[0, 512\).*--rope-positions >= 513"):
        positions.check_rope_range(decode_start=500, max_new_tokens=13, table_positions=512)


def test_export_records_its_rope_table(tiny_export, export_options):
    shape = read_manifest(tiny_export).language_shape
    q = export_options.max_video_pruning_rate  # the largest rate it serves (0.9 by default), not the default rate
    assert q == 0.9 and shape.rope_positions == positions.rope_table_length(export_options.ctx_len, q)


def test_run_refuses_a_request_beyond_the_rope_table(tiny_export, video_npy, question, tmp_path, capsys):
    """The host checks positions against the manifest's table length before any graph call."""
    build = tmp_path / "build"
    shutil.copytree(tiny_export, build)
    manifest = json.loads((build / "manifest.json").read_text())
    manifest["language_shape"]["rope_positions"] = 20  # the clip's prompt alone reaches past 20
    (build / "manifest.json").write_text(json.dumps(manifest))
    code = main(["run", str(build), "--video", str(video_npy), "--prompt", question, "--max-new-tokens", "4"])
    err = capsys.readouterr().err
    assert code == 2
    assert "RoPE tables cover positions [0, 20)" in err and "--rope-positions" in err


def test_rms_norm_rewrite_reads_external_data_beside_the_graph(tmp_path, monkeypatch):
    """A graph over 2 GB keeps its initializers in files beside it (a 3B checkpoint's language graph): the
    rewrite must find its scalars there, whatever the working directory, and leave the weights in place."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    from qeff_evs.export.onnx_graph import ONNX_OPSET, add_compiler_functions

    norm = Qwen2RMSNorm(16, eps=1e-6).eval()
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(3, 16)
    folder = tmp_path / "graph"
    folder.mkdir()
    path = folder / "norm.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the legacy exporter's notice, as legacy_export does
        torch.onnx.export(norm, (x,), str(path), input_names=["x"], output_names=["y"], opset_version=ONNX_OPSET,
                          dynamo=False)
    onnx.save(onnx.load(str(path)), str(path), save_as_external_data=True, all_tensors_to_one_file=False,
              size_threshold=0, convert_attribute=True)  # Constant values too, as torch does for RoPE tables
    saved = onnx.load(str(path), load_external_data=False).graph
    assert any(init.data_location == TensorProto.EXTERNAL for init in saved.initializer)
    assert any(n.attribute[0].t.data_location == TensorProto.EXTERNAL for n in saved.node if n.op_type == "Constant")
    monkeypatch.chdir(tmp_path)  # not the graph's folder
    add_compiler_functions(path)
    model = onnx.load(str(path))
    assert [n.op_type for n in model.graph.node if n.domain == RMS_NORM_DOMAIN] == [CUSTOM_RMS_NORM]
    (y,) = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x.numpy()})
    with torch.no_grad():
        np.testing.assert_allclose(y, norm(x).numpy(), rtol=0, atol=1e-5)
