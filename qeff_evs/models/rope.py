"""M-RoPE cos/sin from fp32 tables gathered by position (QEfficient's way), never Cos/Sin of positions.

``qaic-compile -convert-to-fp16`` runs every float op in fp16: ``cos(position * inv_freq)`` computed
in the graph loses the position itself above 2048 and the angle long before (0.34 error in cos at
position 1000). So the language graph carries ``cos`` and ``sin`` as constant tables of ``positions``
rows, computed once at export by the model's own rotary embedding in fp32, and gathers rows by
position. On the card the tables become fp16 *values* in [-1, 1] (error below 5e-4 whatever the
position); the positions stay int64 gather indices.

Qwen2.5-VL (chunked ``mrope_section``) and Qwen3-VL (interleaved) differ only in which position row
(t, h or w) feeds each channel. That map is read from the model's rotary embedding itself (one
probe per row), so no family layout is restated here, and the table lookup returns exactly what
``rotary_emb(x, position_ids)`` returns: ``(batch, seq, head_dim)`` cos and sin.
"""

from __future__ import annotations

import torch
from torch import nn

POSITION_ROWS = 3  # M-RoPE t, h, w
# Rotary types whose frequencies change with the sequence length: a fixed table cannot serve them.
DYNAMIC_ROPE_TYPES = ("dynamic", "longrope")


def _rotary(rotary_emb: nn.Module, positions: torch.Tensor, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    probe = torch.zeros((), dtype=dtype, device=positions.device)
    with torch.no_grad():
        return rotary_emb(probe, positions)


def channel_rows(rotary_emb: nn.Module) -> torch.Tensor:
    """``(head_dim,)`` int64: the M-RoPE position row (0 t, 1 h, 2 w) each rotary channel uses.

    Probed: position 1 in one row and 0 in the others gives ``sin != 0`` exactly on that row's channels.
    """
    hits = []
    for row in range(POSITION_ROWS):
        positions = torch.zeros(POSITION_ROWS, 1, 1, dtype=torch.int64)
        positions[row] = 1
        _, sin = _rotary(rotary_emb, positions)
        hits.append(sin.reshape(-1) != 0)
    hits = torch.stack(hits)  # (3, head_dim)
    if not bool((hits.sum(dim=0) == 1).all()):
        raise ValueError(
            f"{type(rotary_emb).__name__} does not feed every rotary channel from exactly one position row; "
            "qeff-evs builds RoPE tables only for M-RoPE embeddings (Qwen2.5-VL, Qwen3-VL)"
        )
    return hits.to(torch.int64).argmax(dim=0)


def rope_tables(rotary_emb: nn.Module, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)``, each ``(positions, head_dim)`` fp32: the rotary embedding at positions 0..positions-1."""
    rope_type = getattr(rotary_emb, "rope_type", "default")
    if rope_type in DYNAMIC_ROPE_TYPES:
        raise ValueError(
            f"rope_type {rope_type!r} rescales frequencies with the sequence length; a fixed cos/sin table "
            "cannot serve it. Export a checkpoint with a static rope_type (Qwen VL ships 'default')"
        )
    rows = torch.arange(positions, dtype=torch.int64).expand(POSITION_ROWS, 1, positions)
    cos, sin = _rotary(rotary_emb, rows)
    return cos[0].float().contiguous(), sin[0].float().contiguous()


class RopeTable(nn.Module):
    """``forward(position_ids (3, B, S)) -> (cos, sin)``, each ``(B, S, head_dim)``, by table lookup.

    Positions must lie in ``[0, positions)``; padding (-1) reads row 0 (its result is never used).
    The host refuses a request whose positions would pass the table (``positions`` is in the manifest).
    """

    def __init__(self, rotary_emb: nn.Module, positions: int):
        super().__init__()
        if positions < 1:
            raise ValueError(f"a RoPE table needs at least one position, got {positions}")
        cos, sin = rope_tables(rotary_emb, positions)
        rows = channel_rows(rotary_emb)
        self.positions = positions
        self.register_buffer("cos_table", cos, persistent=False)
        self.register_buffer("sin_table", sin, persistent=False)
        # One bool mask per row: channel c takes row r where masks[r, c]. Where-selection keeps it exact.
        self.register_buffer("row_masks", torch.stack([rows == r for r in range(POSITION_ROWS)]), persistent=False)

    def _lookup(self, table: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        per_row = table[positions]  # (3, B, S, head_dim)
        picked = torch.where(self.row_masks[2], per_row[2], per_row[0])
        picked = torch.where(self.row_masks[1], per_row[1], picked)
        return picked.to(dtype)

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        positions = position_ids.clamp(min=0)
        return self._lookup(self.cos_table, positions, dtype), self._lookup(self.sin_table, positions, dtype)
