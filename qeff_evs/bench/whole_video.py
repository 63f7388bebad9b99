"""The whole-video vision graph the encoder replaced, rebuilt for the vision sweep's baseline only.

Before issue 10 one graph took a whole video: the tower attended over all ``S = T*H*W`` patches with a
dense ``(S, S)`` block mask built from ``cu_seqlens`` (cost and memory ``S^2`` per head), then EVS. It
is composed here from production pieces, never as a switch in them: a weight-sharing copy of the
family encoder's tower given the block-mask attention below, followed by the family's ``EVSSelection``.
It rebuilds a windowed tower's whole-video inputs and carries no extra rows (``whole_video_serves``):
the benchmark's default family.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.vision_utils import get_vision_cu_seqlens, get_vision_position_ids, get_vision_window_index

from qeff_evs.export.onnx_graph import legacy_export
from qeff_evs.models.vision_common import EncoderWrapper, EVSSelection, evs_host_inputs, grid_tensor, share_weights_copy

BLOCK_MASK_ATTENTION = "qeff_evs_flash_block_mask"  # "flash": transformers hands cu_seqlens through
INPUTS = {
    "pixel_values": {0: "grid_height"}, "rotary_position_ids": {0: "grid_height"}, "cu_seqlens": {0: "frame_bounds"},
    "window_index": {0: "vision_size"}, "cu_window_seqlens": {0: "window_bounds"}, "time_carrier": {0: "time"},
    "retained_carrier": {0: "retained_size"},
}
OUTPUTS = {"vision_embeds": {0: "retained_size"}, "retained_indices": {0: "retained_size"}}


def whole_video_serves(encoder: EncoderWrapper, family) -> bool:
    """Whether the baseline can stand in for this family: a windowed tower (its encoder takes window
    indices, which the baseline rebuilds for the whole video) whose rows carry no extra rows."""
    return "window_index" in encoder.graph_spec.inputs and not family.extras


def block_mask_attention(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0,
                         cu_seq_lens_q=None, **kwargs):
    """Attention over the whole sequence with a dense ``(S, S)`` same-segment mask from ``cu_seqlens``."""
    positions = torch.arange(query.shape[2], dtype=torch.int64)
    segments = (positions[:, None] >= cu_seq_lens_q[1:].to(torch.int64)[None, :]).sum(dim=-1)
    scores = torch.matmul(query, key.transpose(-1, -2)) * (scaling or query.shape[-1] ** -0.5)
    scores = torch.where(segments[:, None] == segments[None, :], scores, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores.float(), dim=-1).to(query.dtype)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), None


class WholeVideoVision(nn.Module):
    """Tower over the whole video (block-mask attention) + the EVS selection: the pre-issue-10 graph."""

    def __init__(self, encoder: EncoderWrapper, selection: EVSSelection) -> None:
        super().__init__()
        if ALL_ATTENTION_FUNCTIONS.get(BLOCK_MASK_ATTENTION) is not block_mask_attention:
            AttentionInterface.register(BLOCK_MASK_ATTENTION, block_mask_attention)
        self.visual = share_weights_copy(encoder.visual)
        self.visual.config._attn_implementation = BLOCK_MASK_ATTENTION
        self.selection = selection

    def forward(self, pixel_values, rotary_position_ids, cu_seqlens, window_index, cu_window_seqlens,
                time_carrier, retained_carrier):
        merged = self.visual(pixel_values, grid_thw=None, position_ids=rotary_position_ids, cu_seqlens=cu_seqlens,
                             window_index=window_index, cu_window_seqlens=cu_window_seqlens, max_seqlen=0,
                             max_window_seqlen=0).pooler_output
        return self.selection(merged, time_carrier, retained_carrier)


def host_inputs(vision_config, grid_thw, merged_grid, retained: int) -> dict[str, np.ndarray]:
    """Every input but ``pixel_values``, for the whole video ``grid_thw``."""
    grid = grid_tensor(grid_thw)
    window_index, cu_window_seqlens = get_vision_window_index(
        grid, spatial_merge_size=vision_config.spatial_merge_size, window_size=vision_config.window_size,
        patch_size=vision_config.patch_size)
    return {"rotary_position_ids": get_vision_position_ids(grid, vision_config.spatial_merge_size).numpy(),
            "cu_seqlens": get_vision_cu_seqlens(grid).numpy().astype(np.int32),
            "window_index": window_index.numpy(), "cu_window_seqlens": cu_window_seqlens.numpy().astype(np.int32),
            **evs_host_inputs(merged_grid, retained)}


def export_whole_video_graph(encoder: EncoderWrapper, selection: EVSSelection, path: Path) -> Path:
    """Trace the baseline on a 2-patch 8x8 video keeping one frame's tokens; every size stays a symbol."""
    module = WholeVideoVision(encoder, selection).eval()
    config = encoder.vision_config
    grid, merged = (2, 8, 8), (2, 4, 4)
    width = config.in_channels * config.temporal_patch_size * config.patch_size ** 2
    inputs = {"pixel_values": np.zeros((128, width), np.float32), **host_inputs(config, grid, merged, 16)}
    path.parent.mkdir(parents=True, exist_ok=True)
    legacy_export(module, [torch.from_numpy(v) for v in inputs.values()], path, input_names=list(INPUTS),
                  output_names=list(OUTPUTS), dynamic_axes={**INPUTS, **OUTPUTS})
    return path
