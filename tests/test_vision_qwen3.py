"""Qwen3-VL vision(+EVS) graph: one ONNX for every grid and K, equal to stock transformers + EVS.

The reference is the stock transformers vision forward (its default sdpa attention, per-frame
splits, position-embedding resampling and rotary ids computed inside) followed by the EVS mask
over ``[merger | deepstack levels]``; vLLM's own mask checks that mask. The tiny tower has two
deepstack levels, a vision width (32) different from the output width (64), and a learned
position table scaled up so that a wrong resampling moves the embeddings far beyond tolerance.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

from qeff_evs import evs
from qeff_evs.export.vision import export_vision_graph
from qeff_evs.models.qwen3_vl import (
    Qwen3_VLVisionEVS,
    position_grid_side,
    reference_vision_evs,
    vision_host_inputs,
    vision_symbols,
)

GRIDS = [(4, 8, 8), (2, 12, 8), (6, 4, 16), (1, 8, 8)]  # square, two non-square, one temporal patch
RATES = [0.0, 0.5, 0.75]
EXPORT_GRID, EXPORT_RETAINED = (2, 8, 12), 30  # a grid none of the checks use
PIXEL_WIDTH = 3 * 2 * 16 * 16
LEVELS, OUT_HIDDEN = 2, 64
ATOL = 1e-4


def tiny_qwen3_vl_config(deepstack_visual_indexes=(0, 1)) -> Qwen3VLConfig:
    return Qwen3VLConfig(
        text_config=dict(
            vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                             "mrope_section": [2, 3, 3], "mrope_interleaved": True},
            pad_token_id=2,
        ),
        vision_config=dict(
            depth=2, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=OUT_HIDDEN,
            patch_size=16, temporal_patch_size=2, spatial_merge_size=2,
            num_position_embeddings=64, deepstack_visual_indexes=list(deepstack_visual_indexes), in_channels=3,
        ),
        image_token_id=900, video_token_id=901, vision_start_token_id=902, vision_end_token_id=903,
    )


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    model = Qwen3VLForConditionalGeneration(tiny_qwen3_vl_config()).eval()
    with torch.no_grad():
        # The default init (std 0.02) makes the learned positions a ~1e-4 effect; std 1 makes them count.
        model.model.visual.pos_embed.weight.normal_(std=1.0)
    return model


@pytest.fixture(scope="module")
def visual(model):
    return model.model.visual


@pytest.fixture(scope="module")
def wrapper(model):
    return Qwen3_VLVisionEVS.from_model(model).eval()


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
    return torch.randn(t * h * w, PIXEL_WIDTH, generator=generator)


def retained_for(grid, q):
    t, h, w = evs.merged_grid(grid, 2)
    return evs.retained_token_count(h * w, t, q)


def stock_forward(visual, pixels, grid):
    with torch.no_grad():
        output = visual(pixels, grid_thw=torch.tensor([grid]))
    return output.pooler_output, list(output.deepstack_features)


CASES = [pytest.param(grid, q, id=f"{grid[0]}x{grid[1]}x{grid[2]}-q{q}") for grid in GRIDS for q in RATES]


@pytest.mark.parametrize("grid,q", CASES)
def test_onnx_graph_matches_reference(visual, wrapper, session, grid, q):
    pixels = random_video(grid, seed=sum(grid) + int(q * 100))
    ref_rows, ref_deepstack, ref_indices = reference_vision_evs(visual, pixels, grid, q)
    k = retained_for(grid, q)
    feeds = {"pixel_values": pixels.numpy(), **vision_host_inputs(wrapper.vision_config, grid, k)}
    rows, deepstack, indices = session.run(["vision_embeds", "deepstack_features", "retained_indices"], feeds)
    assert indices.dtype == np.int64
    np.testing.assert_array_equal(indices, ref_indices.numpy())
    assert deepstack.shape == (LEVELS, k, OUT_HIDDEN)
    np.testing.assert_allclose(rows, ref_rows.numpy(), rtol=0, atol=ATOL)
    np.testing.assert_allclose(deepstack, ref_deepstack.numpy(), rtol=0, atol=ATOL)


@pytest.mark.parametrize("grid,q", CASES)
def test_eager_wrapper_matches_reference(visual, wrapper, grid, q):
    pixels = random_video(grid, seed=7 * sum(grid) + int(q * 100))
    ref_rows, ref_deepstack, ref_indices = reference_vision_evs(visual, pixels, grid, q)
    rows, deepstack, indices = wrapper.run(pixels, grid, retained_for(grid, q))
    assert torch.equal(indices, ref_indices)
    torch.testing.assert_close(rows, ref_rows, rtol=0, atol=ATOL)
    torch.testing.assert_close(deepstack, ref_deepstack, rtol=0, atol=ATOL)


@pytest.mark.parametrize("grid,q", [(GRIDS[0], 0.5), (GRIDS[2], 0.75), (GRIDS[1], 0.75)])
def test_reference_mask_is_vllms_on_concatenated_features(visual, grid, q):
    video_prune = pytest.importorskip("vllm.multimodal.video_prune.evs")
    pixels = random_video(grid, seed=3)
    merged, levels = stock_forward(visual, pixels, grid)
    # vLLM's Qwen3-VL video embeddings carry the deepstack channels after the merger output.
    scored = torch.cat([merged, *levels], dim=-1)
    vllm_mask = video_prune.compute_retention_mask(scored, grid, spatial_merge_size=2, q=q)
    ref_rows, ref_deepstack, ref_indices = reference_vision_evs(visual, pixels, grid, q)
    assert torch.equal(ref_indices, torch.nonzero(vllm_mask).reshape(-1))
    assert torch.equal(ref_rows, merged[vllm_mask])
    for level, features in enumerate(levels):
        assert torch.equal(ref_deepstack[level], features[vllm_mask])


def test_deepstack_channels_change_the_selection(visual):
    """Scoring the merger output alone keeps other tokens here, so the checks above see the concatenation."""
    grid, q = GRIDS[0], 0.5
    pixels = random_video(grid, seed=3)
    merged, _ = stock_forward(visual, pixels, grid)
    merger_only = torch.nonzero(evs.retention_mask(merged, grid, 2, q)).reshape(-1)
    _, _, indices = reference_vision_evs(visual, pixels, grid, q)
    assert not torch.equal(merger_only, indices)


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
        "interp_indices": ["grid_height", 4],
        "interp_weights": ["grid_height", 4],
        "retained_carrier": ["retained_size"],
        "vision_embeds": ["retained_size", OUT_HIDDEN],
        "deepstack_features": [LEVELS, "retained_size", OUT_HIDDEN],
        "retained_indices": ["retained_size"],
    }
    assert [vi.name for vi in graph.output] == ["vision_embeds", "deepstack_features", "retained_indices"]


@pytest.mark.parametrize("grid", GRIDS)
def test_symbols_bind_every_dim(model, onnx_path, session, grid):
    config = model.config.vision_config
    k = retained_for(grid, 0.5)
    symbols = vision_symbols(config, grid, k)
    t, h, w = grid
    assert symbols == {
        "grid_height": t * h * w, "grid_width": PIXEL_WIDTH, "time": t, "grid_h": h, "grid_w": w,
        "frame_bounds": t + 1, "vision_size": t * h * w // 4, "retained_size": k,
    }
    graph = onnx.load(str(onnx_path)).graph
    feeds = {"pixel_values": random_video(grid, seed=1).numpy(), **vision_host_inputs(config, grid, k)}
    outputs = dict(zip(["vision_embeds", "deepstack_features", "retained_indices"], session.run(None, feeds)))
    arrays = {**feeds, **outputs}
    for vi in [*graph.input, *graph.output]:
        expected = [symbols[d.dim_param] if d.dim_param else d.dim_value for d in vi.type.tensor_type.shape.dim]
        assert list(arrays[vi.name].shape) == expected, vi.name


def _merge_block_order(rows: int, cols: int, merge: int = 2) -> tuple[np.ndarray, np.ndarray]:
    """(row, col) of each patch in the order the tower sees them: merge blocks raster, then inside a block."""
    row, col = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    blocks = (rows // merge, merge, cols // merge, merge)
    return row.reshape(blocks).transpose(0, 2, 1, 3).reshape(-1), col.reshape(blocks).transpose(0, 2, 1, 3).reshape(-1)


@pytest.mark.parametrize("grid", [(2, 12, 8), (1, 4, 16)])
def test_host_inputs_resample_positions_like_interpolate(visual, grid):
    """The host taps/weights equal F.interpolate(bilinear, align_corners=True) of the learned table."""
    t, h, w = grid
    host = vision_host_inputs(visual.config, grid, retained_for(grid, 0.5))
    table = visual.pos_embed.weight.detach()
    side = position_grid_side(visual.config)
    resampled = F.interpolate(
        table.T.reshape(1, -1, side, side), size=(h, w), mode="bilinear", align_corners=True
    )[0]  # (D, h, w)
    rows, cols = _merge_block_order(h, w)
    expected = resampled[:, rows, cols].T.repeat(t, 1)  # (t*h*w, D), every frame alike
    taps, weights = torch.from_numpy(host["interp_indices"]), torch.from_numpy(host["interp_weights"])
    gathered = (table[taps] * weights[:, :, None]).sum(1)
    torch.testing.assert_close(gathered, expected, rtol=0, atol=1e-5)
    assert host["interp_weights"].dtype == np.float32 and host["interp_indices"].dtype == np.int64


def test_host_inputs_frames_and_rotary_ids(visual):
    host = vision_host_inputs(visual.config, (2, 12, 8), 24)
    assert list(host) == [
        "video_grid_thw", "rotary_position_ids", "cu_seqlens", "interp_indices", "interp_weights", "retained_carrier"
    ]
    assert host["video_grid_thw"].shape == (2, 12, 8)
    np.testing.assert_array_equal(host["cu_seqlens"], [0, 96, 192])  # full attention within each frame only
    assert host["cu_seqlens"].dtype == np.int32
    rows, cols = _merge_block_order(12, 8)
    np.testing.assert_array_equal(host["rotary_position_ids"], np.tile(np.stack([rows, cols], axis=1), (2, 1)))
    assert host["retained_carrier"].shape == (24,)


@pytest.mark.parametrize(
    "grid,retained,needle",
    [((2, 8, 8), 0, "retained count 0"), ((2, 8, 8), 33, "retained count 33"), ((2, 7, 8), 8, "not divisible")],
)
def test_host_inputs_reject_bad_values(visual, grid, retained, needle):
    with pytest.raises(ValueError, match=needle):
        vision_host_inputs(visual.config, grid, retained)


def test_rejects_non_square_position_table():
    with pytest.raises(ValueError, match="num_position_embeddings=60"):
        position_grid_side(SimpleNamespace(num_position_embeddings=60))


def test_wrapper_needs_deepstack_levels():
    torch.manual_seed(0)
    plain = Qwen3VLForConditionalGeneration(tiny_qwen3_vl_config(deepstack_visual_indexes=()))
    with pytest.raises(ValueError, match="deepstack_visual_indexes is empty"):
        Qwen3_VLVisionEVS.from_model(plain)
    with pytest.raises(ValueError, match="no .visual tower"):
        Qwen3_VLVisionEVS.from_model(torch.nn.Linear(2, 2))


def test_wrapping_leaves_user_model_alone(visual, wrapper):
    assert visual.config._attn_implementation == "sdpa"
    assert wrapper.visual.config is not visual.config
    assert wrapper.visual.pos_embed.weight is visual.pos_embed.weight
    shared_level = wrapper.visual.deepstack_merger_list[1].linear_fc2.weight
    assert shared_level is visual.deepstack_merger_list[1].linear_fc2.weight
    assert all(block.attn.config is wrapper.visual.config for block in wrapper.visual.blocks)
    assert wrapper.deepstack_levels == LEVELS


def test_sessions_carry_deepstack(visual, wrapper, onnx_path):
    """Both runtime vision sessions return the wrapper's three outputs in their places."""
    from qeff_evs.runtime.backends.ort import OrtVisionSession
    from qeff_evs.runtime.backends.torch_reference import TorchVisionSession

    grid, q = GRIDS[1], 0.5
    pixels = random_video(grid, seed=11)
    ref_rows, ref_deepstack, ref_indices = reference_vision_evs(visual, pixels, grid, q)
    host = vision_host_inputs(wrapper.vision_config, grid, retained_for(grid, q))
    for vision_session in (OrtVisionSession(onnx_path), TorchVisionSession(wrapper, device="cpu")):
        result = vision_session.run(pixels.numpy(), host)
        np.testing.assert_array_equal(result.retained_indices, ref_indices.numpy())
        np.testing.assert_allclose(result.rows, ref_rows.numpy(), rtol=0, atol=ATOL)
        np.testing.assert_allclose(result.deepstack, ref_deepstack.numpy(), rtol=0, atol=ATOL)
