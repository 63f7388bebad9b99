"""Vision attention inside segments (frames, windows) without a dense ``(S, S)`` mask.

Both Qwen towers attend only inside a segment of their packed patch sequence: a whole frame in the
full-attention blocks, a window of a frame in Qwen2.5-VL's windowed blocks. Stock transformers splits
the sequence with ``lengths.tolist()``, which freezes the grid into a traced graph; a dense block mask
costs ``S x S`` for a video of S patches. Here the segment layout is a small object built from host
index tensors:

* ``EqualSegments(count)``: ``count`` contiguous segments of one length (the frames of one
  resolution): a reshape, then batched attention, no mask; cost ``S x S / count``;
* ``PaddedSegments(gather, key_mask, unpad)``: segments of different lengths gathered into a
  ``(segments, L)`` padded block, padding keys masked out, rows put back with ``unpad``; cost ``S x L``.

The function plugs into transformers through ``AttentionInterface`` (its documented extension point).
Its registered name contains "flash" on purpose: vision attention then hands its ``cu_seqlens``
argument (here: the layout object) through to the implementation instead of splitting by ``tolist()``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

# "flash" in the name selects transformers' varlen code path (cu_seq_lens_q is passed through).
SEGMENT_ATTENTION = "qeff_evs_flash_segments"


@dataclass(frozen=True)
class EqualSegments:
    """The sequence is ``count`` contiguous segments of equal length (one per frame)."""

    count: int | torch.Tensor  # a traced size under export


@dataclass(frozen=True)
class PaddedSegments:
    """Segments of unequal length, padded to ``L`` columns.

    ``gather (segments, L)``: sequence row of each place (padding places repeat a real row);
    ``key_mask (segments, L)`` bool: True on real places; ``unpad (S,)``: flat place of each row.
    """

    gather: torch.Tensor
    key_mask: torch.Tensor
    unpad: torch.Tensor


def tile_per_frame(index: torch.Tensor, frames: int | torch.Tensor, stride: int | torch.Tensor) -> torch.Tensor:
    """``index`` of one frame repeated for ``frames`` frames, frame f offset by ``f * stride``; flattened
    along the first axis (``(n, ...)`` -> ``(frames * n, ...)``)."""
    offsets = torch.arange(frames, dtype=index.dtype, device=index.device) * stride
    tiled = index.unsqueeze(0) + offsets.reshape(-1, *([1] * index.dim()))
    return tiled.reshape(-1, *index.shape[1:])


def frame_windows(gather: torch.Tensor, key_mask: torch.Tensor, unpad: torch.Tensor,
                  frames: int | torch.Tensor) -> PaddedSegments:
    """The padded windows of ``frames`` frames from one frame's ``(windows, L)`` layout (``key_mask`` 1 = real)."""
    windows, width = gather.shape[0], gather.shape[1]
    patches = unpad.shape[0]
    mask = (key_mask != 0).unsqueeze(0).expand(frames, windows, width).reshape(-1, width)
    return PaddedSegments(tile_per_frame(gather, frames, patches), mask,
                          tile_per_frame(unpad, frames, windows * width))


def _attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
            key_mask: torch.Tensor | None = None) -> torch.Tensor:
    scores = torch.matmul(query, key.transpose(-1, -2)) * scaling
    if key_mask is not None:
        # Where (not an additive mask) so a masked score never meets another infinity.
        scores = torch.where(key_mask, scores, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores.float(), dim=-1).to(query.dtype)
    return torch.matmul(probs, value)


def segment_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    scaling: float | None = None,
    dropout: float = 0.0,
    cu_seq_lens_q: EqualSegments | PaddedSegments | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention inside the segments of ``cu_seq_lens_q``; inputs ``(1, heads, S, head_dim)``.

    Returns ``(1, S, heads, head_dim)`` as transformers' attention functions do. Inference only:
    ``dropout`` is ignored. Plain MatMul/Where/Softmax/Gather so every backend (ORT, QAIC) runs it.
    """
    if not isinstance(cu_seq_lens_q, (EqualSegments, PaddedSegments)):
        raise ValueError(
            f"segment_attention needs an EqualSegments or PaddedSegments layout as cu_seqlens, got "
            f"{type(cu_seq_lens_q).__name__}; it only serves the qeff-evs encoder wrappers, which build one")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    heads, dim = query.shape[1], query.shape[3]
    q, k, v = query[0], key[0], value[0]  # (heads, S, head_dim)
    layout = cu_seq_lens_q
    if isinstance(layout, EqualSegments):
        out = _attend(*(t.reshape(heads, layout.count, -1, dim) for t in (q, k, v)), scaling)
        out = out.reshape(heads, -1, dim)
    else:
        segments, width = layout.gather.shape[0], layout.gather.shape[1]
        rows = layout.gather.reshape(-1)
        padded = (t.index_select(1, rows).reshape(heads, segments, width, dim) for t in (q, k, v))
        out = _attend(*padded, scaling, layout.key_mask[None, :, None, :])
        out = out.reshape(heads, -1, dim).index_select(1, layout.unpad)
    return out.transpose(0, 1).unsqueeze(0).contiguous(), None


def register_segment_attention() -> str:
    """Register ``segment_attention`` with transformers (idempotent); returns its implementation name."""
    if ALL_ATTENTION_FUNCTIONS.get(SEGMENT_ATTENTION) is not segment_attention:
        AttentionInterface.register(SEGMENT_ATTENTION, segment_attention)
    return SEGMENT_ATTENTION
