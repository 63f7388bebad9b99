"""Integers packed into int32 words, as AWQ and GPTQ store them (pure functions).

A word holds ``32 // bits`` values; value ``i`` of a word sits at bit ``bits * i`` (the lowest bits first).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from qeff_evs.weights.linear_format import require


def unpack_last(packed: torch.Tensor, bits: int, order: Sequence[int] | None = None) -> torch.Tensor:
    """``(..., n)`` int32 words -> ``(..., n * 32 // bits)`` int32 values, word by word.

    ``order[i]``: which value of its word's group the ``i``-th bit slot holds (AWQ's interleaving); None: slot ``i``
    holds value ``i``.
    """
    require(packed.dtype == torch.int32, f"packed {bits}-bit values must be stored in int32 words, not {packed.dtype}")
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    values = torch.bitwise_and(torch.bitwise_right_shift(packed.unsqueeze(-1), shifts), (1 << bits) - 1)
    if order is not None:
        # slot i holds value order[i]: value j is in slot inverse[j]
        inverse = [list(order).index(j) for j in range(per_word)]
        values = values[..., inverse]
    return values.reshape(*packed.shape[:-1], packed.shape[-1] * per_word)


def unpack_first(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """``(n, ...)`` int32 words packed along the first axis -> ``(n * 32 // bits, ...)`` values."""
    return unpack_last(packed.transpose(0, -1).contiguous(), bits).transpose(0, -1)
