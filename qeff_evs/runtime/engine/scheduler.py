"""A vLLM-v1-style scheduler over abstract requests: token budget, chunked prefill, encoder budget.

Each ``schedule()`` hands out one step:

1. every decoding request gets its one token (decode first, so generation never stalls behind a
   long prompt);
2. requests still prefilling get their next chunk, in admission order, cut at the remaining
   token budget, at ``prefill_seq_len`` and at the request's ``chunk_ends`` (one language-graph
   call per request per step);
3. waiting requests are admitted first-come-first-served while fewer than ``max_num_seqs`` run
   and budget remains; the queue stops at the first request that cannot start.

A chunk that reaches a media item whose encoder output is not cached schedules the item's
encoding in the same step (``SchedulerOutput.encoder_inputs``; the runner encodes the whole item
before the chunk runs). If the item does not fit the per-step encoder budget or the encoder cache,
the chunk stops just before the item's placeholder, or the request waits (vLLM's
``_try_schedule_encoder_inputs``). An item whose placeholder the request has passed
(``offset + length <= num_computed``) is let go after the step; the freed hashes come back in
the next output.

Numbers of computed tokens advance when a step is scheduled; ``update_from_output`` then records
the sampled tokens and finishes requests on an EOS id, a stop id or ``max_new_tokens``.

Row reuse (docs/serving.md#conversations-row-reuse, ``row_history``): with ``row_reuse`` on, a row keeps
what its request fed (a ``RowHistory``) after the request ends, and a waiting request is placed by
``choose_row``: it starts at ``num_computed = prefix`` (the tokens the row holds of it), so chunks inside the
prefix are never scheduled and media wholly inside it are never encoded. A row whose layers cannot be rewound
(``rewindable_rows`` False) is reused only whole. Off: the lowest free row, from token 0, as before.

Media items are declared by content hash and ``Placeholder``. Beyond the placeholder's extent,
only the position of its first embedding row and its row count matter here, so a Qwen3-VL request
can be scheduled with its lumped placeholder before encoding (frame 0 is always kept whole, so the
first video pad sits at the same position in the lumped and the real layout).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum

from qeff_evs.models.pruning import VideoPruning
from qeff_evs.runtime.engine.encoder_cache import EncoderCache
from qeff_evs.runtime.engine.row_history import MediaSpan, RowChoice, RowHistory, choose_row
from qeff_evs.runtime.engine.window import Placeholder, overlaps_window


def check_fits_context(num_prompt_tokens: int, max_new_tokens: int, ctx_len: int, where: str = "") -> None:
    """A request needs a KV slot per prompt and fed generated token."""
    need = num_prompt_tokens + max_new_tokens
    if need > ctx_len:
        raise ValueError(
            f"{where}the prompt ({num_prompt_tokens} tokens) plus max_new_tokens ({max_new_tokens}) needs {need} "
            f"KV slots but ctx_len is {ctx_len}; shorten the prompt (fewer frames, a higher --video-pruning-rate), "
            "lower max_new_tokens, or export a larger --ctx-len")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int  # tokens per step, all requests together
    max_num_seqs: int  # running requests (KV cache rows)
    prefill_seq_len: int  # longest prefill chunk one graph call takes
    ctx_len: int  # KV slots per request
    encoder_compute_budget: int | None = None  # embedding rows encoded per step; None = max_num_batched_tokens
    encoder_cache_size: int | None = None  # embedding rows kept; None = max_num_batched_tokens
    row_reuse: bool = True  # a finished request's KV row serves the next request's common prefix (row_history)

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "prefill_seq_len", "ctx_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) is below max_num_seqs "
                f"({self.max_num_seqs}): every running request must be able to decode each step; "
                "raise the token budget or lower max_num_seqs")
        for name in ("encoder_compute_budget", "encoder_cache_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 embedding row (or None for the token budget), got {value}")

    @property
    def encoder_budget_rows(self) -> int:
        return self.encoder_compute_budget or self.max_num_batched_tokens

    @property
    def encoder_cache_rows(self) -> int:
        return self.encoder_cache_size or self.max_num_batched_tokens


@dataclass(frozen=True)
class MediaPlacement:
    """One media item of a request: its content hash and where its rows go in the prompt."""

    content_hash: str
    placeholder: Placeholder
    pruning: VideoPruning | None = None  # what shaped its kept rows (row reuse compares it); None: an image

    @property
    def span(self) -> MediaSpan:
        return MediaSpan(self.placeholder.offset, self.placeholder.length, self.content_hash, self.pruning)

    @property
    def num_rows(self) -> int:
        return self.placeholder.num_embeds

    @property
    def end(self) -> int:
        return self.placeholder.offset + self.placeholder.length


@dataclass(frozen=True)
class RequestSpec:
    request_id: str
    num_prompt_tokens: int
    media: tuple[MediaPlacement, ...] = ()
    max_new_tokens: int = 16
    eos_token_ids: frozenset[int] = frozenset()
    stop_token_ids: frozenset[int] = frozenset()
    # Prompt positions no prefill chunk crosses (increasing, in (0, num_prompt_tokens]); () = cut anywhere.
    # The single-request engine's explicit chunks are its ends; budget and encoder limits may cut more.
    chunk_ends: tuple[int, ...] = ()
    # The prompt's token ids (provisional inside placeholders is fine: media compare by hash). Row reuse needs
    # them; () = the request neither reuses a row nor leaves a history in it.
    token_ids: tuple[int, ...] = ()


class FinishReason(str, Enum):
    EOS = "eos"
    STOP = "stop"  # one of stop_token_ids
    LENGTH = "length"  # max_new_tokens reached
    ABORTED = "aborted"


@dataclass(frozen=True)
class PrefillChunk:
    """Prompt tokens ``[computed, computed + scheduled)``; the last chunk samples the first token."""

    request_id: str
    cache_row: int  # the request's KV cache row (batch_index)
    computed: int
    scheduled: int
    samples: bool

    @property
    def end(self) -> int:
        return self.computed + self.scheduled


@dataclass(frozen=True)
class DecodeStep:
    """The request's latest token, written to KV index ``computed``."""

    request_id: str
    cache_row: int  # the request's KV cache row (batch_index)
    computed: int
    token_id: int


@dataclass(frozen=True)
class EncoderInput:
    """Encode media item ``item`` of ``request_id`` (whole item) and cache it under ``content_hash``."""

    request_id: str
    item: int
    content_hash: str
    num_rows: int


@dataclass(frozen=True)
class SchedulerOutput:
    step: int
    decodes: tuple[DecodeStep, ...]
    prefills: tuple[PrefillChunk, ...]
    encoder_inputs: tuple[EncoderInput, ...]
    free_encoder_hashes: tuple[str, ...]  # drop these cached outputs before encoding this step's items
    finished_request_ids: tuple[str, ...]  # ended since the previous step: drop their runner state

    @property
    def num_scheduled_tokens(self) -> int:
        return len(self.decodes) + sum(p.scheduled for p in self.prefills)

    @property
    def encoder_rows(self) -> int:
        return sum(e.num_rows for e in self.encoder_inputs)

    @property
    def sampling_request_ids(self) -> tuple[str, ...]:
        """Requests whose step yields a token: every decode and every final prefill chunk."""
        return tuple(d.request_id for d in self.decodes) + tuple(p.request_id for p in self.prefills if p.samples)

    @property
    def is_empty(self) -> bool:
        return not (self.decodes or self.prefills)


@dataclass(frozen=True)
class FinishedRequest:
    request_id: str
    output_token_ids: tuple[int, ...]
    reason: FinishReason
    num_cached_tokens: int = 0  # prompt tokens its KV row held already (vLLM's name for prefix-cache hits)


@dataclass(eq=False)  # identity: list.remove / `in` must not compare specs (numpy masks inside)
class _RequestState:
    spec: RequestSpec
    items_by_offset: tuple[int, ...]  # media item indices sorted by placeholder offset
    num_computed: int = 0
    output_ids: list[int] = field(default_factory=list)
    cache_row: int = -1
    num_cached: int = 0  # prompt tokens the row held when the request took it

    @property
    def num_tokens(self) -> int:
        return self.spec.num_prompt_tokens + len(self.output_ids)

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed < self.spec.num_prompt_tokens


class Scheduler:
    def __init__(self, config: SchedulerConfig, rewindable_rows: bool = True):
        """``rewindable_rows`` False: the language graph keeps per-row state that cannot be cut back to a
        shorter prefix (linear attention), so a row is reused only when its whole history is a prefix."""
        self.config = config
        self.cache = EncoderCache(config.encoder_cache_rows)
        self._waiting: deque[_RequestState] = deque()
        self._running: list[_RequestState] = []  # admission order
        self._free_rows = list(range(config.max_num_seqs))
        self.rewindable_rows = rewindable_rows
        self._histories: dict[int, RowHistory] = {}  # free row -> what it holds (row reuse)
        self._num_ended = 0  # requests that left a row so far: RowHistory.finished_at
        self._finished_since_step: list[str] = []
        self._pending: SchedulerOutput | None = None  # scheduled, awaiting update_from_output
        self._aborted_while_pending: set[str] = set()
        self._step = 0

    # --- requests --------------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def has_unfinished_requests(self) -> bool:
        return bool(self._waiting or self._running)

    def num_computed_tokens(self, request_id: str) -> int:
        return self._live(request_id).num_computed

    def output_token_ids(self, request_id: str) -> tuple[int, ...]:
        return tuple(self._live(request_id).output_ids)

    def num_cached_tokens(self, request_id: str) -> int:
        """Prompt tokens the request's row held when it took it (0 while waiting)."""
        return self._live(request_id).num_cached

    def row_history(self, row: int) -> RowHistory | None:
        """What free row ``row`` holds for the next request (None: nothing usable, or reuse is off)."""
        return self._histories.get(row)

    def add_request(self, spec: RequestSpec) -> None:
        """Queue a request; raises ``ValueError`` (and queues nothing) if it could never run."""
        self._validate(spec)
        order = tuple(sorted(range(len(spec.media)), key=lambda i: spec.media[i].placeholder.offset))
        self._waiting.append(_RequestState(spec, order))

    def abort_request(self, request_id: str) -> FinishedRequest | None:
        """End a waiting or running request now; None if it is not live (unknown or already ended)."""
        state = self._find(request_id)
        if state is None:
            return None
        if state in self._waiting:
            self._waiting.remove(state)
        else:
            # Mid-step, the runner may or may not have run what was scheduled: the row's content is unknown.
            self._end(state, row_known=self._pending is None)
        if self._pending is not None:
            self._aborted_while_pending.add(request_id)
        return FinishedRequest(request_id, tuple(state.output_ids), FinishReason.ABORTED, state.num_cached)

    # --- one step --------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        if self._pending is not None:
            raise ValueError(
                f"step {self._pending.step} has not been reported; call update_from_output() with its "
                "output before scheduling the next step")
        self._step += 1
        budget = self.config.max_num_batched_tokens
        encoder_budget = self.config.encoder_budget_rows
        decodes, prefills, encoder_inputs = [], [], []

        for state in self._running:
            if not state.is_prefilling and budget > 0 and state.num_computed < state.num_tokens:
                decodes.append(DecodeStep(state.spec.request_id, state.cache_row, state.num_computed,
                                          state.output_ids[-1]))
                budget -= 1

        for state in self._running:
            if not state.is_prefilling or budget == 0:
                continue
            scheduled, encoder_budget = self._plan_chunk(state, budget, encoder_budget, encoder_inputs)
            if scheduled:
                prefills.append(self._chunk(state, scheduled))
                budget -= scheduled

        while self._waiting and self._free_rows and budget > 0:
            state = self._waiting[0]
            place = self._place(state)
            state.num_computed = place.prefix  # the chunk starts after what the row holds
            scheduled, encoder_budget = self._plan_chunk(state, budget, encoder_budget, encoder_inputs)
            if scheduled == 0:
                state.num_computed = 0
                break  # first come, first served: nobody overtakes the head of the queue
            self._waiting.popleft()
            self._free_rows.remove(place.row)
            self._histories.pop(place.row, None)
            state.cache_row, state.num_cached = place.row, place.prefix
            self._running.append(state)
            prefills.append(self._chunk(state, scheduled))
            budget -= scheduled

        for d in decodes:
            self._live(d.request_id).num_computed += 1
        for p in prefills:
            self._live(p.request_id).num_computed += p.scheduled

        output = SchedulerOutput(
            step=self._step,
            decodes=tuple(decodes),
            prefills=tuple(prefills),
            encoder_inputs=tuple(encoder_inputs),
            free_encoder_hashes=tuple(self.cache.drain_released()),
            finished_request_ids=tuple(self._finished_since_step),
        )
        self._finished_since_step = []
        self._aborted_while_pending = set()
        self._pending = None if output.is_empty else output
        return output

    def update_from_output(self, output: SchedulerOutput, sampled: Mapping[str, int]) -> list[FinishedRequest]:
        """Record the token each sampling request produced in ``output``'s step; return who finished."""
        if output.is_empty and self._pending is None:
            if sampled:
                raise ValueError(f"step {output.step} scheduled nothing, yet got tokens for {sorted(sampled)}")
            return []
        if self._pending is None or output.step != self._pending.step:
            expected = "none" if self._pending is None else str(self._pending.step)
            raise ValueError(f"update_from_output got step {output.step}, but the step awaiting results is {expected}")
        aborted = self._aborted_while_pending
        expected_ids = {rid for rid in output.sampling_request_ids if rid not in aborted}
        given = set(sampled) - aborted
        if given != expected_ids:
            raise ValueError(
                f"step {output.step} samples tokens for {sorted(expected_ids)}, got tokens for {sorted(given)}; "
                "pass one token id per decode and per final prefill chunk")
        self._pending = None
        self._aborted_while_pending = set()

        finished = []
        for rid in dict.fromkeys(d.request_id for d in output.decodes + output.prefills):
            state = self._find(rid)
            if state is None:
                continue
            self._release_passed_items(state)
            if rid in expected_ids:
                token = int(sampled[rid])
                state.output_ids.append(token)
                reason = self._finish_reason(state, token)
                if reason is not None:
                    self._end(state)
                    finished.append(FinishedRequest(rid, tuple(state.output_ids), reason, state.num_cached))
        return finished

    # --- internals -------------------------------------------------------------------------

    def _plan_chunk(self, state: _RequestState, budget: int, encoder_budget: int,
                    encoder_inputs: list[EncoderInput]) -> tuple[int, int]:
        """Length of the request's next chunk and the encoder budget left; schedules needed encodes."""
        start = state.num_computed
        end = next((e for e in state.spec.chunk_ends if e > start), state.spec.num_prompt_tokens)
        scheduled = min(end - start, budget, self.config.prefill_seq_len)
        rid = state.spec.request_id
        for item in state.items_by_offset:
            media = state.spec.media[item]
            ph = media.placeholder
            if not overlaps_window(ph, start, start + scheduled):
                continue
            if self.cache.hold(media.content_hash, (rid, item), media.num_rows):
                continue  # cached, or being encoded this step for another item or request
            if media.num_rows > encoder_budget or not self.cache.can_store(media.num_rows):
                # Encoders see the whole item at once, so stop before its placeholder, or wait.
                scheduled = ph.offset - start if start < ph.offset else 0
                break
            if start + scheduled <= ph.offset + ph.leading_text:
                continue  # the window only covers text before the item's first row: encode later
            # (Past it, encode even when the provisional layout has text here: a chunk starting inside a reused
            # prefix may reach rows the real layout puts where the provisional one has frame markers.)
            self.cache.store(media.content_hash, media.num_rows, (rid, item))
            encoder_budget -= media.num_rows
            encoder_inputs.append(EncoderInput(rid, item, media.content_hash, media.num_rows))
        return scheduled, encoder_budget

    def _place(self, state: _RequestState) -> RowChoice:
        """The free row a waiting request takes and the prefix it holds (``row_history.choose_row``)."""
        spec = state.spec
        if not self.config.row_reuse or not spec.token_ids:
            return RowChoice(self._free_rows[0], 0)
        return choose_row({row: self._histories.get(row) for row in self._free_rows}, spec.token_ids,
                          [media.span for media in spec.media])

    def _chunk(self, state: _RequestState, scheduled: int) -> PrefillChunk:
        end = state.num_computed + scheduled
        return PrefillChunk(state.spec.request_id, state.cache_row, state.num_computed, scheduled,
                            samples=end == state.spec.num_prompt_tokens)

    def _release_passed_items(self, state: _RequestState) -> None:
        rid = state.spec.request_id
        for item, content_hash in self.cache.held_items(rid).items():
            if state.spec.media[item].end <= state.num_computed:
                self.cache.release(content_hash, (rid, item))

    @staticmethod
    def _finish_reason(state: _RequestState, token: int) -> FinishReason | None:
        if token in state.spec.eos_token_ids:
            return FinishReason.EOS
        if token in state.spec.stop_token_ids:
            return FinishReason.STOP
        if len(state.output_ids) >= state.spec.max_new_tokens:
            return FinishReason.LENGTH
        return None

    def _end(self, state: _RequestState, row_known: bool = True) -> None:
        self._running.remove(state)
        self._free_rows.append(state.cache_row)
        self._free_rows.sort()
        self._num_ended += 1
        spec = state.spec
        if self.config.row_reuse and spec.token_ids and row_known:
            # The row holds every token fed so far: the prompt's computed part and the generated tokens but
            # the last (sampled, never fed).
            fed = (spec.token_ids + tuple(state.output_ids))[:state.num_computed]
            self._histories[state.cache_row] = RowHistory(
                fed, tuple(m.span for m in spec.media if m.placeholder.offset < len(fed)),
                self.rewindable_rows, self._num_ended)
        self.cache.release_request(state.spec.request_id)
        self._finished_since_step.append(state.spec.request_id)

    def _find(self, request_id: str) -> _RequestState | None:
        for state in (*self._running, *self._waiting):
            if state.spec.request_id == request_id:
                return state
        return None

    def _live(self, request_id: str) -> _RequestState:
        state = self._find(request_id)
        if state is None:
            raise ValueError(f"request {request_id!r} is not waiting or running (never added, or already ended)")
        return state

    def _validate(self, spec: RequestSpec) -> None:
        cfg = self.config
        rid = spec.request_id
        if self._find(rid) is not None:
            raise ValueError(f"request id {rid!r} is already waiting or running; use a unique id")
        if spec.num_prompt_tokens < 1:
            raise ValueError(f"request {rid!r}: the prompt needs >= 1 token, got {spec.num_prompt_tokens}")
        if spec.max_new_tokens < 1:
            raise ValueError(f"request {rid!r}: max_new_tokens must be >= 1, got {spec.max_new_tokens}")
        check_fits_context(spec.num_prompt_tokens, spec.max_new_tokens, cfg.ctx_len, f"request {rid!r}: ")
        if spec.token_ids and len(spec.token_ids) != spec.num_prompt_tokens:
            raise ValueError(f"request {rid!r}: {len(spec.token_ids)} token ids for a {spec.num_prompt_tokens}-token "
                             "prompt; give every prompt token's id, or none")
        ends = list(spec.chunk_ends)
        if ends and (ends != sorted(set(ends)) or ends[0] < 1 or ends[-1] > spec.num_prompt_tokens):
            raise ValueError(
                f"request {rid!r}: chunk_ends {ends} must increase strictly within (0, {spec.num_prompt_tokens}] "
                "(positions of the prompt where a prefill chunk ends)")
        ordered = sorted(spec.media, key=lambda m: m.placeholder.offset)
        previous_end = 0
        limit = min(cfg.encoder_cache_rows, cfg.encoder_budget_rows)
        for media in ordered:
            ph = media.placeholder
            if ph.offset < previous_end or ph.length < 1 or media.end > spec.num_prompt_tokens:
                raise ValueError(
                    f"request {rid!r}: placeholder {media.content_hash!r} at [{ph.offset}, {media.end}) must be "
                    f"non-empty, inside the {spec.num_prompt_tokens}-token prompt and not overlap another item")
            previous_end = media.end
            if media.num_rows > limit:
                raise ValueError(
                    f"request {rid!r}: media item {media.content_hash!r} has {media.num_rows} embedding rows, "
                    f"more than the encoder cache ({cfg.encoder_cache_rows} rows) or the per-step encoder budget "
                    f"({cfg.encoder_budget_rows} rows) can hold; raise encoder_cache_size/encoder_compute_budget "
                    "or send fewer frames / a higher pruning rate")
        self._check_same_rows(spec)

    def _check_same_rows(self, spec: RequestSpec) -> None:
        """One content hash must mean one encoded item: the same row count everywhere."""
        known = {}
        for state in (*self._running, *self._waiting):
            for media in state.spec.media:
                known.setdefault(media.content_hash, media.num_rows)
        for media in spec.media:
            rows = self.cache.num_rows(media.content_hash) or known.get(media.content_hash)
            known.setdefault(media.content_hash, media.num_rows)
            if rows is not None and rows != media.num_rows:
                raise ValueError(
                    f"request {spec.request_id!r}: content hash {media.content_hash!r} has {media.num_rows} rows "
                    f"here but {rows} elsewhere; the hash must identify the encoded item (video, resolution, "
                    "frames, pruning rate)")
