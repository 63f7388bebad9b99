"""vLLM 0.34's seeded noise written out in plain Python integers (``vllm/v1/worker/gpu/sample/gumbel.py``: murmur3's
32-bit mix of the seed's two words, the position and the token id; the uniform ``(hash + 0.5) * 2**-32`` in fp32; the
Gumbel noise ``-log(-log(1 - u))``), an independent reference for the plugin's torch version."""

from __future__ import annotations

import math

import numpy as np

M32 = 0xFFFFFFFF


def _rotl(x: int, r: int) -> int:
    return ((x << r) | (x >> (32 - r))) & M32


def _mix(h: int, k: int) -> int:
    k = _rotl((k * 0xCC9E2D51) & M32, 15)
    h ^= (k * 0x1B873593) & M32
    h = _rotl(h, 13)
    return (h * 5 + 0xE6546B64) & M32


def reference_hash(seed: int, pos: int, token: int) -> int:
    h = 0
    for word in (seed & M32, (seed >> 32) & M32, pos & M32, token & M32):
        h = _mix(h, word)
    h ^= 16
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & M32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & M32
    return h ^ (h >> 16)


def reference_uniform(seed: int, pos: int, token: int) -> np.float32:
    h = reference_hash(seed, pos, token)
    f32 = np.float32
    return f32(f32(h >> 16) * f32(1.52587890625e-05)) + f32(f32(h & 0xFFFF) + f32(0.5)) * f32(2.3283064365386963e-10)



def reference_noise(seed: int, pos: int, vocab: int) -> np.ndarray:
    return np.array([-math.log(-math.log1p(-float(reference_uniform(seed, pos, t)))) for t in range(vocab)])
