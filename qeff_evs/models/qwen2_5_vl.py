"""Qwen2.5-VL family.

Vision part: ``Qwen2_5_VLVisionEVS`` wraps the transformers vision tower into the exportable
vision(+EVS) graph; ``vision_host_inputs`` / ``vision_symbols`` give the host-side index tensors
and the specialization symbols for a grid; ``reference_vision_evs`` is the independent reference
(stock transformers forward, then the EVS mask).

Graph interface (DESIGN §5, §7 symbol names):

=====================  ======  ==============================  ===============================
name                   dtype   shape                           meaning
=====================  ======  ==============================  ===============================
pixel_values           float   (grid_height, grid_width)       patches, T*H*W rows of C*tp*p*p
video_grid_thw         int64   (time, grid_h, grid_w)          shape-only carrier, values unused
rotary_position_ids    int64   (grid_height, 2)                (row, col) of each patch, merge-block order
cu_seqlens             int32   (frame_bounds,)                 full-attention segment bounds, time+1
window_index           int64   (vision_size,)                  merged-token order of window attention
cu_window_seqlens      int32   (window_bounds,)                window-attention segment bounds
retained_carrier       int64   (retained_size,)                shape-only: its length is K
vision_embeds          float   (retained_size, out_hidden)     kept merger rows, raster order
retained_indices       int64   (retained_size,)                their flat (t, row, col) indices, ascending
=====================  ======  ==============================  ===============================

``grid_h``/``grid_w`` are the patch rows/columns of one frame (QEfficient's convention), ``time``
the temporal patches, ``vision_size = time * grid_h * grid_w / merge**2``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn as nn
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
from transformers.vision_utils import get_vision_window_index

from qeff_evs import evs
from qeff_evs.models.family import QwenVLFamily
from qeff_evs.models.graph_io import VisionGraphSpec
from qeff_evs.models.protocol import MediaInput, MediaLayout, VideoPreprocessing
from qeff_evs.models.vision_common import (
    VisionEVSWrapper,
    check_retained,
    grid_symbols,
    grid_tensor,
    leading_host_inputs,
    retained_carrier,
)
from qeff_evs.positions import MediaBlock

# The released checkpoints' video preprocessing: 14-px patches, CLIP mean/std, HF's video-processor
# pixel limits per frame.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
PREPROCESS_DEFAULTS = VideoPreprocessing(
    patch_size=14, temporal_patch_size=2, merge_size=2, image_mean=CLIP_MEAN, image_std=CLIP_STD,
    min_pixels=128 * 28 * 28, max_pixels=768 * 28 * 28, pixel_limits_per_video=False,
)
PROCESSOR_CLASS = "Qwen2_5_VL"  # how transformers spells the family in its processor class names

# ---------------------------------------------------------------------------------------------
# Vision(+EVS) graph
# ---------------------------------------------------------------------------------------------

VISION_GRAPH_SPEC = VisionGraphSpec(
    inputs={
        "pixel_values": {0: "grid_height", 1: "grid_width"},
        "video_grid_thw": {0: "time", 1: "grid_h", 2: "grid_w"},
        "rotary_position_ids": {0: "grid_height"},
        "cu_seqlens": {0: "frame_bounds"},
        "window_index": {0: "vision_size"},
        "cu_window_seqlens": {0: "window_bounds"},
        "retained_carrier": {0: "retained_size"},
    },
    outputs={
        "vision_embeds": {0: "retained_size"},
        "retained_indices": {0: "retained_size"},
    },
)


def vision_host_inputs(vision_config, grid_thw: Sequence[int], retained: int) -> dict[str, np.ndarray]:
    """Every vision-graph input except ``pixel_values`` for one video grid ``(T, H, W)`` and K, in graph order."""
    check_retained(vision_config, grid_thw, retained)
    window_index, cu_window_seqlens = get_vision_window_index(
        grid_tensor(grid_thw), spatial_merge_size=vision_config.spatial_merge_size,
        window_size=vision_config.window_size, patch_size=vision_config.patch_size
    )
    return {
        **leading_host_inputs(vision_config, grid_thw),
        "window_index": window_index.numpy().astype(np.int64),
        "cu_window_seqlens": cu_window_seqlens.numpy().astype(np.int32),
        "retained_carrier": retained_carrier(retained),
    }


def vision_symbols(vision_config, grid_thw: Sequence[int], retained: int) -> dict[str, int]:
    """Value of every symbol of the vision graph for one specialization (grid and K)."""
    host = vision_host_inputs(vision_config, grid_thw, retained)
    return {**grid_symbols(vision_config, grid_thw, retained), "window_bounds": len(host["cu_window_seqlens"])}


class Qwen2_5_VLVisionEVS(VisionEVSWrapper):
    """Qwen2.5-VL vision tower + EVS selection, exportable as one graph for every grid and K.

    The tower is a weight-sharing copy of the one given, whose own config copy selects the
    block-mask attention: the caller's model keeps its attention implementation. Grid-dependent
    index tensors come in as inputs (``vision_host_inputs``), so nothing in the graph depends
    on tensor values except the EVS TopK, whose K is the length of ``retained_carrier``.
    """

    graph_spec = VISION_GRAPH_SPEC
    family_label = "Qwen2.5-VL"
    host_inputs_fn = staticmethod(vision_host_inputs)
    symbols_fn = staticmethod(vision_symbols)

    def encode(
        self,
        pixel_values: torch.Tensor,
        video_grid_thw: torch.Tensor,
        rotary_position_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        window_index: torch.Tensor,
        cu_window_seqlens: torch.Tensor,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Every merged row ``(T*h*w, D)``; Qwen2.5-VL has no deepstack levels."""
        merged = self.visual(
            pixel_values,
            grid_thw=None,  # every grid-derived tensor is precomputed; None makes any fallback fail loudly
            position_ids=rotary_position_ids,
            cu_seqlens=cu_seqlens,
            window_index=window_index,
            cu_window_seqlens=cu_window_seqlens,
            max_seqlen=0,  # only flash kernels read these; 0 avoids a .item() on cu_seqlens
            max_window_seqlen=0,
        ).pooler_output
        return merged, []

    def select(self, merged: torch.Tensor, levels: list[torch.Tensor], frames: int,
               retained_carrier: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(vision_embeds (K, D), retained_indices (K,))``."""
        return evs.select_retained(merged, frames, retained_carrier)


# ---------------------------------------------------------------------------------------------
# Reference path
# ---------------------------------------------------------------------------------------------


def reference_vision_evs(
    hf_visual: nn.Module, pixel_values: torch.Tensor, grid_thw: Sequence[int], q: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stock transformers vision forward (its own attention), then the EVS mask: ``(kept rows, indices)``.

    Independent of the wrapper: no precomputed inputs, no block-mask attention, no TopK.
    """
    with torch.no_grad():
        merged = hf_visual(pixel_values, grid_thw=grid_tensor(grid_thw)).pooler_output
    mask = evs.retention_mask(merged, grid_thw, hf_visual.config.spatial_merge_size, q)
    return merged[mask], torch.nonzero(mask).reshape(-1)


# ---------------------------------------------------------------------------------------------
# Family adapter: prompt layout and positions (DESIGN §3-§4)
# ---------------------------------------------------------------------------------------------


class Qwen2_5_VLFamily(QwenVLFamily):
    """Qwen2.5-VL: ``<|vision_start|>`` + K video pads + ``<|vision_end|>``; one M-RoPE block per video.

    The video's temporal positions step by ``tokens_per_second * second_per_grid`` with
    ``second_per_grid = temporal_patch_size / fps`` (kept in double precision, never truncated).
    """

    name = "qwen2_5_vl"
    wrapper = Qwen2_5_VLVisionEVS

    def time_factor(self, fps: float) -> float:
        second_per_grid = self.vision_config.temporal_patch_size / float(fps)
        return float(self.vision_config.tokens_per_second) * second_per_grid

    def video_placeholder(self, video: MediaInput, retained: int) -> np.ndarray:
        return np.full(retained, self.config.video_token_id, dtype=np.int64)

    def real_video_layout(self, video: MediaInput, retained_indices: np.ndarray) -> MediaLayout:
        t, h, w = self.merged_grid(video.grid_thw)
        unpruned = np.full(t * h * w, self.config.video_token_id, dtype=np.int64)
        return MediaLayout(unpruned, self.kept_mask(video, retained_indices),
                           (MediaBlock(t, h, w, self.time_factor(video.fps)),))


Family = Qwen2_5_VLFamily
# The transformers classes of this family's checkpoints.
CONFIG_CLASS = Qwen2_5_VLConfig
MODEL_CLASS = Qwen2_5_VLForConditionalGeneration
