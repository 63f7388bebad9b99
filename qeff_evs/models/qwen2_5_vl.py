"""Qwen2.5-VL family.

Vision part: ``Qwen2_5_VLEncoder`` wraps the transformers vision tower into the exportable encoder
graph (F temporal patches of one resolution per call); ``frame_inputs`` / ``encoder_symbols`` give
one frame's host-side index tensors and the specialization symbols; ``reference_vision_evs`` is the
independent reference (stock transformers forward over the whole video, then the EVS mask). The pruning
graphs are the family-agnostic ``pruning.PruningRanking``.

Encoder graph interface (docs/design.md#the-three-graphs):

=====================  ======  ==============================  ===============================
name                   dtype   shape                           meaning
=====================  ======  ==============================  ===============================
pixel_values           float   (grid_height, grid_width)       patches, F*H*W rows of C*tp*p*p
video_grid_thw         int64   (frames_per_call, grid_h,       shape-only carrier, values unused
                               grid_w)
rotary_position_ids    int64   (frame_patches, 2)              (row, col) of one frame's patches
window_index           int64   (frame_tokens,)                 one frame's merged-token window order
window_gather          int64   (windows, window_len)           patch of each padded window place
window_key_mask        int64   (windows, window_len)           1 on real places, 0 on padding
window_unpad           int64   (frame_patches,)                padded place of each patch
vision_embeds          float   (merged_rows, out_hidden)       merged rows, raster (t, row, col)
=====================  ======  ==============================  ===============================

``grid_h``/``grid_w`` are the patch rows/columns of one frame (QEfficient's convention),
``frame_patches = grid_h * grid_w``, ``merged_rows = frames_per_call * frame_patches / merge**2``.
The full-attention blocks attend per frame (a reshape, no mask); the windowed blocks per padded
window: ``frames_per_call * windows`` segments of ``window_len`` patches, never the whole call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn as nn
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
from transformers.vision_utils import get_vision_window_index

from qeff_evs import evs
from qeff_evs.models.attention import frame_windows, tile_per_frame
from qeff_evs.models.graph_io import VisionGraphSpec
from qeff_evs.models.protocol import MediaInput, MediaLayout, VideoPreprocessing
from qeff_evs.models.qwen_vl import QwenVLFamily
from qeff_evs.models.registry import register_family
from qeff_evs.models.vision_common import (
    CALL_INPUTS,
    FRAME_PATCHES,
    MERGED_ROWS,
    EncoderWrapper,
    encoder_symbols as shared_encoder_symbols,
    equal_frames_call,
    frame_rotary_ids,
    grid_tensor,
)
from qeff_evs.positions import MediaBlock
from qeff_evs.weights.name_map import NameMap, Rename

# The released checkpoints' video preprocessing: 14-px patches, CLIP mean/std, HF's video-processor
# pixel limits per frame.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
PREPROCESS_DEFAULTS = VideoPreprocessing(
    patch_size=14, temporal_patch_size=2, merge_size=2, image_mean=CLIP_MEAN, image_std=CLIP_STD,
    min_pixels=128 * 28 * 28, max_pixels=768 * 28 * 28, pixel_limits_per_video=False,
    video_processor="Qwen2VLVideoProcessor", do_sample_frames=False, sampling_fps=None,
)

# The released checkpoints (and save_pretrained's) name the vision tower ``visual.*`` and the decoder ``model.*``;
# transformers' module holds them as ``model.visual.*`` and ``model.language_model.*`` (its conversion mapping for
# Qwen2-VL). A name already in the module's form is left as it is.
WEIGHT_NAMES = NameMap(renames=(
    Rename(r"^visual\.", "model.visual."),
    Rename(r"^model\.(?!language_model\.|visual\.)", "model.language_model."),
))

# ---------------------------------------------------------------------------------------------
# Encoder graph
# ---------------------------------------------------------------------------------------------

FRAME_TOKENS, WINDOWS, WINDOW_LEN = "frame_tokens", "windows", "window_len"

ENCODER_GRAPH_SPEC = VisionGraphSpec(
    inputs={
        **CALL_INPUTS,
        "window_index": {0: FRAME_TOKENS},
        "window_gather": {0: WINDOWS, 1: WINDOW_LEN},
        "window_key_mask": {0: WINDOWS, 1: WINDOW_LEN},
        "window_unpad": {0: FRAME_PATCHES},
    },
    outputs={"vision_embeds": {0: MERGED_ROWS}},
)


def padded_windows(cu_window_seqlens: Sequence[int], patches: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(gather (windows, L), key_mask (windows, L), unpad (patches,))`` from one frame's window bounds.

    In window order every window is a contiguous run of patches; edge windows are shorter than the
    longest, ``L``, when the grid is not a multiple of the window. Padding places repeat the window's
    first patch and are masked out as keys (``key_mask`` 0; int64, as every index input, so each
    backend takes it); ``unpad`` is each patch's flat place.
    """
    bounds = [int(b) for b in cu_window_seqlens]
    if bounds[0] != 0 or bounds[-1] != patches or any(b <= a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"window bounds {bounds} do not split {patches} patches into non-empty windows")
    lengths = np.diff(bounds)
    places = np.arange(int(lengths.max()))
    starts = np.asarray(bounds[:-1])[:, None]
    real = places[None, :] < lengths[:, None]
    gather = np.where(real, starts + places[None, :], starts).astype(np.int64)
    return gather, real.astype(np.int64), np.flatnonzero(real.reshape(-1)).astype(np.int64)


def frame_inputs(vision_config, grid_hw: Sequence[int]) -> dict[str, np.ndarray]:
    """One frame's index inputs for a ``(H, W)`` patch grid, in graph order (after ``video_grid_thw``)."""
    window_index, cu_window_seqlens = get_vision_window_index(
        grid_tensor((1, *grid_hw)), spatial_merge_size=vision_config.spatial_merge_size,
        window_size=vision_config.window_size, patch_size=vision_config.patch_size)
    gather, key_mask, unpad = padded_windows(cu_window_seqlens.tolist(), int(grid_hw[0]) * int(grid_hw[1]))
    return {
        "rotary_position_ids": frame_rotary_ids(vision_config, grid_hw),
        "window_index": window_index.numpy().astype(np.int64),
        "window_gather": gather,
        "window_key_mask": key_mask,
        "window_unpad": unpad,
    }


def encoder_symbols(vision_config, grid_hw: Sequence[int], frames: int) -> dict[str, int]:
    """Value of every symbol of the encoder graph for one specialization (frame grid and F)."""
    shared = shared_encoder_symbols(vision_config, grid_hw, frames)
    windows = frame_inputs(vision_config, grid_hw)["window_gather"].shape
    return {**shared, FRAME_TOKENS: shared[FRAME_PATCHES] // vision_config.spatial_merge_size ** 2,
            WINDOWS: windows[0], WINDOW_LEN: windows[1]}


class Qwen2_5_VLEncoder(EncoderWrapper):
    """Qwen2.5-VL vision tower over F temporal patches of one resolution, exportable for every (grid, F).

    The tower is a weight-sharing copy of the one given, whose own config copy selects
    ``segment_attention``: the caller's model keeps its attention implementation. The tower's own
    forward runs; it receives the segment layouts in place of ``cu_seqlens`` (frames for the
    full-attention blocks, padded windows for the others) and F-frame index tensors tiled here
    from one frame's, so nothing in the graph depends on tensor values.
    """

    graph_spec = ENCODER_GRAPH_SPEC
    family_label = "Qwen2.5-VL"
    frame_inputs_fn = staticmethod(frame_inputs)
    symbols_fn = staticmethod(encoder_symbols)

    def forward(
        self,
        pixel_values: torch.Tensor,
        video_grid_thw: torch.Tensor,
        rotary_position_ids: torch.Tensor,
        window_index: torch.Tensor,
        window_gather: torch.Tensor,
        window_key_mask: torch.Tensor,
        window_unpad: torch.Tensor,
    ) -> torch.Tensor:
        frames = video_grid_thw.shape[0]  # F from a shape, so it stays a symbol in the graph
        return self.visual(
            pixel_values,
            **equal_frames_call(rotary_position_ids, frames),
            window_index=tile_per_frame(window_index, frames, window_index.shape[0]),
            cu_window_seqlens=frame_windows(window_gather, window_key_mask, window_unpad, frames),
            max_window_seqlen=0,  # like max_seqlen: only flash kernels read it
        ).pooler_output


# ---------------------------------------------------------------------------------------------
# Reference path
# ---------------------------------------------------------------------------------------------


def reference_vision_evs(
    hf_visual: nn.Module, pixel_values: torch.Tensor, grid_thw: Sequence[int], q: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stock transformers vision forward (its own attention), then the EVS mask: ``(kept rows, indices)``.

    Independent of the encoder and EVS graphs: the whole video in one stock forward, no precomputed
    inputs, no segment attention, no TopK.
    """
    with torch.no_grad():
        merged = hf_visual(pixel_values, grid_thw=grid_tensor(grid_thw)).pooler_output
    mask = evs.retention_mask(merged, grid_thw, hf_visual.config.spatial_merge_size, q)
    return merged[mask], torch.nonzero(mask).reshape(-1)


# ---------------------------------------------------------------------------------------------
# Family adapter: prompt layout and positions (docs/design.md#positions, #prompt-layouts)
# ---------------------------------------------------------------------------------------------


@register_family
class Qwen2_5_VLFamily(QwenVLFamily):
    """Qwen2.5-VL: ``<|vision_start|>`` + K video pads + ``<|vision_end|>``; one M-RoPE block per video.

    The video's temporal positions step by ``tokens_per_second * second_per_grid`` with
    ``second_per_grid = temporal_patch_size / fps`` (kept in double precision, never truncated).
    """

    model_type = "qwen2_5_vl"
    hf_architectures = ("Qwen2_5_VLForConditionalGeneration",)
    serving_architecture = "QeffEvsQwen2_5_VLForConditionalGeneration"
    hf_processor = "Qwen2_5_VL"  # how transformers spells the family in its processor class names
    config_class = Qwen2_5_VLConfig
    model_class = Qwen2_5_VLForConditionalGeneration
    preprocessing = PREPROCESS_DEFAULTS
    weight_names = WEIGHT_NAMES
    wrapper = Qwen2_5_VLEncoder

    # ---- tiny test checkpoints and realistic bench configs ----------------------------------------

    @classmethod
    def tiny_widths(cls, text: dict[str, Any], vision: dict[str, Any], vision_layers: int) -> None:
        # mrope_section sums to head_dim // 2 = (64 // 4) // 2.
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
        # window 56 px = 2 merged tokens; the last block attends fully; tokens_per_second as released.
        vision.update(patch_size=14, window_size=56, fullatt_block_indexes=[vision_layers - 1], tokens_per_second=2)

    @classmethod
    def released_pixel_limits(cls) -> dict[str, Any]:
        return {"min_pixels": 3136, "max_pixels": 12845056}

    @classmethod
    def realistic_widths(cls, text_layers: int, vision_layers: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """Qwen2.5-VL-3B widths."""
        # The 3B model uses full attention on every 8th block (7, 15, 23, 31); keep at least the last one.
        fullatt = [i for i in range(7, vision_layers, 8)] or [vision_layers - 1]
        text = dict(
            vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=text_layers,
            num_attention_heads=16, num_key_value_heads=2, max_position_embeddings=128000, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
            tie_word_embeddings=True,
        )
        vision = dict(
            depth=vision_layers, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048,
            patch_size=14, temporal_patch_size=2, spatial_merge_size=2, window_size=112,
            fullatt_block_indexes=fullatt, tokens_per_second=2, in_channels=3,
        )
        return text, vision

    # ---- one checkpoint ----------------------------------------------------------------------------

    def time_factor(self, fps: float) -> float:
        second_per_grid = self.vision_config.temporal_patch_size / float(fps)
        return float(self.vision_config.tokens_per_second) * second_per_grid

    def hf_video_inputs(self, input_ids: torch.Tensor, video: MediaInput) -> dict[str, torch.Tensor]:
        second_per_grid = self.vision_config.temporal_patch_size / float(video.fps)
        return {**super().hf_video_inputs(input_ids, video), "second_per_grid_ts": torch.tensor([second_per_grid])}

    def video_placeholder(self, video: MediaInput, kept: int) -> np.ndarray:
        return np.full(kept, self.config.video_token_id, dtype=np.int64)

    def real_video_layout(self, video: MediaInput, kept_indices: np.ndarray) -> MediaLayout:
        t, h, w = self.merged_grid(video.grid_thw)
        unpruned = np.full(t * h * w, self.config.video_token_id, dtype=np.int64)
        return MediaLayout(unpruned, self.kept_mask(video, kept_indices),
                           (MediaBlock(t, h, w, self.time_factor(video.fps)),))
