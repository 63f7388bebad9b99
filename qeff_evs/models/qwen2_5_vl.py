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

import copy
import itertools
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn as nn
from transformers.vision_utils import get_vision_cu_seqlens, get_vision_position_ids, get_vision_window_index

from qeff_evs import evs
from qeff_evs.export.attention import register_block_mask_attention
from qeff_evs.export.vision import VisionGraphSpec
from qeff_evs.models.protocol import SpecialTokens, VideoInput, VideoLayout, image_layout
from qeff_evs.positions import MediaBlock

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


def _grid_tensor(grid_thw: Sequence[int] | torch.Tensor) -> torch.Tensor:
    return torch.tensor([[int(v) for v in grid_thw]], dtype=torch.int64)


def _check_retained(vision_config, grid_thw: Sequence[int] | torch.Tensor, retained: int) -> tuple[int, int, int]:
    t, h, w = evs.merged_grid(grid_thw, vision_config.spatial_merge_size)
    if not 1 <= int(retained) <= t * h * w:
        raise ValueError(
            f"retained count {retained} is outside [1, {t * h * w}] for grid {tuple(int(v) for v in grid_thw)}; "
            "compute it with evs.retained_token_count(h*w, T, q)"
        )
    return t, h, w


def vision_host_inputs(vision_config, grid_thw: Sequence[int], retained: int) -> dict[str, np.ndarray]:
    """Every vision-graph input except ``pixel_values`` for one video grid ``(T, H, W)`` and K, in graph order."""
    _check_retained(vision_config, grid_thw, retained)
    grid = _grid_tensor(grid_thw)
    merge = vision_config.spatial_merge_size
    window_index, cu_window_seqlens = get_vision_window_index(
        grid, spatial_merge_size=merge, window_size=vision_config.window_size, patch_size=vision_config.patch_size
    )
    return {
        "video_grid_thw": np.zeros(tuple(grid[0].tolist()), dtype=np.int64),
        "rotary_position_ids": get_vision_position_ids(grid, merge).numpy().astype(np.int64),
        "cu_seqlens": get_vision_cu_seqlens(grid).numpy().astype(np.int32),
        "window_index": window_index.numpy().astype(np.int64),
        "cu_window_seqlens": cu_window_seqlens.numpy().astype(np.int32),
        "retained_carrier": np.zeros(int(retained), dtype=np.int64),
    }


def vision_symbols(vision_config, grid_thw: Sequence[int], retained: int) -> dict[str, int]:
    """Value of every symbol of the vision graph for one specialization (grid and K)."""
    t, h, w = _check_retained(vision_config, grid_thw, retained)
    big_t, big_h, big_w = (int(v) for v in grid_thw)
    host = vision_host_inputs(vision_config, grid_thw, retained)
    patch = vision_config.patch_size
    return {
        "grid_height": big_t * big_h * big_w,
        "grid_width": vision_config.in_channels * vision_config.temporal_patch_size * patch * patch,
        "time": big_t,
        "grid_h": big_h,
        "grid_w": big_w,
        "frame_bounds": len(host["cu_seqlens"]),
        "vision_size": t * h * w,
        "window_bounds": len(host["cu_window_seqlens"]),
        "retained_size": int(retained),
    }


def _share_weights_copy(module: nn.Module) -> nn.Module:
    """A structural copy of ``module`` (own config objects) that shares every parameter and buffer."""
    shared = {id(t): t for t in itertools.chain(module.parameters(), module.buffers())}
    return copy.deepcopy(module, memo=shared)


class Qwen2_5_VLVisionEVS(nn.Module):
    """Qwen2.5-VL vision tower + EVS selection, exportable as one graph for every grid and K.

    The tower is a weight-sharing copy of the one given, whose own config copy selects the
    block-mask attention: the caller's model keeps its attention implementation. Grid-dependent
    index tensors come in as inputs (``vision_host_inputs``), so nothing in the graph depends
    on tensor values except the EVS TopK, whose K is the length of ``retained_carrier``.
    """

    graph_spec = VISION_GRAPH_SPEC

    def __init__(self, visual: nn.Module, evs_selection: bool = True) -> None:
        super().__init__()
        self.visual = _share_weights_copy(visual)
        self.visual.config._attn_implementation = register_block_mask_attention()
        # False only for benchmarks: the first K rows stand in for the EVS selection (same output shapes).
        self.evs_selection = evs_selection

    @classmethod
    def from_model(cls, model: nn.Module) -> Qwen2_5_VLVisionEVS:
        """Wrap the vision tower of a ``Qwen2_5_VLForConditionalGeneration`` (or its inner ``Qwen2_5_VLModel``)."""
        inner = getattr(model, "model", model)
        visual = getattr(inner, "visual", None)
        if visual is None:
            raise ValueError(f"{type(model).__name__} has no .visual tower; pass a Qwen2.5-VL model or its .visual")
        return cls(visual)

    @property
    def vision_config(self):
        return self.visual.config

    def forward(
        self,
        pixel_values: torch.Tensor,
        video_grid_thw: torch.Tensor,
        rotary_position_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        window_index: torch.Tensor,
        cu_window_seqlens: torch.Tensor,
        retained_carrier: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
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
        # T from a shape, so the EVS reshape stays symbolic in the graph.
        frames = video_grid_thw.shape[0]
        if not self.evs_selection:
            # Benchmark baseline: EVS's final Gather, of the first K rows instead of the selected ones.
            # (frame, token) -> raster index is the identity, written so T stays a graph input.
            per_frame = merged.shape[0] // frames
            first = torch.arange(retained_carrier.shape[0], device=merged.device)
            indices = (first // per_frame) * per_frame + first % per_frame
            return merged.index_select(0, indices), indices
        return evs.select_retained(merged, frames, retained_carrier)

    def host_inputs(self, grid_thw: Sequence[int], retained: int) -> dict[str, np.ndarray]:
        return vision_host_inputs(self.vision_config, grid_thw, retained)

    def symbols(self, grid_thw: Sequence[int], retained: int) -> dict[str, int]:
        return vision_symbols(self.vision_config, grid_thw, retained)

    def dummy_inputs(self, grid_thw: Sequence[int], retained: int, seed: int = 0) -> dict[str, torch.Tensor]:
        """Random ``pixel_values`` plus the host inputs, as tensors in graph order (export examples)."""
        symbols = self.symbols(grid_thw, retained)
        dtype = next(self.visual.parameters()).dtype
        generator = torch.Generator().manual_seed(seed)
        pixels = torch.randn(symbols["grid_height"], symbols["grid_width"], generator=generator).to(dtype)
        host = {name: torch.from_numpy(array) for name, array in self.host_inputs(grid_thw, retained).items()}
        return {"pixel_values": pixels, **host}

    def run(
        self, pixel_values: torch.Tensor, grid_thw: Sequence[int], retained: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Eager forward for one video: host inputs built here. Returns ``(embeds (K, D), indices (K,))``."""
        device = pixel_values.device
        host = [torch.from_numpy(array).to(device) for array in self.host_inputs(grid_thw, retained).values()]
        with torch.no_grad():
            return self(pixel_values, *host)


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
        merged = hf_visual(pixel_values, grid_thw=_grid_tensor(grid_thw)).pooler_output
    mask = evs.retention_mask(merged, grid_thw, hf_visual.config.spatial_merge_size, q)
    return merged[mask], torch.nonzero(mask).reshape(-1)


# ---------------------------------------------------------------------------------------------
# Family adapter: prompt layout and positions (DESIGN §3-§4)
# ---------------------------------------------------------------------------------------------


class Qwen2_5_VLFamily:
    """Qwen2.5-VL: ``<|vision_start|>`` + K video pads + ``<|vision_end|>``; one M-RoPE block per video.

    The video's temporal positions step by ``tokens_per_second * second_per_grid`` with
    ``second_per_grid = temporal_patch_size / fps`` (kept in double precision, never truncated).
    """

    name = "qwen2_5_vl"
    deepstack_levels = 0

    def __init__(self, config) -> None:
        self.config = config
        self.vision_config = config.vision_config
        self.merge_size = int(self.vision_config.spatial_merge_size)

    def special_tokens(self) -> SpecialTokens:
        c = self.config
        eos = getattr(c.text_config, "eos_token_id", None)
        eos = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
        return SpecialTokens(c.image_token_id, c.video_token_id, c.vision_start_token_id, c.vision_end_token_id, eos)

    def merged_grid(self, grid_thw: Sequence[int]) -> tuple[int, int, int]:
        return evs.merged_grid(grid_thw, self.merge_size)

    def vision_wrapper(self, model: nn.Module) -> Qwen2_5_VLVisionEVS:
        return Qwen2_5_VLVisionEVS.from_model(model)

    def vision_host_inputs(self, grid_thw: Sequence[int], retained: int) -> dict[str, np.ndarray]:
        return vision_host_inputs(self.vision_config, grid_thw, retained)

    def vision_symbols(self, grid_thw: Sequence[int], retained: int) -> dict[str, int]:
        return vision_symbols(self.vision_config, grid_thw, retained)

    def time_factor(self, fps: float) -> float:
        second_per_grid = self.vision_config.temporal_patch_size / float(fps)
        return float(self.vision_config.tokens_per_second) * second_per_grid

    def placeholder_ids(self, video: VideoInput, retained: int) -> np.ndarray:
        if video.kind == "image":
            return image_layout(self.config.image_token_id, self.merged_grid(video.grid_thw)).ids
        return np.full(retained, self.config.video_token_id, dtype=np.int64)

    def video_layout(self, video: VideoInput, retained_indices: np.ndarray) -> VideoLayout:
        if video.kind == "image":
            return image_layout(self.config.image_token_id, self.merged_grid(video.grid_thw))
        t, h, w = self.merged_grid(video.grid_thw)
        keep = np.zeros(t * h * w, dtype=bool)
        keep[np.asarray(retained_indices, dtype=np.int64)] = True
        unpruned = np.full(t * h * w, self.config.video_token_id, dtype=np.int64)
        return VideoLayout(unpruned, keep, (MediaBlock(t, h, w, self.time_factor(video.fps)),))
