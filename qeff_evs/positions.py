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

import torch

from qeff_evs import evs

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


# --------------------------------------------------------------------------- restriction and decode start


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


def rope_table_length(ctx_len: int, q: float, multiple: int = 64) -> int:
    """Default number of positions the language graph's RoPE tables cover (``qeff-evs export``).

    A request holds at most ``ctx_len`` tokens, but under EVS its positions are the *unpruned* ones:
    the kept ``(1 - q)`` share of a video keeps the positions of the whole. So the table covers
    ``ctx_len / (1 - q)`` positions, rounded up to a multiple of ``multiple``. (Qwen2.5-VL's temporal
    positions can outrun even that for sparse frame rates; ``--rope-positions`` sets it explicitly, and
    the host refuses any request that would pass the table.)
    """
    if ctx_len < 1:
        raise ValueError(f"ctx_len must be >= 1, got {ctx_len}")
    evs.validate_pruning_rate(q)
    needed = math.ceil(round(ctx_len / (1.0 - q), 6))  # round: 8192 / (1 - 0.9) is 81920.00000000001
    return -(-needed // multiple) * multiple


def check_rope_range(decode_start: int, max_new_tokens: int, table_positions: int | None) -> None:
    """Refuse a request whose M-RoPE positions would pass the export's RoPE tables (before any graph call).

    The prompt's positions all lie below ``decode_start``; generated token ``j`` (from 0) is fed at
    ``decode_start + j``, so the request needs positions up to ``decode_start + max_new_tokens - 1``.
    """
    if table_positions is None:
        return
    last = decode_start + max_new_tokens - 1
    if last >= table_positions:
        raise ValueError(
            f"this request needs M-RoPE positions up to {last} (its prompt's positions end at {decode_start - 1}, "
            f"plus {max_new_tokens} new tokens) but the export's RoPE tables cover positions [0, {table_positions}); "
            f"re-export with --rope-positions >= {last + 1}, or use fewer frames / fewer new tokens")
