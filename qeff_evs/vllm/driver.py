"""Runs our vision and language sessions on the decisions of vLLM v1's own ``Scheduler``.

vLLM's scheduler decides, each step, how many tokens of which request to run and which media
items to encode; a model runner executes that and reports the sampled tokens back. This module is
that model runner for qeff-evs: it translates each ``SchedulerOutput`` onto the executor every engine
shares (``qeff_evs.runtime.engine.executor``): encode the scheduled media items (keyed by the
feature's ``identifier``, freed on ``free_encoder_mm_hashes``), run each prefill chunk
``[num_computed_tokens, +num_scheduled_tokens)`` as one language call into the request's KV cache
row with the window of its placeholders (the features' ``mm_position`` s), run all decodes in one
continuous-batching call, and return a ``ModelRunnerOutput`` (greedy). A chunk that does not
finish the prompt samples nothing, as in vLLM's GPU runner.

vLLM is imported lazily; only attributes of its objects are read.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from qeff_evs.models.protocol import ModelFamily, MediaInput
from qeff_evs.positions import check_rope_range
from qeff_evs.runtime.backends.base import LanguageSession, VisionSession
from qeff_evs.runtime.engine.executor import EngineConfig, Executor, ExecutorRequest
from qeff_evs.runtime.engine.request import PromptPiece
from qeff_evs.vllm.adapters import to_placeholder_range


class VllmDriver:
    """Builds vLLM ``Request`` s for our prompts and executes vLLM ``SchedulerOutput`` s with our sessions."""

    def __init__(self, family: ModelFamily, vision: VisionSession, language: LanguageSession,
                 config: EngineConfig):
        self.config = config
        self.executor = Executor(family, vision, language, config)

    @property
    def live(self) -> dict[str, ExecutorRequest]:
        """Requests made and not finished, by id (``.request`` is the vLLM ``Request``)."""
        return self.executor.requests

    # -- requests ---------------------------------------------------------------------------------
    def make_request(self, request_id: str, pieces: Sequence[PromptPiece], media: Sequence[MediaInput],
                     max_new_tokens: int):
        """A vLLM ``Request`` (greedy, EOS ignored) whose features carry our EVS placeholders."""
        from vllm.multimodal.inputs import MultiModalFeatureSpec
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        self.executor.check_new(request_id)
        plan = self.executor.plan(pieces, media)
        check_rope_range(plan.decode_start, max_new_tokens, self.executor.language.shape.rope_positions)
        features = [MultiModalFeatureSpec(data=None, modality="video", identifier=content_hash,
                                          mm_position=to_placeholder_range(ph))
                    for content_hash, ph in zip(self.executor.media_hashes(media), plan.placeholders)]
        request = Request(request_id=request_id, prompt_token_ids=plan.ids.tolist(),
                          sampling_params=SamplingParams(max_tokens=max_new_tokens, temperature=0.0,
                                                         ignore_eos=True),
                          pooling_params=None, mm_features=features or None)
        self.executor.add(request_id, plan, media, [str(f.identifier) for f in features], request)
        return request

    # -- one step ---------------------------------------------------------------------------------
    def execute(self, out: Any):
        """Run one vLLM ``SchedulerOutput``; the ``ModelRunnerOutput`` for ``update_from_output``."""
        from vllm.v1.outputs import ModelRunnerOutput

        for request_id in out.finished_req_ids:
            self.executor.drop(request_id)
        self.executor.free(out.free_encoder_mm_hashes)
        computed = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        for request_id, items in out.scheduled_encoder_inputs.items():
            for item in items:
                self.executor.encode(request_id, item)
        sampled: dict[str, list[int]] = {}
        decodes = []
        for request_id, scheduled in out.num_scheduled_tokens.items():
            start = computed[request_id]
            if start >= self.live[request_id].num_prompt_tokens:
                if scheduled != 1:
                    raise ValueError(f"{request_id}: {scheduled} decode tokens scheduled; speculative decoding "
                                     "is not supported, schedule one token per decode")
                decodes.append((request_id, start))
                continue
            if scheduled > self.config.prefill_seq_len:
                raise ValueError(f"vLLM scheduled {scheduled} tokens in one chunk but prefill_seq_len is "
                                 f"{self.config.prefill_seq_len}; set max_num_batched_tokens <= prefill_seq_len")
            token = self.executor.prefill(request_id, start, scheduled)
            sampled[request_id] = [] if token is None else [token]
        sampled.update({request_id: [token] for request_id, token in self.executor.decode(decodes).items()})
        req_ids = list(out.num_scheduled_tokens)
        return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                 sampled_token_ids=[sampled[r] for r in req_ids])
