"""The serving engine: many requests at once, the way a vLLM v1 deployment on AI 100 runs them.

Per step the scheduler hands out decode tokens first, then prefill chunks (one language-graph call
per chunk, batch 1, into the request's KV cache row), plus the media items to encode. Encoder outputs
are cached by content hash and dropped when every holder has passed them; each prefill chunk gets
only its own window of retained rows. All running requests decode together in one call
(continuous batching). Greedy sampling.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from qeff_evs.models.protocol import ModelFamily, MediaInput
from qeff_evs.runtime.engine.steps import prefill_step
from qeff_evs.runtime.engine.single_request import EngineConfig, encode_media, retained_count
from qeff_evs.runtime.engine.request import EncodedMedia, PromptPiece, PromptPlan, plan_prompt
from qeff_evs.runtime.engine.scheduler import (
    FinishReason,
    MediaItem,
    RequestSpec,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)
from qeff_evs.runtime.backends.base import BatchedLanguageSession, DecodeRow, VisionSession


@dataclass(frozen=True)
class ServeRequest:
    request_id: str
    pieces: Sequence[PromptPiece]
    media: Sequence[MediaInput] = ()
    max_new_tokens: int = 16
    stop_token_ids: frozenset[int] = frozenset()


@dataclass(frozen=True)
class TokenEvent:
    request_id: str
    token_id: int
    finish_reason: FinishReason | None = None


@dataclass
class _Live:
    request: ServeRequest
    plan: PromptPlan
    hashes: tuple[str, ...]
    tokens: list[int] = field(default_factory=list)


def media_hash(media: MediaInput, q: float) -> str:
    """Content hash of one media item as the encoder sees it (pixels, grid, kind, pruning rate)."""
    digest = hashlib.sha256()
    digest.update(np.ascontiguousarray(media.pixel_values.numpy()).tobytes())
    digest.update(repr((tuple(int(v) for v in media.grid_thw), media.kind, float(q))).encode())
    return digest.hexdigest()


class ServingEngine:
    """Add requests, step, stream tokens, abort: the API a server embeds."""

    def __init__(self, family: ModelFamily, vision: VisionSession, language: BatchedLanguageSession,
                 config: EngineConfig, scheduler: SchedulerConfig, eos_ids: Sequence[int] = (),
                 progress: Callable[[str], None] | None = None):
        shape = language.shape
        if scheduler.max_num_seqs > shape.full_batch_size:
            raise ValueError(
                f"max_num_seqs {scheduler.max_num_seqs} exceeds the language graph's full_batch_size "
                f"{shape.full_batch_size}; export with --full-batch-size >= {scheduler.max_num_seqs}")
        if scheduler.prefill_seq_len != config.prefill_seq_len or scheduler.ctx_len != config.ctx_len:
            raise ValueError("scheduler and engine disagree on prefill_seq_len / ctx_len")
        self.family = family
        self.vision = vision
        self.language = language
        self.config = config
        self.scheduler = Scheduler(scheduler)
        self.eos_ids = frozenset(int(t) for t in eos_ids)
        self.progress = progress or (lambda message: None)
        self.encoder_outputs: dict[str, EncodedMedia] = {}
        self.live: dict[str, _Live] = {}
        self.language.reset()

    # -- requests ---------------------------------------------------------------------------------
    def retained_count(self, media: MediaInput) -> int:
        return retained_count(self.family, media, self.config.video_pruning_rate)

    def add_request(self, request: ServeRequest) -> None:
        """Queue a request; a request that can never run raises ValueError and leaves the others alone."""
        if request.request_id in self.live:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        plan = plan_prompt(list(request.pieces), list(request.media),
                           [self.retained_count(m) for m in request.media], self.family)
        hashes = tuple(media_hash(m, self.config.video_pruning_rate) for m in request.media)
        items = tuple(MediaItem(h, ph) for h, ph in zip(hashes, plan.placeholders))
        self.scheduler.add_request(RequestSpec(
            request.request_id, len(plan.ids), items, request.max_new_tokens,
            eos_token_ids=self.eos_ids, stop_token_ids=frozenset(request.stop_token_ids)))
        self.live[request.request_id] = _Live(request, plan, hashes)

    def abort(self, request_id: str) -> None:
        self.scheduler.abort_request(request_id)
        self.live.pop(request_id, None)
        self._free_when_idle()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # -- one step ---------------------------------------------------------------------------------
    def step(self) -> list[TokenEvent]:
        out = self.scheduler.schedule()
        for content_hash in out.free_encoder_hashes:
            self.encoder_outputs.pop(content_hash, None)
        self._encode(out)
        sampled = self._prefill(out)
        sampled.update(self._decode(out))
        finished = {f.request_id: f.reason for f in self.scheduler.update_from_output(out, sampled)}
        for request_id in finished:
            self.live.pop(request_id, None)
        self._free_when_idle()
        return [TokenEvent(rid, token, finished.get(rid)) for rid, token in sampled.items()]

    def _free_when_idle(self) -> None:
        # Released encoder outputs are freed by the next step's schedule(); with no request left
        # there is no next step, so take an empty one now rather than keep the rows.
        if not self.has_unfinished():
            for content_hash in self.scheduler.schedule().free_encoder_hashes:
                self.encoder_outputs.pop(content_hash, None)

    def _encode(self, out: SchedulerOutput) -> None:
        for item in out.encoder_inputs:
            if item.content_hash in self.encoder_outputs:
                continue
            media = self.live[item.request_id].request.media[item.item]
            self.encoder_outputs[item.content_hash] = encode_media(
                self.family, self.vision, media, self.config.video_pruning_rate)
            self.progress(f"encoded {item.request_id} item {item.item}: grid {tuple(media.grid_thw)}")

    def _fill(self, live: _Live, computed: int, scheduled: int) -> None:
        for item in live.plan.items_needing_fill(computed, scheduled):
            encoded = self.encoder_outputs.get(live.hashes[item])
            if encoded is None:
                raise RuntimeError(f"{live.request.request_id}: media item {item} reached before it was encoded")
            live.plan.fill(item, live.request.media[item], encoded, self.family)

    def _prefill(self, out: SchedulerOutput) -> dict[str, int]:
        cfg, shape = self.config, self.language.shape
        sampled = {}
        for chunk in out.prefills:
            live = self.live[chunk.request_id]
            self._fill(live, chunk.computed, chunk.scheduled)
            step = prefill_step(live.plan, chunk.computed, chunk.scheduled, cfg.prefill_seq_len,
                                cfg.user_vision_size, shape.hidden, shape.deepstack_levels, cfg.pad_token_id)
            logits = self.language.prefill(chunk.slot, step)
            if chunk.samples:
                sampled[chunk.request_id] = int(np.argmax(logits.reshape(-1)))
        return sampled

    def _decode(self, out: SchedulerOutput) -> dict[str, int]:
        if not out.decodes:
            return {}
        rows = []
        for d in out.decodes:
            plan = self.live[d.request_id].plan
            rows.append(DecodeRow(d.slot, d.token_id, d.computed, plan.decode_start + d.computed - len(plan.ids)))
        logits = self.language.decode(rows, self.config.pad_token_id)
        return {d.request_id: int(np.argmax(row)) for d, row in zip(out.decodes, logits)}

    # -- convenience ------------------------------------------------------------------------------
    def run_to_completion(self, max_steps: int = 1_000_000) -> dict[str, list[int]]:
        """Step until every request finished; the generated ids per request (aborted ones excluded)."""
        outputs: dict[str, list[int]] = {}
        for _ in range(max_steps):
            if not self.has_unfinished():
                return outputs
            for event in self.step():
                outputs.setdefault(event.request_id, []).append(event.token_id)
        raise RuntimeError(f"requests still unfinished after {max_steps} steps")
