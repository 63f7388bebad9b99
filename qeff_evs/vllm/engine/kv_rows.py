"""Which KV row a request vLLM schedules runs in, and how much of it the row already holds (row reuse).

An export's KV rows are not vLLM's blocks: vLLM's block pool only counts them (one block per row, see
``engine/platform.py``), so the row is chosen here, in the scheduler's process, when vLLM asks for a new request's
prefix-cache hit (``QeffEvsScheduler``), and handed to the worker with the step's output. What a row holds and how
much of a request it holds are the engine's (``runtime/engine/row_history.py``: its ``RowHistory``,
``reusable_prefix`` and ``choose_row``, the policy included); this module feeds them vLLM's requests. Each media
item is known by vLLM's identifier (``mm_hash``: the item's content and the request's ``mm_processor_kwargs``, so a
request's own pruning is part of it; the server's flags are one per server).

vLLM's ``cache_salt`` keeps users apart as in vLLM's prefix cache: a row that holds another salt's tokens is offered
as holding nothing (its first token masked), so it keeps its place in the recency order and lends no prefix; so is
every row to a request that skips the prefix cache (vLLM's ``skip_reading_prefix_cache``). With reuse off
(``--no-enable-prefix-caching``) rows keep no history.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

from qeff_evs.runtime.engine.row_history import MediaSpan, RowChoice, RowHistory, choose_row

NO_TOKEN = -1  # no vocabulary has it: a history whose first token is this lends no prefix


def media_spans(request) -> tuple[MediaSpan, ...]:
    """A vLLM ``Request`` 's media items, in prompt order, by vLLM's identifier."""
    spans = (MediaSpan(int(f.mm_position.offset), int(f.mm_position.length), str(f.identifier))
             for f in request.mm_features or ())
    return tuple(sorted(spans, key=lambda span: span.offset))


@dataclass(frozen=True)
class SaltedHistory:
    """A row's history and the ``cache_salt`` of the request that left it."""

    history: RowHistory
    salt: str | None

    def offered_to(self, salt: str | None, readable: bool = True) -> RowHistory:
        """The history as a request under ``salt`` may reuse it (``readable`` False: a request that reads none)."""
        if readable and salt == self.salt or not self.history.token_ids:
            return self.history
        return dataclasses.replace(self.history, token_ids=(NO_TOKEN, *self.history.token_ids[1:]), media=())


@dataclass
class RowBook:
    """The scheduler's view of the export's KV rows: who holds each, what each free one still holds."""

    num_rows: int
    rewindable: bool
    reuse: bool
    histories: dict[int, SaltedHistory] = field(default_factory=dict)  # free rows that hold something
    held: dict[str, int] = field(default_factory=dict)  # request id -> row, for requests vLLM scheduled
    claimed: dict[str, RowChoice] = field(default_factory=dict)  # this step's choices, until vLLM schedules them
    pulling: set[str] = field(default_factory=set)  # held rows a KV hand-over is being written into (kv_connector)
    clock: int = 0

    def claim(self, request, scheduled: Collection[str] = (), limit: int | None = None) -> RowChoice | None:
        """Choose a row for a vLLM ``Request`` about to be scheduled for the first time (it may still not be); None
        when no row is free (vLLM then has no block for it either). ``scheduled``: the requests vLLM has scheduled
        so far (its running list): vLLM places waiting requests one at a time, so an earlier claim of a request not
        among them was passed over and lapses. ``limit``: the longest prefix the request may reuse (vLLM's bound; 0
        for a request that reads no history); a row that cannot be rewound to it is reused for nothing."""
        self.claimed = {r: c for r, c in self.claimed.items() if r in scheduled and r != request.request_id}
        salt = request.cache_salt
        read_history = limit is None or limit > 0
        free = {row: self.histories[row].offered_to(salt, read_history) if row in self.histories else None
                for row in self._free_rows()}
        if not free:
            return None
        choice = choose_row(free, tuple(request.all_token_ids), media_spans(request))
        if limit is not None and choice.prefix > limit:
            choice = RowChoice(choice.row, limit if self.rewindable else 0)
        self.claimed[request.request_id] = choice
        return choice

    def hold_for_pull(self, request_id: str) -> int:
        """Keep a claimed row for a request that waits for its KV from a prefill instance (vLLM schedules it later,
        with no new claim); the row it holds until :meth:`pulled` is unknown."""
        choice = self.claimed.pop(request_id)
        self.held[request_id] = choice.row
        self.histories.pop(choice.row, None)
        self.pulling.add(request_id)
        return choice.row

    def pulled(self, request_id: str) -> None:
        """The hand-over was written into the request's row: it holds the request's tokens from now on."""
        self.pulling.discard(request_id)

    def confirm(self, scheduled: Iterable[str]) -> dict[str, int]:
        """The rows of the requests vLLM scheduled for the first time this step; other claims lapse."""
        rows = {}
        for request_id in scheduled:
            if request_id in self.held:  # held since vLLM first placed it (a pull: hold_for_pull)
                rows[request_id] = self.held[request_id]
                continue
            choice = self.claimed.pop(request_id, None)
            free = self._free_rows()
            row = choice.row if choice is not None else free[0] if free else None  # unclaimed: vLLM reported no hit
            if row is None:  # an instance without KV rows (an encoder-only one) places nothing
                continue
            self.held[request_id] = rows[request_id] = row
            self.histories.pop(row, None)  # overwritten from here on; known again when the request ends
        self.claimed.clear()
        return rows

    def _free_rows(self) -> list[int]:
        taken = set(self.held.values()) | {c.row for c in self.claimed.values()}
        return [row for row in range(self.num_rows) if row not in taken]

    def release(self, request, computed_known: bool = True) -> None:
        """vLLM freed ``request``: its row is free and holds the tokens it computed (nothing when ``computed_known``
        is False: the worker failed it)."""
        row = self.held.pop(request.request_id, None)
        self.claimed.pop(request.request_id, None)
        if request.request_id in self.pulling:  # a hand-over that never arrived: the row holds nothing known
            self.pulling.discard(request.request_id)
            computed_known = False
        if row is None:
            return
        self.clock += 1
        if self.reuse and computed_known:
            computed = int(request.num_computed_tokens)
            history = RowHistory(tuple(request.all_token_ids[:computed]),
                                 tuple(s for s in media_spans(request) if s.offset < computed),
                                 rewindable=self.rewindable, finished_at=self.clock)
            self.histories[row] = SaltedHistory(history, request.cache_salt)
