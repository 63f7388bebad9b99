"""The logprobs vLLM 0.34 returns for a sampled token: its own, the top ``k`` (or the request's
``logprob_token_ids``), and its rank (``vllm/v1/worker/gpu/sample/logprob.py``'s ``compute_topk_scores``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def logprobs_of(logits: torch.Tensor, sampled: torch.Tensor, num_logprobs: int,
                token_ids: Sequence[Sequence[int]] | None = None, logits_mode: bool = False):
    """vLLM's ``LogprobsTensors`` for one step's rows.

    Args:
        logits: fp32 ``(rows, vocab)``: raw or processed, as ``--logprobs-mode`` says.
        sampled: int64 ``(rows,)``, the tokens drawn.
        num_logprobs: the step's largest ``logprobs`` (0: the sampled token's only).
        token_ids: per row, the request's ``logprob_token_ids`` (empty: the top ``num_logprobs``); None: none asked.
        logits_mode: ``raw_logits`` / ``processed_logits``: the values are logits, not log-probabilities.
    Returns:
        ``(token ids, values, ranks)``: ``(rows, 1 + columns)`` with the sampled token first, columns that a row does
        not fill at -inf; ranks ``(rows,)``: how many tokens score at least the sampled one.
    """
    rows = logits.shape[0]
    sampled = sampled.to(torch.int64)
    width = max(num_logprobs, max((len(ids) for ids in token_ids), default=0) if token_ids else 0)
    chosen = torch.zeros((rows, width), dtype=torch.int64)
    valid = torch.zeros((rows, width), dtype=torch.bool)
    if num_logprobs > 0:
        chosen[:, :num_logprobs] = torch.topk(logits, num_logprobs, dim=-1).indices
        valid[:, :num_logprobs] = True
    for row, ids in enumerate(token_ids or ()):
        if ids:
            chosen[row] = 0
            chosen[row, :len(ids)] = torch.tensor(list(ids), dtype=torch.int64)
            valid[row] = False
            valid[row, :len(ids)] = True
    ids = torch.cat((sampled.unsqueeze(-1), chosen), dim=1)
    values = logits.gather(-1, ids) if logits_mode else \
        logits.gather(-1, ids) - torch.logsumexp(logits, dim=-1, keepdim=True)
    if token_ids:
        values = values.masked_fill(~torch.cat((torch.ones((rows, 1), dtype=torch.bool), valid), dim=1),
                                    float("-inf"))
    ranks = (logits >= logits.gather(-1, sampled.unsqueeze(-1))).sum(-1)
    return ids, values.to(torch.float32), ranks
