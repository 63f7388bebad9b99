"""Runs our vision and language sessions on the decisions of vLLM v1's own ``Scheduler``.

vLLM's scheduler decides, each step, how many tokens of which request to run and which media
items to encode; a model runner executes that and reports the sampled tokens back. This module is
that model runner for qeff-evs: it translates each ``SchedulerOutput`` onto the executor every engine
shares (``qeff_evs.runtime.engine.executor``): encode the scheduled media items (keyed by the
feature's ``identifier``, freed on ``free_encoder_mm_hashes``), run each prefill chunk
``[num_computed_tokens, +num_scheduled_tokens)`` into the request's KV cache row, in calls of at most
``prefill_seq_len`` tokens each with the window of its placeholders, and run all decodes in one
continuous-batching call. :meth:`VllmDriver.step` returns the logits of each request whose step
yields a token (a chunk that does not finish the prompt yields none, as in vLLM's GPU runner); the
caller samples and reports back with :meth:`VllmDriver.accept` (the plugin's worker, with vLLM's
sampler), or :meth:`VllmDriver.execute` picks greedily and returns the ``ModelRunnerOutput``.
Requests come in through :meth:`VllmDriver.make_request` (our prompts) or :meth:`VllmDriver.admit`
(a plan for a request vLLM's frontend made).

vLLM is imported lazily; only attributes of its objects are read.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from qeff_evs.models.protocol import ModelFamily, MediaInput
from qeff_evs.runtime.backends.base import LanguageSession, VisionSession
from qeff_evs.runtime.engine.executor import EngineConfig, Executor, ExecutorRequest
from qeff_evs.runtime.engine.request import PromptPiece, PromptPlan
from qeff_evs.vllm.processing.adapters import to_placeholder_range


class VllmDriver:
    """Builds vLLM ``Request`` s for our prompts and executes vLLM ``SchedulerOutput`` s with our sessions."""

    def __init__(self, family: ModelFamily, vision: VisionSession, language: LanguageSession,
                 config: EngineConfig):
        self.config = config
        self.executor = Executor(family, vision, language, config)
        # Prefill/decode disaggregation (kv_connector/worker.py). A prefill instance: request id -> the token count after which
        # its row is handed over (one call ends there), and what is called then with (request id, count).
        self.handover_at: dict[str, int] = {}
        self.on_handover = None
        # A decode instance runs one-token programs only: a prompt's last token (the rest was handed over) is one.
        self.decode_only = False

    @property
    def live(self) -> dict[str, ExecutorRequest]:
        """Requests made and not finished, by id (``.request`` is the vLLM ``Request``)."""
        return self.executor.requests

    # -- requests ---------------------------------------------------------------------------------
    def make_request(self, request_id: str, pieces: Sequence[PromptPiece], media: Sequence[MediaInput],
                     max_new_tokens: int):
        """A vLLM ``Request`` (greedy, EOS ignored) whose features carry our EVS placeholders."""
        from qeff_evs.vllm.surface import MultiModalFeatureSpec
        from qeff_evs.vllm.surface import SamplingParams
        from qeff_evs.vllm.surface import Request

        self.executor.check_new(request_id)
        plan = self.plan(pieces, media)
        features = [MultiModalFeatureSpec(data=None, modality=m.kind, identifier=content_hash,
                                          mm_position=to_placeholder_range(ph))
                    for m, content_hash, ph in zip(media, self.executor.media_hashes(media), plan.placeholders)]
        request = Request(request_id=request_id, prompt_token_ids=plan.ids.tolist(),
                          sampling_params=SamplingParams(max_tokens=max_new_tokens, temperature=0.0,
                                                         ignore_eos=True),
                          pooling_params=None, mm_features=features or None)
        self.admit(request_id, plan, media, features, request, max_new_tokens=max_new_tokens)
        return request

    def plan(self, pieces: Sequence[PromptPiece], media: Sequence[MediaInput]) -> PromptPlan:
        """A request's prompt plan (provisional ids, text positions, EVS placeholders)."""
        return self.executor.plan(pieces, media)

    def admit(self, request_id: str, plan: PromptPlan, media: Sequence[MediaInput], features: Sequence[Any],
              request: Any = None, *, max_new_tokens: int, row: int | None = None) -> None:
        """Take a request before its first step; ``features``: its vLLM ``MultiModalFeatureSpec`` s, in plan order;
        refused (``Executor.add``) when ``max_new_tokens`` would take its positions past the RoPE tables. ``row``:
        its KV row (the scheduler's choice), else the lowest free one at its first chunk."""
        state = self.executor.add(request_id, plan, media, [str(f.identifier) for f in features], request,
                                  max_new_tokens=max_new_tokens)
        state.cache_row = row

    def finish(self, request_id: str) -> None:
        """Forget a finished or aborted request: its KV row is free for the next one."""
        self.executor.drop(request_id)

    def accept(self, request_id: str, tokens: Sequence[int]) -> None:
        """The tokens sampled for ``request_id`` from :meth:`step`'s logits (the next decode feeds the last)."""
        for token in tokens:
            self.executor.accept(request_id, token)

    # -- one step ---------------------------------------------------------------------------------
    def execute(self, out: Any):
        """Run one vLLM ``SchedulerOutput``, greedily; the ``ModelRunnerOutput`` for ``update_from_output``."""
        from qeff_evs.vllm.surface import ModelRunnerOutput

        sampled = {request_id: [int(np.argmax(row))] for request_id, row in self.step(out).items()}
        for request_id, tokens in sampled.items():
            self.accept(request_id, tokens)
        req_ids = list(out.num_scheduled_tokens)
        return ModelRunnerOutput(req_ids=req_ids,
                                 sampled_token_ids=[sampled.get(r, []) for r in req_ids])

    def step(self, out: Any, failed: dict[str, str] | None = None) -> dict[str, np.ndarray]:
        """Run one vLLM ``SchedulerOutput``: the ``(vocab,)`` logits of each request whose step yields a token.

        ``failed``: when given, a request whose work raises is recorded there (id -> reason) and dropped, and
        the step goes on for the others; requests already in it are skipped (the plugin's worker, whose
        scheduler then finishes them with an error). Without it, the error propagates.
        """
        for request_id in out.finished_req_ids:
            self.finish(request_id)
        self.executor.free(out.free_encoder_mm_hashes)
        computed = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        skip = {} if failed is None else failed  # grows as requests fail: later work skips them
        for request_id, items in out.scheduled_encoder_inputs.items():
            for item in items:
                if request_id not in skip:
                    self._guard([request_id], failed, lambda: self.executor.encode(request_id, item))
        logits: dict[str, np.ndarray] = {}
        decodes = []
        for request_id, scheduled in out.num_scheduled_tokens.items():
            if request_id in skip:
                continue
            start = computed[request_id]
            if start >= self.live[request_id].num_prompt_tokens:
                if scheduled != 1:
                    raise ValueError(f"{request_id}: {scheduled} decode tokens scheduled; speculative decoding "
                                     "is not supported, schedule one token per decode")
                decodes.append((request_id, start))
                continue
            row = self._guard([request_id], failed, lambda: self._prefill(request_id, start, scheduled))
            if row is not None:
                logits[request_id] = row
        logits.update(self._guard([r for r, _ in decodes], failed, lambda: self.executor.decode_logits(decodes))
                      or {})
        return logits

    def _guard(self, request_ids: Sequence[str], failed: dict[str, str] | None, work):
        """``work()``; with ``failed``, an exception fails ``request_ids`` (recorded, dropped) instead of the step."""
        if failed is None:
            return work()
        try:
            return work()
        except Exception as error:  # noqa: BLE001 - any error of one request must not stop the others
            for request_id in request_ids:
                failed[request_id] = f"{type(error).__name__}: {error}"
                self.finish(request_id)
            return None

    def _prefill(self, request_id: str, computed: int, scheduled: int) -> np.ndarray | None:
        """vLLM's chunk in calls of at most prefill_seq_len tokens, each gathering its own window.

        vLLM may schedule more of one request than the graph's chunk (long_prefill_token_threshold
        is lifted while a request runs alone); any cut gives the same result, since each call
        gathers exactly its window and positions belong to the request. A request whose row is handed over
        (``handover_at``) has one more cut, where the hand-over is taken.
        """
        if self.decode_only:
            return self.executor.prompt_tail_logits(request_id, computed)
        end, step = computed + scheduled, self.config.prefill_seq_len
        bounds = [*range(computed, end, step), end]
        cut = self.handover_at.get(request_id)
        if cut is not None and computed < cut < end and cut not in bounds:
            bounds = sorted([*bounds, cut])
        if cut == computed:  # the row holds the hand-over's tokens already (the last step ended there, or reuse)
            self._hand_over(request_id)
        logits = None
        for start, stop in zip(bounds, bounds[1:]):
            logits = self.executor.prefill_logits(request_id, start, stop - start)
            if stop == cut:
                self._hand_over(request_id)
        return logits

    def _hand_over(self, request_id: str) -> None:
        self.on_handover(request_id, self.handover_at.pop(request_id))
