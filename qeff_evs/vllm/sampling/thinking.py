"""vLLM 0.34's thinking budget: once a request has thought ``thinking_token_budget`` tokens, the end of thinking is
forced (``vllm/v1/worker/gpu/sample/thinking_budget.py``).

Thinking starts at the last occurrence of the start marker's ids and ends at a later occurrence of the natural end
marker's; while it is open and at least ``budget`` tokens follow the start marker, the next id of the end marker (the
first, or the one after the part of it the history already ends with) gets logit 1e9. The scan is incremental: each
step reads only the tokens committed since the last one (plus the markers' overlap).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

FORCED_LOGIT = 1.0e9


@dataclass(frozen=True)
class ThinkingMarkers:
    """The reasoning config's marker ids; all three non-empty, or the budget is off (as in vLLM)."""

    start: tuple[int, ...]
    end: tuple[int, ...]
    natural_end: tuple[int, ...]

    @classmethod
    def from_config(cls, reasoning_config) -> ThinkingMarkers | None:
        if reasoning_config is None:
            return None
        ids = [tuple(getattr(reasoning_config, name) or ()) for name in
               ("reasoning_start_token_ids", "reasoning_end_token_ids", "natural_reasoning_end_token_ids")]
        return cls(*ids) if all(ids) else None


def _last_match(tokens: Sequence[int], marker: Sequence[int], offset: int, current: int) -> int:
    marker = list(marker)
    for at in range(len(tokens) - len(marker) + 1):
        if list(tokens[at:at + len(marker)]) == marker:
            current = offset + at
    return current


@dataclass
class ThinkingScan:
    """One request's scan state: where its last start and natural-end markers begin, and how far it has read."""

    budget: int
    last_start: int = -1
    last_end: int = -1
    scanned: int = field(default=0)

    def forced_token(self, history: Sequence[int], markers: ThinkingMarkers) -> int | None:
        """The end-marker id to force after ``history`` (prompt and output so far), or None."""
        total = len(history)
        overlap = max(len(markers.start), len(markers.natural_end)) - 1
        tokens = history[self.scanned:total]
        self.last_start = _last_match(tokens, markers.start, self.scanned, self.last_start)
        self.last_end = _last_match(tokens, markers.natural_end, self.scanned, self.last_end)
        self.scanned = max(0, total - overlap)
        if self.last_start < 0 or self.last_start <= self.last_end:
            return None
        if total - self.last_start - len(markers.start) < self.budget:
            return None
        tail = list(history[max(0, total - (len(markers.end) - 1)):]) if len(markers.end) > 1 else []
        done = 0
        for length in range(1, min(len(tail), len(markers.end) - 1) + 1):
            if tail[-length:] == list(markers.end[:length]):
                done = length
        return markers.end[done]
