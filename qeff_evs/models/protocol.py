"""The small protocol a model family implements to plug into export and runtime.

A family knows four things the shared pipeline does not: how to build its exportable
encoder and language wrappers from a transformers model, which host-side index tensors
its encoder takes for one frame of a grid, how a video is laid out in the prompt (before the
encoder, where only the retained count K is known, and after it, where the per-frame split is),
and how its released checkpoints preprocess video (``VideoPreprocessing``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np
import torch

from qeff_evs.manifest import SpecialTokens
from qeff_evs.positions import MediaBlock

SAMPLING_FPS = 2.0  # both Qwen-VL families sample videos at 2 frames per second


@dataclass(frozen=True)
class VideoPreprocessing:
    """What differs by family in turning frames into patches; a family's ``PREPROCESS_DEFAULTS`` are its
    released checkpoints' values (a checkpoint's own processor config overrides them).

    ``min_pixels``/``max_pixels`` bound the resized frame: per frame (Qwen2.5-VL), or over the whole
    clip, frames x height x width, with ``pixel_limits_per_video`` (Qwen3-VL), as HF's video processors do.

    Frame sampling is HF's video processor's: ``video_processor`` names its class (vLLM picks its video
    loader by that name and ``runtime/inputs/frame_sampling.py`` its sampling rule), and the class
    defaults follow: ``do_sample_frames``, ``sampling_fps`` (``fps``; ``None`` where the class has none),
    ``num_frames``, ``min_frames``, ``max_frames``.
    """

    patch_size: int
    temporal_patch_size: int
    merge_size: int
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    min_pixels: int
    max_pixels: int
    pixel_limits_per_video: bool = False
    video_processor: str = "Qwen2VLVideoProcessor"
    do_sample_frames: bool = False
    sampling_fps: float | None = None
    num_frames: int | None = None
    min_frames: int = 4
    max_frames: int = 768


@dataclass(frozen=True)
class MediaInput:
    """A preprocessed video: patches in the family's order and its patch grid."""

    pixel_values: torch.Tensor  # (T*H*W, C*tp*p*p)
    grid_thw: tuple[int, int, int]  # patch grid (temporal patches, H patches, W patches)
    fps: float  # sampling rate of the frames the patches were made from
    frame_times: tuple[float, ...] = ()  # seconds of each sampled frame (Qwen3-VL timestamps)
    kind: str = "video"  # "video" (pruned by EVS) or "image" (grid T = 1, never pruned)

    def __post_init__(self) -> None:
        if self.kind not in ("video", "image"):
            raise ValueError(f"media kind must be 'video' or 'image', got {self.kind!r}")
        if self.kind == "image" and int(self.grid_thw[0]) != 1:
            raise ValueError(f"an image has one temporal patch, got grid {tuple(self.grid_thw)}")


@dataclass(frozen=True)
class MediaLayout:
    """A video's prompt segment after encoding, described on its unpruned layout.

    ``unpruned_ids[keep]`` are the ids fed to the language graph; positions are computed on
    the unpruned ids with ``blocks`` and then restricted with ``keep``.
    """

    unpruned_ids: np.ndarray  # int64
    keep: np.ndarray  # bool, same length
    blocks: tuple[MediaBlock, ...]

    @property
    def ids(self) -> np.ndarray:
        return self.unpruned_ids[self.keep]


def image_layout(image_pad: int, merged_grid: tuple[int, int, int]) -> MediaLayout:
    """Images are never pruned: h*w image pads, one M-RoPE block, everything kept (both families)."""
    _, h, w = merged_grid
    ids = np.full(h * w, image_pad, dtype=np.int64)
    return MediaLayout(ids, np.ones(h * w, dtype=bool), (MediaBlock(1, h, w),))


class ModelFamily(Protocol):
    """What export and runtime need from Qwen2.5-VL or Qwen3-VL."""

    name: str
    deepstack_levels: int

    def special_tokens(self) -> SpecialTokens: ...

    def merged_grid(self, grid_thw: Sequence[int]) -> tuple[int, int, int]: ...

    def encoder(self, model: torch.nn.Module) -> torch.nn.Module:
        """Exportable encoder: F temporal patches + one frame's host inputs in, merged rows [+ deepstack] out."""

    def evs_selection(self) -> torch.nn.Module:
        """Exportable EVS graph: a whole video's merged rows in, (kept rows, [deepstack], indices) out."""

    def encoder_host_inputs(self, grid_hw: Sequence[int], frames: int) -> dict[str, np.ndarray]:
        """Every encoder input except ``pixel_values``, for calls of ``frames`` patches of grid ``(H, W)``."""

    def encoder_symbols(self, grid_hw: Sequence[int], frames: int) -> dict[str, int]:
        """Values of the encoder graph's dynamic symbols for one (frame grid, F) specialization."""

    def evs_symbols(self, grid_thw: Sequence[int], retained: int) -> dict[str, int]:
        """Values of the EVS graph's dynamic symbols for one (video grid, K) specialization."""

    def placeholder_ids(self, video: MediaInput, retained: int) -> np.ndarray:
        """The video's prompt segment before encoding (only K known). Same length as after."""

    def video_layout(self, video: MediaInput, retained_indices: np.ndarray) -> MediaLayout:
        """The video's real segment once the encoder has chosen the retained tokens."""
