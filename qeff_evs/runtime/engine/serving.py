"""The serving engine: many requests at once, the way a vLLM v1 deployment on AI 100 runs them.

Per step the scheduler hands out decode tokens first, then prefill chunks (one language-graph call
per chunk, batch 1, into the request's KV cache row), plus the media items to encode. Encoder outputs
are cached by content hash and dropped when every holder has passed them; each prefill chunk gets
only its own window of kept rows. All running requests decode together in one call
(continuous batching). Greedy sampling. Our ``Scheduler`` decides; the shared ``Executor`` runs.

Row reuse (docs/serving.md#conversations-row-reuse; on unless ``SchedulerConfig.row_reuse`` is off): a
request placed in a row that holds its first ``p`` tokens starts its prefill at ``p``; the row's keys and values
(and, for a graph whose rows cannot be rewound, its layer state) are left as the earlier request wrote them, since
no backend clears a row per request.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from qeff_evs.models.protocol import ModelFamily, MediaInput
from qeff_evs.runtime.backends.base import LanguageSession, VisionSession
from qeff_evs.runtime.engine.executor import EngineConfig, Executor, ExecutorRequest, media_pruning
from qeff_evs.runtime.engine.request import EncodedMedia, PromptPiece, PromptPlan
from qeff_evs.runtime.engine.scheduler import (
    FinishReason,
    MediaPlacement,
    RequestSpec,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)


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
    num_cached_tokens: int = 0  # prompt tokens the request's KV row held already (row reuse; vLLM's name)
    num_prompt_tokens: int = 0  # the request's prompt length


class ServingEngine:
    """Add requests, step, stream tokens, abort: the API a server embeds. Our ``Scheduler`` + the executor."""

    def __init__(self, family: ModelFamily, vision: VisionSession, language: LanguageSession,
                 config: EngineConfig, scheduler: SchedulerConfig, eos_ids: Sequence[int] = (),
                 progress: Callable[[str], None] | None = None):
        shape = language.shape
        if scheduler.max_num_seqs > shape.full_batch_size:
            raise ValueError(
                f"max_num_seqs {scheduler.max_num_seqs} exceeds the language graph's full_batch_size "
                f"{shape.full_batch_size}; export with --full-batch-size >= {scheduler.max_num_seqs}")
        if scheduler.prefill_seq_len != config.prefill_seq_len or scheduler.ctx_len != config.ctx_len:
            raise ValueError("scheduler and engine disagree on prefill_seq_len / ctx_len")
        self.config = config
        # Linear-attention state sums every token of the row: it cannot be cut back to a shorter prefix.
        self.scheduler = Scheduler(scheduler, rewindable_rows=not shape.layer_states)
        self.executor = Executor(family, vision, language, config, progress)
        self.eos_ids = frozenset(int(t) for t in eos_ids)

    @property
    def live(self) -> dict[str, ExecutorRequest]:
        """Queued and running requests, by id (``.request`` is the ``ServeRequest``)."""
        return self.executor.requests

    @property
    def encoder_outputs(self) -> dict[str, EncodedMedia]:
        """Encoder outputs kept now, by content hash."""
        return self.executor.encoder_outputs

    # -- requests ---------------------------------------------------------------------------------
    def kept_count(self, media: MediaInput) -> int:
        return self.executor.kept_count(media)

    def add_request(self, request: ServeRequest) -> None:
        """Queue a request; a request that can never run raises ValueError and leaves the others alone."""
        plan = self.executor.plan(request.pieces, request.media)
        self.add_planned(request.request_id, plan, request.media, self.executor.media_hashes(request.media),
                         request.max_new_tokens, frozenset(request.stop_token_ids), request=request)

    def add_planned(self, request_id: str, plan: PromptPlan, media: Sequence[MediaInput], hashes: Sequence[str],
                    max_new_tokens: int, stop_token_ids: frozenset[int] = frozenset(),
                    chunk_ends: tuple[int, ...] = (), request: Any = None) -> ExecutorRequest:
        """Queue a request whose prompt is planned (items may be encoded already); its executor record."""
        self.executor.check_new(request_id)
        prunings = [self._pruning(m) for m in media] if media else [None] * len(hashes)
        items = tuple(MediaPlacement(h, ph, pruning) for h, ph, pruning in zip(hashes, plan.placeholders, prunings))
        self.scheduler.add_request(RequestSpec(
            request_id, len(plan.ids), items, max_new_tokens, eos_token_ids=self.eos_ids,
            stop_token_ids=stop_token_ids, chunk_ends=chunk_ends, token_ids=tuple(plan.ids.tolist())))
        try:  # after the scheduler's own checks, so a prompt too long for ctx_len is reported as such
            return self.executor.add(request_id, plan, media, hashes, request, max_new_tokens=max_new_tokens)
        except ValueError:
            self.scheduler.abort_request(request_id)
            raise

    def _pruning(self, media: MediaInput):
        return None if media.kind == "image" else media_pruning(media, self.config.pruning)

    def abort(self, request_id: str) -> None:
        self.scheduler.abort_request(request_id)
        self.executor.drop(request_id)
        self._free_when_idle()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def close(self) -> None:
        """Release the sessions' programs (QAIC); call once, when the engine stops serving."""
        self.executor.close()

    # -- one step ---------------------------------------------------------------------------------
    def step(self) -> list[TokenEvent]:
        out = self.scheduler.schedule()
        self.executor.free(out.free_encoder_hashes)
        for item in out.encoder_inputs:
            self.executor.encode(item.request_id, item.item)
        sampled = self._prefill(out)
        sampled.update(self.executor.decode([(d.request_id, d.computed) for d in out.decodes]))
        finished = {f.request_id: f for f in self.scheduler.update_from_output(out, sampled)}
        cached = {rid: f.num_cached_tokens for rid, f in finished.items()}
        cached.update({rid: self.scheduler.num_cached_tokens(rid) for rid in sampled if rid not in finished})
        prompt_lengths = {rid: self.executor.requests[rid].num_prompt_tokens for rid in sampled}
        for request_id in finished:
            self.executor.drop(request_id)
        self._free_when_idle()
        return [TokenEvent(rid, token, finished[rid].reason if rid in finished else None, cached[rid],
                           prompt_lengths[rid]) for rid, token in sampled.items()]

    def _free_when_idle(self) -> None:
        # Released encoder outputs are freed by the next step's schedule(); with no request left
        # there is no next step, so take an empty one now rather than keep the rows.
        if not self.has_unfinished():
            self.executor.free(self.scheduler.schedule().free_encoder_hashes)

    def _prefill(self, out: SchedulerOutput) -> dict[str, int]:
        sampled = {}
        for chunk in out.prefills:
            token = self.executor.prefill(chunk.request_id, chunk.computed, chunk.scheduled, chunk.cache_row)
            if chunk.samples:
                sampled[chunk.request_id] = token
        return sampled

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
