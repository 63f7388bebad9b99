"""The pruning graphs (docs/design.md#the-three-graphs): a video's merged rows padded to a frame bucket in, a ranking
out.

``PruningRanking(method, score_levels)`` is family-agnostic; the methods are data (``METHODS``):

* ``evs`` ranks rows by EVS dissimilarity (``evs.rank_candidates``); q never enters the graph;
* ``vidcom2`` ranks them by VidCom2's per-frame budgets and reconciliation order (``vidcom2.rank_candidates``);
  the rate reaches it as ``retention_ratio = float32(1 - q)`` (``vidcom2.retention_ratio``).

Inputs, in order: ``merged_embeds (bucket_tokens, D)`` (the video's rows, zero-padded to ``B`` temporal patches),
[``score_extras (levels, bucket_tokens, E)``: more features to score with, concatenated level by level after the
rows; a family with extra rows passes them], ``bucket_carrier (frame_bucket,)`` (int64, values unused: its length is
``B``), ``frame_count (1,)`` (int64, the real ``T <= B``), and for VidCom2 ``retention_ratio (1,)`` (float32).
Output: ``ranking (bucket_tokens,)`` int64. The host keeps ``evs.kept_from_ranking(ranking, K)`` with ``K`` from the
method's count rule for its ``T`` and ``q`` and gathers the rows (and the extra rows) itself.

The symbols are ``frame_bucket`` and ``bucket_tokens`` only: one specialization per (resolution, bucket) serves
every ``T`` up to the bucket and every rate. The arithmetic runs in float32 whatever the I/O dtype
(docs/design.md#numerics-on-the-card: the graph is compiled without fp16 conversion; with fp16 custom I/O only its
inputs arrive rounded).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn

from qeff_evs import evs, vidcom2
from qeff_evs.models.graph_io import VisionGraphSpec

FRAME_BUCKET, BUCKET_TOKENS = "frame_bucket", "bucket_tokens"


def check_bucket(tokens_per_frame: int, bucket: int) -> None:
    for name, value in (("tokens_per_frame", tokens_per_frame), ("bucket", bucket)):
        if isinstance(value, bool) or int(value) != value or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def pruning_symbols(tokens_per_frame: int, bucket: int) -> dict[str, int]:
    """The symbols a pruning specialization binds, for ``h*w`` merged tokens per frame and a bucket of ``B``."""
    check_bucket(tokens_per_frame, bucket)
    return {FRAME_BUCKET: int(bucket), BUCKET_TOKENS: int(bucket) * int(tokens_per_frame)}


def pad_to_bucket(rows: np.ndarray, bucket_rows: int, axis: int = 0) -> np.ndarray:
    """``rows`` zero-padded along ``axis`` to ``bucket_rows`` (a video's merged or extra rows)."""
    rows = np.asarray(rows)
    missing = int(bucket_rows) - rows.shape[axis]
    if missing < 0:
        raise ValueError(
            f"{rows.shape[axis]} rows do not fit a bucket of {bucket_rows}; pick a bucket at least as long as the video")
    widths = [(0, 0)] * rows.ndim
    widths[axis] = (0, missing)
    return np.pad(rows, widths)


@dataclass(frozen=True)
class PruningMethod:
    """A pruning method as the graph and the host see it."""

    name: str
    rank: Callable[..., torch.Tensor]
    """``(rows, bucket, frame_count, [ratio,] extra=None) -> ranking``: the exportable ranking."""
    kept_token_count: Callable[[int, int, float], int]
    """``(tokens_per_frame, T, q) -> K``: the count rule, in Python double as vLLM computes it."""
    takes_ratio: bool
    """Whether the graph takes ``retention_ratio`` (VidCom2's budgets depend on q; EVS ranks without it)."""


METHODS: Mapping[str, PruningMethod] = {
    "evs": PruningMethod("evs", evs.rank_candidates, evs.kept_token_count, takes_ratio=False),
    "vidcom2": PruningMethod("vidcom2", vidcom2.rank_candidates, vidcom2.kept_token_count, takes_ratio=True),
}


PRUNING_METHODS: tuple[str, ...] = tuple(METHODS)
DEFAULT_METHOD = "evs"  # vLLM's default --video-pruning-method


def pruning_method(name: str) -> PruningMethod:
    if name not in METHODS:
        raise ValueError(f"unknown video pruning method {name!r}; choose one of {', '.join(PRUNING_METHODS)}")
    return METHODS[name]


@dataclass(frozen=True)
class VideoPruning:
    """How a request's videos are pruned: vLLM's ``--video-pruning-method`` and ``--video-pruning-rate``.

    ``rate`` 0 turns pruning off whatever the method (vLLM's rule). Images are never pruned.
    """

    method: str = DEFAULT_METHOD
    rate: float = 0.0

    def __post_init__(self) -> None:
        pruning_method(self.method)
        object.__setattr__(self, "rate", evs.validate_pruning_rate(self.rate))

    def kept_token_count(self, tokens_per_frame: int, frame_count: int) -> int:
        """``K`` of a video of ``frame_count`` temporal patches: the method's count rule at this rate."""
        return pruning_method(self.method).kept_token_count(tokens_per_frame, frame_count, self.rate)

    def kept_tokens(self, merged_grid: Sequence[int], kind: str = "video") -> int:
        """``K`` of one media item of merged grid ``(T, h, w)``: every token of an image or an audio item, the count
        rule's for a video."""
        t, h, w = (int(v) for v in merged_grid)
        if kind != "video":
            return t * h * w
        return self.kept_token_count(h * w, t)


def temporal_patch_bucket(temporal_patches: int, buckets: Sequence[int]) -> int:
    """The smallest of ``buckets`` (temporal patches) holding ``temporal_patches``; ValueError naming the largest."""
    fitting = [int(b) for b in buckets if int(b) >= temporal_patches]
    if not fitting:
        raise ValueError(f"a video of {temporal_patches} temporal patches is longer than the largest frame bucket "
                         f"({max(buckets, default=0)} temporal patches); sample fewer frames or export a larger "
                         "bucket")
    return min(fitting)


def pruning_host_inputs(method: str, bucket: int, frame_count: int, q: float) -> dict[str, np.ndarray]:
    """The inputs after the rows for one video: the bucket carrier, ``T`` and, for VidCom2, the ratio."""
    check_bucket(1, bucket)
    if isinstance(frame_count, bool) or int(frame_count) != frame_count or not 1 <= frame_count <= bucket:
        raise ValueError(
            f"frame_count {frame_count!r} is outside [1, {bucket}]; use a bucket at least as long as the video")
    inputs = {"bucket_carrier": np.zeros(int(bucket), dtype=np.int64),
              "frame_count": np.array([int(frame_count)], dtype=np.int64)}
    if pruning_method(method).takes_ratio:
        inputs["retention_ratio"] = np.array([vidcom2.retention_ratio(q)], dtype=np.float32)
    else:
        evs.validate_pruning_rate(q)
    return inputs


class PruningRanking(nn.Module):
    """The ranking graph of one method: padded rows, the bucket carrier, ``T`` [and the ratio] in, a ranking out."""

    def __init__(self, method: str, score_levels: int = 0) -> None:
        super().__init__()
        if isinstance(score_levels, bool) or int(score_levels) != score_levels or score_levels < 0:
            raise ValueError(f"score_levels must be a non-negative integer, got {score_levels!r}")
        self.method = pruning_method(method)
        self.score_levels = int(score_levels)
        self.graph_spec = pruning_graph_spec(method, self.score_levels)

    def forward(self, merged_embeds: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        extra = None
        if self.score_levels:
            score_extras, *rest = rest
            # [level 0 | level 1 | ...] along features after the rows, as vLLM concatenates a model's multi-level rows.
            extra = score_extras.float().permute(1, 0, 2).reshape(score_extras.shape[1], -1)
        bucket_carrier, frame_count, *ratio = rest
        return self.method.rank(merged_embeds.float(), bucket_carrier.shape[0], frame_count, *ratio, extra=extra)

    def host_inputs(self, bucket: int, frame_count: int, q: float) -> dict[str, np.ndarray]:
        """The inputs after the rows for one request: the bucket carrier, ``T`` and, for VidCom2, the ratio."""
        return pruning_host_inputs(self.method.name, bucket, frame_count, q)

    def kept_token_count(self, tokens_per_frame: int, frame_count: int, q: float) -> int:
        """``K``: how many entries of the ranking the host keeps for this ``T`` and ``q``."""
        return self.method.kept_token_count(tokens_per_frame, frame_count, q)

    def symbols(self, tokens_per_frame: int, bucket: int) -> dict[str, int]:
        return pruning_symbols(tokens_per_frame, bucket)

    def dummy_inputs(self, tokens_per_frame: int, bucket: int, hidden: int, frame_count: int | None = None,
                     q: float = 0.5, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        """Random rows (``hidden`` wide, and ``score_levels`` extra levels) plus host inputs, in graph order."""
        rows = pruning_symbols(tokens_per_frame, bucket)[BUCKET_TOKENS]
        generator = torch.Generator().manual_seed(seed)
        inputs = {"merged_embeds": torch.randn(rows, hidden, generator=generator).to(dtype)}
        if self.score_levels:
            inputs["score_extras"] = torch.randn(self.score_levels, rows, hidden, generator=generator).to(dtype)
        count = bucket if frame_count is None else frame_count
        inputs.update({k: torch.from_numpy(v) for k, v in self.host_inputs(bucket, count, q).items()})
        return inputs


def pruning_graph_spec(method: str, score_levels: int) -> VisionGraphSpec:
    """I/O of a ranking graph, in forward order, with the dynamic axes' symbols."""
    takes_ratio = pruning_method(method).takes_ratio
    inputs: dict[str, dict[int, str]] = {"merged_embeds": {0: BUCKET_TOKENS}}
    if score_levels:
        inputs["score_extras"] = {1: BUCKET_TOKENS}
    inputs.update(bucket_carrier={0: FRAME_BUCKET}, frame_count={})
    if takes_ratio:
        inputs["retention_ratio"] = {}
    return VisionGraphSpec(inputs=inputs, outputs={"ranking": {0: BUCKET_TOKENS}})
