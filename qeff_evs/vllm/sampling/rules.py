"""vLLM 0.34's logits rules, one pure function each, on one request's ``(vocab,)`` fp32 logits.

Each function is the rule vLLM's Model Runner V2 sampler applies (``vllm/v1/worker/gpu/sample/``: ``logit_bias.py``,
``penalties.py``, ``bad_words.py``, ``min_p.py``, ``states.py``; ``v1/sample/ops/topk_topp_sampler.py``), in the
same arithmetic, so that the same logits give the same token. vLLM runs them as batched GPU kernels over a persistent
batch; a host sampler over a handful of KV rows needs none of that machinery, only the rules. The order they run in
is :data:`qeff_evs.vllm.sampling.host_sampler` 's: bias, penalties, bad words, custom processors, thinking budget,
temperature, min-p, top-k/top-p, then the draw.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

NEG_INF = float("-inf")


def _f32(value: float) -> torch.Tensor:
    """A parameter as vLLM holds it: an fp32 tensor of one element (not a 0-d scalar: torch divides by a CPU scalar
    as a multiplication by its reciprocal, which rounds differently from vLLM's division)."""
    return torch.tensor([value], dtype=torch.float32)


def apply_allowed_bias_min_tokens(logits: torch.Tensor, *, allowed: Sequence[int] | None,
                                  bias: dict[int, float] | None, num_output: int, min_tokens: int,
                                  stop_ids: Sequence[int], restore_when_all_masked: bool) -> torch.Tensor:
    """``allowed_token_ids`` (every other token -inf), then ``logit_bias`` (added), then ``min_tokens`` (the stop
    ids -inf while fewer than ``min_tokens`` tokens were generated; with structured outputs they come back when
    nothing else is left), as vLLM's ``_bias_kernel``. In place; returns ``logits``."""
    if allowed:
        ids = torch.tensor(list(allowed), dtype=torch.int64)
        kept = logits[ids].clone()
        logits.fill_(NEG_INF)
        logits[ids] = kept
    if bias:
        ids = torch.tensor(list(bias), dtype=torch.int64)
        logits[ids] = logits[ids] + torch.tensor(list(bias.values()), dtype=torch.float32)
    if stop_ids and num_output < min_tokens:
        ids = torch.tensor(sorted(stop_ids), dtype=torch.int64)
        saved = logits[ids].clone()
        logits[ids] = NEG_INF
        if restore_when_all_masked and bool(torch.isneginf(logits).all()):
            finite = torch.isfinite(saved)
            logits[ids[finite]] = saved[finite]
    return logits


def apply_penalties(logits: torch.Tensor, prompt_ids: Sequence[int], output_ids: Sequence[int], *,
                    repetition: float, frequency: float, presence: float) -> torch.Tensor:
    """vLLM's penalties: every token seen in the prompt or the output is divided by ``repetition`` where positive
    (multiplied where not); each output token then loses ``frequency * count + presence``. In place."""
    if repetition == 1.0 and frequency == 0.0 and presence == 0.0:
        return logits
    vocab = logits.shape[0]
    prompt = torch.tensor(list(prompt_ids), dtype=torch.int64)
    prompt = prompt[(prompt >= 0) & (prompt < vocab)]
    outputs, counts = torch.unique(torch.tensor(list(output_ids), dtype=torch.int64), return_counts=True)
    seen = torch.unique(torch.cat((prompt, outputs)))
    values = logits[seen]
    rep = _f32(repetition)
    logits[seen] = torch.where(values > 0, values / rep, values * rep)
    logits[outputs] -= _f32(frequency) * counts + _f32(presence)
    return logits


def apply_bad_words(logits: torch.Tensor, bad_words: Sequence[Sequence[int]], output_ids: Sequence[int]
                    ) -> torch.Tensor:
    """A bad word's last token is -inf where the output so far ends with the rest of the word (always, for a
    one-token word), as vLLM's bad-words state. In place."""
    history = list(output_ids)
    for word in bad_words:
        prefix = list(word[:-1])
        if len(prefix) <= len(history) and (not prefix or history[-len(prefix):] == prefix):
            logits[word[-1]] = NEG_INF
    return logits


def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Divided by the temperature, unless it is 0 (greedy) or 1. In place."""
    if temperature not in (0.0, 1.0):
        logits.div_(_f32(temperature))
    return logits


def apply_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Tokens whose probability is below ``min_p`` times the top one's are -inf (in log space, as vLLM)."""
    if min_p != 0.0:
        threshold = logits.amax() + _f32(min_p).log()
        logits.masked_fill_(logits < threshold, NEG_INF)
    return logits


def apply_top_k_top_p(logits: torch.Tensor, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """Keep the ``top_k`` largest (ties at the k-th value kept) and the smallest set whose probability reaches
    ``top_p`` (at least one token), from one ascending sort, as vLLM's torch path; None: that filter is off."""
    if top_k is None and top_p is None:
        return logits
    ordered, order = logits.sort(descending=False)
    if top_k is not None:
        kth = ordered[ordered.shape[0] - top_k]
        ordered = ordered.masked_fill(ordered < kth, NEG_INF)
    if top_p is not None:
        cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= 1 - _f32(top_p)
        drop[-1] = False
        ordered = ordered.masked_fill(drop, NEG_INF)
    return logits.scatter_(0, order, ordered)
