"""The plugin's host sampler against vLLM 0.34: its own functions where they run on a CPU, else an independent
reference written here from vLLM's definitions.

* penalties and bad words: vLLM's CPU model runner's ``CPUPenalties`` / ``CPUBadWords`` on the same rows;
* top-k / top-p: vLLM's ``apply_top_k_top_p_pytorch``;
* seeded noise: vLLM's murmur3 stream (``vllm/v1/worker/gpu/sample/gumbel.py``, a Triton kernel here unrunnable)
  rewritten in plain Python integers: the uniforms bit-equal, the draws equal;
* allowed ids, logit bias, min_tokens, min-p, temperature and logprobs: the kernels' rules, written out.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("vllm.v1.worker.worker_base")

from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch  # noqa: E402
from vllm.v1.worker.cpu import logits_processors as vllm_cpu  # noqa: E402

from qeff_evs.vllm.sampling import rules  # noqa: E402
from qeff_evs.vllm.sampling.gumbel import gumbel_argmax, gumbel_noise, uniform32  # noqa: E402
from qeff_evs.vllm.sampling.logprobs import logprobs_of  # noqa: E402
from qeff_evs.vllm.sampling.thinking import ThinkingMarkers, ThinkingScan  # noqa: E402

VOCAB = 97


from helpers.vllm_noise import reference_uniform  # noqa: E402

SEEDS = [0, 1, 1234, -7, 2**62 + 5, -(2**63)]


@pytest.mark.parametrize("seed", SEEDS)
def test_seeded_uniforms_are_vllms_stream_bit_for_bit(seed):
    positions = [0, 1, 31, 4096, 2**31 + 3]
    got = uniform32(torch.tensor([[seed]] * len(positions)), torch.tensor([[p] for p in positions]),
                    torch.arange(VOCAB).unsqueeze(0))
    want = np.array([[reference_uniform(seed, p, t) for t in range(VOCAB)] for p in positions], dtype=np.float32)
    assert np.array_equal(got.numpy(), want)
    assert 0.0 < want.min() and want.max() < 1.0


def test_seeded_draws_are_the_gumbel_max_of_vllms_noise():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn((len(SEEDS), VOCAB), generator=generator) * 3
    positions = torch.tensor([5, 6, 7, 8, 9, 10])
    noise = np.array([[-math.log(-math.log1p(-float(reference_uniform(s, int(p), t)))) for t in range(VOCAB)]
                      for s, p in zip(SEEDS, positions)])
    assert np.allclose(gumbel_noise(torch.tensor(SEEDS), positions, VOCAB).numpy(), noise, atol=2e-5)
    want = (logits.double().numpy() + noise).argmax(axis=1)
    temperature = torch.ones(len(SEEDS))
    assert gumbel_argmax(logits, temperature, torch.tensor(SEEDS), positions).tolist() == want.tolist()
    # greedy rows: the argmax; the draw does not depend on the other rows of the batch
    temperature[2] = 0.0
    mixed = gumbel_argmax(logits, temperature, torch.tensor(SEEDS), positions)
    assert mixed[2] == logits[2].argmax() and mixed[[0, 1, 3, 4, 5]].tolist() == want[[0, 1, 3, 4, 5]].tolist()
    alone = gumbel_argmax(logits[:1], torch.ones(1), torch.tensor(SEEDS[:1]), positions[:1])
    assert alone.tolist() == want[:1].tolist()


# --- penalties and bad words: vLLM's CPU runner classes -----------------------------------------------------
def vllm_states(prompts: list[list[int]], outputs: list[list[int]]):
    rows = len(prompts)
    width = max(len(p) + len(o) for p, o in zip(prompts, outputs))
    tokens = torch.zeros((rows, width), dtype=torch.int32)
    for i, (p, o) in enumerate(zip(prompts, outputs)):
        tokens[i, :len(p) + len(o)] = torch.tensor(p + o)
    prompt_len = torch.tensor([len(p) for p in prompts], dtype=torch.int32)
    total = torch.tensor([len(p) + len(o) for p, o in zip(prompts, outputs)], dtype=torch.int32)
    state = vllm_cpu.LogitsProcRequestState(device=torch.device("cpu"), max_num_reqs=rows, vocab_size=VOCAB,
                                            all_token_ids=tokens, prompt_len=prompt_len,
                                            prompt_len_np=prompt_len.numpy(), prefill_len=prompt_len,
                                            prefill_len_np=prompt_len.numpy(), total_len=total)
    slots = torch.arange(rows, dtype=torch.int32)
    context = vllm_cpu.LogitsContext(expanded_idx_mapping=slots, idx_mapping=slots, idx_mapping_np=slots.numpy(),
                                     expanded_local_pos=torch.zeros(rows, dtype=torch.int32),
                                     input_ids=tokens[torch.arange(rows), total.long() - 1], pos=total.long() - 1,
                                     seq_lens_upper_bound_np=total.numpy())
    return state, context


def params(**kw):
    base = dict(repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0, bad_words_token_ids=None)
    return SimpleNamespace(**{**base, **kw})


PROMPTS = [[3, 4, 5, 4, 90], [7, 7, 7], [1, 2]]
OUTPUTS = [[4, 8, 8, 9], [11], []]
PENALTIES = [dict(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.25),
             dict(repetition_penalty=0.7, frequency_penalty=-0.2), dict(presence_penalty=1.5)]


def test_penalties_equal_vllms():
    logits = torch.randn((3, VOCAB), generator=torch.Generator().manual_seed(1)) * 4
    state, context = vllm_states(PROMPTS, OUTPUTS)
    theirs = vllm_cpu.CPUPenalties(None, state)
    for i, p in enumerate(PENALTIES):
        theirs.add_request(i, params(**p))
    want = theirs.apply(logits.clone(), context)
    got = torch.stack([rules.apply_penalties(logits[i].clone(), PROMPTS[i], OUTPUTS[i],
                                             repetition=params(**p).repetition_penalty,
                                             frequency=params(**p).frequency_penalty,
                                             presence=params(**p).presence_penalty) for i, p in enumerate(PENALTIES)])
    assert torch.equal(got, want)
    assert not torch.equal(got, logits)


def test_bad_words_equal_vllms():
    words = [[[8, 9], [4], [77, 78]], [[11, 12], [3]], [[5, 6]]]
    logits = torch.randn((3, VOCAB), generator=torch.Generator().manual_seed(2))
    state, context = vllm_states(PROMPTS, OUTPUTS)
    theirs = vllm_cpu.CPUBadWords(None, state)
    for i, w in enumerate(words):
        theirs.add_request(i, SimpleNamespace(bad_words_token_ids=w))
    want = theirs.apply(logits.clone(), context)
    got = torch.stack([rules.apply_bad_words(logits[i].clone(), words[i], OUTPUTS[i]) for i in range(3)])
    assert torch.equal(got, want)
    assert torch.isneginf(got[1, 12]) and torch.isneginf(got[0, 4]) and not torch.isneginf(got[0, 9])


# --- top-k / top-p: vLLM's torch path ------------------------------------------------------------------------
@pytest.mark.parametrize("top_k, top_p", [(5, None), (None, 0.8), (20, 0.5), (1, None), (None, 0.999)])
def test_top_k_top_p_equal_vllms(top_k, top_p):
    logits = torch.randn((4, VOCAB), generator=torch.Generator().manual_seed(3)) * 2
    logits[1, :10] = logits[1, 10]  # ties at the k-th value
    k = None if top_k is None else torch.full((4,), top_k, dtype=torch.int32)
    p = None if top_p is None else torch.full((4,), top_p, dtype=torch.float32)
    want = apply_top_k_top_p_pytorch(logits.clone(), k, p)
    got = torch.stack([rules.apply_top_k_top_p(row.clone(), top_k, top_p) for row in logits])
    assert torch.equal(got, want)


# --- the rest: the kernels' rules written out ----------------------------------------------------------------
def test_allowed_ids_bias_and_min_tokens_follow_vllms_kernel():
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(4))
    got = rules.apply_allowed_bias_min_tokens(logits.clone(), allowed=[3, 9, 40], bias={9: 2.5, 50: 1.0},
                                              num_output=1, min_tokens=3, stop_ids=[40], restore_when_all_masked=False)
    want = torch.full((VOCAB,), float("-inf"))
    want[3], want[9], want[50] = logits[3], logits[9] + 2.5, float("-inf") + 1.0
    assert torch.equal(got, want)  # 40 allowed, but a stop id before min_tokens
    enough = rules.apply_allowed_bias_min_tokens(logits.clone(), allowed=None, bias=None, num_output=3, min_tokens=3,
                                                 stop_ids=[40], restore_when_all_masked=False)
    assert torch.equal(enough, logits)
    only_stop = torch.full((VOCAB,), float("-inf"))
    only_stop[40] = 1.0
    restored = rules.apply_allowed_bias_min_tokens(only_stop.clone(), allowed=None, bias=None, num_output=0,
                                                   min_tokens=2, stop_ids=[40], restore_when_all_masked=True)
    assert torch.equal(restored, only_stop)  # structured output: nothing else left, the stop id comes back


def test_temperature_and_min_p_follow_vllms_rule():
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(5)) * 3
    assert torch.equal(rules.apply_temperature(logits.clone(), 0.7), logits / torch.tensor([0.7]))
    assert torch.equal(rules.apply_temperature(logits.clone(), 0.0), logits)
    probs = logits.softmax(-1)
    kept = ~torch.isneginf(rules.apply_min_p(logits.clone(), 0.2))
    assert torch.equal(kept, probs >= 0.2 * probs.max() - 1e-7)


def test_logprobs_are_log_softmax_with_the_sampled_token_first():
    logits = torch.randn((2, VOCAB), generator=torch.Generator().manual_seed(6))
    sampled = torch.tensor([7, 11])
    ids, values, ranks = logprobs_of(logits, sampled, 3, [[], [5, 6]])
    reference = torch.log_softmax(logits.double(), -1)
    assert ids[0].tolist() == [7, *logits[0].topk(3).indices.tolist()] and ids[1].tolist()[:3] == [11, 5, 6]
    assert torch.allclose(values[0].double(), reference[0, ids[0]], atol=1e-6)
    assert torch.allclose(values[1, :3].double(), reference[1, [11, 5, 6]], atol=1e-6)
    assert torch.isneginf(values[1, 3])
    assert ranks.tolist() == [int((logits[r] >= logits[r, t]).sum()) for r, t in enumerate([7, 11])]


def test_the_thinking_budget_forces_the_end_marker_once_spent():
    markers = ThinkingMarkers(start=(50,), end=(60, 61), natural_end=(60, 61))
    scan = ThinkingScan(budget=2)
    history = [1, 2, 50, 9]
    assert scan.forced_token(history, markers) is None  # one thinking token
    history.append(9)
    assert scan.forced_token(history, markers) == 60  # two: the end marker, first id
    history.append(60)
    assert scan.forced_token(history, markers) == 61  # then the rest of it
    history.append(61)
    assert scan.forced_token(history, markers) is None  # closed
