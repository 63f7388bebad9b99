"""Qwen3-VL family.

Vision part: ``Qwen3_VLEncoder`` wraps the transformers vision tower into the exportable encoder
graph (F temporal patches of one resolution per call, merged rows + deepstack out);
``frame_inputs`` / ``encoder_symbols`` give one frame's host-side index tensors and the
specialization symbols; ``reference_vision_evs`` is the independent reference (stock transformers
forward over the whole video, then the EVS mask over the deepstack-concatenated features). The
pruning graphs are the family-agnostic ``pruning.PruningRanking``, scoring with ``DEEPSTACK``'s levels.

What differs from Qwen2.5-VL: full attention within each temporal patch (no windows), learned
position embeddings resampled bilinearly to the grid (the taps and weights are host inputs), and
``levels`` deepstack mergers whose outputs are pruned with the same kept indices as the main rows.
EVS scores ``[merger | deepstack 0 | deepstack 1 | ...]`` along features, as vLLM does.

Encoder graph interface (docs/design.md#the-three-graphs):

=====================  ======  ==================================  ===============================
name                   dtype   shape                               meaning
=====================  ======  ==================================  ===============================
pixel_values           float   (grid_height, grid_width)           patches, F*H*W rows of C*tp*p*p
video_grid_thw         int64   (frames_per_call, grid_h, grid_w)   shape-only carrier, values unused
rotary_position_ids    int64   (frame_patches, 2)                  (row, col) of one frame's patches
interp_indices         int64   (frame_patches, 4)                  bilinear taps into the pos-embed table
interp_weights         float   (frame_patches, 4)                  their weights (float32)
vision_embeds          float   (merged_rows, out_hidden)           merged rows, raster (t, row, col)
deepstack_features     float   (levels, merged_rows, out_hidden)   every deepstack level's rows
=====================  ======  ==================================  ===============================

``grid_h``/``grid_w`` are the patch rows/columns of one frame (QEfficient's convention),
``frame_patches = grid_h * grid_w``, ``merged_rows = frames_per_call * frame_patches / merge**2``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn as nn
from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration
from transformers.vision_utils import get_vision_interpolation_indices_and_weights

from qeff_evs import evs
from qeff_evs.models.graph_io import VisionGraphSpec
from qeff_evs.models.protocol import SAMPLING_FPS, ExtraRows, MediaInput, MediaLayout, VideoPreprocessing
from qeff_evs.models.qwen_vl import QwenVLFamily
from qeff_evs.models.registry import register_family
from qeff_evs.models.vision_common import (
    CALL_INPUTS,
    FRAME_PATCHES,
    MERGED_ROWS,
    EncoderWrapper,
    encoder_symbols,
    equal_frames_call,
    frame_rotary_ids,
    grid_tensor,
    tiled,
)
from qeff_evs.positions import MediaBlock

# The released checkpoints' video preprocessing: 16-px patches, mean/std 0.5, pixel limits over the
# whole clip.
PREPROCESS_DEFAULTS = VideoPreprocessing(
    patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5),
    min_pixels=128 * 32 * 32, max_pixels=768 * 32 * 32, pixel_limits_per_video=True,
    video_processor="Qwen3VLVideoProcessor", do_sample_frames=True, sampling_fps=SAMPLING_FPS,
)

# ---------------------------------------------------------------------------------------------
# Encoder graph
# ---------------------------------------------------------------------------------------------

# How transformers' Qwen3-VL tower resamples its square learned position grid (set on the model
# instance, not in the config); the host inputs reproduce exactly this.
INTERPOLATION_MODE = "bilinear"
INTERPOLATION_ALIGN_CORNERS = True

TOWER_INPUTS = {
    **CALL_INPUTS,
    "interp_indices": {0: FRAME_PATCHES},
    "interp_weights": {0: FRAME_PATCHES},
}
# The tower's merged rows only (a family without deepstack levels), and with them.
TOWER_GRAPH_SPEC = VisionGraphSpec(inputs=TOWER_INPUTS, outputs={"vision_embeds": {0: MERGED_ROWS}})
ENCODER_GRAPH_SPEC = VisionGraphSpec(
    inputs=TOWER_INPUTS,
    outputs={
        "vision_embeds": {0: MERGED_ROWS},
        "deepstack_features": {1: MERGED_ROWS},
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


def frame_inputs(vision_config, grid_hw: Sequence[int]) -> dict[str, np.ndarray]:
    """One frame's index inputs for a ``(H, W)`` patch grid, in graph order (after ``video_grid_thw``).

    Qwen3-VL attends fully within a frame, never across: the graph needs no attention bounds.
    """
    interp_indices, interp_weights = get_vision_interpolation_indices_and_weights(
        grid_tensor((1, *grid_hw)),
        num_grid_per_side=position_grid_side(vision_config),
        mode=INTERPOLATION_MODE,
        align_corners=INTERPOLATION_ALIGN_CORNERS,
        spatial_merge_size=vision_config.spatial_merge_size,
    )
    return {
        "rotary_position_ids": frame_rotary_ids(vision_config, grid_hw),
        "interp_indices": interp_indices.numpy().astype(np.int64),
        "interp_weights": interp_weights.numpy().astype(np.float32),
    }


def _check_tower(visual: nn.Module, family_label: str) -> None:
    if not hasattr(visual, "pos_embed") or not hasattr(visual, "merger"):
        raise ValueError(
            f"{type(visual).__name__} is not a {family_label} vision tower; pass a {family_label} model or its .visual"
        )
    resample = (getattr(visual, "interpolation_mode", None), getattr(visual, "interpolation_align_corners", None))
    if resample != (INTERPOLATION_MODE, INTERPOLATION_ALIGN_CORNERS):
        raise ValueError(
            f"vision tower resamples position embeddings with (mode, align_corners)={resample}, but the host "
            f"inputs reproduce {(INTERPOLATION_MODE, INTERPOLATION_ALIGN_CORNERS)}; update INTERPOLATION_* to match"
        )
    position_grid_side(visual.config)


class Qwen3_VLTower(EncoderWrapper):
    """A Qwen3-VL-style vision tower (learned position grid resampled per frame, full attention within a
    frame) over F temporal patches of one resolution, exportable for every (grid, F): its merged rows.

    The tower is a weight-sharing copy of the one given, whose own config copy selects
    ``segment_attention``: the caller's model keeps its attention implementation. The tower's own
    forward runs with the frames as equal attention segments (a reshape, no mask) and F-frame index
    tensors tiled here from one frame's, so nothing in the graph depends on tensor values. A family
    whose tower has no deepstack levels (Qwen3.5) uses it as it is; Qwen3-VL's adds them.
    """

    graph_spec = TOWER_GRAPH_SPEC
    family_label = "Qwen3-VL"
    frame_inputs_fn = staticmethod(frame_inputs)
    symbols_fn = staticmethod(encoder_symbols)

    def __init__(self, visual: nn.Module) -> None:
        _check_tower(visual, self.family_label)
        super().__init__(visual)

    def tower(self, pixel_values: torch.Tensor, video_grid_thw: torch.Tensor, rotary_position_ids: torch.Tensor,
              interp_indices: torch.Tensor, interp_weights: torch.Tensor):
        """The transformers tower's output over the call's F frames."""
        frames = video_grid_thw.shape[0]  # F from a shape, so it stays a symbol in the graph
        return self.visual(
            pixel_values,
            **equal_frames_call(rotary_position_ids, frames),
            interp_indices=tiled(interp_indices, frames),
            interp_weights=tiled(interp_weights, frames),
        )

    def forward(self, pixel_values: torch.Tensor, video_grid_thw: torch.Tensor, rotary_position_ids: torch.Tensor,
                interp_indices: torch.Tensor, interp_weights: torch.Tensor) -> torch.Tensor:
        """Returns ``vision_embeds (F*h*w, D)``."""
        return self.tower(pixel_values, video_grid_thw, rotary_position_ids, interp_indices, interp_weights).pooler_output


class Qwen3_VLEncoder(Qwen3_VLTower):
    """Qwen3-VL vision tower + deepstack over F temporal patches of one resolution (``Qwen3_VLTower``)."""

    graph_spec = ENCODER_GRAPH_SPEC

    def __init__(self, visual: nn.Module) -> None:
        levels = getattr(visual, "deepstack_merger_list", None)
        if levels is None:
            raise ValueError(
                f"{type(visual).__name__} is not a Qwen3-VL vision tower; pass a Qwen3-VL model or its .visual")
        if len(levels) == 0:
            raise ValueError(
                "vision_config.deepstack_visual_indexes is empty; the Qwen3-VL graph outputs "
                "deepstack_features (levels, K, hidden) and needs at least one level (released models have 3)"
            )
        super().__init__(visual)

    @property
    def deepstack_levels(self) -> int:
        return len(self.visual.deepstack_merger_list)

    def forward(
        self,
        pixel_values: torch.Tensor,
        video_grid_thw: torch.Tensor,
        rotary_position_ids: torch.Tensor,
        interp_indices: torch.Tensor,
        interp_weights: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(vision_embeds (F*h*w, D), deepstack_features (levels, F*h*w, D))``."""
        output = self.tower(pixel_values, video_grid_thw, rotary_position_ids, interp_indices, interp_weights)
        return output.pooler_output, torch.stack(list(output.deepstack_features), dim=0)


# ---------------------------------------------------------------------------------------------
# Reference path
# ---------------------------------------------------------------------------------------------


def reference_vision_evs(
    hf_visual: nn.Module, pixel_values: torch.Tensor, grid_thw: Sequence[int], q: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stock transformers vision forward (its own attention), then the EVS mask over ``[merger | deepstack...]``.

    Returns ``(kept rows (K, D), kept deepstack (levels, K, D), indices (K,))``. Independent of the
    encoder and EVS graphs: the whole video in one stock forward, no precomputed inputs, no segment
    attention, no TopK.
    """
    with torch.no_grad():
        output = hf_visual(pixel_values, grid_thw=grid_tensor(grid_thw))
    merged, levels = output.pooler_output, list(output.deepstack_features)
    scored = torch.cat([merged, *levels], dim=-1)
    mask = evs.retention_mask(scored, grid_thw, hf_visual.config.spatial_merge_size, q)
    deepstack = torch.stack([level[mask] for level in levels], dim=0)
    return merged[mask], deepstack, torch.nonzero(mask).reshape(-1)


# ---------------------------------------------------------------------------------------------
# Family adapter: timestamps, the lumped placeholder and the real per-frame layout (docs/design.md#prompt-layouts)
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


# The deepstack levels travel beside the merged rows under this graph I/O name (encoder output, language
# input + its _RetainedState); a whole video's levels enter the pruning graph as its ``score_extras``.
DEEPSTACK = ExtraRows(name="deepstack_features")

# Qwen3 text attention normalises q and k per head; see _sharpen_qk_norm.
QK_NORM_WEIGHT = 2.0


def _sharpen_qk_norm(model) -> None:
    """Set Qwen3's per-head q/k RMSNorm weights to QK_NORM_WEIGHT instead of 1.

    Unit-RMS q and k bound every attention logit by sqrt(head_dim) = 4, so random attention stays
    near uniform, the current token dominates the residual stream and greedy decoding falls into
    short loops. Weight 2 bounds logits by 16, which gives varied greedy tokens.
    """
    with torch.no_grad():
        for layer in model.model.language_model.layers:
            layer.self_attn.q_norm.weight.fill_(QK_NORM_WEIGHT)
            layer.self_attn.k_norm.weight.fill_(QK_NORM_WEIGHT)


def _realistic_deepstack_levels(vision_layers: int) -> list[int]:
    # The 2B/4B models tap blocks 5, 11, 17 of 24; with fewer blocks tap up to three spread evenly.
    levels = [i for i in (5, 11, 17) if i < vision_layers]
    return levels or sorted({(vision_layers - 1) * (j + 1) // 3 for j in range(min(3, vision_layers))})


@register_family
class Qwen3_VLFamily(QwenVLFamily):
    """Qwen3-VL: per temporal patch ``<t seconds> <|vision_start|> n_f pads <|vision_end|>``.

    Before encoding only K = sum(n_f) is known; the text per frame does not depend on the split, so
    the placeholder is built with the lumped split ``[K, 0, ..., 0]`` and rewritten after the encoder
    to the real split, same length. Each frame is its own M-RoPE block (1, h, w). Its vision rows carry
    the deepstack levels (``DEEPSTACK``).
    """

    model_type = "qwen3_vl"
    hf_architectures = ("Qwen3VLForConditionalGeneration",)
    serving_architecture = "QeffEvsQwen3_VLForConditionalGeneration"
    hf_processor = "Qwen3VL"  # how transformers spells the family in its processor class names
    config_class = Qwen3VLConfig
    model_class = Qwen3VLForConditionalGeneration
    preprocessing = PREPROCESS_DEFAULTS
    extra_rows = (DEEPSTACK,)
    wrapper = Qwen3_VLEncoder

    def __init__(self, config, tokenizer=None) -> None:
        super().__init__(config, tokenizer)
        levels = len(getattr(self.vision_config, "deepstack_visual_indexes", ()) or ())
        self.deepstack_levels = levels
        self.extras = {DEEPSTACK.name: levels} if levels else {}

    # ---- tiny test checkpoints and realistic bench configs ----------------------------------------

    @classmethod
    def tiny_widths(cls, text: dict[str, Any], vision: dict[str, Any], vision_layers: int) -> None:
        text["head_dim"] = 16
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                                   "mrope_interleaved": True}
        # num_position_embeddings must be a perfect square (8 x 8 learned grid).
        vision.update(patch_size=16, num_position_embeddings=64, deepstack_visual_indexes=[0])

    @classmethod
    def prepare_tiny_model(cls, model, tokenizer) -> None:
        super().prepare_tiny_model(model, tokenizer)
        _sharpen_qk_norm(model)

    @classmethod
    def released_pixel_limits(cls) -> dict[str, Any]:
        return {"size": {"shortest_edge": 65536, "longest_edge": 16777216}}

    @classmethod
    def realistic_widths(cls, text_layers: int, vision_layers: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """Qwen3-VL-2B widths."""
        text = dict(
            vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=text_layers,
            num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=262144,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [24, 20, 20],
                             "mrope_interleaved": True},
        )
        vision = dict(
            depth=vision_layers, hidden_size=1024, intermediate_size=4096, num_heads=16, out_hidden_size=2048,
            patch_size=16, temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=2304,
            deepstack_visual_indexes=_realistic_deepstack_levels(vision_layers), in_channels=3,
        )
        return text, vision

    # ---- one checkpoint ----------------------------------------------------------------------------

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

    def video_placeholder(self, video: MediaInput, kept: int) -> np.ndarray:
        t = self.merged_grid(video.grid_thw)[0]
        return self._frames(video, [kept] + [0] * (t - 1))

    def real_video_layout(self, video: MediaInput, kept_indices: np.ndarray) -> MediaLayout:
        t, h, w = self.merged_grid(video.grid_thw)
        unpruned = self._frames(video, [h * w] * t)
        keep = np.ones(len(unpruned), dtype=bool)
        keep[unpruned == self.config.video_token_id] = self.kept_mask(video, kept_indices)  # raster order
        return MediaLayout(unpruned, keep, tuple(MediaBlock(1, h, w) for _ in range(t)))
