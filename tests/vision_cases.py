"""Shared by the vision tests: tiny towers of both families, exported graphs, and the pipeline over them.

The reference every test compares against is the stock transformers vision forward over the WHOLE
video (its own sdpa attention, per-segment splits, every index computed inside) followed by the EVS
mask (``reference_vision_evs``); vLLM's ``compute_retention_mask`` checks that mask.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from transformers import (
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
)

from qeff_evs import evs
from qeff_evs.export.vision import export_encoder_graph, export_pruning_graph
from qeff_evs.models.protocol import MediaInput
from qeff_evs.models.pruning import PRUNING_METHODS, VideoPruning
from qeff_evs.models.registry import family_for_config
from qeff_evs.runtime.backends.base import MergedRows
from qeff_evs.runtime.backends.ort import OrtEncoderSession, OrtPruningSession
from qeff_evs.runtime.backends.vision import VisionPipeline

ATOL = 1e-4
EXAMPLE_GRID_HW, EXAMPLE_FRAMES = (8, 12), 2  # the export's example: a grid none of the checks use
# Frame buckets in temporal patches: a video pads to the smallest holding it (T = 5 runs in 8 with 3 padding
# frames), as an export's pruning specializations do.
BUCKETS = (1, 2, 4, 8, 16, 32, 64)


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


def tiny_qwen3_vl_config(deepstack_visual_indexes=(0, 1)) -> Qwen3VLConfig:
    """Two deepstack levels, a vision width (32) different from the output width (64)."""
    return Qwen3VLConfig(
        text_config=dict(
            vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                             "mrope_section": [2, 3, 3], "mrope_interleaved": True},
            pad_token_id=2,
        ),
        vision_config=dict(
            depth=2, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=64,
            patch_size=16, temporal_patch_size=2, spatial_merge_size=2,
            num_position_embeddings=64, deepstack_visual_indexes=list(deepstack_visual_indexes), in_channels=3,
        ),
        image_token_id=900, video_token_id=901, vision_start_token_id=902, vision_end_token_id=903,
    )


def tiny_model(family: str):
    torch.manual_seed(0)
    if family == "qwen2_5_vl":
        return Qwen2_5_VLForConditionalGeneration(tiny_qwen2_5_vl_config()).eval()
    model = Qwen3VLForConditionalGeneration(tiny_qwen3_vl_config()).eval()
    with torch.no_grad():
        # The default init (std 0.02) makes the learned positions a ~1e-4 effect; std 1 makes them count.
        model.model.visual.pos_embed.weight.normal_(std=1.0)
    return model


def patch_width(model) -> int:
    vc = model.config.vision_config
    return vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2


def random_video(model, grid, seed) -> torch.Tensor:
    t, h, w = grid
    return torch.randn(t * h * w, patch_width(model), generator=torch.Generator().manual_seed(seed))


def media(pixels: torch.Tensor, grid, kind: str = "video") -> MediaInput:
    return MediaInput(pixels, tuple(grid), 2.0, kind=kind)


def kept_for(grid, q) -> int:
    t, h, w = evs.merged_grid(grid, 2)
    return evs.kept_token_count(h * w, t, q)


def evs_at(q: float) -> VideoPruning:
    return VideoPruning("evs", q)


@dataclass
class Exported:
    """A family's tiny model, its encoder wrapper and the exported graphs (the encoder, a pruning graph per method)."""

    model: torch.nn.Module
    family: object
    encoder: torch.nn.Module
    encoder_path: Path
    pruning_paths: dict[str, Path]
    messages: list[str] = field(default_factory=list)

    @property
    def evs_path(self) -> Path:
        return self.pruning_paths["evs"]

    @property
    def visual(self):
        return self.model.model.visual

    def ort_pipeline(self, frames_per_call: int, buckets: tuple[int, ...] = BUCKETS) -> VisionPipeline:
        return VisionPipeline(self.family, OrtEncoderSession(self.encoder_path),
                              {m: OrtPruningSession(p) for m, p in self.pruning_paths.items()}, frames_per_call,
                              buckets)


def export_family(family_name: str, folder: Path) -> Exported:
    model = tiny_model(family_name)
    family = family_for_config(model.config, None)
    encoder = family.encoder(model).eval()
    messages: list[str] = []
    encoder_path = export_encoder_graph(encoder, EXAMPLE_GRID_HW, EXAMPLE_FRAMES, folder / "encoder.onnx",
                                        progress=messages.append)
    hidden = model.config.vision_config.out_hidden_size
    pruning_paths = {m: export_pruning_graph(family.pruning_ranking(m), hidden, folder / f"pruning_{m}.onnx",
                                             progress=messages.append) for m in PRUNING_METHODS}
    return Exported(model, family, encoder, encoder_path, pruning_paths, messages)


def assert_matches_reference(result, reference) -> None:
    """Indices exactly, rows (and deepstack) within ATOL of the stock tower + EVS mask."""
    *ref_rows, ref_indices = reference
    assert result.kept_indices.dtype == np.int64
    np.testing.assert_array_equal(result.kept_indices, ref_indices.numpy())
    np.testing.assert_allclose(result.rows, ref_rows[0].numpy(), rtol=0, atol=ATOL)
    if len(ref_rows) > 1:
        np.testing.assert_allclose(result.extras["deepstack_features"], ref_rows[1].numpy(), rtol=0, atol=ATOL)
    else:
        assert not result.extras


class RecordingEncoder:
    """An encoder session that remembers the pixel shape of every call it forwards."""

    def __init__(self, inner):
        self.inner = inner
        self.calls: list[tuple[int, ...]] = []

    def encode(self, pixel_values, host_inputs) -> MergedRows:
        self.calls.append(tuple(np.shape(pixel_values)))
        return self.inner.encode(pixel_values, host_inputs)


class RecordingPruning:
    """A pruning session that remembers what reached it."""

    def __init__(self, inner):
        self.inner = inner
        self.seen: list[dict] = []  # the pruning graph's feeds by input name

    def rank(self, feeds):
        self.seen.append(feeds)
        return self.inner.rank(feeds)
