"""vLLM's own sampler on our logits, with vLLM's persistent batch holding each request's sampling state.

vLLM's GPU model runner keeps an ``InputBatch`` (per-request temperature, top-p/top-k, seeded generators,
penalties, logits processors such as min_tokens and logit_bias, custom logits processors, allowed/bad
words, logprob counts, thinking-budget state) and samples with ``vllm.v1.sample.sampler.Sampler`` from its
``sampling_metadata``, after applying the structured-output grammar bitmask to the logits. This module
keeps the same batch in step with each ``SchedulerOutput`` (what ``GPUModelRunner._update_states`` does,
minus GPU tensors, speculative decoding and pipeline stages, which our platform refuses) and does the same
with our ``(vocab,)`` logits. A request whose step yields no token (a prefill chunk that does not finish its
prompt) is sampled on a zero row and discarded, with its seeded generator rewound, as vLLM does.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from vllm.sampling_params import SamplingType
from vllm.v1.sample.logits_processor import build_logitsprocs
from vllm.v1.sample.sampler import Sampler
from vllm.v1.structured_output.utils import apply_grammar_bitmask
from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch

from qeff_evs.vllm.engine.scheduler import RunnerOutput

CPU = torch.device("cpu")


class HostSampler(Sampler):
    """vLLM's sampler on its torch-native paths.

    On a CPU platform vLLM picks kernels from ``vllm._C`` (greedy argmax, fused Gumbel sampling), which the
    CUDA wheel installed here does not carry; the native paths are the same algorithms in plain torch
    (vLLM's own fallback on other CPU architectures).
    """

    def __init__(self, logprobs_mode):
        super().__init__(logprobs_mode=logprobs_mode)
        self.topk_topp_sampler.forward = self.topk_topp_sampler.forward_native

    @staticmethod
    def greedy_sample(logits: torch.Tensor) -> torch.Tensor:
        return logits.argmax(dim=-1).view(-1)


class VllmSampling:
    def __init__(self, vllm_config, vocab_size: int, block_size: int):
        scheduler, model = vllm_config.scheduler_config, vllm_config.model_config
        custom = tuple(model.logits_processors or ())  # --logits-processors, as vLLM's GPU runner builds them
        self.batch = InputBatch(
            max_num_reqs=scheduler.max_num_seqs, max_model_len=model.max_model_len,
            max_num_batched_tokens=scheduler.max_num_batched_tokens, device=CPU, vocab_size=vocab_size,
            block_sizes=[block_size], max_num_blocks_per_req=[1],
            logitsprocs=build_logitsprocs(vllm_config, CPU, False, False, custom),
            logitsprocs_need_output_token_ids=bool(custom), reasoning_config=vllm_config.reasoning_config)
        self.sampler = HostSampler(model.logprobs_mode)
        self.requests: dict[str, CachedRequestState] = {}

    def update(self, out) -> None:
        """Bring the persistent batch in line with one ``SchedulerOutput``."""
        for request_id in out.finished_req_ids:
            self.requests.pop(request_id, None)
            self.batch.remove_request(request_id)
        scheduled = out.num_scheduled_tokens.keys()
        for request_id in [r for r in self.batch.req_id_to_index if r not in scheduled]:
            self.batch.remove_request(request_id)  # not scheduled this step: back when it is
        to_add = []
        for new in out.scheduled_new_reqs:
            params = new.sampling_params
            generator = None
            if params is not None and params.sampling_type == SamplingType.RANDOM_SEED:
                generator = torch.Generator(device=CPU)
                generator.manual_seed(params.seed)
            state = CachedRequestState(req_id=new.req_id, prompt_token_ids=new.prompt_token_ids,
                                       mm_features=new.mm_features, sampling_params=params, generator=generator,
                                       block_ids=new.block_ids, num_computed_tokens=new.num_computed_tokens,
                                       output_token_ids=[], lora_request=new.lora_request)
            self.requests[new.req_id] = state
            to_add.append(state)
        cached = out.scheduled_cached_reqs
        for i, request_id in enumerate(cached.req_ids):
            if request_id in cached.resumed_req_ids:
                raise RuntimeError(f"vLLM resumed preempted request {request_id}; the qeff-evs platform sizes KV "
                                   "blocks so that this cannot happen (block_size must equal max_model_len)")
            state = self.requests[request_id]
            state.num_computed_tokens = cached.num_computed_tokens[i]
            index = self.batch.req_id_to_index.get(request_id)
            if index is None:
                to_add.append(state)
            else:
                self.batch.num_computed_tokens_cpu[index] = state.num_computed_tokens
        for state in to_add:
            self.batch.add_request(state)
        self.batch.condense()
        self.batch.refresh_metadata()

    def sample(self, logits: Mapping[str, np.ndarray], scheduler_output=None,
               grammar_output=None) -> tuple[RunnerOutput, dict[str, list[int]]]:
        """Sample the requests that have logits; the runner output vLLM's scheduler takes, and the tokens.

        ``grammar_output``: vLLM's structured-output bitmask for the step (``scheduler_output``'s), applied to
        the logits first, as vLLM's GPU runner does.
        """
        req_ids = list(self.batch.req_ids)
        if not req_ids:
            return RunnerOutput(req_ids=[], req_id_to_index={}), {}
        vocab = self.batch.vocab_size
        rows = torch.zeros((len(req_ids), vocab), dtype=torch.float32)
        for i, request_id in enumerate(req_ids):
            if request_id in logits:
                row = np.asarray(logits[request_id], dtype=np.float32).reshape(-1)
                if row.shape[0] != vocab:
                    raise ValueError(f"the language graph returned {row.shape[0]} logits, vLLM's vocabulary has "
                                     f"{vocab}; the export and its config.json disagree")
                rows[i] = torch.from_numpy(row)
        if grammar_output is not None:
            apply_grammar_bitmask(scheduler_output, grammar_output, self.batch, rows)
        discarded = [i for i, r in enumerate(req_ids) if r not in logits]
        generators = self.batch.generators
        saved = {i: generators[i].get_state() for i in discarded if i in generators}
        output = self.sampler(logits=rows, sampling_metadata=self.batch.sampling_metadata)
        for i, state in saved.items():  # a discarded draw must not advance the request's seeded stream
            generators[i].set_state(state)
        tokens = output.sampled_token_ids.reshape(len(req_ids), -1)[:, 0].tolist()
        sampled: dict[str, list[int]] = {}
        valid: list[list[int]] = []
        for i, request_id in enumerate(req_ids):
            if request_id not in logits:
                valid.append([])
                continue
            token = int(tokens[i])
            valid.append([token])
            sampled[request_id] = [token]
            end = int(self.batch.num_tokens_no_spec[i])
            self.batch.token_ids_cpu[i, end] = token
            self.batch.is_token_ids[i, end] = True
            self.batch.num_tokens_no_spec[i] = end + 1
            self.requests[request_id].output_token_ids.append(token)
        logprobs = None if output.logprobs_tensors is None else output.logprobs_tensors.tolists()
        runner_output = RunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                          sampled_token_ids=valid, logprobs=logprobs, prompt_logprobs_dict={})
        return runner_output, sampled
