"""Qwen3-VL encoder graph: its interface, per-frame host inputs (rotary ids, position taps) and deepstack.

End-to-end parity of encoder + EVS against the stock tower lives in ``test_vision_pipeline.py``;
here the family's pieces. The reference is the stock transformers vision forward followed by the EVS
mask over ``[merger | deepstack levels]``; vLLM's own mask checks that mask. The tiny tower has two
deepstack levels, a vision width (32) different from the output width (64), and a learned position
table scaled up so that a wrong resampling moves the embeddings far beyond tolerance.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3VLForConditionalGeneration
from vision_cases import export_family, random_video, tiny_qwen3_vl_config

from qeff_evs import evs
from qeff_evs.models.qwen3_vl import (
    Qwen3_VLEncoder,
    encoder_symbols,
    frame_inputs,
    position_grid_side,
    reference_vision_evs,
)

LEVELS, OUT_HIDDEN, PIXEL_WIDTH = 2, 64, 3 * 2 * 16 * 16


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    return export_family("qwen3_vl", tmp_path_factory.mktemp("qwen3_vl"))


@pytest.fixture(scope="module")
def visual(exported):
    return exported.visual


def stock_forward(visual, pixels, grid):
    with torch.no_grad():
        output = visual(pixels, grid_thw=torch.tensor([grid]))
    return output.pooler_output, list(output.deepstack_features)


@pytest.mark.parametrize("grid,q", [((4, 8, 8), 0.5), ((6, 4, 16), 0.75), ((2, 12, 8), 0.75)])
def test_reference_mask_is_vllms_on_concatenated_features(exported, visual, grid, q):
    video_prune = pytest.importorskip("vllm.multimodal.video_prune.evs")
    pixels = random_video(exported.model, grid, seed=3)
    merged, levels = stock_forward(visual, pixels, grid)
    # vLLM's Qwen3-VL video embeddings carry the deepstack channels after the merger output.
    scored = torch.cat([merged, *levels], dim=-1)
    vllm_mask = video_prune.compute_retention_mask(scored, grid, spatial_merge_size=2, q=q)
    ref_rows, ref_deepstack, ref_indices = reference_vision_evs(visual, pixels, grid, q)
    assert torch.equal(ref_indices, torch.nonzero(vllm_mask).reshape(-1))
    assert torch.equal(ref_rows, merged[vllm_mask])
    for level, features in enumerate(levels):
        assert torch.equal(ref_deepstack[level], features[vllm_mask])


def test_deepstack_channels_change_the_selection(exported, visual):
    """Scoring the merger output alone keeps other tokens here, so the parity checks see the concatenation."""
    grid, q = (4, 8, 8), 0.5
    pixels = random_video(exported.model, grid, seed=3)
    merged, _ = stock_forward(visual, pixels, grid)
    merger_only = torch.nonzero(evs.retention_mask(merged, grid, 2, q)).reshape(-1)
    _, _, indices = reference_vision_evs(visual, pixels, grid, q)
    assert not torch.equal(merger_only, indices)


def _shapes(path):
    graph = onnx.load(str(path)).graph
    ops = {node.op_type for node in graph.node}
    return {vi.name: [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim]
            for vi in [*graph.input, *graph.output]}, ops, [vi.name for vi in graph.output]


def test_graph_interfaces_and_no_data_dependent_ops(exported):
    shapes, ops, outputs = _shapes(exported.encoder_path)
    assert "NonZero" not in ops
    assert shapes == {
        "pixel_values": ["grid_height", "grid_width"],
        "video_grid_thw": ["frames_per_call", "grid_h", "grid_w"],
        "rotary_position_ids": ["frame_patches", 2],
        "interp_indices": ["frame_patches", 4],
        "interp_weights": ["frame_patches", 4],
        "vision_embeds": ["merged_rows", OUT_HIDDEN],
        "deepstack_features": [LEVELS, "merged_rows", OUT_HIDDEN],
    }
    assert outputs == ["vision_embeds", "deepstack_features"]
    for method, ratio in (("evs", {}), ("vidcom2", {"retention_ratio": [1]})):
        shapes, ops, outputs = _shapes(exported.pruning_paths[method])
        assert "TopK" in ops and "NonZero" not in ops
        assert shapes == {
            "merged_embeds": ["bucket_tokens", OUT_HIDDEN], "score_extras": [LEVELS, "bucket_tokens", OUT_HIDDEN],
            "bucket_carrier": ["frame_bucket"], "frame_count": [1], **ratio, "ranking": ["bucket_tokens"],
        }
        assert outputs == ["ranking"]


@pytest.mark.parametrize("grid_hw,frames", [((8, 8), 2), ((12, 8), 3), ((4, 16), 1)])
def test_symbols_bind_every_dim(exported, grid_hw, frames):
    config = exported.model.config.vision_config
    symbols = encoder_symbols(config, grid_hw, frames)
    h, w = grid_hw
    assert symbols == {
        "frames_per_call": frames, "grid_h": h, "grid_w": w, "grid_height": frames * h * w,
        "grid_width": PIXEL_WIDTH, "frame_patches": h * w, "merged_rows": frames * h * w // 4,
    }
    session = ort.InferenceSession(str(exported.encoder_path), providers=["CPUExecutionProvider"])
    feeds = {"pixel_values": np.zeros((frames * h * w, PIXEL_WIDTH), np.float32),
             **exported.family.encoder_host_inputs(grid_hw, frames)}
    arrays = {**feeds, **dict(zip(["vision_embeds", "deepstack_features"], session.run(None, feeds)))}
    graph = onnx.load(str(exported.encoder_path)).graph
    for vi in [*graph.input, *graph.output]:
        expected = [symbols[d.dim_param] if d.dim_param else d.dim_value for d in vi.type.tensor_type.shape.dim]
        assert list(arrays[vi.name].shape) == expected, vi.name


def _merge_block_order(rows: int, cols: int, merge: int = 2) -> tuple[np.ndarray, np.ndarray]:
    """(row, col) of each patch in the order the tower sees them: merge blocks raster, then inside a block."""
    row, col = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    blocks = (rows // merge, merge, cols // merge, merge)
    return row.reshape(blocks).transpose(0, 2, 1, 3).reshape(-1), col.reshape(blocks).transpose(0, 2, 1, 3).reshape(-1)


@pytest.mark.parametrize("grid_hw", [(12, 8), (4, 16)])
def test_host_inputs_resample_positions_like_interpolate(visual, grid_hw):
    """One frame's taps/weights equal F.interpolate(bilinear, align_corners=True) of the learned table."""
    h, w = grid_hw
    host = frame_inputs(visual.config, grid_hw)
    table = visual.pos_embed.weight.detach()
    side = position_grid_side(visual.config)
    resampled = F.interpolate(
        table.T.reshape(1, -1, side, side), size=(h, w), mode="bilinear", align_corners=True
    )[0]  # (D, h, w)
    rows, cols = _merge_block_order(h, w)
    expected = resampled[:, rows, cols].T  # (h*w, D), the same for every frame
    taps, weights = torch.from_numpy(host["interp_indices"]), torch.from_numpy(host["interp_weights"])
    gathered = (table[taps] * weights[:, :, None]).sum(1)
    torch.testing.assert_close(gathered, expected, rtol=0, atol=1e-5)
    assert host["interp_weights"].dtype == np.float32 and host["interp_indices"].dtype == np.int64


def test_host_inputs_are_one_frames(exported):
    host = exported.family.encoder_host_inputs((12, 8), 3)
    assert list(host) == ["video_grid_thw", "rotary_position_ids", "interp_indices", "interp_weights"]
    assert host["video_grid_thw"].shape == (3, 12, 8)  # the F carrier
    rows, cols = _merge_block_order(12, 8)
    np.testing.assert_array_equal(host["rotary_position_ids"], np.stack([rows, cols], axis=1))
    assert host["interp_indices"].shape == (96, 4)
    with pytest.raises(ValueError, match="not divisible"):
        exported.family.encoder_host_inputs((7, 8), 2)


def test_rejects_non_square_position_table():
    with pytest.raises(ValueError, match="num_position_embeddings=60"):
        position_grid_side(SimpleNamespace(num_position_embeddings=60))


def test_wrapper_needs_deepstack_levels():
    torch.manual_seed(0)
    plain = Qwen3VLForConditionalGeneration(tiny_qwen3_vl_config(deepstack_visual_indexes=()))
    with pytest.raises(ValueError, match="deepstack_visual_indexes is empty"):
        Qwen3_VLEncoder.from_model(plain)
    with pytest.raises(ValueError, match="no .visual tower"):
        Qwen3_VLEncoder.from_model(torch.nn.Linear(2, 2))


def test_wrapping_leaves_user_model_alone(exported, visual):
    wrapper = exported.encoder
    assert visual.config._attn_implementation == "sdpa"
    assert wrapper.visual.config is not visual.config
    assert wrapper.visual.pos_embed.weight is visual.pos_embed.weight
    shared_level = wrapper.visual.deepstack_merger_list[1].linear_fc2.weight
    assert shared_level is visual.deepstack_merger_list[1].linear_fc2.weight
    assert all(block.attn.config is wrapper.visual.config for block in wrapper.visual.blocks)
    assert wrapper.deepstack_levels == LEVELS
