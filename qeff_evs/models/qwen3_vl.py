"""Qwen3-VL family.

Vision part: ``Qwen3_VLVisionEVS`` wraps the transformers vision tower into the exportable
vision(+EVS) graph; ``vision_host_inputs`` / ``vision_symbols`` give the host-side index tensors
and the specialization symbols for a grid; ``reference_vision_evs`` is the independent reference
(stock transformers forward, then the EVS mask over the deepstack-concatenated features).

What differs from Qwen2.5-VL: full attention within each temporal patch (no windows), learned
position embeddings resampled bilinearly to the grid (the taps and weights are host inputs), and
``levels`` deepstack mergers whose outputs are pruned with the same kept indices as the main rows.
EVS scores ``[merger | deepstack 0 | deepstack 1 | ...]`` along features, as vLLM does.

Graph interface (DESIGN §5, §7 symbol names):

=====================  ======  ==================================  ===============================
name                   dtype   shape                               meaning
=====================  ======  ==================================  ===============================
pixel_values           float   (grid_height, grid_width)           patches, T*H*W rows of C*tp*p*p
video_grid_thw         int64   (time, grid_h, grid_w)              shape-only carrier, values unused
rotary_position_ids    int64   (grid_height, 2)                    (row, col) of each patch, merge-block order
cu_seqlens             int32   (frame_bounds,)                     per-frame attention bounds, time+1
interp_indices         int64   (grid_height, 4)                    bilinear taps into the pos-embed table
interp_weights         float   (grid_height, 4)                    their weights (float32)
retained_carrier       int64   (retained_size,)                    shape-only: its length is K
vision_embeds          float   (retained_size, out_hidden)         kept merger rows, raster order
deepstack_features     float   (levels, retained_size, out_hidden) the same rows of every deepstack level
retained_indices       int64   (retained_size,)                    their flat (t, row, col) indices, ascending
=====================  ======  ==================================  ===============================

``grid_h``/``grid_w`` are the patch rows/columns of one frame (QEfficient's convention), ``time``
the temporal patches. ``vision_size = time * grid_h * grid_w / merge**2`` is not a graph axis
here (no window index) but is reported with the other symbols, as every vision specialization has it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn as nn
from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration
from transformers.vision_utils import get_vision_interpolation_indices_and_weights

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

# The released checkpoints' video preprocessing: 16-px patches, mean/std 0.5, pixel limits over the
# whole clip.
PREPROCESS_DEFAULTS = VideoPreprocessing(
    patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5),
    min_pixels=128 * 32 * 32, max_pixels=768 * 32 * 32, pixel_limits_per_video=True,
)
PROCESSOR_CLASS = "Qwen3VL"  # how transformers spells the family in its processor class names

# ---------------------------------------------------------------------------------------------
# Vision(+EVS) graph
# ---------------------------------------------------------------------------------------------

# How transformers' Qwen3-VL tower resamples its square learned position grid (set on the model
# instance, not in the config); the host inputs reproduce exactly this.
INTERPOLATION_MODE = "bilinear"
INTERPOLATION_ALIGN_CORNERS = True

VISION_GRAPH_SPEC = VisionGraphSpec(
    inputs={
        "pixel_values": {0: "grid_height", 1: "grid_width"},
        "video_grid_thw": {0: "time", 1: "grid_h", 2: "grid_w"},
        "rotary_position_ids": {0: "grid_height"},
        "cu_seqlens": {0: "frame_bounds"},
        "interp_indices": {0: "grid_height"},
        "interp_weights": {0: "grid_height"},
        "retained_carrier": {0: "retained_size"},
    },
    outputs={
        "vision_embeds": {0: "retained_size"},
        "deepstack_features": {1: "retained_size"},
        "retained_indices": {0: "retained_size"},
    },
)


def position_grid_side(vision_config) -> int:
    """Side of the square learned position-embedding grid; raises if ``num_position_embeddings`` is not square."""
    count = int(vision_config.num_position_embeddings)
    side = int(round(count**0.5))
    if side * side != count:
        raise ValueError(
            f"num_position_embeddings={count} is not a perfect square; Qwen3-VL learns a square position grid "
            "(e.g. 2304 = 48 x 48)"
        )
    return side


def vision_host_inputs(vision_config, grid_thw: Sequence[int], retained: int) -> dict[str, np.ndarray]:
    """Every vision-graph input except ``pixel_values`` for one video grid ``(T, H, W)`` and K, in graph order.

    ``cu_seqlens`` holds one segment per temporal patch: Qwen3-VL attends fully within a frame, never across.
    """
    check_retained(vision_config, grid_thw, retained)
    interp_indices, interp_weights = get_vision_interpolation_indices_and_weights(
        grid_tensor(grid_thw),
        num_grid_per_side=position_grid_side(vision_config),
        mode=INTERPOLATION_MODE,
        align_corners=INTERPOLATION_ALIGN_CORNERS,
        spatial_merge_size=vision_config.spatial_merge_size,
    )
    return {
        **leading_host_inputs(vision_config, grid_thw),
        "interp_indices": interp_indices.numpy().astype(np.int64),
        "interp_weights": interp_weights.numpy().astype(np.float32),
        "retained_carrier": retained_carrier(retained),
    }


def vision_symbols(vision_config, grid_thw: Sequence[int], retained: int) -> dict[str, int]:
    """Value of every symbol of the vision graph for one specialization (grid and K)."""
    return grid_symbols(vision_config, grid_thw, retained)


def _check_tower(visual: nn.Module) -> None:
    levels = getattr(visual, "deepstack_merger_list", None)
    if levels is None or not hasattr(visual, "pos_embed"):
        raise ValueError(
            f"{type(visual).__name__} is not a Qwen3-VL vision tower; pass a Qwen3-VL model or its .visual"
        )
    if len(levels) == 0:
        raise ValueError(
            "vision_config.deepstack_visual_indexes is empty; the Qwen3-VL graph outputs "
            "deepstack_features (levels, K, hidden) and needs at least one level (released models have 3)"
        )
    resample = (getattr(visual, "interpolation_mode", None), getattr(visual, "interpolation_align_corners", None))
    if resample != (INTERPOLATION_MODE, INTERPOLATION_ALIGN_CORNERS):
        raise ValueError(
            f"vision tower resamples position embeddings with (mode, align_corners)={resample}, but the host "
            f"inputs reproduce {(INTERPOLATION_MODE, INTERPOLATION_ALIGN_CORNERS)}; update INTERPOLATION_* to match"
        )
    position_grid_side(visual.config)


class Qwen3_VLVisionEVS(VisionEVSWrapper):
    """Qwen3-VL vision tower + deepstack + EVS selection, exportable as one graph for every grid and K.

    The tower is a weight-sharing copy of the one given, whose own config copy selects the
    block-mask attention: the caller's model keeps its attention implementation. Grid-dependent
    index tensors (rotary ids, frame bounds, position-embedding taps and weights) come in as inputs
    (``vision_host_inputs``), so nothing in the graph depends on tensor values except the EVS TopK,
    whose K is the length of ``retained_carrier``.
    """

    graph_spec = VISION_GRAPH_SPEC
    family_label = "Qwen3-VL"
    host_inputs_fn = staticmethod(vision_host_inputs)
    symbols_fn = staticmethod(vision_symbols)

    def __init__(self, visual: nn.Module) -> None:
        _check_tower(visual)
        super().__init__(visual)

    @property
    def deepstack_levels(self) -> int:
        return len(self.visual.deepstack_merger_list)

    def encode(
        self,
        pixel_values: torch.Tensor,
        video_grid_thw: torch.Tensor,
        rotary_position_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        interp_indices: torch.Tensor,
        interp_weights: torch.Tensor,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Every merged row ``(T*h*w, D)`` and each deepstack level's rows (same shape)."""
        output = self.visual(
            pixel_values,
            grid_thw=None,  # every grid-derived tensor is precomputed; None makes any fallback fail loudly
            position_ids=rotary_position_ids,
            cu_seqlens=cu_seqlens,
            interp_indices=interp_indices,
            interp_weights=interp_weights,
            max_seqlen=0,  # only flash kernels read it; 0 avoids a .item() on cu_seqlens
        )
        return output.pooler_output, list(output.deepstack_features)

    def select(self, merged: torch.Tensor, levels: list[torch.Tensor], frames: int,
               retained_carrier: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(vision_embeds (K, D), deepstack_features (levels, K, D), retained_indices (K,))``."""
        # vLLM scores the concatenation [merger | level 0 | level 1 | ...] and prunes every part alike.
        rows, indices = evs.select_retained(merged, frames, retained_carrier, extra=torch.cat(levels, dim=-1))
        deepstack = torch.stack(levels, dim=0).index_select(1, indices)
        return rows, deepstack, indices


# ---------------------------------------------------------------------------------------------
# Reference path
# ---------------------------------------------------------------------------------------------


def reference_vision_evs(
    hf_visual: nn.Module, pixel_values: torch.Tensor, grid_thw: Sequence[int], q: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stock transformers vision forward (its own attention), then the EVS mask over ``[merger | deepstack...]``.

    Returns ``(kept rows (K, D), kept deepstack (levels, K, D), indices (K,))``. Independent of the
    wrapper: no precomputed inputs, no block-mask attention, no TopK.
    """
    with torch.no_grad():
        output = hf_visual(pixel_values, grid_thw=grid_tensor(grid_thw))
    merged, levels = output.pooler_output, list(output.deepstack_features)
    scored = torch.cat([merged, *levels], dim=-1)
    mask = evs.retention_mask(scored, grid_thw, hf_visual.config.spatial_merge_size, q)
    deepstack = torch.stack([level[mask] for level in levels], dim=0)
    return merged[mask], deepstack, torch.nonzero(mask).reshape(-1)


# ---------------------------------------------------------------------------------------------
# Family adapter: timestamps, the lumped placeholder and the real per-frame layout (DESIGN §4)
# ---------------------------------------------------------------------------------------------


def temporal_patch_times(frame_times: Sequence[float], temporal_patch_size: int) -> list[float]:
    """Seconds of each temporal patch: the mean of its first and last frame's time.

    An incomplete last group is completed with the last frame, as the frames themselves are.
    """
    times = [float(t) for t in frame_times]
    if not times:
        raise ValueError("a Qwen3-VL video needs the sampled frames' times to write its timestamps")
    while len(times) % temporal_patch_size:
        times.append(times[-1])
    return [(times[i] + times[i + temporal_patch_size - 1]) / 2 for i in range(0, len(times), temporal_patch_size)]


def timestamp_text(seconds: float) -> str:
    """``<{t:.1f} seconds>``: Python's formatting, ties to even on the binary value (0.25 -> "0.2")."""
    return f"<{seconds:.1f} seconds>"


class Qwen3_VLFamily(QwenVLFamily):
    """Qwen3-VL: per temporal patch ``<t seconds> <|vision_start|> n_f pads <|vision_end|>``.

    Before encoding only K = sum(n_f) is known; the text per frame does not depend on the split, so
    the placeholder is built with the lumped split ``[K, 0, ..., 0]`` and rewritten after the encoder
    to the real split, same length. Each frame is its own M-RoPE block (1, h, w).
    """

    name = "qwen3_vl"
    wrapper = Qwen3_VLVisionEVS

    def __init__(self, config, tokenizer=None) -> None:
        super().__init__(config, tokenizer)
        self.deepstack_levels = len(getattr(self.vision_config, "deepstack_visual_indexes", ()) or ())

    def timestamp_ids(self, video: MediaInput) -> list[np.ndarray]:
        if self.tokenizer is None:
            raise ValueError("the Qwen3-VL prompt layout needs the checkpoint's tokenizer for its timestamps")
        t = self.merged_grid(video.grid_thw)[0]
        times = temporal_patch_times(video.frame_times, int(self.vision_config.temporal_patch_size))
        if len(times) != t:
            raise ValueError(f"video has {t} temporal patches but {len(video.frame_times)} frame times "
                             f"({len(times)} patches); pass the sampled frames' times")
        return [np.asarray(self.tokenizer.encode(timestamp_text(s), add_special_tokens=False), dtype=np.int64)
                for s in times]

    def _frames(self, video: MediaInput, pads_per_frame: Sequence[int]) -> np.ndarray:
        c = self.config
        parts = []
        for stamp, pads in zip(self.timestamp_ids(video), pads_per_frame):
            parts += [stamp, np.array([c.vision_start_token_id]), np.full(pads, c.video_token_id),
                      np.array([c.vision_end_token_id])]
        return np.concatenate(parts).astype(np.int64)

    def video_placeholder(self, video: MediaInput, retained: int) -> np.ndarray:
        t = self.merged_grid(video.grid_thw)[0]
        return self._frames(video, [retained] + [0] * (t - 1))

    def real_video_layout(self, video: MediaInput, retained_indices: np.ndarray) -> MediaLayout:
        t, h, w = self.merged_grid(video.grid_thw)
        unpruned = self._frames(video, [h * w] * t)
        keep = np.ones(len(unpruned), dtype=bool)
        keep[unpruned == self.config.video_token_id] = self.kept_mask(video, retained_indices)  # raster order
        return MediaLayout(unpruned, keep, tuple(MediaBlock(1, h, w) for _ in range(t)))


Family = Qwen3_VLFamily
# The transformers classes of this family's checkpoints.
CONFIG_CLASS = Qwen3VLConfig
MODEL_CLASS = Qwen3VLForConditionalGeneration
