"""Runs what a scheduler decided, on the vision and language sessions: the one executor every engine shares.

A scheduler (ours in ``serving.py``, vLLM's through ``qeff_evs.vllm.engine.driver``) decides per step which
media items to encode, which prefill chunks and which decodes to run. The executor keeps each
request's prompt plan, media, content hashes, KV cache row and sampled tokens; encodes an item
once per content hash; fills an item's placeholder when the first chunk reaches it; runs each
prefill chunk (``steps.prefill_step``: its own window of vision rows) into the request's cache row
and every decode of a step in one batch (the sessions' ``decode``); frees encoder outputs when told.
Sampling is greedy, or the caller's (``prefill_logits``/``decode_logits``, then ``accept``: the vLLM
plugin samples with vLLM's sampler). A language graph with one KV cache row (``full_batch_size`` 1, with or without
``batch_index``) is called through ``run``; more rows need a continuous-batching session.
The executor never resets the language session: its KV cache was zeroed once, when it was made, and a
request in a used row never reads what earlier requests left there (``backends.base``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from qeff_evs import evs
from qeff_evs.models.protocol import MediaInput, ModelFamily, item_grid
from qeff_evs.models.pruning import DEFAULT_METHOD, VideoPruning
from qeff_evs.positions import check_rope_range
from qeff_evs.specializations.sets import chunk_seq_len
from qeff_evs.runtime.backends.base import DecodeRow, LanguageSession, VisionSession, close_session, decode_batch
from qeff_evs.runtime.engine.request import EncodedMedia, PromptPiece, PromptPlan, plan_prompt
from qeff_evs.runtime.engine.steps import prefill_step


@dataclass(frozen=True)
class EngineConfig:
    prefill_seq_len: int
    ctx_len: int
    user_vision_size: int
    video_pruning_rate: float
    max_new_tokens: int = 16
    pad_token_id: int = 0
    video_pruning_method: str = DEFAULT_METHOD
    short_prefill_lens: tuple[int, ...] = ()  # the export's shorter prefill lengths (Manifest.short_prefill_lens)

    def __post_init__(self) -> None:
        VideoPruning(self.video_pruning_method, self.video_pruning_rate)  # raises on a bad method or rate
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.user_vision_size < self.prefill_seq_len:
            raise ValueError(
                f"user_vision_size {self.user_vision_size} is below prefill_seq_len {self.prefill_seq_len}: a "
                "chunk can hold that many media tokens; use --user-vision-size >= --prefill-seq-len")

    @property
    def pruning(self) -> VideoPruning:
        return VideoPruning(self.video_pruning_method, self.video_pruning_rate)

    def chunk_seq_len(self, scheduled: int) -> int:
        """The prefill length a chunk of ``scheduled`` tokens is padded to: the shortest the export has."""
        return chunk_seq_len(scheduled, self.prefill_seq_len, self.short_prefill_lens)


def kept_count(family: ModelFamily, media: MediaInput, pruning: VideoPruning) -> int:
    """K for one media item: the method's count rule for a video, every token of an image or an audio item."""
    return pruning.kept_tokens(item_grid(family, media), media.kind)


def encode_media(family: ModelFamily, vision: VisionSession, media: MediaInput, pruning: VideoPruning
                 ) -> EncodedMedia:
    """Encode one item (encoder calls, then its pruning graph once): its K kept rows, their indices, per-frame
    counts."""
    result = vision.encode(media, pruning)
    t, h, w = item_grid(family, media)
    indices = result.kept_indices.astype(np.int64)
    per_frame = evs.tokens_per_frame_kept(indices, t, h * w)
    return EncodedMedia(result.rows, indices, result.extras, tuple(per_frame))


def media_pruning(media: MediaInput, default: VideoPruning) -> VideoPruning:
    """The pruning of one media item: its own (a request's choice), else the engine's ``default``."""
    return default if media.pruning is None else media.pruning


def media_hash(media: MediaInput, pruning: VideoPruning) -> str:
    """Content hash of one media item: what the encoder sees (pixels, grid, kind, pruning method and rate) and
    what its placeholder's ids and positions follow from besides (frame rate and times), so that one hash means
    one encoder output and one prompt segment (row reuse compares media by it, ``row_history``)."""
    digest = hashlib.sha256()
    digest.update(np.ascontiguousarray(media.pixel_values.numpy()).tobytes())
    digest.update(repr((tuple(int(v) for v in media.grid_thw), media.kind, pruning.method, pruning.rate,
                        float(media.fps), tuple(float(t) for t in media.frame_times), media.clip_frames)).encode())
    return digest.hexdigest()


@dataclass
class ExecutorRequest:
    """What the executor keeps of one request between steps."""

    request_id: str
    plan: PromptPlan
    media: Sequence[MediaInput]  # may be empty when every item arrived encoded (``PromptPlan.complete``)
    hashes: tuple[str, ...]  # encoder-output key of each media item
    request: Any = None  # the request as its caller submitted it (a ``ServeRequest``, a vLLM ``Request``)
    cache_row: int | None = None  # KV cache row, fixed by the first prefill chunk
    tokens: list[int] = field(default_factory=list)  # sampled so far
    vision_rows_per_chunk: list[int] = field(default_factory=list)
    prompt_logits: np.ndarray | None = None  # of the chunk that completed the prompt

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.plan.ids)

    def decode_row(self, computed: int) -> DecodeRow:
        """The token at KV slot ``computed`` (the latest sampled one); generated text has t = h = w."""
        generated = computed - self.num_prompt_tokens
        return DecodeRow(self.cache_row, self.tokens[generated], computed, self.plan.decode_start + generated)


class Executor:
    def __init__(self, family: ModelFamily, vision: VisionSession, language: LanguageSession,
                 config: EngineConfig, progress: Callable[[str], None] | None = None):
        self.family = family
        self.vision = vision
        self.language = language
        self.config = config
        self.progress = progress or (lambda message: None)
        self.requests: dict[str, ExecutorRequest] = {}
        self.encoder_outputs: dict[str, EncodedMedia] = {}  # by content hash

    def close(self) -> None:
        """Release the sessions' programs (on QAIC: deactivate and unload them); the executor is done."""
        try:
            close_session(self.vision)
        finally:
            close_session(self.language)

    # -- requests ---------------------------------------------------------------------------------
    def kept_count(self, media: MediaInput) -> int:
        return kept_count(self.family, media, media_pruning(media, self.config.pruning))

    def plan(self, pieces: Sequence[PromptPiece], media: Sequence[MediaInput]) -> PromptPlan:
        """The request's prompt before encoding: provisional placeholders sized by K."""
        return plan_prompt(list(pieces), list(media), [self.kept_count(m) for m in media], self.family)

    def media_hashes(self, media: Sequence[MediaInput]) -> tuple[str, ...]:
        return tuple(media_hash(m, media_pruning(m, self.config.pruning)) for m in media)

    def check_new(self, request_id: str) -> None:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")

    def add(self, request_id: str, plan: PromptPlan, media: Sequence[MediaInput], hashes: Sequence[str],
            request: Any = None, max_new_tokens: int | None = None) -> ExecutorRequest:
        """Take a planned request. Every engine admits its requests here, so this is where a request whose
        M-RoPE positions would pass the export's RoPE tables with ``max_new_tokens`` new tokens is refused, before
        any of its graph calls (``max_new_tokens`` None: a caller that feeds the tokens itself, with no budget)."""
        if max_new_tokens is not None:
            check_rope_range(plan.decode_start, max_new_tokens, self.language.shape.rope_positions)
        self.check_new(request_id)
        if len(hashes) != len(plan.placeholders):
            raise ValueError(f"{len(hashes)} content hashes for {len(plan.placeholders)} media items; give one each")
        state = ExecutorRequest(request_id, plan, list(media), tuple(hashes), request)
        self.requests[request_id] = state
        return state

    def drop(self, request_id: str) -> ExecutorRequest | None:
        """Forget a finished or aborted request (its KV cache row becomes free)."""
        return self.requests.pop(request_id, None)

    def free(self, content_hashes: Iterable[str]) -> None:
        for content_hash in content_hashes:
            self.encoder_outputs.pop(content_hash, None)

    def free_cache_row(self) -> int:
        """The lowest KV cache row no request holds."""
        used = {r.cache_row for r in self.requests.values()}
        rows = self.language.shape.full_batch_size
        row = next((r for r in range(rows) if r not in used), None)
        if row is None:
            raise ValueError(f"more running requests than full_batch_size {rows}; give vLLM max_num_seqs <= "
                             "the export's --full-batch-size")
        return row

    # -- one step ---------------------------------------------------------------------------------
    def encode(self, request_id: str, item: int) -> None:
        """Encode media item ``item`` unless its content hash is cached or the plan already holds it."""
        request = self.requests[request_id]
        content_hash = request.hashes[item]
        if content_hash in self.encoder_outputs or request.plan.encoded[item] is not None:
            return
        media = request.media[item]
        self.encoder_outputs[content_hash] = encode_media(self.family, self.vision, media,
                                                          media_pruning(media, self.config.pruning))
        self.progress(f"encoded {request_id} item {item}: grid {tuple(media.grid_thw)}")

    def prefill(self, request_id: str, computed: int, scheduled: int, cache_row: int | None = None) -> int | None:
        """Run chunk ``[computed, computed+scheduled)`` into the request's cache row (``cache_row``, or the one
        its first chunk took, or the lowest free one); the first token when the chunk completes the prompt."""
        logits = self.prefill_logits(request_id, computed, scheduled, cache_row)
        return None if logits is None else self._sample(self.requests[request_id], logits)

    def prefill_logits(self, request_id: str, computed: int, scheduled: int,
                       cache_row: int | None = None) -> np.ndarray | None:
        """:meth:`prefill` without sampling: the ``(vocab,)`` logits when the chunk completes the prompt
        (the caller samples and reports the token with :meth:`accept`)."""
        cfg, shape = self.config, self.language.shape
        request = self.requests[request_id]
        if cache_row is not None:
            request.cache_row = cache_row
        elif request.cache_row is None:
            request.cache_row = self.free_cache_row()
        self._fill(request, computed, scheduled)
        last = computed + scheduled == request.num_prompt_tokens  # only this chunk's logits are read
        inputs = prefill_step(request.plan, computed, scheduled, cfg.chunk_seq_len(scheduled), cfg.user_vision_size,
                              shape.hidden, shape.extras, cfg.pad_token_id, wants_logits=last)
        request.vision_rows_per_chunk.append(inputs.vision_rows)
        self.progress(f"prefill {request_id} [{computed}, {computed + scheduled}): {inputs.vision_rows} vision rows")
        if shape.full_batch_size == 1:  # one KV cache row: graphs without batch_index address it implicitly
            logits = self.language.run(inputs)
        else:
            logits = self.language.prefill(request.cache_row, inputs)
        if not last:
            return None  # only the chunk that completes the prompt yields a token
        request.prompt_logits = logits
        return logits.reshape(-1)

    def prompt_tail_logits(self, request_id: str, computed: int, cache_row: int | None = None) -> np.ndarray:
        """The ``(vocab,)`` logits of a prompt's last token run as a one-token (decode) call.

        A decode instance of prefill/decode disaggregation runs one-token programs only; the rest of the prompt was
        handed over into the request's KV row (``cache_row``), so its last token is the first call here, at its own
        slot and M-RoPE position (text: t = h = w). A prompt ending inside a media item has no such call: refused."""
        request = self.requests[request_id]
        if cache_row is not None:
            request.cache_row = cache_row
        if computed != request.num_prompt_tokens - 1:
            raise ValueError(f"{request_id}: a one-token call runs the prompt's last token ({request.num_prompt_tokens - 1}"
                             f"), not token {computed}; this instance computes no prompt")
        position = request.plan.positions[:, computed]
        token = int(request.plan.ids[computed])
        if len(set(position.tolist())) != 1 or token in self.family.special_tokens().media_pads:
            raise ValueError(f"{request_id}: the prompt ends inside a media item (token {token} at positions "
                             f"{position.tolist()}); end it with text, as chat templates do")
        row = DecodeRow(request.cache_row, token, computed, int(position[0]))
        if self.language.shape.full_batch_size == 1:
            inputs, _ = decode_batch([row], 1, 1, self.config.pad_token_id)
            logits = self.language.run(inputs)[:, 0]
        else:
            logits = self.language.decode([row], self.config.pad_token_id)
        request.prompt_logits = logits
        return np.asarray(logits).reshape(-1)

    def decode(self, batch: Sequence[tuple[str, int]]) -> dict[str, int]:
        """The next token of each ``(request_id, computed)``, all in one decode batch."""
        return {request_id: self._sample(self.requests[request_id], row)
                for request_id, row in self.decode_logits(batch).items()}

    def decode_logits(self, batch: Sequence[tuple[str, int]]) -> dict[str, np.ndarray]:
        """:meth:`decode` without sampling: each request's ``(vocab,)`` next-token logits."""
        if not batch:
            return {}
        rows = [self.requests[request_id].decode_row(computed) for request_id, computed in batch]
        pad = self.config.pad_token_id
        if self.language.shape.full_batch_size == 1:
            inputs, _ = decode_batch(rows, 1, 1, pad)
            logits = self.language.run(inputs)[:, 0]
        else:
            logits = self.language.decode(rows, pad)
        return {request_id: np.asarray(row).reshape(-1) for (request_id, _), row in zip(batch, logits)}

    def accept(self, request_id: str, token: int) -> None:
        """Record a token sampled for ``request_id`` (the next decode feeds it)."""
        self.requests[request_id].tokens.append(int(token))

    def _fill(self, request: ExecutorRequest, computed: int, scheduled: int) -> None:
        for item in request.plan.items_needing_fill(computed, scheduled):
            encoded = self.encoder_outputs.get(request.hashes[item])
            if encoded is None:
                raise RuntimeError(f"{request.request_id}: media item {item} reached before it was encoded")
            request.plan.fill(item, request.media[item], encoded, self.family)

    def _sample(self, request: ExecutorRequest, logits: np.ndarray) -> int:
        token = int(np.argmax(logits))
        self.accept(request.request_id, token)
        return token
