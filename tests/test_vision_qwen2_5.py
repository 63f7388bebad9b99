"""Qwen2.5-VL encoder graph: its interface, per-frame host inputs, padded windows and segment attention.

End-to-end parity of encoder + EVS against the stock tower lives in ``test_vision_pipeline.py``;
here the pieces: the window layout the host computes, the attention that consumes it, the graph's
symbols, the pruning graphs' interface and vLLM's mask as the reference's mask.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.vision_utils import get_vision_window_index
from vision_cases import export_family, random_video, kept_for

from qeff_evs.export.vision import check_vision_graph
from qeff_evs.models.attention import (
    EqualSegments,
    PaddedSegments,
    register_segment_attention,
    segment_attention,
)
from qeff_evs.models.graph_io import VisionGraphSpec
from qeff_evs.models.qwen2_5_vl import encoder_symbols, frame_inputs, padded_windows, reference_vision_evs
from qeff_evs.models.pruning import pruning_host_inputs


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    return export_family("qwen2_5_vl", tmp_path_factory.mktemp("qwen2_5_vl"))


@pytest.fixture(scope="module")
def config(exported):
    return exported.model.config.vision_config


def shapes_of(path):
    graph = onnx.load(str(path)).graph
    return {vi.name: [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim]
            for vi in [*graph.input, *graph.output]}, {node.op_type for node in graph.node}


def test_encoder_graph_interface_has_no_video_length(exported):
    shapes, ops = shapes_of(exported.encoder_path)
    assert "NonZero" not in ops
    assert shapes == {
        "pixel_values": ["grid_height", "grid_width"],
        "video_grid_thw": ["frames_per_call", "grid_h", "grid_w"],
        "rotary_position_ids": ["frame_patches", 2],
        "window_index": ["frame_tokens"],
        "window_gather": ["windows", "window_len"],
        "window_key_mask": ["windows", "window_len"],
        "window_unpad": ["frame_patches"],
        "vision_embeds": ["merged_rows", 64],
    }


@pytest.mark.parametrize("method", ["evs", "vidcom2"])
def test_pruning_graph_interface(exported, method):
    shapes, ops = shapes_of(exported.pruning_paths[method])
    assert "TopK" in ops and "NonZero" not in ops
    ratio = {"retention_ratio": [1]} if method == "vidcom2" else {}
    assert shapes == {
        "merged_embeds": ["bucket_tokens", 64], "bucket_carrier": ["frame_bucket"], "frame_count": [1], **ratio,
        "ranking": ["bucket_tokens"],
    }


@pytest.mark.parametrize("grid_hw,frames", [((8, 8), 2), ((12, 8), 3), ((4, 16), 1)])
def test_encoder_symbols_bind_every_dim(exported, config, grid_hw, frames):
    symbols = encoder_symbols(config, grid_hw, frames)
    h, w = grid_hw
    windows = frame_inputs(config, grid_hw)["window_gather"].shape
    assert symbols == {
        "frames_per_call": frames, "grid_h": h, "grid_w": w, "grid_height": frames * h * w, "grid_width": 1176,
        "frame_patches": h * w, "merged_rows": frames * h * w // 4, "frame_tokens": h * w // 4,
        "windows": windows[0], "window_len": windows[1],
    }
    session = ort.InferenceSession(str(exported.encoder_path), providers=["CPUExecutionProvider"])
    feeds = {"pixel_values": np.zeros((frames * h * w, 1176), np.float32),
             **exported.family.encoder_host_inputs(grid_hw, frames)}
    arrays = {**feeds, "vision_embeds": session.run(None, feeds)[0]}
    graph = onnx.load(str(exported.encoder_path)).graph
    for vi in [*graph.input, *graph.output]:
        expected = [symbols[d.dim_param] if d.dim_param else d.dim_value for d in vi.type.tensor_type.shape.dim]
        assert list(arrays[vi.name].shape) == expected, vi.name


def test_pruning_symbols_and_carriers(exported):
    assert exported.family.pruning_symbols((8, 14), 6) == {"frame_bucket": 6, "bucket_tokens": 168}
    carriers = pruning_host_inputs("evs", 6, 5, 0.5)
    assert {k: v.shape for k, v in carriers.items()} == {"bucket_carrier": (6,), "frame_count": (1,)}
    assert carriers["frame_count"].tolist() == [5]
    assert set(pruning_host_inputs("vidcom2", 6, 5, 0.5)) == {"bucket_carrier", "frame_count", "retention_ratio"}
    with pytest.raises(ValueError, match="frame_count 7 is outside"):
        pruning_host_inputs("evs", 6, 7, 0.5)
    with pytest.raises(ValueError, match="bucket must be a positive integer"):
        pruning_host_inputs("evs", 0, 1, 0.5)


@pytest.mark.parametrize("grid_hw", [(8, 8), (12, 10), (4, 16), (6, 6)])
def test_padded_windows_cover_transformers_windows(config, grid_hw):
    """Every window of transformers' layout is one row of the gather index; padding is masked and undone."""
    host = frame_inputs(config, grid_hw)
    patches = grid_hw[0] * grid_hw[1]
    window_index, cu = get_vision_window_index(torch.tensor([[1, *grid_hw]]), spatial_merge_size=2,
                                               window_size=config.window_size, patch_size=config.patch_size)
    np.testing.assert_array_equal(host["window_index"], window_index.numpy())
    gather, mask, unpad = host["window_gather"], host["window_key_mask"].astype(bool), host["window_unpad"]
    bounds = cu.tolist()
    assert gather.shape == (len(bounds) - 1, max(b - a for a, b in zip(bounds, bounds[1:])))
    for row, (a, b) in enumerate(zip(bounds, bounds[1:])):
        np.testing.assert_array_equal(gather[row][mask[row]], np.arange(a, b))
    np.testing.assert_array_equal(gather.reshape(-1)[unpad], np.arange(patches))
    assert host["window_key_mask"].dtype == np.int64


def test_padded_windows_reject_bad_bounds():
    with pytest.raises(ValueError, match="do not split 8 patches"):
        padded_windows([0, 4, 4, 8], 8)
    with pytest.raises(ValueError, match="do not split 9 patches"):
        padded_windows([0, 4, 8], 9)


def test_frame_inputs_reject_bad_grids(exported):
    with pytest.raises(ValueError, match="not divisible"):
        exported.family.encoder_host_inputs((7, 8), 2)
    with pytest.raises(ValueError, match="frames per call must be a positive integer"):
        exported.family.encoder_host_inputs((8, 8), 0)


def _per_segment_sdpa(q, k, v, bounds, scale):
    pieces = [F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], scale=scale)
              for a, b in zip(bounds, bounds[1:])]
    return torch.cat(pieces, dim=2).transpose(1, 2)


def test_segment_attention_equals_per_segment_sdpa():
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 24, 8, generator=generator) for _ in range(3))
    out, _ = segment_attention(None, q, k, v, scaling=0.3, cu_seq_lens_q=EqualSegments(3))
    torch.testing.assert_close(out, _per_segment_sdpa(q, k, v, [0, 8, 16, 24], 0.3), rtol=0, atol=1e-6)

    bounds = [0, 3, 11, 12, 24]  # unequal segments, one of length 1
    gather, mask, unpad = padded_windows(bounds, 24)
    layout = PaddedSegments(torch.from_numpy(gather), torch.from_numpy(mask != 0), torch.from_numpy(unpad))
    out, _ = segment_attention(None, q, k, v, scaling=0.3, cu_seq_lens_q=layout)
    torch.testing.assert_close(out, _per_segment_sdpa(q, k, v, bounds, 0.3), rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="EqualSegments or PaddedSegments"):
        segment_attention(None, q, k, v, cu_seq_lens_q=torch.tensor([0, 24]))


def test_registration_is_idempotent():
    first, second = register_segment_attention(), register_segment_attention()
    assert first == second and "flash" in first
    assert ALL_ATTENTION_FUNCTIONS[first] is segment_attention


def test_wrapping_leaves_user_model_alone(exported):
    visual, wrapper = exported.visual, exported.encoder
    assert visual.config._attn_implementation == "sdpa"
    assert wrapper.visual.config is not visual.config
    assert wrapper.visual.blocks[0].attn.qkv.weight is visual.blocks[0].attn.qkv.weight
    assert all(block.attn.config is wrapper.visual.config for block in wrapper.visual.blocks)


@pytest.mark.parametrize("grid,q", [((4, 8, 8), 0.5), ((6, 4, 16), 0.75), ((5, 12, 8), 0.5)])
def test_reference_mask_is_vllms(exported, grid, q):
    video_prune = pytest.importorskip("vllm.multimodal.video_prune.evs")
    visual = exported.visual
    pixels = random_video(exported.model, grid, seed=3)
    with torch.no_grad():
        merged = visual(pixels, grid_thw=torch.tensor([grid])).pooler_output
    vllm_mask = video_prune.compute_retention_mask(merged, grid, spatial_merge_size=2, q=q)
    ref_embeds, ref_indices = reference_vision_evs(visual, pixels, grid, q)
    assert len(ref_indices) == kept_for(grid, q)
    assert torch.equal(ref_indices, torch.nonzero(vllm_mask).reshape(-1))
    assert torch.equal(ref_embeds, merged[vllm_mask])


def test_graph_check_rejects_nonzero_and_unnamed_dims():
    spec = VisionGraphSpec(inputs={"x": {0: "n"}}, outputs={"y": {}})
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["n"])
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.INT64, [2, "nnz"])
    graph = onnx.helper.make_graph([onnx.helper.make_node("NonZero", ["x"], ["y"])], "g", [x], [y])
    with pytest.raises(ValueError, match="no declared symbol"):
        check_vision_graph(onnx.helper.make_model(graph), spec)
    with pytest.raises(ValueError, match="NonZero"):
        named_spec = VisionGraphSpec(inputs={"x": {0: "n"}}, outputs={"y": {1: "nnz"}})
        check_vision_graph(onnx.helper.make_model(graph), named_spec)


def test_patch_embedding_runs_as_a_matmul(exported):
    """The copy's patch embedding is the Conv3d's MatMul (PatchProjection), the same numbers; the user's keeps its
    Conv3d, and the encoder graph has no Conv."""
    from qeff_evs.models.vision_common import PatchProjection

    conv, projection = exported.visual.patch_embed.proj, exported.encoder.visual.patch_embed.proj
    assert isinstance(conv, torch.nn.Conv3d) and isinstance(projection, PatchProjection)
    assert projection.weight is conv.weight
    patches = torch.randn(37, conv.in_channels, *conv.kernel_size, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        np.testing.assert_allclose(projection(patches).numpy(), conv(patches).numpy(), rtol=0, atol=1e-5)
    _, ops = shapes_of(exported.encoder_path)
    assert "Conv" not in ops
    assert not PatchProjection.applies_to(torch.nn.Conv3d(3, 8, kernel_size=(2, 4, 4), stride=(2, 2, 2)))
