"""VidCom2's count rule, budget factor and eager reference mask against vLLM 0.32.0's own functions.

The graph form (``vidcom2.rank_candidates`` and the exported pruning graph) is tested in
``test_pruning_ranking.py``; here the definition: ``qeff_evs.vidcom2`` against
``vllm.multimodal.video_prune.vidcom2``, and the two facts about ``torch.topk`` the tie rule rests on.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from qeff_evs import vidcom2
from helpers.pruning_oracles import (
    GENERIC_KINDS,
    topk_cuda_ties,
    vllm_vidcom2,
    vllm_vidcom2_mask,
)

RATES = (0.0, 0.1, 0.5, 0.75, 0.9)
FINE_RATES = tuple(i / 100 for i in range(100)) + (0.123456789, 0.999)


def test_count_rule_equals_vllm():
    for tokens, frames, q in itertools.product((1, 4, 12, 196, 256, 1280), range(1, 65), FINE_RATES):
        want = vllm_vidcom2.compute_retained_tokens_count(tokens, frames, q)
        assert vidcom2.kept_token_count(tokens, frames, q) == want, (tokens, frames, q)


def test_count_rule_floor_is_one_token_per_frame():
    assert vidcom2.kept_token_count(256, 16, 0.999) == 16
    assert vidcom2.kept_token_count(256, 16, 0.0) == 256 * 16


@pytest.mark.parametrize("bad", [-0.1, 1.0, float("nan"), "half"])
def test_count_rule_refuses_a_bad_rate(bad):
    with pytest.raises(ValueError, match="pruning rate"):
        vidcom2.kept_token_count(16, 4, bad)


def test_retention_ratio_is_the_factor_torch_multiplies_by():
    # vLLM writes `base * tensor` with base = 1.0 - q, a Python double: torch rounds it to float32 first.
    x = torch.rand(4096) * 3
    for q in FINE_RATES:
        ratio = torch.tensor(vidcom2.retention_ratio(q))
        assert torch.equal(x * (1.0 - q), x * ratio), q
    # ... which float32 arithmetic on a float32 q does not reproduce: the graph takes the ratio, not q.
    assert np.float32(1) - np.float32(0.09) != vidcom2.retention_ratio(0.09)


def test_cpu_topk_breaks_ties_by_arrangement():
    """Why the oracle runs with CUDA's tie rule: on CPU the tied picks depend on the whole row."""
    picks = torch.topk(torch.zeros(20), 3, largest=False, sorted=False).indices
    assert sorted(picks.tolist()) != [0, 1, 2]
    frames, tokens = 6, 12
    embeds = torch.full((frames * tokens, 16), 0.3)
    cpu = vllm_vidcom2_mask(embeds, (frames, 6, 8), 2, 0.5, cuda_ties=False)
    cuda_rule = vllm_vidcom2_mask(embeds, (frames, 6, 8), 2, 0.5)
    assert int(cpu.sum()) == int(cuda_rule.sum()) and not torch.equal(cpu, cuda_rule)


def test_cuda_tie_rule_changes_nothing_without_ties():
    generator = torch.Generator().manual_seed(0)
    for n, k, largest, dim in itertools.product((5, 64, 300), (1, 3, 5), (True, False), (0, 1)):
        values = torch.randn(4, n, generator=generator) if dim == 1 else torch.randn(n, 4, generator=generator)
        want = torch.topk(values, k, dim=dim, largest=largest, sorted=True)
        got = topk_cuda_ties(values, k, dim=dim, largest=largest, sorted=True)
        assert torch.equal(want.indices, got.indices) and torch.equal(want.values, got.values)


def _cases():
    rng = np.random.default_rng(7)
    grids = [(1, 1), (1, 5), (3, 4), (4, 7), (6, 6), (2, 9)]
    for kind, frames, grid, merge, q, width in itertools.product(
            GENERIC_KINDS, (1, 2, 3, 5, 8, 13, 16), grids, (1, 2), RATES, (16, 64)):
        if rng.random() < 0.2:  # a deterministic fifth of the product: every axis still covered
            yield kind, frames, grid, merge, q, width, int(rng.integers(2**31))


@pytest.mark.parametrize("kind", list(GENERIC_KINDS))
def test_reference_mask_equals_vllm(kind):
    checked = 0
    for case_kind, frames, (h, w), merge, q, width, seed in _cases():
        if case_kind != kind:
            continue
        embeds = torch.from_numpy(GENERIC_KINDS[kind](np.random.default_rng(seed), frames, h * w, width))
        grid = (frames, h * merge, w * merge)
        want = vllm_vidcom2_mask(embeds, grid, merge, q)
        got = vidcom2.retention_mask(embeds, grid, merge, q)
        assert got.dtype == torch.bool and torch.equal(got, want), (kind, frames, (h, w), merge, q, width)
        assert int(got.sum()) == vidcom2.kept_token_count(h * w, frames, q)
        if kind == "random":  # no ties: vLLM's own CPU run agrees as is
            assert torch.equal(got, vllm_vidcom2_mask(embeds, grid, merge, q, cuda_ties=False))
        checked += 1
    assert checked > 50


def test_reference_mask_in_bfloat16_equals_vllm():
    # The reference computes in the embeddings' dtype, as vLLM does.
    embeds = torch.randn(8 * 12, 32, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    for q in RATES:
        assert torch.equal(vidcom2.retention_mask(embeds, (8, 6, 8), 2, q),
                           vllm_vidcom2_mask(embeds, (8, 6, 8), 2, q)), q


def test_reference_mask_refuses_wrong_rows():
    with pytest.raises(ValueError, match=r"\(T\*h\*w, D\) = \(48, D\)"):
        vidcom2.retention_mask(torch.zeros(47, 8), (4, 6, 8), 2, 0.5)
    with pytest.raises(ValueError, match="not divisible by spatial_merge_size"):
        vidcom2.retention_mask(torch.zeros(48, 8), (4, 5, 8), 2, 0.5)
