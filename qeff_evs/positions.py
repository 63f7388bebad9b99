"""M-RoPE positions of (possibly EVS-pruned) prompts, in int64, computed once on the host.

Definition: the pruned prompt's positions are the *unpruned* prompt's positions restricted to
the tokens that remain, and decoding continues from the unpruned maximum + 1. So the only
rule to get right is the unpruned one, which follows vLLM without EVS:

* a text token takes ``(s, s, s)`` for the next free index ``s``, then ``s += 1``;
* a media block with merged grid ``(t, h, w)`` and time factor ``f`` gives its token
  ``(ti, r, c)`` (raster order) the position ``(s + int(ti * f), s + r, s + c)``; the next
  free index is then the block's maximum + 1.

``int(ti * f)`` is a Python double product truncated toward zero, as vLLM's numpy code does.
Nothing here goes through a float tensor: vLLM's EVS path stores positions next to bf16
embeddings, which rounds every value above 256.

Each maximal run of media pad tokens in the unpruned prompt is exactly one block. Qwen2.5-VL
has one block per image or video; Qwen3-VL one block per image and one per temporal patch of
a video (its timestamps and vision markers are ordinary text between the blocks).
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from qeff_evs.evs import merged_grid

IndexLike = torch.Tensor | Sequence[int]


@dataclass(frozen=True)
class MediaBlock:
    """One run of media pad tokens in the unpruned prompt, on the merged (LLM) grid."""

    grid_t: int
    grid_h: int
    grid_w: int
    time_factor: float = 1.0  # tokens_per_second * second_per_grid (Qwen2.5-VL video), else 1

    def __post_init__(self) -> None:
        dims = (self.grid_t, self.grid_h, self.grid_w)
        try:
            # operator.index accepts numpy / 0-d torch ints and refuses floats
            ints = tuple(operator.index(d) for d in dims if not isinstance(d, bool))
        except TypeError:
            ints = ()
        if len(ints) != 3 or min(ints) < 1:
            raise ValueError(f"MediaBlock grid must be positive ints (t, h, w), got {dims}")
        for name, value in zip(("grid_t", "grid_h", "grid_w"), ints):
            object.__setattr__(self, name, value)  # store plain ints so the block hashes and compares simply
        f = self.time_factor
        if isinstance(f, bool) or not isinstance(f, numbers.Real) or not math.isfinite(f) or f < 0:
            raise ValueError(
                f"MediaBlock time_factor must be a finite float >= 0, got {f!r}; "
                "pass tokens_per_second * second_per_grid for Qwen2.5-VL videos, 1.0 otherwise"
            )
        object.__setattr__(self, "time_factor", float(f))  # the rule is a Python double product

    @property
    def num_tokens(self) -> int:
        return self.grid_t * self.grid_h * self.grid_w

    @property
    def tokens_per_frame(self) -> int:
        return self.grid_h * self.grid_w


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


# --------------------------------------------------------------------------- unpruned positions


def temporal_offsets(grid_t: int, time_factor: float) -> list[int]:
    """``int(ti * f)`` for every temporal patch: a double product, truncated (vLLM's rule)."""
    return [int(ti * float(time_factor)) for ti in range(grid_t)]


def block_positions(start: int, block: MediaBlock) -> torch.Tensor:
    """``(3, t*h*w)`` int64 positions of one media block whose first free index is ``start``."""
    t_idx = torch.tensor(temporal_offsets(block.grid_t, block.time_factor), dtype=torch.int64)
    h_idx = torch.arange(block.grid_h, dtype=torch.int64)
    w_idx = torch.arange(block.grid_w, dtype=torch.int64)
    grid = torch.stack(torch.meshgrid(t_idx, h_idx, w_idx, indexing="ij"), dim=0)
    return grid.reshape(3, -1) + int(start)


def _as_ids(input_ids: IndexLike, name: str = "input_ids") -> torch.Tensor:
    ids = torch.as_tensor(input_ids)
    if ids.numel() == 0:
        raise ValueError(f"{name} is empty; a prompt needs at least one token")
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.dim() != 1:
        raise ValueError(f"{name} must be 1-D (one prompt), got shape {tuple(ids.shape)}; pass one request at a time")
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(f"{name} must hold integer token ids, got dtype {ids.dtype}")
    return ids.to(device="cpu", dtype=torch.int64)  # positions are host-side


def media_runs(input_ids: IndexLike, media_token_ids: Sequence[int]) -> list[tuple[int, int]]:
    """``[start, end)`` of every maximal run of media pad tokens, in prompt order."""
    ids = _as_ids(input_ids)
    is_media = torch.isin(ids, torch.as_tensor(list(media_token_ids), dtype=torch.int64))
    edges = torch.diff(torch.nn.functional.pad(is_media.to(torch.int8), (1, 1)))
    starts = torch.nonzero(edges == 1).flatten().tolist()
    ends = torch.nonzero(edges == -1).flatten().tolist()
    return list(zip(starts, ends))


def _check_runs_match_blocks(runs: list[tuple[int, int]], blocks: Sequence[MediaBlock]) -> None:
    if len(runs) != len(blocks):
        raise ValueError(
            f"the prompt has {len(runs)} runs of media pad tokens but {len(blocks)} media blocks were given; "
            "give one block per run (Qwen3-VL: one per video frame) in prompt order"
        )
    for i, ((start, end), block) in enumerate(zip(runs, blocks)):
        if end - start != block.num_tokens:
            raise ValueError(
                f"media run {i} at tokens [{start}, {end}) has {end - start} pad tokens but its block "
                f"{(block.grid_t, block.grid_h, block.grid_w)} needs {block.num_tokens}; "
                "build the unpruned prompt (every frame's full h*w pads) before computing positions"
            )


def unpruned_positions(
    input_ids: IndexLike, media_token_ids: Sequence[int], blocks: Sequence[MediaBlock]
) -> torch.Tensor:
    """``(3, N)`` int64 M-RoPE positions of the unpruned prompt."""
    ids = _as_ids(input_ids)
    runs = media_runs(ids, media_token_ids)
    _check_runs_match_blocks(runs, blocks)
    pieces: list[torch.Tensor] = []
    next_free = 0
    cursor = 0  # first prompt index not yet placed
    for (start, end), block in zip(runs, blocks):
        text = torch.arange(next_free, next_free + start - cursor, dtype=torch.int64)
        pieces.append(text.expand(3, -1))
        next_free += start - cursor
        media = block_positions(next_free, block)
        pieces.append(media)
        next_free = int(media.max()) + 1
        cursor = end
    tail = torch.arange(next_free, next_free + ids.numel() - cursor, dtype=torch.int64)
    pieces.append(tail.expand(3, -1))
    return torch.cat(pieces, dim=1)


# --------------------------------------------------------------------------- pruning


def _check_local_indices(indices: IndexLike, size: int, what: str) -> torch.Tensor:
    idx = torch.as_tensor(indices)
    if idx.numel() == 0:  # an empty list arrives as float32; nothing to check
        return torch.zeros(0, dtype=torch.int64)
    if idx.dtype.is_floating_point or idx.dtype == torch.bool:
        raise ValueError(f"{what}: retained indices must be integers, got dtype {idx.dtype}")
    idx = idx.to(device="cpu", dtype=torch.int64).reshape(-1)
    low, high = int(idx.min()), int(idx.max())
    if low < 0 or high >= size:
        raise ValueError(
            f"{what}: retained indices must lie in [0, {size}), got range [{low}, {high}]; "
            "pass flat raster indices local to this block"
        )
    if torch.unique(idx).numel() != idx.numel():
        raise ValueError(f"{what}: retained indices must be unique, got {idx.tolist()}")
    return idx


def keep_mask(
    input_ids: IndexLike,
    media_token_ids: Sequence[int],
    retained_per_block: Sequence[IndexLike | None],
) -> torch.Tensor:
    """``(N,)`` bool over the unpruned prompt: text always kept, media tokens kept if retained.

    ``retained_per_block[i]`` holds flat raster indices local to media run ``i``; ``None`` keeps it all.
    """
    ids = _as_ids(input_ids)
    runs = media_runs(ids, media_token_ids)
    if len(runs) != len(retained_per_block):
        raise ValueError(
            f"the prompt has {len(runs)} runs of media pad tokens but retained indices were given for "
            f"{len(retained_per_block)} blocks; give one entry per run (None keeps the whole block)"
        )
    mask = torch.ones(ids.numel(), dtype=torch.bool)
    for i, ((start, end), retained) in enumerate(zip(runs, retained_per_block)):
        if retained is None:
            continue
        idx = _check_local_indices(retained, end - start, f"media block {i} ({end - start} tokens)")
        mask[start:end] = False
        mask[start + idx] = True
    return mask


def pruned_positions(unpruned: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """The unpruned positions restricted to the kept tokens: ``(3, keep.sum())`` int64."""
    if unpruned.dim() != 2 or unpruned.shape[0] != 3 or unpruned.dtype != torch.int64:
        raise ValueError(
            f"unpruned positions must be a (3, N) int64 tensor, got {tuple(unpruned.shape)} {unpruned.dtype}"
        )
    if keep.dtype != torch.bool or keep.shape != (unpruned.shape[1],):
        raise ValueError(
            f"keep must be a bool tensor of shape ({unpruned.shape[1]},), got {tuple(keep.shape)} {keep.dtype}"
        )
    return unpruned[:, keep]


def decode_start(unpruned: torch.Tensor) -> int:
    """First position of generated tokens: the unpruned maximum + 1 (all three rows)."""
    if unpruned.numel() == 0:
        raise ValueError("positions are empty; a prompt needs at least one token")
    return int(unpruned.max()) + 1


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
    retained_per_block: Sequence[IndexLike | None],
) -> PrunedPrompt:
    """Drop the media tokens EVS removed from an unpruned prompt, keeping the unpruned positions."""
    ids = _as_ids(input_ids)
    unpruned = unpruned_positions(ids, media_token_ids, blocks)
    keep = keep_mask(ids, media_token_ids, retained_per_block)
    return PrunedPrompt(ids[keep], pruned_positions(unpruned, keep), decode_start(unpruned))


# --------------------------------------------------------------------------- per-family blocks


def split_retained_by_frame(
    retained_indices: IndexLike, num_frames: int, tokens_per_frame: int
) -> list[torch.Tensor]:
    """Split a video's flat retained indices into one ascending tensor per frame, local to the frame."""
    if num_frames < 1 or tokens_per_frame < 1:
        raise ValueError(f"num_frames and tokens_per_frame must be >= 1, got {num_frames} and {tokens_per_frame}")
    idx = _check_local_indices(retained_indices, num_frames * tokens_per_frame, "video")
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


def qwen3_vl_retained_per_block(
    items: Sequence[MediaItem],
    spatial_merge_size: int,
    retained_per_item: Sequence[IndexLike | None],
) -> list[torch.Tensor | None]:
    """Per Qwen3-VL block (see :func:`qwen3_vl_blocks`): each video's flat indices split by frame."""
    if len(items) != len(retained_per_item):
        raise ValueError(
            f"{len(items)} media items but {len(retained_per_item)} retained-index entries; give one per item"
        )
    per_block: list[torch.Tensor | None] = []
    for item, retained in zip(items, retained_per_item):
        t, h, w = merged_grid(item.grid_thw, spatial_merge_size)
        if retained is None:
            per_block.extend([None] * t)
        else:
            per_block.extend(split_retained_by_frame(retained, t, h * w))
    return per_block
