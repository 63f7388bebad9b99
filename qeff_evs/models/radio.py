"""The RADIO vision tower of the Nemotron-H vision-language checkpoints as an exportable encoder graph.

transformers' ``RadioModel`` (``models/radio``) embeds each temporally packed tubelet (``video_temporal_patch_size``
frames stacked along the channels) with its video patch projection, adds a learned position table resampled to the
frame's patch grid (CPE: bilinear to ``max(H, W)`` square, then the top-left ``H x W`` window), prepends its class
and register tokens and runs a ViT over each tubelet alone. The vision-language model then normalises the patch
features (``vision_final_layernorm``, in checkpoints whose language model has MTP layers), pixel-shuffles each
``2 x 2`` block of patches into one row (channels ordered ``(row in block, column in block, feature)``) and
projects it to the language model's width (RMSNorm, linear, squared ReLU, linear).

Images (tiles) have a graph of their own, the same computation but for the first layer: each tile is one frame
embedded by RADIO's image patch projection (``patch_projection``, rows ``(channel, y, x)``) instead of the video
one; ``RadioEncoder(model, image=True)`` is that graph, with the same interface (F tiles per call).

The graph takes F tubelets of one resolution per call, as every family's encoder does
(docs/design.md#the-three-graphs); attention never crosses a tubelet, so the F tubelets are a batch and no mask is needed. The resampled
position table is the one grid-derived tensor: the host passes its bilinear taps for one frame (``position_taps``),
four table rows and their weights per patch, as PyTorch's ``interpolate(mode="bilinear", align_corners=False)``
computes them, and the graph gathers and sums them.

Encoder graph interface:

=====================  ======  ==================================  ===============================
name                   dtype   shape                               meaning
=====================  ======  ==================================  ===============================
pixel_values           float   (grid_height, grid_width)           F*H*W patch rows of T*C*p*p, raster
video_grid_thw         int64   (frames_per_call, grid_h, grid_w)   shape-only carrier, values unused
position_indices       int64   (frame_patches, 4)                  bilinear taps into the position table
position_weights       float   (frame_patches, 4)                  their weights (float32)
vision_embeds          float   (merged_rows, hidden)               projected rows, raster (t, row, col)
=====================  ======  ==================================  ===============================

Rows of ``pixel_values`` run over ``(tubelet, patch row, patch column)``; each row is ``(frame in tubelet, channel,
y, x)`` flattened, the order RADIO's video patch projection reads (vLLM's ``forward_video`` and transformers'
``get_video_features`` build the same rows).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn as nn

from qeff_evs.models.graph_io import VisionGraphSpec
from qeff_evs.models.vision_common import (
    FRAME_PATCHES,
    FRAMES_PER_CALL,
    GRID_H,
    GRID_W,
    MERGED_ROWS,
    PATCH_ROWS,
    PATCH_WIDTH,
    share_weights_copy,
)
from qeff_evs.specializations.sets import check_frames_per_call

TAPS = 4  # bilinear: two rows x two columns of the position table per patch

GRAPH_SPEC = VisionGraphSpec(
    inputs={
        "pixel_values": {0: PATCH_ROWS, 1: PATCH_WIDTH},
        "video_grid_thw": {0: FRAMES_PER_CALL, 1: GRID_H, 2: GRID_W},
        "position_indices": {0: FRAME_PATCHES},
        "position_weights": {0: FRAME_PATCHES},
    },
    outputs={"vision_embeds": {0: MERGED_ROWS}},
)


def bilinear_taps(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(low, high, high_weight)`` per output index of a 1-D bilinear resampling, ``align_corners=False``.

    PyTorch's rule (``area_pixel_compute_source_index``, float32): source ``(dst + 0.5) * in / out - 0.5``,
    clamped at 0; taps ``floor`` and the next one (the last index repeats at the edge).
    """
    scale = np.float32(in_size) / np.float32(out_size)
    source = np.maximum((np.arange(out_size, dtype=np.float32) + np.float32(0.5)) * scale - np.float32(0.5),
                        np.float32(0))
    low = source.astype(np.int64)
    high = np.minimum(low + 1, in_size - 1)
    return low, high, (source - low.astype(np.float32)).astype(np.float32)


def position_taps(vision_config, grid_hw: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """``(indices (H*W, 4) int64, weights (H*W, 4) float32)``: each patch's position-table rows and weights.

    The table is ``(max_img_size / patch)`` squared, row-major; RADIO resamples it bilinearly (up or down) to
    ``max(H, W)`` square and keeps the top-left ``H x W`` window (a grid as large as the table reads it unchanged).
    """
    big_h, big_w = (int(v) for v in grid_hw)
    side = int(vision_config.max_img_size) // int(vision_config.patch_size)
    if big_h < 1 or big_w < 1:
        raise ValueError(f"a patch grid is positive, got {big_h}x{big_w}")
    square = max(big_h, big_w)
    row_low, row_high, row_w = (a[:big_h] for a in bilinear_taps(side, square))
    col_low, col_high, col_w = (a[:big_w] for a in bilinear_taps(side, square))
    rows = np.stack([row_low, row_low, row_high, row_high], axis=1)[:, None, :]  # (H, 1, 4)
    cols = np.stack([col_low, col_high, col_low, col_high], axis=1)[None, :, :]  # (1, W, 4)
    one = np.float32(1)
    row_weights = np.stack([one - row_w, one - row_w, row_w, row_w], axis=1)[:, None, :]
    col_weights = np.stack([one - col_w, col_w, one - col_w, col_w], axis=1)[None, :, :]
    indices = (rows * side + cols).reshape(-1, TAPS)
    weights = (row_weights * col_weights).astype(np.float32).reshape(-1, TAPS)
    return indices.astype(np.int64), weights


def frame_grid(grid_hw: Sequence[int], downsample: int) -> tuple[int, int]:
    """``(H, W)`` patches of one frame; raises unless both divide by the pixel shuffle's block side."""
    if len(grid_hw) != 2:
        raise ValueError(f"a frame grid is (H patches, W patches), got {tuple(grid_hw)}")
    big_h, big_w = (int(v) for v in grid_hw)
    if big_h < 1 or big_w < 1 or big_h % downsample or big_w % downsample:
        raise ValueError(f"patch grid {big_h}x{big_w} is not a positive multiple of the pixel shuffle's {downsample}; "
                         f"resize frames to multiples of {downsample} patches")
    return big_h, big_w


def encoder_symbols(patch_width: int, downsample: int, grid_hw: Sequence[int], frames: int) -> dict[str, int]:
    """The symbols an encoder specialization binds for one frame grid and F tubelets per call."""
    big_h, big_w = frame_grid(grid_hw, downsample)
    frames = check_frames_per_call(frames)
    return {FRAMES_PER_CALL: frames, GRID_H: big_h, GRID_W: big_w, PATCH_ROWS: frames * big_h * big_w,
            PATCH_WIDTH: int(patch_width), FRAME_PATCHES: big_h * big_w,
            MERGED_ROWS: frames * big_h * big_w // (downsample * downsample)}


def encoder_host_inputs(vision_config, downsample: int, grid_hw: Sequence[int], frames: int) -> dict[str, np.ndarray]:
    """Every encoder input but ``pixel_values``: the F carrier, then one frame's position taps."""
    big_h, big_w = frame_grid(grid_hw, downsample)
    indices, weights = position_taps(vision_config, (big_h, big_w))
    return {"video_grid_thw": np.zeros((check_frames_per_call(frames), big_h, big_w), dtype=np.int64),
            "position_indices": indices, "position_weights": weights}


def pixel_shuffle(features: torch.Tensor, big_h: torch.Tensor | int, big_w: torch.Tensor | int,
                  block: int, width: int) -> torch.Tensor:
    """``(F, H*W, D) -> (F * H/b * W/b, b*b*D)``: each ``b x b`` block of patches one row, in raster order,
    channels ordered ``(row in block, column in block, feature)`` (vLLM's ``pixel_shuffle`` "v2" and transformers'
    alike). ``width`` is ``D`` as a constant, so the graph's row width stays static."""
    frames = features.shape[0]
    x = features.reshape(frames, big_h // block, block, big_w // block, block, width)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(-1, block * block * width)


class RadioEncoder(nn.Module):
    """The vision side of a Nemotron-H vision-language model over F tubelets of one resolution (module docstring).

    Shares the model's parameters: a structural copy of its RADIO tower (whose config copy selects eager attention,
    so the caller's model keeps its own), its final vision norm if any, and its projector.
    """

    graph_spec = GRAPH_SPEC

    def __init__(self, model: nn.Module, image: bool = False) -> None:
        super().__init__()
        for name in ("vision_model", "multi_modal_projector"):
            if not hasattr(model, name):
                raise ValueError(f"{type(model).__name__} has no .{name}; pass a Nemotron-H vision-language model "
                                 "(transformers' NemotronH_Omni_Reasoning_V3)")
        self.radio = share_weights_copy(model.vision_model)
        self.radio.config._attn_implementation = "eager"
        embeddings = self.radio.embeddings
        self.projection = embeddings.patch_projection if image else embeddings.video_patch_projection
        if self.projection is None:
            raise ValueError("this RADIO tower has no video patch projection (vision_config.video_temporal_patch_size "
                             "is unset); its checkpoint cannot encode tubelets")
        self.final_norm = getattr(model, "vision_final_layernorm", None)
        self.projector = model.multi_modal_projector
        self.downsample = int(round(1 / float(model.config.downsample_ratio)))
        self.skip = int(self.radio.config.num_cls_tokens) + int(self.radio.config.num_registers)
        self.hidden = int(self.radio.config.hidden_size)

    @classmethod
    def from_model(cls, model: nn.Module, image: bool = False) -> "RadioEncoder":
        return cls(model, image)

    @property
    def patch_width(self) -> int:
        return int(self.projection.in_features)

    def symbols(self, grid_hw: Sequence[int], frames: int) -> dict[str, int]:
        return encoder_symbols(self.patch_width, self.downsample, grid_hw, frames)

    def host_inputs(self, grid_hw: Sequence[int], frames: int) -> dict[str, np.ndarray]:
        return encoder_host_inputs(self.radio.config, self.downsample, grid_hw, frames)

    def forward(self, pixel_values: torch.Tensor, video_grid_thw: torch.Tensor, position_indices: torch.Tensor,
                position_weights: torch.Tensor) -> torch.Tensor:
        """Returns ``vision_embeds (F * H/2 * W/2, hidden)``."""
        frames, big_h, big_w = video_grid_thw.shape  # sizes from a shape: symbols in the graph
        embeddings = self.radio.embeddings
        patches = self.projection(pixel_values.reshape(frames, big_h * big_w, self.patch_width))
        table = embeddings.position_embedding[0]  # (rows * cols of the table, D)
        positions = (table[position_indices] * position_weights[..., None].to(table.dtype)).sum(dim=1)
        hidden = patches + positions.to(patches.dtype)
        prefix = embeddings.cls_register_token[None].expand(frames, -1, -1)
        hidden = self.radio.encoder(torch.cat([prefix, hidden], dim=1)).last_hidden_state
        features = hidden[:, self.skip:]
        if self.final_norm is not None:
            features = self.final_norm(features)
        return self.projector(pixel_shuffle(features, big_h, big_w, self.downsample, self.hidden))

    def dummy_inputs(self, grid_hw: Sequence[int], frames: int, seed: int = 0) -> dict[str, torch.Tensor]:
        """Random ``pixel_values`` plus the host inputs, as tensors in graph order (export examples)."""
        symbols = self.symbols(grid_hw, frames)
        dtype = self.projection.weight.dtype
        generator = torch.Generator().manual_seed(seed)
        pixels = torch.randn(symbols[PATCH_ROWS], symbols[PATCH_WIDTH], generator=generator).to(dtype)
        host = {name: torch.from_numpy(array) for name, array in self.host_inputs(grid_hw, frames).items()}
        return {"pixel_values": pixels, **host}

    def run(self, pixel_values: torch.Tensor, host_inputs: dict[str, np.ndarray]) -> torch.Tensor:
        """Eager forward of one call (the PyTorch reference backend's call)."""
        device = pixel_values.device
        host = [torch.from_numpy(np.asarray(array)).to(device) for array in host_inputs.values()]
        with torch.no_grad():
            return self(pixel_values, *host)
