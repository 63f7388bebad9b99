"""EVS (Efficient Video Sampling): which merged video tokens survive pruning.

Semantics are vLLM's (``vllm.multimodal.video_prune.evs``), reproduced bit for bit:

* kept count ``K = max(h*w, int(h*w*T * (1 - q)))`` in Python double precision;
* dissimilarity ``1 - cosine_similarity`` with the same spatial token of the previous
  temporal patch, in the embeddings' dtype, frame 0 pinned to the sentinel 255;
* the K largest survive, ties broken toward the lower flat index, raster order kept.

Two selection paths share the dissimilarity: the eager reference (stable argsort, the
definition) and the exportable one (TopK, whose ONNX tie rule is the same "lower index
first"; eager ``torch.topk`` breaks ties the other way, so it is only used under export).

A pruning graph serves every video length up to its frame bucket and every rate (docs/design.md#pruning-semantics):
``rank_candidates`` orders all ``B*h*w`` rows of a video padded to ``B`` temporal patches, given
the real count ``T`` as a tensor, and the host keeps the first ``K(q, T)`` of that ranking
(``kept_from_ranking``). q never reaches the graph; padding rows rank after every real row.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

FIRST_FRAME_SENTINEL = 255.0
# Below every real dissimilarity (1 - cos lies in [0, 2]), exact in fp16 too: padding ranks last.
PADDING_SENTINEL = -255.0
# The exported cosine runs over this many runs of frame pairs (a smaller peak; see _chunked_cosine).
COSINE_CHUNKS = 4


def validate_pruning_rate(q: float) -> float:
    """Return ``q`` as a float, or raise if it is not a pruning rate in [0, 1)."""
    try:
        value = float(q)
    except (TypeError, ValueError):
        raise ValueError(f"video pruning rate must be a number in [0, 1), got {q!r}") from None
    if math.isnan(value) or not 0.0 <= value < 1.0:
        raise ValueError(
            f"video pruning rate must be in [0, 1) (0 disables EVS), got {q!r}; "
            "pass e.g. --video-pruning-rate 0.5"
        )
    return value


def kept_token_count(tokens_per_frame: int, num_frames: int, q: float) -> int:
    """Number of merged video tokens EVS keeps: at least one full frame."""
    q = validate_pruning_rate(q)
    if tokens_per_frame < 1 or num_frames < 1:
        raise ValueError(
            f"tokens_per_frame and num_frames must be >= 1, got {tokens_per_frame} and {num_frames}"
        )
    # Integer product first, then a double multiply, then truncation: the order vLLM uses.
    total = tokens_per_frame * num_frames
    return max(tokens_per_frame, int(total * (1 - q)))


def merged_grid(grid_thw: Sequence[int] | torch.Tensor, spatial_merge_size: int) -> tuple[int, int, int]:
    """(T, h, w) on the merged grid from the patch grid (T, H, W); H and W must divide by the merge size."""
    t, h, w = (int(v) for v in grid_thw)
    m = int(spatial_merge_size)
    if m < 1:
        raise ValueError(f"spatial_merge_size must be >= 1, got {spatial_merge_size}")
    if t < 1 or h < 1 or w < 1:
        raise ValueError(f"grid_thw must be positive, got {(t, h, w)}")
    if h % m or w % m:
        raise ValueError(
            f"patch grid {h}x{w} is not divisible by spatial_merge_size {m}; "
            f"resize frames so the patch grid is a multiple of {m}"
        )
    return t, h // m, w // m


def _chunked_cosine(frames: torch.Tensor) -> torch.Tensor:
    """Export form of ``cosine_similarity(frames[1:], frames[:-1], dim=-1)``, a few frames at a time.

    Each chunk is the same cosine (the same ops per element, in the same order) over a consecutive run
    of frame pairs. ONNX Runtime materialises every Slice, so the whole-video form holds two shifted
    copies of the video plus a product at its peak; in chunks that working set is divided by
    ``COSINE_CHUNKS``. Bounds follow the traced T; a chunk may be empty when T - 1 < COSINE_CHUNKS.
    """
    pairs = frames.shape[0] - 1
    bounds = [1 + pairs * i // COSINE_CHUNKS for i in range(COSINE_CHUNKS + 1)]
    return torch.cat([F.cosine_similarity(frames[lo:hi], frames[lo - 1:hi - 1], dim=-1)
                      for lo, hi in zip(bounds, bounds[1:])])


def frame_dissimilarity(frames: torch.Tensor) -> torch.Tensor:
    """``(T, hw, D)`` -> ``(T, hw)``: 1 - cosine with the previous frame, frame 0 = 255.

    Runs in the input dtype, with PyTorch's cosine definition (eps 1e-8), as vLLM does.
    """
    if exporting():
        similarity = _chunked_cosine(frames)
    else:
        similarity = F.cosine_similarity(frames[1:], frames[:-1], dim=-1)
    sentinel = torch.full_like(frames[:1, :, 0], FIRST_FRAME_SENTINEL)
    return torch.cat([sentinel, 1 - similarity], dim=0)


def checked_video(embeds: torch.Tensor, grid_thw: Sequence[int] | torch.Tensor, spatial_merge_size: int,
                  q: float) -> tuple[float, tuple[int, int, int]]:
    """What every reference retention mask checks first: ``q`` validated, and the merged grid ``(t, h, w)``
    whose ``t*h*w`` rows ``embeds`` must be."""
    q = validate_pruning_rate(q)
    t, h, w = merged_grid(grid_thw, spatial_merge_size)
    _check_embeds(embeds, t, h, w)
    return q, (t, h, w)


def _check_embeds(embeds: torch.Tensor, t: int, h: int, w: int) -> None:
    rows = t * h * w
    if embeds.dim() != 2:
        raise ValueError(
            f"embeds must be 2-D (T*h*w, D) = ({rows}, D), got shape {tuple(embeds.shape)}; "
            "flatten the video's merged tokens"
        )
    if embeds.shape[0] != rows:
        raise ValueError(
            f"embeds has {embeds.shape[0]} rows but the merged grid {t}x{h}x{w} needs {rows} "
            f"((T*h*w, D) = ({rows}, D)); pass the merger output of exactly this video"
        )


def reference_keep_order(dissimilarity: torch.Tensor, k: int) -> torch.Tensor:
    """Flat indices of the ``k`` most dissimilar tokens, ties toward the lower index, ascending."""
    order = torch.argsort(dissimilarity.reshape(-1), descending=True, stable=True)
    return torch.sort(order[:k]).values


def retention_mask(embeds: torch.Tensor, grid_thw: Sequence[int] | torch.Tensor, spatial_merge_size: int,
                   q: float) -> torch.BoolTensor:
    """Boolean mask over the ``T*h*w`` merged tokens (raster order) of the tokens EVS keeps."""
    q, (t, h, w) = checked_video(embeds, grid_thw, spatial_merge_size, q)
    dissimilarity = frame_dissimilarity(embeds.reshape(t, h * w, embeds.shape[-1]))
    keep = reference_keep_order(dissimilarity, kept_token_count(h * w, t, q))
    mask = torch.zeros(t * h * w, dtype=torch.bool, device=embeds.device)
    mask[keep] = True
    return mask


def exporting() -> bool:
    """Whether a torch.onnx export (or torch.export) is tracing: the selection then takes its TopK form."""
    return torch.onnx.is_in_onnx_export() or torch.compiler.is_exporting()


def exportable_keep_order(dissimilarity: torch.Tensor, kept_carrier: torch.Tensor) -> torch.Tensor:
    """Ascending flat indices of the K kept tokens, K = ``kept_carrier.shape[0]``.

    Export form: TopK(K) (ONNX ties -> lower index), then a second TopK over the indices to
    restore raster order. No NonZero, no boolean indexing, no data-dependent shape. In eager
    mode it falls back to the reference order so both paths mean the same thing.
    """
    flat = dissimilarity.reshape(-1)
    k = kept_carrier.shape[0]
    if not exporting():
        return reference_keep_order(flat, k)
    top = torch.topk(flat, k, largest=True, sorted=True).indices
    return torch.topk(top, k, largest=False, sorted=True).values


def _check_selection_shapes(embeds: torch.Tensor, frames: int, k: int, extra: torch.Tensor | None) -> None:
    if embeds.dim() != 2:
        raise ValueError(f"embeds must be 2-D (T*h*w, D), got shape {tuple(embeds.shape)}")
    rows = embeds.shape[0]
    if frames < 1 or rows % frames:
        raise ValueError(
            f"{rows} embedding rows do not split into {frames} frames; "
            "the frames carrier length must be the temporal grid size T"
        )
    if not 1 <= k <= rows:
        raise ValueError(
            f"kept count {k} must be in [1, {rows}]; size the kept carrier with kept_token_count"
        )
    if extra is not None and (extra.dim() != 2 or extra.shape[0] != rows):
        raise ValueError(f"extra features must be 2-D with {rows} rows, got shape {tuple(extra.shape)}")


def select_kept(
    embeds: torch.Tensor, frames: int, kept_carrier: torch.Tensor, extra: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep the EVS-selected rows of ``embeds`` (``(T*hw, D)``); returns ``(rows (K, D), indices (K,))``.

    The dissimilarity is taken over ``embeds`` concatenated with ``extra`` along features
    (a family's extra rows, e.g. Qwen3-VL's multi-level features) when given; callers gather ``extra``
    with the same indices.
    """
    if not exporting():
        # Under export these sizes are symbols; in eager mode catch what TopK would
        # otherwise turn into a silent short selection or an opaque reshape error.
        _check_selection_shapes(embeds, frames, kept_carrier.shape[0], extra)
    features = embeds if extra is None else torch.cat([embeds, extra], dim=-1)
    per_frame = features.reshape(frames, -1, features.shape[-1])
    indices = exportable_keep_order(frame_dissimilarity(per_frame), kept_carrier)
    return embeds.index_select(0, indices), indices


def tokens_per_frame_kept(
    kept_indices: torch.Tensor | Sequence[int], num_frames: int, tokens_per_frame: int
) -> list[int]:
    """Per temporal patch, how many kept flat indices fall in it."""
    if num_frames < 1 or tokens_per_frame < 1:
        raise ValueError(
            f"num_frames and tokens_per_frame must be >= 1, got {num_frames} and {tokens_per_frame}"
        )
    idx = torch.as_tensor(kept_indices, dtype=torch.int64).reshape(-1)
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= num_frames * tokens_per_frame):
        raise ValueError(
            f"kept indices must lie in [0, {num_frames * tokens_per_frame}), got range "
            f"[{int(idx.min())}, {int(idx.max())}]"
        )
    return torch.bincount(idx // tokens_per_frame, minlength=num_frames).tolist()


# ---------------------------------------------------------------------------------------------
# Ranking over a frame bucket: one graph for every T <= B and every q
# ---------------------------------------------------------------------------------------------


def ascending_order(key: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Indices that sort ``key`` ascending along ``dim``, ties toward the lower index.

    Export form: a full-length TopK (ONNX breaks ties toward the lower index). Eager form: a stable
    argsort, because eager ``torch.topk`` on CPU resolves ties by its selection algorithm.
    """
    if exporting():
        return torch.topk(key, key.shape[dim], dim=dim, largest=False, sorted=True).indices
    return torch.argsort(key, dim=dim, stable=True)


def descending_order(key: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Indices that sort ``key`` descending along ``dim``, ties toward the lower index (see ``ascending_order``)."""
    if exporting():
        return torch.topk(key, key.shape[dim], dim=dim, largest=True, sorted=True).indices
    return torch.argsort(key, dim=dim, descending=True, stable=True)


def real_frames(frame_count: torch.Tensor, bucket: int) -> torch.Tensor:
    """``(B,)`` bool: which temporal patches of a bucket of ``B`` hold the video (the first ``T``)."""
    return torch.arange(bucket, device=frame_count.device) < frame_count.reshape(-1)[:1]


def check_bucket_inputs(rows: int, bucket: int, frame_count: torch.Tensor) -> None:
    """Eager checks of a padded video: rows split into ``bucket`` frames, ``1 <= T <= bucket``."""
    if bucket < 1 or rows % bucket:
        raise ValueError(
            f"{rows} rows do not split into a bucket of {bucket} temporal patches; "
            "pad the video's merged rows to bucket * tokens_per_frame")
    if frame_count.numel() != 1 or frame_count.dtype != torch.int64:
        raise ValueError(
            f"frame_count must hold one int64 (the real temporal patches T), got {frame_count.dtype} "
            f"with shape {tuple(frame_count.shape)}")
    if not 1 <= int(frame_count.reshape(-1)[0]) <= bucket:
        raise ValueError(
            f"frame_count {int(frame_count.reshape(-1)[0])} is outside [1, {bucket}]; "
            "use a bucket at least as long as the video")


def rank_candidates(embeds: torch.Tensor, bucket: int, frame_count: torch.Tensor,
                    extra: torch.Tensor | None = None) -> torch.Tensor:
    """EVS over a frame bucket: ``(B*h*w,)`` int64, every row ranked from most to least worth keeping.

    ``embeds`` is a video's merged rows padded to ``bucket`` temporal patches (``(B*h*w, D)``, raster
    order); ``frame_count`` a one-element int64 tensor ``T <= B``; ``extra`` optional scoring features
    ``(B*h*w, E)`` concatenated after ``embeds`` (a family's extra rows, level by level). Real rows rank by
    dissimilarity, descending, ties toward the lower flat index; padding rows follow in index order.
    The first ``kept_token_count(h*w, T, q)`` entries are vLLM's kept set for every ``T`` and ``q``
    (``kept_from_ranking``). Runs in the input dtype, like ``retention_mask``.
    """
    if not exporting():
        check_bucket_inputs(embeds.shape[0], bucket, frame_count)
    features = embeds if extra is None else torch.cat([embeds, extra], dim=-1)
    frames = features.reshape(bucket, -1, features.shape[-1])
    dissimilarity = frame_dissimilarity(frames)
    padding = torch.full_like(dissimilarity, PADDING_SENTINEL)
    key = torch.where(real_frames(frame_count, bucket)[:, None], dissimilarity, padding)
    return descending_order(key.reshape(-1))


def kept_from_ranking(ranking, k: int) -> np.ndarray:
    """The first ``k`` entries of a pruning graph's ranking, ascending int64: the rows to keep."""
    order = np.asarray(ranking.detach().cpu() if isinstance(ranking, torch.Tensor) else ranking)
    if order.ndim != 1 or order.dtype.kind not in "iu":
        raise ValueError(f"ranking must be a 1-D integer array, got {order.dtype} with shape {order.shape}")
    if isinstance(k, bool) or int(k) != k or not 1 <= k <= order.size:
        raise ValueError(
            f"cannot keep {k!r} of {order.size} ranked rows; compute k with the method's kept_token_count")
    return np.sort(order[: int(k)]).astype(np.int64)
