"""Runs our vision and language sessions on the decisions of vLLM v1's own ``Scheduler``.

vLLM's scheduler decides, each step, how many tokens of which request to run and which media
items to encode; a model runner executes that and reports the sampled tokens back. This module is
that model runner for qeff-evs: per ``SchedulerOutput`` it encodes the scheduled media items (keyed
by the feature's ``identifier``, freed on ``free_encoder_mm_hashes``), runs each prefill chunk
``[num_computed_tokens, +num_scheduled_tokens)`` as one language call into the request's KV cache
row with the window gathered from vLLM's own ``MultiModalFeatureSpec`` s, runs all decodes in one
continuous-batching call, and returns a ``ModelRunnerOutput`` (greedy). A chunk that does not
finish the prompt samples nothing, as in vLLM's GPU runner.

vLLM is imported lazily; only attributes of its objects are read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from qeff_evs.models.protocol import ModelFamily, MediaInput
from qeff_evs.models.graph_io import PAD_POSITION
from qeff_evs.runtime.engine.single_request import EngineConfig, encode_media, retained_count
from qeff_evs.runtime.engine.request import EncodedMedia, PromptPiece, PromptPlan, plan_prompt
from qeff_evs.runtime.engine.serving import media_hash
from qeff_evs.runtime.backends.base import BatchedLanguageSession, DecodeRow, LanguageInputs, VisionSession
from qeff_evs.vllm.adapters import gather_feature_window, to_placeholder_range


@dataclass
class _Live:
    plan: PromptPlan
    media: Sequence[MediaInput]
    request: Any  # vllm.v1.request.Request
    cache_row: int | None = None
    tokens: list[int] = field(default_factory=list)


class VllmDriver:
    """Builds vLLM ``Request`` s for our prompts and executes vLLM ``SchedulerOutput`` s with our sessions."""

    def __init__(self, family: ModelFamily, vision: VisionSession, language: BatchedLanguageSession,
                 config: EngineConfig):
        self.family = family
        self.vision = vision
        self.language = language
        self.config = config
        self.live: dict[str, _Live] = {}
        self.encoded: dict[str, EncodedMedia] = {}  # vLLM's encoder cache, by feature identifier
        self.language.reset()

    # -- requests ---------------------------------------------------------------------------------
    def make_request(self, request_id: str, pieces: Sequence[PromptPiece], media: Sequence[MediaInput],
                     max_new_tokens: int):
        """A vLLM ``Request`` (greedy, EOS ignored) whose features carry our EVS placeholders."""
        from vllm.multimodal.inputs import MultiModalFeatureSpec
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        if request_id in self.live:
            raise ValueError(f"request id {request_id!r} is already in use")
        q = self.config.video_pruning_rate
        plan = plan_prompt(list(pieces), list(media), [retained_count(self.family, m, q) for m in media],
                           self.family)
        features = [MultiModalFeatureSpec(data=None, modality="video", identifier=media_hash(m, q),
                                          mm_position=to_placeholder_range(ph))
                    for m, ph in zip(media, plan.placeholders)]
        request = Request(request_id=request_id, prompt_token_ids=plan.ids.tolist(),
                          sampling_params=SamplingParams(max_tokens=max_new_tokens, temperature=0.0,
                                                         ignore_eos=True),
                          pooling_params=None, mm_features=features or None)
        self.live[request_id] = _Live(plan, list(media), request)
        return request

    # -- one step ---------------------------------------------------------------------------------
    def execute(self, out: Any):
        """Run one vLLM ``SchedulerOutput``; the ``ModelRunnerOutput`` for ``update_from_output``."""
        from vllm.v1.outputs import ModelRunnerOutput

        for request_id in out.finished_req_ids:
            self.live.pop(request_id, None)
        for identifier in out.free_encoder_mm_hashes:
            self.encoded.pop(identifier, None)
        computed = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        for request_id, items in out.scheduled_encoder_inputs.items():
            self._encode(request_id, items)
        sampled: dict[str, list[int]] = {}
        decodes = []
        for request_id, scheduled in out.num_scheduled_tokens.items():
            live = self.live[request_id]
            if live.cache_row is None:
                live.cache_row = self._free_row()
            start = computed[request_id]
            if start >= len(live.plan.ids):
                if scheduled != 1:
                    raise ValueError(f"{request_id}: {scheduled} decode tokens scheduled; speculative decoding "
                                     "is not supported, schedule one token per decode")
                decodes.append((request_id, start))
            else:
                sampled[request_id] = self._prefill(live, start, scheduled)
        sampled.update(self._decode(decodes))
        for request_id, tokens in sampled.items():
            self.live[request_id].tokens.extend(tokens)
        req_ids = list(out.num_scheduled_tokens)
        return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                 sampled_token_ids=[sampled[r] for r in req_ids])

    def _free_row(self) -> int:
        used = {lv.cache_row for lv in self.live.values()}
        for row in range(self.language.shape.full_batch_size):
            if row not in used:
                return row
        raise ValueError(f"more running requests than full_batch_size {self.language.shape.full_batch_size}; "
                         "give vLLM max_num_seqs <= the export's --full-batch-size")

    def _encode(self, request_id: str, items: Sequence[int]) -> None:
        live = self.live[request_id]
        for item in items:
            identifier = str(live.request.mm_features[item].identifier)
            if identifier not in self.encoded:
                self.encoded[identifier] = encode_media(self.family, self.vision, live.media[item],
                                                        self.config.video_pruning_rate)

    def _prefill(self, live: _Live, computed: int, scheduled: int) -> list[int]:
        cfg, shape = self.config, self.language.shape
        if scheduled > cfg.prefill_seq_len:
            raise ValueError(f"vLLM scheduled {scheduled} tokens in one chunk but prefill_seq_len is "
                             f"{cfg.prefill_seq_len}; set max_num_batched_tokens <= prefill_seq_len")
        features = live.request.mm_features or []
        for item in live.plan.items_needing_fill(computed, scheduled):
            live.plan.fill(item, live.media[item], self.encoded[str(features[item].identifier)], self.family)
        rows = {k: v.rows for k, v in self.encoded.items()}
        deepstack = {k: v.deepstack for k, v in self.encoded.items() if v.deepstack is not None}
        window = gather_feature_window(features, rows, computed, scheduled, cfg.user_vision_size, shape.hidden,
                                       shape.deepstack_levels, deepstack)
        ids = np.full((1, cfg.prefill_seq_len), cfg.pad_token_id, dtype=np.int64)
        ids[0, :scheduled] = live.plan.ids[computed:computed + scheduled]
        position_ids = np.full((4, 1, cfg.prefill_seq_len), PAD_POSITION, dtype=np.int64)
        position_ids[0, 0, :scheduled] = np.arange(computed, computed + scheduled)
        position_ids[1:, 0, :scheduled] = live.plan.positions[:, computed:computed + scheduled]
        step = LanguageInputs(ids, position_ids, window.vision_embeds, window.deepstack, window.image_idx,
                            window.num_rows)
        logits = self.language.prefill(live.cache_row, step)
        # Only the chunk that completes the prompt yields a token.
        return [int(np.argmax(logits.reshape(-1)))] if computed + scheduled == len(live.plan.ids) else []

    def _decode(self, decodes: Sequence[tuple[str, int]]) -> dict[str, list[int]]:
        if not decodes:
            return {}
        rows = []
        for request_id, computed in decodes:
            live = self.live[request_id]
            token = live.tokens[computed - len(live.plan.ids)]
            rows.append(DecodeRow(live.cache_row, token, computed,
                                  live.plan.decode_start + computed - len(live.plan.ids)))
        logits = self.language.decode(rows, self.config.pad_token_id)
        return {request_id: [int(np.argmax(row))] for (request_id, _), row in zip(decodes, logits)}
