"""Qwen2.5-VL vision(+EVS) graph: one ONNX for every grid and K, equal to stock transformers + EVS.

The reference is the stock transformers vision forward (its default sdpa attention, per-segment
splits, grid computed inside) followed by the EVS mask; vLLM's own mask checks that mask.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from qeff_evs import evs
from qeff_evs.models.attention import block_mask_attention, register_block_mask_attention
from qeff_evs.export.vision import check_vision_graph, export_vision_graph
from qeff_evs.models.graph_io import VisionGraphSpec
from qeff_evs.models.qwen2_5_vl import (
    Qwen2_5_VLVisionEVS,
    reference_vision_evs,
    vision_host_inputs,
    vision_symbols,
)

GRIDS = [(4, 8, 8), (2, 12, 8), (6, 4, 16), (1, 8, 8)]  # square, two non-square, one temporal patch
RATES = [0.0, 0.5, 0.75]
EXPORT_GRID, EXPORT_RETAINED = (2, 8, 12), 30  # a grid none of the checks use
ATOL = 1e-4


def tiny_qwen2_5_vl_config() -> Qwen2_5_VLConfig:
    return Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
            bos_token_id=0, eos_token_id=1, pad_token_id=2,
        ),
        vision_config=dict(
            depth=2, hidden_size=64, intermediate_size=128, num_heads=4, out_hidden_size=64,
            patch_size=14, temporal_patch_size=2, spatial_merge_size=2,
            window_size=56, fullatt_block_indexes=[1], in_channels=3,
        ),
        image_token_id=900, video_token_id=901, vision_start_token_id=902, vision_end_token_id=903,
    )


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return Qwen2_5_VLForConditionalGeneration(tiny_qwen2_5_vl_config()).eval()


@pytest.fixture(scope="module")
def wrapper(model):
    return Qwen2_5_VLVisionEVS.from_model(model).eval()


@pytest.fixture(scope="module")
def onnx_path(wrapper, tmp_path_factory):
    messages: list[str] = []
    target = tmp_path_factory.mktemp("vision") / "vision.onnx"
    path = export_vision_graph(wrapper, EXPORT_GRID, EXPORT_RETAINED, target, progress=messages.append)
    assert messages, "export reports progress through the callable"
    return path


@pytest.fixture(scope="module")
def session(onnx_path):
    return ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])


def random_video(grid, seed):
    t, h, w = grid
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(t * h * w, 3 * 2 * 14 * 14, generator=generator)


def retained_for(grid, q):
    t, h, w = evs.merged_grid(grid, 2)
    return evs.retained_token_count(h * w, t, q)


CASES = [pytest.param(grid, q, id=f"{grid[0]}x{grid[1]}x{grid[2]}-q{q}") for grid in GRIDS for q in RATES]


@pytest.mark.parametrize("grid,q", CASES)
def test_onnx_graph_matches_reference(model, wrapper, session, grid, q):
    pixels = random_video(grid, seed=sum(grid) + int(q * 100))
    ref_embeds, ref_indices = reference_vision_evs(model.model.visual, pixels, grid, q)
    k = retained_for(grid, q)
    feeds = {"pixel_values": pixels.numpy(), **vision_host_inputs(wrapper.vision_config, grid, k)}
    embeds, indices = session.run(["vision_embeds", "retained_indices"], feeds)
    assert indices.dtype == np.int64
    np.testing.assert_array_equal(indices, ref_indices.numpy())
    np.testing.assert_allclose(embeds, ref_embeds.numpy(), rtol=0, atol=ATOL)


@pytest.mark.parametrize("grid,q", CASES)
def test_eager_wrapper_matches_reference(model, wrapper, grid, q):
    pixels = random_video(grid, seed=7 * sum(grid) + int(q * 100))
    ref_embeds, ref_indices = reference_vision_evs(model.model.visual, pixels, grid, q)
    embeds, indices = wrapper.run(pixels, grid, retained_for(grid, q))
    assert torch.equal(indices, ref_indices)
    torch.testing.assert_close(embeds, ref_embeds, rtol=0, atol=ATOL)


@pytest.mark.parametrize("grid,q", [(GRIDS[0], 0.5), (GRIDS[2], 0.75)])
def test_reference_mask_is_vllms(model, grid, q):
    video_prune = pytest.importorskip("vllm.multimodal.video_prune.evs")
    pixels = random_video(grid, seed=3)
    merged = model.model.visual(pixels, grid_thw=torch.tensor([grid])).pooler_output.detach()
    vllm_mask = video_prune.compute_retention_mask(merged, grid, spatial_merge_size=2, q=q)
    ref_embeds, ref_indices = reference_vision_evs(model.model.visual, pixels, grid, q)
    assert torch.equal(ref_indices, torch.nonzero(vllm_mask).reshape(-1))
    assert torch.equal(ref_embeds, merged[vllm_mask])


def test_graph_interface_and_no_data_dependent_ops(onnx_path):
    graph = onnx.load(str(onnx_path)).graph
    ops = {node.op_type for node in graph.node}
    assert "NonZero" not in ops
    assert "TopK" in ops  # the EVS selection
    shapes = {
        vi.name: [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim]
        for vi in [*graph.input, *graph.output]
    }
    assert shapes == {
        "pixel_values": ["grid_height", "grid_width"],
        "video_grid_thw": ["time", "grid_h", "grid_w"],
        "rotary_position_ids": ["grid_height", 2],
        "cu_seqlens": ["frame_bounds"],
        "window_index": ["vision_size"],
        "cu_window_seqlens": ["window_bounds"],
        "retained_carrier": ["retained_size"],
        "vision_embeds": ["retained_size", 64],
        "retained_indices": ["retained_size"],
    }


@pytest.mark.parametrize("grid", GRIDS)
def test_symbols_bind_every_dim(model, onnx_path, session, grid):
    config = model.config.vision_config
    k = retained_for(grid, 0.5)
    symbols = vision_symbols(config, grid, k)
    t, h, w = grid
    assert symbols == {
        "grid_height": t * h * w, "grid_width": 1176, "time": t, "grid_h": h, "grid_w": w,
        "frame_bounds": t + 1, "vision_size": t * h * w // 4,
        "window_bounds": symbols["window_bounds"], "retained_size": k,
    }
    graph = onnx.load(str(onnx_path)).graph
    feeds = {"pixel_values": random_video(grid, seed=1).numpy(), **vision_host_inputs(config, grid, k)}
    outputs = dict(zip(["vision_embeds", "retained_indices"], session.run(None, feeds)))
    arrays = {**feeds, **outputs}
    for vi in [*graph.input, *graph.output]:
        expected = [symbols[d.dim_param] if d.dim_param else d.dim_value for d in vi.type.tensor_type.shape.dim]
        assert list(arrays[vi.name].shape) == expected, vi.name


def test_host_inputs_follow_transformers_and_vision_grid(model):
    config = model.config.vision_config
    host = vision_host_inputs(config, (2, 12, 8), 24)
    assert list(host) == [
        "video_grid_thw", "rotary_position_ids", "cu_seqlens", "window_index", "cu_window_seqlens", "retained_carrier"
    ]
    np.testing.assert_array_equal(host["cu_seqlens"], [0, 96, 192])
    assert host["cu_seqlens"].dtype == np.int32 and host["cu_window_seqlens"].dtype == np.int32
    assert sorted(host["window_index"].tolist()) == list(range(48))  # a permutation of the merged tokens
    assert host["cu_window_seqlens"][-1] == 192


@pytest.mark.parametrize(
    "grid,retained,needle",
    [((2, 8, 8), 0, "retained count 0"), ((2, 8, 8), 33, "retained count 33"), ((2, 7, 8), 8, "not divisible")],
)
def test_host_inputs_reject_bad_values(model, grid, retained, needle):
    with pytest.raises(ValueError, match=needle):
        vision_host_inputs(model.config.vision_config, grid, retained)


def test_wrapping_leaves_user_model_alone(model, wrapper):
    assert model.model.visual.config._attn_implementation == "sdpa"
    assert wrapper.visual.config is not model.model.visual.config
    assert wrapper.visual.blocks[0].attn.qkv.weight is model.model.visual.blocks[0].attn.qkv.weight
    assert all(block.attn.config is wrapper.visual.config for block in wrapper.visual.blocks)


def test_registration_is_idempotent():
    first, second = register_block_mask_attention(), register_block_mask_attention()
    assert first == second and "flash" in first
    assert ALL_ATTENTION_FUNCTIONS[first] is block_mask_attention


def test_block_mask_attention_equals_per_segment_sdpa():
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 20, 8, generator=generator) for _ in range(3))
    cu = torch.tensor([0, 3, 3, 11, 20], dtype=torch.int32)  # includes an empty segment
    out, _ = block_mask_attention(None, q, k, v, scaling=0.3, cu_seq_lens_q=cu)
    pieces = [
        F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], scale=0.3)
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())
    ]
    torch.testing.assert_close(out, torch.cat(pieces, dim=2).transpose(1, 2), rtol=0, atol=1e-6)


def test_graph_check_rejects_nonzero_and_unnamed_dims():
    spec = VisionGraphSpec(inputs={"x": {0: "n"}}, outputs={"y": {}})
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["n"])
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.INT64, [2, "nnz"])
    graph = onnx.helper.make_graph([onnx.helper.make_node("NonZero", ["x"], ["y"])], "g", [x], [y])
    with pytest.raises(ValueError, match="no declared symbol"):
        check_vision_graph(onnx.helper.make_model(graph), spec)
    y_named = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.INT64, [2, "nnz"])
    graph = onnx.helper.make_graph([onnx.helper.make_node("NonZero", ["x"], ["y"])], "g", [x], [y_named])
    with pytest.raises(ValueError, match="NonZero"):
        named_spec = VisionGraphSpec(inputs={"x": {0: "n"}}, outputs={"y": {1: "nnz"}})
        check_vision_graph(onnx.helper.make_model(graph), named_spec)
