"""Seeded sampling as vLLM 0.34 draws it: Gumbel-max with noise hashed from (seed, position, token).

vLLM's Model Runner V2 keeps no random generator per request: the noise of token ``t`` at the step that reads
position ``pos`` is a pure function of the request's 64-bit seed, ``pos`` and ``t`` (murmur3's 32-bit finaliser over
those words, ``vllm/v1/worker/gpu/sample/gumbel.py``), so a seeded request draws the same tokens whatever else is in
the batch, however its prompt was chunked and on whichever instance each step ran. vLLM computes it in a Triton
kernel (a CPU op on its CPU runner, which the CUDA wheel installed here does not carry); this is the same arithmetic
in torch: the uniforms are bit-equal to the kernel's, the Gumbel transform equal to within fp32 rounding of ``log``.
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF


def _mul32(a: torch.Tensor, b: int) -> torch.Tensor:
    """``a * b mod 2**32`` for int64 ``a`` in [0, 2**32) without int64 overflow (``b`` split into 16-bit halves)."""
    low, high = b & 0xFFFF, b >> 16
    return (a * low + (((a * high) & 0xFFFF) << 16)) & MASK32


def _rotl32(x: torch.Tensor, shift: int) -> torch.Tensor:
    return ((x << shift) | (x >> (32 - shift))) & MASK32


def _mix(h: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    key = _rotl32(_mul32(key, 0xCC9E2D51), 15)
    h = h ^ _mul32(key, 0x1B873593)
    h = _rotl32(h, 13)
    return (_mul32(h, 5) + 0xE6546B64) & MASK32


def _fmix(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def murmur3_hash32(seed: torch.Tensor, pos: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """vLLM's ``murmur3_hash32(seed, pos, offset)`` (domain 0), as int64 values in [0, 2**32).

    Args:
        seed: int64 ``(rows, 1)``, a request's seed each.
        pos: int64 ``(rows, 1)``, the position whose logits are sampled (the last token fed).
        token: int64 ``(1, vocab)`` or ``(rows, vocab)``, the token ids.
    """
    h = torch.zeros_like(seed)
    h = _mix(h, seed & MASK32)
    h = _mix(h, (seed >> 32) & MASK32)
    h = _mix(h, pos & MASK32)
    h = _mix(h, token & MASK32)
    return _fmix(h ^ 16)


def uniform32(seed: torch.Tensor, pos: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """vLLM's ``murmur3_uniform32``: ``(hash + 0.5) * 2**-32`` rounded once to fp32, in (0, 1)."""
    h = murmur3_hash32(seed, pos, token)
    high = (h >> 16).to(torch.float32)
    low = (h & 0xFFFF).to(torch.float32)
    return high * 1.52587890625e-05 + (low + 0.5) * 2.3283064365386963e-10


def _log1p_neg(value: torch.Tensor) -> torch.Tensor:
    """``log(1 - value)`` as vLLM's kernel computes it: a degree-8 series below 0.25, the direct form above."""
    poly = torch.full_like(value, 1.0 / 8.0)
    for k in (7, 6, 5, 4, 3, 2):
        poly = 1.0 / k + value * poly
    poly = 1.0 + value * poly
    series = -value * poly
    direct = torch.log(torch.clamp(1.0 - value, min=5.960464477539063e-08))
    return torch.where(value < 0.25, series, direct)


def gumbel_noise(seed: torch.Tensor, pos: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The ``(rows, vocab)`` fp32 Gumbel noise of rows with seeds ``seed`` and positions ``pos`` (int64 ``(rows,)``)."""
    tokens = torch.arange(vocab_size, dtype=torch.int64).unsqueeze(0)
    u = uniform32(seed.to(torch.int64).unsqueeze(1), pos.to(torch.int64).unsqueeze(1), tokens)
    return -torch.log(-_log1p_neg(u))


def gumbel_argmax(logits: torch.Tensor, temperature: torch.Tensor, seed: torch.Tensor,
                  pos: torch.Tensor) -> torch.Tensor:
    """vLLM 0.34's ``gumbel_sample`` with temperature already applied: ``argmax(logits + noise)`` on rows with a
    non-zero temperature, ``argmax(logits)`` on greedy rows (ties and -inf: the first maximum, as ``torch.argmax``).

    Args:
        logits: fp32 ``(rows, vocab)``, processed (penalties, temperature, min-p, top-k/top-p applied).
        temperature: ``(rows,)``; 0 is greedy.
        seed, pos: int64 ``(rows,)``: each row's request seed and sampled position.
    Returns:
        int64 ``(rows,)`` token ids.
    """
    random = temperature != 0.0
    if not bool(random.any()):
        return logits.argmax(dim=-1)
    noisy = logits.clone()
    rows = random.nonzero(as_tuple=True)[0]
    noisy[rows] = logits[rows] + gumbel_noise(seed[rows], pos[rows], logits.shape[1])
    return noisy.argmax(dim=-1)
