"""Our reported top logits against a reference's full logit vector."""

from __future__ import annotations

import torch


def assert_top_logits_match(ours: list[list[float]], reference: torch.Tensor, atol: float) -> None:
    """``ours`` is ``[token_id, value]`` pairs, best first: the same argmax, the same top set, each value within
    ``atol`` of the reference's."""
    ids = [int(i) for i, _ in ours]
    assert ids[0] == int(reference.argmax())
    assert set(ids) == set(reference.topk(len(ids)).indices.tolist())
    for token_id, value in ours:
        assert abs(value - float(reference[int(token_id)])) <= atol, (token_id, value)
