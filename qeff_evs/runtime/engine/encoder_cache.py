"""Which vision-encoder outputs are alive, keyed by the media item's content hash.

The cache is sized in embedding rows (a video's K kept rows; ``Placeholder.num_embeds``),
the unit vLLM v1's ``EncoderCacheManager`` counts in. An entry is held by ``(request_id, item)``
pairs, so the same video in two requests is one entry, encoded once, alive while either holds it.

When the last holder lets go the entry is *released*, not dropped: it stays readable until the
scheduler drains it into ``SchedulerOutput.free_encoder_hashes`` at the end of its next
``schedule()``. A request that asks for it during that call picks it up again instead of
re-encoding it. Released rows count as reclaimable space: storing a new entry that needs them
evicts released entries, oldest first (vLLM's freeable pool), and the evicted hashes are drained
with the rest. The runner frees the drained hashes before it encodes the step's new items, so
the rows it keeps never exceed the capacity.
"""

from __future__ import annotations

from dataclasses import dataclass, field

Holder = tuple[str, int]  # (request_id, index of the media item in that request)


@dataclass
class CacheEntry:
    content_hash: str
    num_rows: int
    holders: set[Holder] = field(default_factory=set)


class EncoderCache:
    """Book-keeping only: the runner stores the rows; this decides what is alive and what fits."""

    def __init__(self, capacity_rows: int):
        if capacity_rows < 1:
            raise ValueError(f"encoder cache capacity must be >= 1 embedding row, got {capacity_rows}")
        self.capacity_rows = int(capacity_rows)
        self._entries: dict[str, CacheEntry] = {}
        self._released: dict[str, None] = {}  # insertion-ordered set: unheld, not yet drained
        self._evicted: list[str] = []  # released entries dropped to make room, not yet drained
        self._held_by_request: dict[str, dict[int, str]] = {}  # request_id -> {item: hash}

    # --- queries -------------------------------------------------------------------------

    def __contains__(self, content_hash: object) -> bool:
        return content_hash in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def is_empty(self) -> bool:
        return not self._entries

    def num_rows(self, content_hash: str) -> int | None:
        entry = self._entries.get(content_hash)
        return None if entry is None else entry.num_rows

    def holders(self, content_hash: str) -> frozenset[Holder]:
        entry = self._entries.get(content_hash)
        return frozenset() if entry is None else frozenset(entry.holders)

    def held_items(self, request_id: str) -> dict[int, str]:
        """``{item: content_hash}`` for every media item this request holds."""
        return dict(self._held_by_request.get(request_id, {}))

    @property
    def held_rows(self) -> int:
        return sum(e.num_rows for h, e in self._entries.items() if h not in self._released)

    @property
    def stored_rows(self) -> int:
        """Rows the runner still keeps, released entries included."""
        return sum(e.num_rows for e in self._entries.values())

    @property
    def free_rows(self) -> int:
        """Room for new entries once released entries are reclaimed."""
        return self.capacity_rows - self.held_rows

    def can_store(self, num_rows: int) -> bool:
        return num_rows <= self.free_rows

    # --- updates ---------------------------------------------------------------------------

    def hold(self, content_hash: str, holder: Holder, num_rows: int) -> bool:
        """Add ``holder`` to an existing entry (reviving it if released); False when not cached."""
        entry = self._entries.get(content_hash)
        if entry is None:
            return False
        self._check_rows(entry, num_rows, holder)
        entry.holders.add(holder)
        self._released.pop(content_hash, None)
        self._held_by_request.setdefault(holder[0], {})[holder[1]] = content_hash
        return True

    def store(self, content_hash: str, num_rows: int, holder: Holder) -> None:
        """A new entry, held by ``holder``; its rows must fit next to the held entries."""
        if content_hash in self._entries:
            raise ValueError(f"encoder cache already has {content_hash!r}; call hold() for a cached item")
        if num_rows < 1:
            raise ValueError(f"an encoder cache entry needs >= 1 row, got {num_rows} for {content_hash!r}")
        if not self.can_store(num_rows):
            raise ValueError(
                f"{content_hash!r} needs {num_rows} rows but only {self.free_rows} of {self.capacity_rows} "
                "are free; check can_store() first or raise the encoder cache size")
        while self.stored_rows + num_rows > self.capacity_rows:
            oldest = next(iter(self._released))
            del self._released[oldest]
            del self._entries[oldest]
            self._evicted.append(oldest)
        self._entries[content_hash] = CacheEntry(content_hash, num_rows, {holder})
        self._held_by_request.setdefault(holder[0], {})[holder[1]] = content_hash

    def release(self, content_hash: str, holder: Holder) -> None:
        """Drop one holder; the entry becomes released when nobody holds it."""
        entry = self._entries.get(content_hash)
        if entry is None or holder not in entry.holders:
            raise ValueError(f"{holder} does not hold {content_hash!r} in the encoder cache")
        entry.holders.discard(holder)
        items = self._held_by_request[holder[0]]
        del items[holder[1]]
        if not items:
            del self._held_by_request[holder[0]]
        if not entry.holders:
            self._released[content_hash] = None

    def release_request(self, request_id: str) -> None:
        """Drop every hold of a finished or aborted request."""
        for item, content_hash in self.held_items(request_id).items():
            self.release(content_hash, (request_id, item))

    def drain_released(self) -> list[str]:
        """Forget the released entries; return their hashes and the evicted ones, oldest release first.

        A hash can be both drained and stored again in one step (evicted, then needed): the runner
        frees before it encodes, so that stays consistent.
        """
        drained = self._evicted + list(self._released)
        for content_hash in self._released:
            del self._entries[content_hash]
        self._released.clear()
        self._evicted = []
        return drained

    @staticmethod
    def _check_rows(entry: CacheEntry, num_rows: int, holder: Holder) -> None:
        if num_rows != entry.num_rows:
            raise ValueError(
                f"request {holder[0]!r} item {holder[1]} expects {num_rows} rows for content hash "
                f"{entry.content_hash!r}, but the cached entry has {entry.num_rows}; the same hash must "
                "mean the same video at the same resolution, frame count and pruning rate")
