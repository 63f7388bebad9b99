"""A request's own video pruning (docs/serving.md#per-request-pruning): ``video_pruning_rate``,
``video_pruning_method``, ``max_video_tokens``.

vLLM takes the pruning rate and method per server (``--video-pruning-rate``, ``--video-pruning-method``); the
export's graphs take both at run time, so a request may choose its own, within what the export serves. The server's
(or ``qeff-evs run``'s) settings are the default. A request carries them in ``mm_processor_kwargs`` (vLLM's API) or
as fields of a ``qeff-evs run --requests`` line.

``max_video_tokens = N`` asks for at most N kept tokens per video: the smallest rate (at least the request's rate)
whose count rule keeps at most N of this video's tokens. A video keeps at least one frame (EVS) or one token per
frame (VidCom2), and rates stop at what the export's RoPE tables cover: N below what the largest such rate keeps is
refused, naming that count.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from qeff_evs.manifest import Manifest
from qeff_evs.models.pruning import VideoPruning

RATE, METHOD, MAX_TOKENS = "video_pruning_rate", "video_pruning_method", "max_video_tokens"
PRUNING_KEYS = (RATE, METHOD, MAX_TOKENS)


@dataclass(frozen=True)
class PruningRequest:
    """What a request asks of its videos' pruning; ``None`` leaves the default's."""

    rate: float | None = None
    method: str | None = None
    max_video_tokens: int | None = None

    @classmethod
    def split(cls, kwargs: Mapping[str, Any] | None) -> tuple[PruningRequest, dict[str, Any]]:
        """The pruning keys of ``kwargs`` (e.g. ``mm_processor_kwargs``), checked for type, and the other keys."""
        kwargs = dict(kwargs or {})
        rate, method, tokens = (kwargs.pop(key, None) for key in PRUNING_KEYS)
        if rate is not None and (isinstance(rate, bool) or not isinstance(rate, (int, float))
                                 or not math.isfinite(rate)):
            raise ValueError(f"{RATE} must be a number in [0, 1), got {rate!r}")
        if method is not None and not isinstance(method, str):
            raise ValueError(f"{METHOD} must be a method name, got {method!r}")
        if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1):
            raise ValueError(f"{MAX_TOKENS} must be an integer >= 1, got {tokens!r}")
        return cls(None if rate is None else float(rate), method, tokens), kwargs

    @property
    def is_default(self) -> bool:
        return self.rate is None and self.method is None and self.max_video_tokens is None

    def resolve(self, default: VideoPruning, manifest: Manifest, max_model_len: int | None,
                merged_grid: tuple[int, int, int]) -> VideoPruning:
        """The pruning of one video of merged grid ``(T, h, w)``: a ``ValueError`` naming the bound when the
        export cannot serve it (a method it does not carry, a rate past its RoPE tables in ``max_model_len``)."""
        method = default.method if self.method is None else self.method
        problem = manifest.method_refusal(method)
        if problem:
            raise ValueError(f"{METHOD}: {problem}")
        chosen = VideoPruning(method, default.rate if self.rate is None else _checked_rate(self.rate))
        if self.rate is not None:
            problem = manifest.rate_refusal(chosen.rate, max_model_len)
            if problem:
                raise ValueError(f"{RATE}: {problem}")
        if self.max_video_tokens is None:
            return chosen
        return _at_most(chosen, self.max_video_tokens, manifest, max_model_len, merged_grid)


def _checked_rate(rate: float) -> float:
    try:
        return VideoPruning(rate=rate).rate
    except ValueError as error:
        raise ValueError(f"{RATE}: {error}") from None


def _kept(method: str, q: float, tokens_per_frame: int, frames: int) -> int:
    return VideoPruning(method, q).kept_token_count(tokens_per_frame, frames)


def rate_for_at_most(method: str, n: int, tokens_per_frame: int, frames: int) -> float:
    """The smallest rate whose count rule keeps at most ``n`` tokens of a video of ``frames`` temporal patches
    (0 when ``n`` covers them all); a ValueError when no rate below 1 keeps that few."""
    total = tokens_per_frame * frames
    if n >= total:
        return 0.0
    fewest = _kept(method, math.nextafter(1.0, 0.0), tokens_per_frame, frames)
    if fewest > n:
        raise ValueError(f"{MAX_TOKENS}={n}: a video of {frames} temporal patches of {tokens_per_frame} tokens keeps "
                         f"at least {fewest} with {method}")
    # The count falls as q rises; it truncates a float product, so bisect over floats: K(low) > n >= K(high).
    low, high = 0.0, 1.0 - n / total
    while high < 1.0 and _kept(method, high, tokens_per_frame, frames) > n:  # rounding can leave one over
        high = math.nextafter(high, 1.0)
    while True:
        middle = (low + high) / 2
        if middle in (low, high):
            return high
        if _kept(method, middle, tokens_per_frame, frames) <= n:
            high = middle
        else:
            low = middle


def _at_most(chosen: VideoPruning, n: int, manifest: Manifest, max_model_len: int | None,
             merged_grid: tuple[int, int, int]) -> VideoPruning:
    t, h, w = (int(v) for v in merged_grid)
    if chosen.kept_token_count(h * w, t) <= n:
        return chosen
    top = manifest.max_video_pruning_rate
    fewest = _kept(chosen.method, top, h * w, t)
    q = rate_for_at_most(chosen.method, n, h * w, t) if fewest <= n else 1.0
    if q == 1.0 or manifest.rate_refusal(q, max_model_len):
        raise ValueError(f"{MAX_TOKENS}={n}: this video ({t} temporal patches of {h}x{w} tokens) keeps at least "
                         f"{fewest} tokens at the export's largest rate {top} ({chosen.method}); ask for "
                         f">= {fewest}, or send fewer frames")
    return VideoPruning(chosen.method, q)
