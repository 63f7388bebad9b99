"""vLLM v1 window arithmetic: which cached encoder rows a prefill chunk needs.

For a request with ``c`` computed tokens and ``n`` scheduled tokens, a media item whose
placeholder covers prompt positions ``[offset, offset + length)`` contributes its placeholder
slice ``[max(c - offset, 0), min(c - offset + n, length))``; when the placeholder mixes text
and embeddings (``is_embed``), the slice maps to embedding rows through the cumulative count.
These are the rules of ``GPUModelRunner._gather_mm_embeddings`` and
``PlaceholderRange.get_embeds_indices_in_range``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Placeholder:
    """Where one media item sits in the prompt, and which of its positions take embedding rows."""

    offset: int
    length: int
    is_embed: np.ndarray | None = None  # bool (length,); None = every position is a row
    _cumsum: np.ndarray | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.is_embed is not None:
            mask = np.asarray(self.is_embed, dtype=bool).reshape(-1)
            if mask.shape[0] != self.length:
                raise ValueError(f"is_embed has {mask.shape[0]} entries for a placeholder of length {self.length}")
            object.__setattr__(self, "is_embed", mask)
            object.__setattr__(self, "_cumsum", np.cumsum(mask, dtype=np.int64))

    @classmethod
    def of_ids(cls, offset: int, ids: np.ndarray, media_pads: tuple[int, ...]) -> Placeholder:
        """The placeholder of a media segment ``ids`` at ``offset``: its media pads are its embedding rows."""
        is_embed = np.isin(ids, media_pads)
        return cls(offset, len(ids), None if is_embed.all() else is_embed)

    @property
    def num_embeds(self) -> int:
        if self._cumsum is None:
            return self.length
        return int(self._cumsum[-1]) if self.length else 0

    @property
    def leading_text(self) -> int:
        """Positions before the first embedding row (all of them when the placeholder has none)."""
        if self.num_embeds == 0:
            return self.length
        return int(np.argmax(self.is_embed)) if self.is_embed is not None else 0

    def embed_rows_in_range(self, start: int, end: int) -> tuple[int, int]:
        """Embedding rows ``[first, last)`` behind placeholder positions ``[start, end)``."""
        if self._cumsum is None:
            return start, end
        first = int(self._cumsum[start - 1]) if start > 0 else 0
        last = int(self._cumsum[end - 1]) if end > 0 else 0
        return first, last


@dataclass(frozen=True)
class WindowSlice:
    """Rows ``[row_start, row_end)`` of item ``item`` feed chunk positions ``[pos_start, pos_end)``."""

    item: int
    pos_start: int  # placeholder-relative positions of the chunk that belong to this item
    pos_end: int
    row_start: int
    row_end: int

    @property
    def num_rows(self) -> int:
        return self.row_end - self.row_start


def overlaps_window(placeholder: Placeholder, start: int, end: int) -> bool:
    return placeholder.offset + placeholder.length > start and placeholder.offset < end


def window_slices(placeholders: list[Placeholder], computed: int, scheduled: int) -> list[WindowSlice]:
    """The encoder rows the chunk ``[computed, computed + scheduled)`` consumes, in prompt order."""
    slices = []
    order = sorted(range(len(placeholders)), key=lambda i: placeholders[i].offset)
    for item in order:
        ph = placeholders[item]
        if not overlaps_window(ph, computed, computed + scheduled):
            continue
        pos_start = max(computed - ph.offset, 0)
        pos_end = min(computed - ph.offset + scheduled, ph.length)
        row_start, row_end = ph.embed_rows_in_range(pos_start, pos_end)
        if row_start == row_end:
            continue
        slices.append(WindowSlice(item, pos_start, pos_end, row_start, row_end))
    return slices


def prefill_chunks(num_prompt_tokens: int, chunk_len: int, short_lens: Sequence[int] = ()) -> list[tuple[int, int]]:
    """``(computed, scheduled)`` for a prompt cut into chunks of at most ``chunk_len`` tokens.

    With the export's shorter prefill lengths ``short_lens`` the tail (what is left after the full chunks) is cut
    again where one chunk would be padded by more than the shortest length's worth of tokens: a chunk of the longest
    length it holds goes first, and so on. A call costs about that many tokens of its own (docs/performance.md), so
    this spends calls only where padding costs more. Example: ``prefill_chunks(1058, 2048, (32, 64, ..., 1024))``
    is 1024 + 34 (padded to 64), not one chunk padded to 2048; with ``(32, 64)`` and 128 a tail of 100 stays one
    chunk (28 padded).
    """
    if chunk_len < 1:
        raise ValueError(f"chunk length must be >= 1, got {chunk_len}")
    chunks = [(c, chunk_len) for c in range(0, num_prompt_tokens - chunk_len + 1, chunk_len)]
    computed = len(chunks) * chunk_len
    lengths = sorted({*short_lens, chunk_len})
    while computed < num_prompt_tokens:
        left = num_prompt_tokens - computed
        padded = min(n for n in lengths if n >= left)
        shorter = [n for n in lengths if n < left]
        scheduled = shorter[-1] if shorter and padded - left > lengths[0] else left
        chunks.append((computed, scheduled))
        computed += scheduled
    return chunks
