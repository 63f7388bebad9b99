"""Row reuse: what a KV row holds after its request, and how much of a new request it holds already.

(docs/serving.md#conversations-row-reuse says it for users.)

When a request leaves its KV row, the row keeps the keys and values of every token it fed the graph: the prompt
and the generated tokens but the last (sampled, never fed). A ``RowHistory`` describes them. A new request whose
first ``p`` tokens are the same tokens at the same slots, with the same media at the same places pruned the same
way, finds their keys and values already written: it starts at ``num_computed = p`` and computes only the rest.
Nothing beyond slot ``p`` needs clearing: each chunk writes its slots before it reads them, and a query at slot
``s`` sees only slots ``<= s`` (``models.kv_cache``).

Inside a media item's placeholder the token ids are not compared: before encoding a prompt holds the family's
provisional layout (Qwen3-VL's lumped split) and after it the real one, and both follow from the item itself. The
content hash decides there: equal hashes (pixels, grid, frame times) with equal pruning and placement give equal
ids, rows and positions. A prefix may end inside such an item (the new request then computes the item's tail from
its encoder output); it never covers part of an item that differs.

A row whose layers cannot be rewound (``rewindable`` False: Qwen3.5's linear-attention conv/recurrent state sums
every token it has seen) is reused only whole: its history must be a prefix of the new request.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from qeff_evs.models.pruning import VideoPruning


@dataclass(frozen=True)
class MediaSpan:
    """One media item of a token stream: its placeholder's place, what it shows, how it was pruned.

    Example: a 16-frame video whose placeholder (markers, timestamps and kept pads) takes prompt tokens
    ``[14, 14 + 530)`` is ``MediaSpan(14, 530, "<sha256>", VideoPruning("evs", 0.5))``; the same clip at rate 0.75
    has another ``pruning`` (and another length), so it never matches.
    """

    offset: int
    """First token of the placeholder in the stream."""
    length: int
    """Tokens of the placeholder (text inside it included)."""
    content_hash: str
    """Identifies the item's content: its pixels, grid and frame times (two items with one hash fill their
    placeholders with the same ids, rows and positions, given the same pruning)."""
    pruning: VideoPruning | None = None
    """The pruning that shaped its kept rows; None for an image (never pruned)."""

    def __post_init__(self) -> None:
        if self.offset < 0 or self.length < 1:
            raise ValueError(f"media span [{self.offset}, {self.offset + self.length}) of {self.content_hash!r} must "
                             "start at a token >= 0 and hold >= 1 token")

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True)
class RowHistory:
    """What a KV row holds once its request left it.

    Example: a request of 40 prompt tokens that generated 6 tokens fed 45 of them (the 6th was sampled, never
    fed): ``token_ids`` are the prompt's 40 and the first 5 generated, slots 0..44 of the row.
    """

    token_ids: tuple[int, ...]
    """The tokens whose keys and values the row holds, slot by slot from slot 0."""
    media: tuple[MediaSpan, ...] = ()
    """The media items of those tokens (an item may extend past them when its request ended inside it)."""
    rewindable: bool = True
    """False when some layer's per-row state cannot be cut back to a shorter prefix (linear attention)."""
    finished_at: int = 0
    """When the request left the row (any increasing counter, e.g. a step number): the policy's recency."""


@dataclass(frozen=True)
class RowChoice:
    """The row a new request takes and how many of its tokens that row holds already."""

    row: int
    prefix: int
    """The request's first ``prefix`` tokens are in the row (KV slots ``0..prefix-1``): its ``num_computed``."""


def reusable_prefix(history: RowHistory | None, token_ids: Sequence[int], media: Sequence[MediaSpan]) -> int:
    """How many of a new request's first tokens ``history`` holds exactly; 0 when none (or no history).

    Args:
        history: the row's content, or None for a row that holds nothing usable.
        token_ids: the new request's prompt ids (placeholders as the request holds them: provisional or real).
        media: the new request's media items.

    Returns:
        ``p``: the longest common prefix of the two token streams, where a media item counts as equal only when
        both streams have it at the same offset and length with the same hash and pruning (its ids are then not
        compared), cut back to the offset of any item that differs; at most ``len(token_ids) - 1``, so the request
        computes at least its last token and gets logits. A non-rewindable history gives all of it or nothing.
    """
    if history is None:
        return 0
    held = np.asarray(history.token_ids, dtype=np.int64)
    new = np.asarray(token_ids, dtype=np.int64)
    limit = min(len(held), len(new) - 1)
    if limit <= 0:
        return 0
    same = set(history.media) & set(media)
    for span in (*history.media, *media):
        if span not in same:
            limit = min(limit, span.offset)  # differing content from here on, whatever the ids say
    differs = held[:limit] != new[:limit]
    for span in same:
        differs[span.offset:span.end] = False  # the hash decides inside a placeholder
    mismatches = np.flatnonzero(differs)
    if mismatches.size:
        limit = int(mismatches[0])
    if not history.rewindable and limit < len(held):
        return 0
    return limit


def choose_row(free_rows: Mapping[int, RowHistory | None], token_ids: Sequence[int],
               media: Sequence[MediaSpan]) -> RowChoice:
    """The free row a new request takes, and the prefix that row holds of it.

    Policy: rows with useful history are kept longest.

    1. A row is *worth reusing* when the request would keep at least as many of its history's tokens as it
       overwrites (``prefix >= len(history) - prefix``, ``prefix > 0``): a follow-up in its conversation, or the same
       video asked anew. Of those, the longest prefix wins (ties: the lowest row).
    2. Otherwise the request takes the row with the least to lose: an empty row (no history) first, then the one
       whose request finished longest ago (``finished_at``), ties to the lowest row; it still starts at whatever
       prefix that row holds. So a shared chat-template opening never costs another conversation its video.

    Args:
        free_rows: every free row and its history (None or no tokens: the row holds nothing usable).
        token_ids, media: the new request, as for :func:`reusable_prefix`.
    """
    if not free_rows:
        raise ValueError("no free KV row to place the request in; wait for a running request to finish")
    prefixes = {row: reusable_prefix(history, token_ids, media) for row, history in free_rows.items()}

    def overwritten(row: int) -> int:
        history = free_rows[row]
        return 0 if history is None else len(history.token_ids) - prefixes[row]

    worth = [row for row in free_rows if prefixes[row] > 0 and prefixes[row] >= overwritten(row)]
    if worth:
        row = max(worth, key=lambda r: (prefixes[r], -r))
    else:
        row = min(free_rows, key=lambda r: (_last_used(free_rows[r]), r))
    return RowChoice(row, prefixes[row])


def _last_used(history: RowHistory | None) -> float:
    """Empty rows first, then by when their request finished."""
    return float("-inf") if history is None or not history.token_ids else float(history.finished_at)
