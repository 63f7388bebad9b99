"""Whole pruned prompts from per-item media descriptions, for the positions tests.

The package computes positions per request from each family's ``MediaLayout`` (its blocks and keep
mask); these builders let the tests state a multi-item prompt directly: media items with their patch
grids, per-family blocks, kept indices per block, and the pruned ids with their positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from qeff_evs.evs import merged_grid
from qeff_evs.positions import (
    IndexLike,
    MediaBlock,
    _as_ids,
    decode_start,
    media_runs,
    pruned_positions,
    unpruned_positions,
)


@dataclass(frozen=True)
class MediaItem:
    """One image or video as the processor reports it: patch grid (T, H, W) before the spatial merge."""

    kind: Literal["image", "video"]
    grid_thw: tuple[int, int, int]
    second_per_grid: float = 1.0  # seconds per temporal patch (videos; Qwen2.5-VL uses it)

    def __post_init__(self) -> None:
        if self.kind not in ("image", "video"):
            raise ValueError(f"MediaItem kind must be 'image' or 'video', got {self.kind!r}")
        if self.kind == "image" and int(self.grid_thw[0]) != 1:
            raise ValueError(f"an image has one temporal patch, got grid_thw {tuple(self.grid_thw)}")


def _check_local_indices(indices: IndexLike, size: int, what: str) -> torch.Tensor:
    idx = torch.as_tensor(indices)
    if idx.numel() == 0:  # an empty list arrives as float32; nothing to check
        return torch.zeros(0, dtype=torch.int64)
    if idx.dtype.is_floating_point or idx.dtype == torch.bool:
        raise ValueError(f"{what}: kept indices must be integers, got dtype {idx.dtype}")
    idx = idx.to(device="cpu", dtype=torch.int64).reshape(-1)
    low, high = int(idx.min()), int(idx.max())
    if low < 0 or high >= size:
        raise ValueError(
            f"{what}: kept indices must lie in [0, {size}), got range [{low}, {high}]; "
            "pass flat raster indices local to this block"
        )
    if torch.unique(idx).numel() != idx.numel():
        raise ValueError(f"{what}: kept indices must be unique, got {idx.tolist()}")
    return idx


def keep_mask(
    input_ids: IndexLike,
    media_token_ids: Sequence[int],
    kept_per_block: Sequence[IndexLike | None],
) -> torch.Tensor:
    """``(N,)`` bool over the unpruned prompt: text always kept, media tokens kept if kept.

    ``kept_per_block[i]`` holds flat raster indices local to media run ``i``; ``None`` keeps it all.
    """
    ids = _as_ids(input_ids)
    runs = media_runs(ids, media_token_ids)
    if len(runs) != len(kept_per_block):
        raise ValueError(
            f"the prompt has {len(runs)} runs of media pad tokens but kept indices were given for "
            f"{len(kept_per_block)} blocks; give one entry per run (None keeps the whole block)"
        )
    mask = torch.ones(ids.numel(), dtype=torch.bool)
    for i, ((start, end), kept) in enumerate(zip(runs, kept_per_block)):
        if kept is None:
            continue
        idx = _check_local_indices(kept, end - start, f"media block {i} ({end - start} tokens)")
        mask[start:end] = False
        mask[start + idx] = True
    return mask


def mrope_delta(unpruned: torch.Tensor, num_prompt_tokens: int) -> int:
    """vLLM's ``mrope_position_delta``: generated token ``i >= num_prompt_tokens`` sits at ``i + delta``.

    ``num_prompt_tokens`` is the length of the prompt actually fed (the pruned one under EVS).
    """
    return decode_start(unpruned) - int(num_prompt_tokens)


@dataclass(frozen=True)
class PrunedPrompt:
    """A prompt after EVS: its token ids, their int64 positions and where decoding continues."""

    input_ids: torch.Tensor  # (N',)
    positions: torch.Tensor  # (3, N') int64
    next_position: int  # unpruned max + 1

    @property
    def rope_delta(self) -> int:
        return self.next_position - self.input_ids.numel()


def prune_prompt(
    input_ids: IndexLike,
    media_token_ids: Sequence[int],
    blocks: Sequence[MediaBlock],
    kept_per_block: Sequence[IndexLike | None],
) -> PrunedPrompt:
    """Drop the media tokens EVS removed from an unpruned prompt, keeping the unpruned positions."""
    ids = _as_ids(input_ids)
    unpruned = unpruned_positions(ids, media_token_ids, blocks)
    keep = keep_mask(ids, media_token_ids, kept_per_block)
    return PrunedPrompt(ids[keep], pruned_positions(unpruned, keep), decode_start(unpruned))


def split_kept_by_frame(
    kept_indices: IndexLike, num_frames: int, tokens_per_frame: int
) -> list[torch.Tensor]:
    """Split a video's flat kept indices into one ascending tensor per frame, local to the frame."""
    if num_frames < 1 or tokens_per_frame < 1:
        raise ValueError(f"num_frames and tokens_per_frame must be >= 1, got {num_frames} and {tokens_per_frame}")
    idx = _check_local_indices(kept_indices, num_frames * tokens_per_frame, "video")
    idx = torch.sort(idx).values
    frame = idx // tokens_per_frame
    return [idx[frame == f] - f * tokens_per_frame for f in range(num_frames)]


def qwen2_5_vl_blocks(
    items: Sequence[MediaItem], spatial_merge_size: int, tokens_per_second: float
) -> list[MediaBlock]:
    """One block per image or video; a video's time factor is ``second_per_grid * tokens_per_second``.

    The factor is a double product of the two values as given, like vLLM's; vLLM receives
    ``second_per_grid`` from the HF processor as a float32 tensor, so pass it through float32
    first when bit-for-bit parity with a served model is wanted.
    """
    blocks = []
    for item in items:
        t, h, w = merged_grid(item.grid_thw, spatial_merge_size)
        factor = float(item.second_per_grid) * float(tokens_per_second) if item.kind == "video" else 1.0
        blocks.append(MediaBlock(t, h, w, factor))
    return blocks


def qwen3_vl_blocks(items: Sequence[MediaItem], spatial_merge_size: int) -> list[MediaBlock]:
    """One ``(1, h, w)`` block per image and per temporal patch of every video."""
    blocks = []
    for item in items:
        t, h, w = merged_grid(item.grid_thw, spatial_merge_size)
        blocks.extend(MediaBlock(1, h, w) for _ in range(t))
    return blocks


def qwen3_vl_kept_per_block(
    items: Sequence[MediaItem],
    spatial_merge_size: int,
    kept_per_item: Sequence[IndexLike | None],
) -> list[torch.Tensor | None]:
    """Per Qwen3-VL block (see :func:`qwen3_vl_blocks`): each video's flat indices split by frame."""
    if len(items) != len(kept_per_item):
        raise ValueError(
            f"{len(items)} media items but {len(kept_per_item)} kept-index entries; give one per item"
        )
    per_block: list[torch.Tensor | None] = []
    for item, kept in zip(items, kept_per_item):
        t, h, w = merged_grid(item.grid_thw, spatial_merge_size)
        if kept is None:
            per_block.extend([None] * t)
        else:
            per_block.extend(split_kept_by_frame(kept, t, h * w))
    return per_block
