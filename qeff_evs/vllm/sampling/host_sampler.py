"""Sampling on the host with vLLM 0.34's semantics, from the ``(vocab,)`` logits the language graph returns.

vLLM 0.34 has one model runner (V2) and samples inside it, on the GPU; an out-of-tree worker that runs its own graphs
samples itself (docs/design.md: the supported vLLM). :class:`HostSampler` keeps each running request's sampling state (its parameters, seed,
prompt and output ids, a slot for custom logits processors) in step with vLLM's ``SchedulerOutput`` and applies, per
step, what vLLM's V2 sampler applies, in its order: the structured-output grammar bitmask, allowed ids, logit bias
and min_tokens, penalties, bad words, custom logits processors (vLLM 0.34's interface), the thinking budget,
temperature, min-p, top-k/top-p, then the draw: greedy, or Gumbel-max with vLLM's stateless seeded noise
(:mod:`gumbel`). Logprobs follow ``--logprobs-mode``.

Every request scheduled in a step gets a row; a row whose step yields no token (a prefill chunk that does not finish
its prompt) is sampled on zeros and discarded: the noise is a function of (seed, position, token), so nothing is
consumed by it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from qeff_evs.vllm.engine.scheduler import RunnerOutput
from qeff_evs.vllm.sampling import rules
from qeff_evs.vllm.sampling.gumbel import gumbel_argmax
from qeff_evs.vllm.sampling.logprobs import logprobs_of
from qeff_evs.vllm.sampling.thinking import FORCED_LOGIT, ThinkingMarkers, ThinkingScan

CPU = torch.device("cpu")
INT64 = np.iinfo(np.int64)
PROCESSED_MODES = ("processed_logits", "processed_logprobs")


@dataclass
class RequestSampling:
    """What one running request samples with: its parameters and seed, its token ids, its processor slot."""

    params: object  # vLLM's SamplingParams
    seed: int
    prompt_ids: list[int]
    slot: int
    output_ids: list[int] = field(default_factory=list)
    thinking: ThinkingScan | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)


def request_seed(params) -> int:
    """The request's seed, or, unseeded, a draw from numpy's generator (which ``--seed`` seeds), as vLLM 0.34."""
    return int(params.seed) if params.seed is not None else int(np.random.randint(INT64.min, INT64.max))


class ProcessorState:
    """What vLLM 0.34 shares with custom logits processors (``LogitsProcRequestState``): per slot, the committed
    token ids and the prompt, prefill and total lengths, as CPU tensors (as vLLM's CPU model runner holds them)."""

    def __init__(self, max_num_reqs: int, max_model_len: int, vocab_size: int):
        self.device = CPU
        self.max_num_reqs = max_num_reqs
        self.vocab_size = vocab_size
        self.all_token_ids = torch.zeros((max_num_reqs, max_model_len), dtype=torch.int32)
        self.prompt_len = torch.zeros(max_num_reqs, dtype=torch.int32)
        self.prefill_len = torch.zeros(max_num_reqs, dtype=torch.int32)
        self.total_len = torch.zeros(max_num_reqs, dtype=torch.int32)
        # vLLM's CPU runner also gives the lengths as numpy views
        self.prompt_len_np = self.prompt_len.numpy()
        self.prefill_len_np = self.prefill_len.numpy()

    def start(self, slot: int, prompt_ids: list[int]) -> None:
        n = len(prompt_ids)
        self.all_token_ids[slot, :n] = torch.tensor(prompt_ids, dtype=torch.int32)
        self.prompt_len[slot] = self.prefill_len[slot] = self.total_len[slot] = n

    def append(self, slot: int, token: int) -> None:
        end = int(self.total_len[slot])
        self.all_token_ids[slot, end] = token
        self.total_len[slot] = end + 1


class HostSampler:
    def __init__(self, vllm_config, vocab_size: int):
        from qeff_evs.vllm.surface import LogitsContext, build_custom_logits_processors

        scheduler, model = vllm_config.scheduler_config, vllm_config.model_config
        self.vocab_size = vocab_size
        self.logprobs_mode = model.logprobs_mode
        self.markers = ThinkingMarkers.from_config(vllm_config.reasoning_config)
        self.state = ProcessorState(scheduler.max_num_seqs, model.max_model_len, vocab_size)
        # --logits-processors (and installed plugins), loaded and built as vLLM 0.34's runner builds them
        self.custom = build_custom_logits_processors(vllm_config, self.state, False,
                                                     tuple(model.logits_processors or ()))
        self._context = LogitsContext
        self.requests: dict[str, RequestSampling] = {}
        self._free_slots = list(range(scheduler.max_num_seqs))

    # -- the batch ------------------------------------------------------------------------------------------
    def update(self, out) -> None:
        """Bring the request states in line with one ``SchedulerOutput``."""
        for request_id in (*out.finished_req_ids, *(getattr(out, "preempted_req_ids", None) or ())):
            self.drop(request_id)
        for new in out.scheduled_new_reqs:
            self.drop(new.req_id)  # a resumed request arrives anew
            self.add(new.req_id, new.sampling_params, list(new.prompt_token_ids))

    def add(self, request_id: str, params, prompt_ids: list[int]) -> None:
        slot = self._free_slots.pop(0)
        thinking = None
        if self.markers is not None and params.thinking_token_budget is not None:
            thinking = ThinkingScan(budget=params.thinking_token_budget)
        self.requests[request_id] = RequestSampling(params, request_seed(params), prompt_ids, slot, thinking=thinking)
        self.state.start(slot, prompt_ids)
        for processor in self.custom:
            processor.add_request(slot, params)

    def drop(self, request_id: str) -> None:
        state = self.requests.pop(request_id, None)
        if state is not None:
            self._free_slots.append(state.slot)
            self._free_slots.sort()

    # -- one step -------------------------------------------------------------------------------------------
    def sample(self, logits: Mapping[str, np.ndarray], scheduler_output=None,
               grammar_output=None) -> tuple[RunnerOutput, dict[str, list[int]]]:
        """Sample the step's requests; the runner output vLLM's scheduler takes, and the tokens of those with logits.

        ``grammar_output``: vLLM's structured-output bitmask for the step, applied to the logits first.
        """
        req_ids = [r for r in (scheduler_output.num_scheduled_tokens if scheduler_output is not None else logits)
                   if r in self.requests]
        if not req_ids:
            return RunnerOutput(req_ids=[]), {}
        raw = self._rows(req_ids, logits)
        if grammar_output is not None:
            apply_grammar_bitmask(raw, req_ids, grammar_output)
        processed = self._process(raw.clone(), req_ids)
        states = [self.requests[r] for r in req_ids]
        temperature = torch.tensor([s.params.temperature for s in states], dtype=torch.float32)
        seeds = torch.tensor([s.seed for s in states], dtype=torch.int64)
        positions = torch.tensor([s.num_tokens - 1 for s in states], dtype=torch.int64)
        tokens = gumbel_argmax(processed, temperature, seeds, positions)
        logprobs = self._logprobs(raw, processed, tokens, states)
        sampled: dict[str, list[int]] = {}
        valid: list[list[int]] = []
        for request_id, state, token in zip(req_ids, states, tokens.tolist()):
            if request_id not in logits:
                valid.append([])
                continue
            valid.append([token])
            sampled[request_id] = [token]
            state.output_ids.append(token)
            self.state.append(state.slot, token)
        return RunnerOutput(req_ids=req_ids, sampled_token_ids=valid, logprobs=logprobs), sampled

    def _rows(self, req_ids: list[str], logits: Mapping[str, np.ndarray]) -> torch.Tensor:
        rows = torch.zeros((len(req_ids), self.vocab_size), dtype=torch.float32)
        for i, request_id in enumerate(req_ids):
            if request_id in logits:
                row = np.asarray(logits[request_id], dtype=np.float32).reshape(-1)
                if row.shape[0] != self.vocab_size:
                    raise ValueError(f"the language graph returned {row.shape[0]} logits, vLLM's vocabulary has "
                                     f"{self.vocab_size}; the export and its config.json disagree")
                rows[i] = torch.from_numpy(row)
        return rows

    def _process(self, logits: torch.Tensor, req_ids: list[str]) -> torch.Tensor:
        """Every rule before the draw, in vLLM 0.34's order; ``logits`` is changed in place and returned."""
        states = [self.requests[r] for r in req_ids]
        for row, state in zip(logits, states):
            p = state.params
            rules.apply_allowed_bias_min_tokens(
                row, allowed=p.allowed_token_ids, bias=p.logit_bias, num_output=len(state.output_ids),
                min_tokens=p.min_tokens, stop_ids=p.all_stop_token_ids if p.min_tokens > 0 else (),
                restore_when_all_masked=p.structured_outputs is not None)
            rules.apply_penalties(row, state.prompt_ids, state.output_ids, repetition=p.repetition_penalty,
                                  frequency=p.frequency_penalty, presence=p.presence_penalty)
            if p.bad_words_token_ids:
                rules.apply_bad_words(row, p.bad_words_token_ids, state.output_ids)
        if self.custom:
            logits = self._custom(logits, states)
        for row, state in zip(logits, states):
            p = state.params
            if state.thinking is not None:
                forced = state.thinking.forced_token([*state.prompt_ids, *state.output_ids], self.markers)
                if forced is not None:
                    row[forced] = FORCED_LOGIT
            rules.apply_temperature(row, p.temperature)
            rules.apply_min_p(row, p.min_p)
            top_k = p.top_k if 0 < p.top_k < self.vocab_size else None
            rules.apply_top_k_top_p(row, top_k, p.top_p if p.top_p != 1.0 else None)
        return logits

    def _custom(self, logits: torch.Tensor, states: list[RequestSampling]) -> torch.Tensor:
        slots = torch.tensor([s.slot for s in states], dtype=torch.int32)
        positions = torch.tensor([s.num_tokens - 1 for s in states], dtype=torch.int64)
        last = torch.tensor([(s.output_ids or s.prompt_ids)[-1] for s in states], dtype=torch.int32)
        context = self._context(expanded_idx_mapping=slots, idx_mapping=slots, idx_mapping_np=slots.numpy(),
                                expanded_local_pos=torch.zeros(len(states), dtype=torch.int32), input_ids=last,
                                pos=positions, seq_lens_upper_bound_np=(positions + 1).numpy())
        for processor in self.custom:
            logits = processor.apply(logits, context)
        return logits

    def _logprobs(self, raw: torch.Tensor, processed: torch.Tensor, tokens: torch.Tensor,
                  states: list[RequestSampling]):
        from qeff_evs.vllm.surface import LogprobsTensors

        asked = [s.params.logprobs for s in states]
        token_ids = [list(s.params.logprob_token_ids or ()) for s in states]
        if all(n is None for n in asked) and not any(token_ids):
            return None
        num = max((self.vocab_size if n == -1 else n) for n in asked if n is not None) if any(
            n is not None for n in asked) else 0
        scores = processed if self.logprobs_mode in PROCESSED_MODES else raw
        ids, values, ranks = logprobs_of(scores, tokens, num, token_ids if any(token_ids) else None,
                                         logits_mode=self.logprobs_mode in ("raw_logits", "processed_logits"))
        return LogprobsTensors(ids, values, ranks).tolists()


def apply_grammar_bitmask(logits: torch.Tensor, req_ids: list[str], grammar_output) -> None:
    """vLLM's structured-output bitmask (one packed row of 32-bit words per request it names): tokens whose bit
    is 0 get -inf. In place."""
    index = {r: i for i, r in enumerate(req_ids)}
    bitmask = np.asarray(grammar_output.grammar_bitmask)
    tokens = torch.arange(logits.shape[1], dtype=torch.int64)
    for request_id, words in zip(grammar_output.structured_output_request_ids, bitmask):
        row = index.get(request_id)
        if row is None:
            continue
        packed = torch.from_numpy(words.astype(np.int64) & 0xFFFFFFFF)
        allowed = ((packed[tokens // 32] >> (tokens % 32)) & 1).bool()
        logits[row].masked_fill_(~allowed, float("-inf"))
