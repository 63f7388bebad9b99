"""What the Qwen-VL encoder graphs share (docs/design.md#the-three-graphs).

The vision side is two graphs: the **encoder** here (one per family) and the family-agnostic pruning graphs
(``models.pruning``). The encoder takes ``F`` temporal patches of one resolution and returns their merged rows
(+ the family's extra rows, ``ExtraRows``). It wraps a weight-sharing copy of the transformers tower whose own
config selects ``segment_attention``; every grid-derived index tensor comes from the host, for ONE frame (they
are the same for every frame of a resolution), and the graph tiles it over the F frames whose count it reads
from the shape of the carrier ``video_grid_thw (F, H, W)``.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn as nn
from transformers.vision_utils import get_vision_position_ids

from qeff_evs import evs
from qeff_evs.models.attention import EqualSegments, register_segment_attention
from qeff_evs.models.graph_io import VisionGraphSpec
from qeff_evs.specializations.sets import check_frames_per_call

# Symbol names of the encoder graph (docs/design.md#specializations): F, the patch grid of one frame, the rows of
# a call.
FRAMES_PER_CALL, GRID_H, GRID_W = "frames_per_call", "grid_h", "grid_w"
PATCH_ROWS, PATCH_WIDTH, FRAME_PATCHES, MERGED_ROWS = "grid_height", "grid_width", "frame_patches", "merged_rows"

# The inputs every Qwen-VL encoder graph takes first, in this order: the call's patches, its grid, one
# frame's rotary ids (tiled in the graph); a family appends its own per-frame index inputs.
CALL_INPUTS = {
    "pixel_values": {0: PATCH_ROWS, 1: PATCH_WIDTH},
    "video_grid_thw": {0: FRAMES_PER_CALL, 1: GRID_H, 2: GRID_W},
    "rotary_position_ids": {0: FRAME_PATCHES},
}


def grid_tensor(grid_thw: Sequence[int] | torch.Tensor) -> torch.Tensor:
    return torch.tensor([[int(v) for v in grid_thw]], dtype=torch.int64)


def frame_grid(vision_config, grid_hw: Sequence[int]) -> tuple[int, int]:
    """``(H, W)`` patches of one frame; raises unless both are positive multiples of the merge size."""
    if len(grid_hw) != 2:
        raise ValueError(f"a frame grid is (H patches, W patches), got {tuple(grid_hw)}")
    evs.merged_grid((1, *grid_hw), vision_config.spatial_merge_size)  # checks divisibility
    return int(grid_hw[0]), int(grid_hw[1])


def frame_rotary_ids(vision_config, grid_hw: Sequence[int]) -> np.ndarray:
    """``(H*W, 2)`` int64 (row, col) of each patch of one frame, in merge-block order."""
    return get_vision_position_ids(grid_tensor((1, *grid_hw)), vision_config.spatial_merge_size).numpy().astype(np.int64)


def encoder_symbols(vision_config, grid_hw: Sequence[int], frames: int) -> dict[str, int]:
    """The symbols every encoder specialization binds, for one frame grid and F."""
    big_h, big_w = frame_grid(vision_config, grid_hw)
    frames = check_frames_per_call(frames)
    merge = vision_config.spatial_merge_size
    patch = vision_config.patch_size
    return {
        FRAMES_PER_CALL: frames,
        GRID_H: big_h,
        GRID_W: big_w,
        PATCH_ROWS: frames * big_h * big_w,
        PATCH_WIDTH: vision_config.in_channels * vision_config.temporal_patch_size * patch * patch,
        FRAME_PATCHES: big_h * big_w,
        MERGED_ROWS: frames * big_h * big_w // (merge * merge),
    }


def share_weights_copy(module: nn.Module) -> nn.Module:
    """A structural copy of ``module`` (own config objects) that shares every parameter and buffer."""
    shared = {id(t): t for t in itertools.chain(module.parameters(), module.buffers())}
    return copy.deepcopy(module, memo=shared)


class PatchProjection(nn.Module):
    """A patch embedding's ``Conv3d`` as the matrix product it is, for the tower's own ``patch_embed`` to call.

    The tower views each patch row as ``(C, T, P, P)`` and convolves it with a kernel of that size at that stride,
    no padding: one output per row, the row times the flattened kernel. ONNX Runtime's CPU ``Conv`` takes the 5-D
    form through im2col, several times slower than the ``MatMul`` of the same numbers (measured at Qwen2.5-VL-3B
    vision widths, 448x448: 12% of an encoder call). ``weight`` is the convolution's (the tower reads its dtype).
    """

    def __init__(self, conv: nn.Conv3d) -> None:
        super().__init__()
        self.conv = conv

    @staticmethod
    def applies_to(conv: nn.Module) -> bool:
        return (isinstance(conv, nn.Conv3d) and tuple(conv.kernel_size) == tuple(conv.stride)
                and not any(conv.padding) and conv.groups == 1 and conv.padding_mode == "zeros"
                and tuple(conv.dilation) == (1, 1, 1))

    @property
    def weight(self) -> torch.Tensor:
        return self.conv.weight

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        rows = patches.reshape(patches.shape[0], -1)
        out = nn.functional.linear(rows, self.conv.weight.reshape(self.conv.out_channels, -1), self.conv.bias)
        return out.reshape(patches.shape[0], self.conv.out_channels, 1, 1, 1)


class EncoderWrapper(nn.Module):
    """Shared plumbing of the exportable encoders; subclasses define ``forward`` and the frame inputs."""

    family_label = "Qwen-VL"
    graph_spec: VisionGraphSpec
    # The family's module-level functions (vision_config, grid_hw) -> one frame's index inputs,
    # and (vision_config, grid_hw, frames) -> symbol values.
    frame_inputs_fn = staticmethod(lambda vision_config, grid_hw: {})
    symbols_fn = staticmethod(encoder_symbols)

    def __init__(self, visual: nn.Module) -> None:
        super().__init__()
        self.visual = share_weights_copy(visual)
        self.visual.config._attn_implementation = register_segment_attention()
        patch_embed = getattr(self.visual, "patch_embed", None)  # the copy's: the caller's tower keeps its Conv3d
        if patch_embed is not None and PatchProjection.applies_to(getattr(patch_embed, "proj", None)):
            patch_embed.proj = PatchProjection(patch_embed.proj)

    @classmethod
    def from_model(cls, model: nn.Module):
        """Wrap the vision tower of a ``...ForConditionalGeneration`` model (or its inner model)."""
        inner = getattr(model, "model", model)
        visual = getattr(inner, "visual", None)
        if visual is None:
            raise ValueError(
                f"{type(model).__name__} has no .visual tower; pass a {cls.family_label} model or its .visual")
        return cls(visual)

    @property
    def vision_config(self):
        return self.visual.config

    def host_inputs(self, grid_hw: Sequence[int], frames: int) -> dict[str, np.ndarray]:
        """Every input but ``pixel_values`` for a call of ``frames`` temporal patches of grid ``(H, W)``."""
        return encoder_host_inputs(self.vision_config, self.frame_inputs_fn, grid_hw, frames)

    def symbols(self, grid_hw: Sequence[int], frames: int) -> dict[str, int]:
        return self.symbols_fn(self.vision_config, grid_hw, frames)

    def dummy_inputs(self, grid_hw: Sequence[int], frames: int, seed: int = 0) -> dict[str, torch.Tensor]:
        """Random ``pixel_values`` plus the host inputs, as tensors in graph order (export examples)."""
        symbols = self.symbols(grid_hw, frames)
        dtype = next(self.visual.parameters()).dtype
        generator = torch.Generator().manual_seed(seed)
        pixels = torch.randn(symbols[PATCH_ROWS], symbols[PATCH_WIDTH], generator=generator).to(dtype)
        host = {name: torch.from_numpy(array) for name, array in self.host_inputs(grid_hw, frames).items()}
        return {"pixel_values": pixels, **host}

    def run(self, pixel_values: torch.Tensor, host_inputs: dict[str, np.ndarray]):
        """Eager forward of one call (the PyTorch reference backend's call)."""
        device = pixel_values.device
        host = [torch.from_numpy(np.asarray(array)).to(device) for array in host_inputs.values()]
        with torch.no_grad():
            return self(pixel_values, *host)


def encoder_host_inputs(vision_config, frame_inputs_fn, grid_hw: Sequence[int], frames: int) -> dict[str, np.ndarray]:
    """The F carrier, then one frame's index inputs (the graph tiles them over the F frames)."""
    big_h, big_w = frame_grid(vision_config, grid_hw)
    return {"video_grid_thw": np.zeros((check_frames_per_call(frames), big_h, big_w), dtype=np.int64),
            **frame_inputs_fn(vision_config, (big_h, big_w))}


def tiled(frame_input: torch.Tensor, frames: int | torch.Tensor) -> torch.Tensor:
    """A per-patch input of one frame ``(H*W, ...)`` repeated for ``frames`` frames."""
    return frame_input.repeat(frames, *([1] * (frame_input.dim() - 1)))


def equal_frames_call(rotary_position_ids: torch.Tensor, frames: int | torch.Tensor) -> dict:
    """The keyword arguments every family's tower call shares: F equal frames, each given one frame's rotary
    ids, and nothing derived from a grid (so nothing in the graph depends on tensor values)."""
    return dict(
        grid_thw=None,  # every grid-derived tensor is given; None makes any fallback fail loudly
        position_ids=tiled(rotary_position_ids, frames),
        cu_seqlens=EqualSegments(frames),
        max_seqlen=0,  # only flash kernels read it; given, transformers never inspects the layout
    )
