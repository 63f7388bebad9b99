"""``qeff-evs verify``: the fp16 emulation is faithful (overflow and rounding happen where fp16 has them)
and, on the session export, the card-ready graphs meet the targets of docs/design.md#numerics-on-the-card in it."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from qeff_evs.cli import main
from qeff_evs.export.fp16 import convert_to_fp16, round_external_weights, round_to_fp16
from qeff_evs.export.verify import compile_lines, evs_comparisons, verify_export
from qeff_evs.export.verify_routers import router_agreement


def run(model: onnx.ModelProto, **feeds: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


def test_external_weights_are_rounded_file_to_file_as_in_memory(tmp_path):
    """A graph whose weights lie in external files (how torch writes a released-width one) converts without
    loading them: the weights rounded file to file run as the in-memory conversion of the loaded graph."""
    rng = np.random.default_rng(0)
    weight = (rng.standard_normal((64, 64)) * 7).astype(np.float32)
    shape = np.array([1, 64], np.int64)
    mixing = (rng.standard_normal((64, 64)) * 7).astype(np.float32)  # a Constant, stored externally as torch does
    nodes = [helper.make_node("MatMul", ["x", "w"], ["xw"]),
             helper.make_node("Constant", [], ["c"], value=onnx.numpy_helper.from_array(mixing, "c")),
             helper.make_node("MatMul", ["xw", "c"], ["y"]), helper.make_node("Reshape", ["y", "shape"], ["out"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 64])],
                              [onnx.numpy_helper.from_array(weight, "w"), onnx.numpy_helper.from_array(shape, "shape")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    (tmp_path / "export").mkdir()
    (tmp_path / "twin").mkdir()
    path = tmp_path / "export" / "g.onnx"
    onnx.save(model, str(path), save_as_external_data=True, all_tensors_to_one_file=False, convert_attribute=True)
    assert onnx.load(str(path), load_external_data=False).graph.node[1].attribute[0].t.data_location == \
        TensorProto.EXTERNAL
    light = convert_to_fp16(onnx.load(str(path), load_external_data=False), in_place=True)
    round_external_weights(light, path.parent, tmp_path / "twin", "weights.data")
    onnx.save(light, str(tmp_path / "twin" / "g.onnx"))
    x = rng.standard_normal((1, 64)).astype(np.float32)
    streamed = ort.InferenceSession(str(tmp_path / "twin" / "g.onnx"), providers=["CPUExecutionProvider"])
    expected = run(convert_to_fp16(onnx.load(str(path))), x=x)
    np.testing.assert_array_equal(streamed.run(None, {"x": x})[0], expected)
    assert not np.array_equal(expected, run(onnx.load(str(path)), x=x))  # the weights were rounded


def test_emulation_rounds_every_op_output_through_fp16():
    """sqrt(sum(x^2) * sum(y^2)) overflows in fp16 once the product passes 65504, even between two
    ops that have no fp16 kernel in ONNX Runtime; a small value is rounded to fp16's precision."""
    nodes = [helper.make_node("ReduceSumSquare", ["x"], ["a"], keepdims=0),
             helper.make_node("ReduceSumSquare", ["y"], ["b"], keepdims=0),
             helper.make_node("Mul", ["a", "b"], ["ab"]), helper.make_node("Sqrt", ["ab"], ["out"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, [4]) for n in "xy"],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    x = np.full(4, 9.0, np.float32)  # sum x^2 = 324, product 104976 > 65504
    assert run(model, x=x, y=x) == pytest.approx(324.0)
    assert np.isinf(run(convert_to_fp16(model), x=x, y=x))
    small = np.full(4, 0.1, np.float32)
    squares = round_to_fp16(np.sum(round_to_fp16(small) ** 2))  # inputs, then each op's output, in fp16
    expected = round_to_fp16(np.sqrt(round_to_fp16(squares * squares)))
    assert run(convert_to_fp16(model), x=small, y=small) == expected != np.sqrt(np.float32(0.04) ** 2)


def test_round_to_fp16_saturates_finite_values_and_keeps_infinities():
    values = np.array([1e6, -1e6, np.inf, -np.inf, 1.0 / 3], np.float32)
    np.testing.assert_array_equal(round_to_fp16(values)[:4], [65504, -65504, np.inf, -np.inf])
    assert round_to_fp16(values)[4] == np.float32(np.float16(1.0 / 3))


def test_router_agreement_counts_flips_margins_and_errors():
    """Two routers over two chunks, top-2 of 4: hand-made fp32 probabilities, one variant that swaps a near tie
    (error 0.01 on a margin of 0.01) and one that moves a probability without changing the set. The flips, their
    margins, each variant's probability error, the pairs within twice their error and the first router's own
    error are those of the made-up numbers."""
    def chunk(probs):  # per router: probabilities, then the top-2 chosen by numpy
        return [*probs, *[np.argsort(-p, axis=-1, kind="stable")[:, :2] for p in probs]]

    base = np.array([[0.40, 0.30, 0.20, 0.10], [0.35, 0.33, 0.32, 0.00]], np.float32)  # margins 0.10, 0.01
    fp32 = [chunk([base, base]), chunk([base, base])]
    tie = base.copy()
    tie[1, 1], tie[1, 2] = 0.32, 0.33  # the second token's 2nd and 3rd swap
    moved = base.copy()
    moved[0, 0] = 0.42  # the first token's top prob moves by 0.02, the set stays
    after = base.copy()
    after[1, 0] = 0.353  # ... and at router 1 that token's top prob moves by 0.003, inside its margin of 0.01
    fp16 = [chunk([tie, after]), chunk([base, base])]  # router 0 of chunk 0 flips one token
    kept = [chunk([moved, base]), chunk([base, base])]
    detail = router_agreement({"fp32": fp32, "router_fp16": fp16, "router_fp32": kept}, routers=2)
    assert detail["routers"] == 2 and detail["top_k"] == 2 and detail["tokens_x_layers"] == 8
    assert detail["flipped_share_router_fp16"] == 1 / 8 and detail["flipped_share_router_fp32"] == 0.0
    np.testing.assert_allclose(detail["flipped_margins_router_fp16"], [0.01], atol=1e-7)
    assert len(detail["flipped_by_layer_router_fp16"][0]) == 1 and detail["flipped_by_layer_router_fp16"][1] == []
    np.testing.assert_allclose(detail["prob_error_max_router_fp16"], 0.01, atol=1e-7)
    np.testing.assert_allclose(detail["prob_error_max_router_fp32"], 0.02, atol=1e-7)
    assert detail["prob_error_median_router_fp16"] == 0.0
    np.testing.assert_allclose(detail["prob_error_by_layer_router_fp32"], [[0.0, 0.02], [0.0, 0.0]], atol=1e-7)
    # fp16's one erring pair has margin 0.01 <= 2 x 0.01; fp32's has margin 0.10 > 2 x 0.02; the other pairs have
    # no error and a positive margin.
    assert detail["within_error_share_router_fp16"] == 1 / 8 and detail["within_error_share_router_fp32"] == 0.0
    np.testing.assert_allclose(detail["router_own_error_max"], 0.02, atol=1e-7)  # tie vs moved, first router
    # At router 1 only the token router 0 flipped errs (0.003), in neither variant another.
    np.testing.assert_allclose(detail["later_layers_prob_error_max_after_flip_router_fp16"], 0.003, atol=1e-7)
    assert detail["later_layers_prob_error_max_no_earlier_flip_router_fp16"] == 0.0
    assert detail["later_layers_prob_error_max_after_flip_router_fp32"] == 0.0  # nothing flipped
    assert detail["later_layers_prob_error_max_no_earlier_flip_router_fp32"] == 0.0


def test_compile_lines_follow_compile_sh(tiny_export):
    # The pruning graphs alone keep fp32 arithmetic (docs/design.md#numerics-on-the-card).
    assert compile_lines(tiny_export) == {"vision/encoder.onnx": True, "vision/pruning_evs.onnx": False,
                                          "vision/pruning_vidcom2.onnx": False, "language/language.onnx": True}


def test_evs_arithmetic_collapses_in_fp16_and_agrees_in_fp32(tiny_export):
    """Realistic vision norms (20..100) at widths 2048/3584: fp16 arithmetic loses the ranking."""
    in_fp16 = evs_comparisons(tiny_export, converts_evs=True)
    in_fp32 = evs_comparisons(tiny_export, converts_evs=False)  # fp16 rows, fp32 arithmetic
    assert [c.name for c in in_fp32] == ["evs@width2048", "evs@width3584"]
    assert all(c.kept_token_agreement < 0.9 for c in in_fp16)
    assert all(c.kept_token_agreement >= 0.99 for c in in_fp32)


@pytest.fixture(scope="module")
def report(tiny_export):
    return verify_export(tiny_export, fp16=True)


def test_position_error_does_not_grow(report):
    positions = [c for c in report.comparisons if c.name.startswith("positions@")]
    assert len(positions) >= 2 and positions[0].detail["first_position"] == 10
    near_start, far = positions[0], positions[-1]
    # The table's end: ctx_len 256 at the largest rate, --max-video-pruning-rate 0.9, covers 2560 positions.
    assert far.detail["first_position"] > 2500
    # fp16 noise differs a little from chunk to chunk (measured: 0.046 at 10, 0.063-0.079 from 491 to 2539, flat);
    # Cos(position * inv_freq) in fp16 would be off by radians at 2539.
    assert all(c.max_abs_error <= 2 * near_start.max_abs_error for c in positions)
    assert far.max_abs_error <= 1.5 * min(c.max_abs_error for c in positions[1:])
    assert all(c.greedy_agreement == 1.0 for c in positions)


def test_hidden_states_of_magnitude_1e3_stay_finite(report):
    magnitude = next(c for c in report.comparisons if c.name == "magnitude_1e3")
    assert magnitude.nonfinite_fp16 == magnitude.nonfinite_fp32 == 0
    assert magnitude.greedy_agreement == 1.0 and magnitude.max_abs_error < 0.5


def test_every_graph_is_reported_without_inf_or_nan(report, tiny_export):
    assert set(report.graphs) == {"encoder", "pruning_evs", "pruning_vidcom2", "language"}
    for method in ("evs", "vidcom2"):
        ranking = next(c for c in report.comparisons if c.name == f"pruning_{method}")
        assert ranking.kept_token_agreement is not None and ranking.kept_token_agreement >= 0.9
    assert report.problems == []


def test_cli_verify_json(tiny_export, capsys):
    assert main(["verify", str(tiny_export), "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["fp16"] is False
    assert set(document["graphs"]) == {"encoder", "pruning_evs", "pruning_vidcom2", "language"}
    assert {c["name"] for c in document["comparisons"]} >= {"encoder", "pruning_evs", "pruning_vidcom2", "positions@10",
                                                            "magnitude_1e3"}
