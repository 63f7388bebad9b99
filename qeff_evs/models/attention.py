"""Block-diagonal attention from ``cu_seqlens``: one exportable graph for every vision grid.

Vision towers attend within segments (a frame, or a window of one frame) whose boundaries
``cu_seqlens`` lists. Stock transformers splits the sequence with ``lengths.tolist()``, which
freezes the grid into a traced graph. Here the segments become a dense ``(S, S)`` mask built
from ``cu_seqlens`` with comparisons only, so the graph has no data-dependent shapes.

The function plugs into transformers through ``AttentionInterface`` (its documented extension
point). Its registered name contains "flash" on purpose: vision attention hands ``cu_seq_lens_q``
to implementations it takes for flash-style varlen kernels, instead of splitting by ``tolist()``.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

# "flash" in the name selects transformers' varlen code path (cu_seq_lens_q is passed through).
BLOCK_MASK_ATTENTION = "qeff_evs_flash_block_mask"


def segment_ids(cu_seqlens: torch.Tensor, length: int | torch.Tensor) -> torch.Tensor:
    """Segment number of each of ``length`` packed tokens: how many boundaries ``cu_seqlens[1:]`` it has passed."""
    positions = torch.arange(length, device=cu_seqlens.device, dtype=torch.int64)
    ends = cu_seqlens[1:].to(torch.int64)
    return (positions[:, None] >= ends[None, :]).sum(dim=-1)


def block_diagonal_mask(cu_seqlens: torch.Tensor, length: int | torch.Tensor) -> torch.Tensor:
    """``(length, length)`` bool: True where query and key lie in the same segment."""
    segments = segment_ids(cu_seqlens, length)
    return segments[:, None] == segments[None, :]


def block_mask_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    scaling: float | None = None,
    dropout: float = 0.0,
    cu_seq_lens_q: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention restricted to the segments of ``cu_seq_lens_q``; inputs ``(1, heads, S, head_dim)``.

    Returns ``(1, S, heads, head_dim)`` as transformers' attention functions do. Inference only:
    ``dropout`` is ignored. Plain MatMul/Where/Softmax so every backend (ORT, QAIC) can run it.
    """
    if cu_seq_lens_q is None:
        raise ValueError(
            "block_mask_attention needs cu_seq_lens_q (segment boundaries); it only serves vision towers "
            f"that pass them, set {BLOCK_MASK_ATTENTION!r} on the vision config only"
        )
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    same_segment = block_diagonal_mask(cu_seq_lens_q, query.shape[2])
    scores = torch.matmul(query, key.transpose(-1, -2)) * scaling
    # Where (not an additive mask) so a fully masked value never meets another infinity.
    scores = torch.where(same_segment, scores, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores.float(), dim=-1).to(query.dtype)
    output = torch.matmul(probs, value)
    return output.transpose(1, 2).contiguous(), None


def register_block_mask_attention() -> str:
    """Register ``block_mask_attention`` with transformers (idempotent); returns its implementation name."""
    if ALL_ATTENTION_FUNCTIONS.get(BLOCK_MASK_ATTENTION) is not block_mask_attention:
        AttentionInterface.register(BLOCK_MASK_ATTENTION, block_mask_attention)
    return BLOCK_MASK_ATTENTION
