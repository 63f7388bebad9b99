"""VidCom2 (Video Compression Commander, Liu et al., EMNLP 2025): which merged video tokens survive pruning.

Semantics are vLLM 0.32's ``vllm.multimodal.video_prune.vidcom2``, on the same embeddings as EVS
(``(T*h*w, D)`` in raster order; a family with extra rows scores ``[merger | extra levels]``):

* **count** ``K = max(T, min(int(T*h*w * (1.0 - q)), T*h*w))`` in Python double: at least one token per frame;
* **scores**: keep the ``D // 2`` channels of lowest population variance (over all rows, ascending), L2-normalise
  each row, and give every token the sum of Gaussian kernels ``exp(-|x - c|^2 / (2a))``, ``a`` in 2^-3..2, to the
  video's centre (``video_kernel``) plus the same to its frame's centre. Lower similarity = more distinctive;
* **per-frame budgets**: frame score ``s_f = -mean(video_kernel of frame f)``, ``p = softmax((s - max s) / 0.01)``,
  ``scale_f = min(1, r * ((1 + p_f) - mean(p)))`` with ``r = 1 - q`` rounded once to float32 (torch rounds a Python
  scalar to the tensor's dtype before multiplying), ``k_f = clamp(round(scale_f * h*w), 1, h*w)`` (float32, round
  half to even);
* **selection**: each frame keeps its ``k_f`` least similar tokens; then the total is reconciled to ``K`` by dropping
  the most similar kept tokens or adding the least similar unkept ones.

**Ties** (equal similarities, equal variances): every step keeps the lower flat index. That is what vLLM's
``torch.topk`` calls keep on CUDA, where vLLM serves: its gather kernel writes the values strictly past the k-th,
then the k-th value's ties in index order (``aten/src/ATen/native/cuda/TensorTopK.cu``, single- and multi-block
paths alike). On CPU, ``torch.topk`` resolves ties by libstdc++'s ``nth_element``/``partial_sort``, whose choice
depends on the arrangement of the whole row (``topk(zeros(20), 3, largest=False)`` keeps 12, 13, 14); no static
graph reproduces that, so tests run vLLM's function with a topk that follows the CUDA rule wherever values tie.

**Frames that score exactly alike** (a frozen video) get ``p_f = 1/T`` each, and every budget then hangs on how
``mean(p)`` rounds: a sum of T copies of ``float32(1/T)`` depends on the order of its additions. Torch's CPU sum of
T values, the sum over a padded bucket here and ONNX Runtime's agree for every T <= 64 but 31, where
``scale_f * h*w`` can land on the other side of a .5 (e.g. q = 0.5, h*w = 3); vLLM on CUDA sums in its own order.

Two forms: ``retention_mask`` is the eager reference (one video, unpadded, the definition above with torch's own
ops), ``rank_candidates`` the exportable form over a frame bucket: rows padded to ``B`` temporal patches, ``T`` and
``r`` as tensors, static shapes, returning a ranking whose first ``K(q, T)`` entries are the kept set for any ``K``
(``evs.kept_from_ranking``). Padding frames enter no statistic (variance, centres, softmax) and rank last.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from qeff_evs.evs import (
    ascending_order,
    check_bucket_inputs,
    checked_video,
    descending_order,
    exporting,
    real_frames,
    validate_pruning_rate,
)

GAUSSIAN_BANDWIDTHS: tuple[float, ...] = (0.125, 0.25, 0.5, 1.0, 2.0)  # 2^-3 .. 2^1, summed in this order
LOW_VARIANCE_SHARE = 0.5
BUDGET_TEMPERATURE = 0.01
# Above every similarity (a sum of 10 kernels, each at most 1), exact in fp16 too: marks rows a ranking step skips.
RANK_SENTINEL = 255.0


def kept_token_count(tokens_per_frame: int, num_frames: int, q: float) -> int:
    """Number of merged video tokens VidCom2 keeps: at least one per frame."""
    q = validate_pruning_rate(q)
    if tokens_per_frame < 1 or num_frames < 1:
        raise ValueError(
            f"tokens_per_frame and num_frames must be >= 1, got {tokens_per_frame} and {num_frames}")
    total = tokens_per_frame * num_frames
    # Integer product, a double multiply, truncation, then the floor and ceiling (vLLM's order).
    return max(num_frames, min(int(total * (1.0 - q)), total))


def retention_ratio(q: float) -> np.float32:
    """``1 - q`` in double, rounded once to float32: the factor vLLM's budget multiply really uses.

    The pruning graph takes this value, not q: ``1 - float32(q)`` computed in float32 differs from it for
    about 4 in 10 two-decimal rates (0.09, 0.16, 0.29, ...), and the card computes no float64.
    """
    return np.float32(1.0 - validate_pruning_rate(q))


def scoring_channels(width: int) -> int:
    """How many low-variance channels score the tokens: half the feature width, at least one."""
    return max(1, int(width * LOW_VARIANCE_SHARE))


def _channel_count(width) -> int:
    # Under export ``width`` is a traced size: ``width // 2`` stays a graph value (graph widths are >= 2).
    return width // 2 if exporting() else scoring_channels(width)


def gaussian_kernels(rows: torch.Tensor, centre: torch.Tensor) -> torch.Tensor:
    """``(..., N, C)`` unit rows, a broadcastable centre -> ``(..., N)``: the kernels of every bandwidth, summed in order."""
    difference = rows - centre
    squared_distance = (difference * difference).sum(dim=-1)
    total = None
    for bandwidth in GAUSSIAN_BANDWIDTHS:
        # 2 * bandwidth is a power of two: dividing by it is exact, as in vLLM's expression.
        kernel = torch.exp(-squared_distance / (2.0 * bandwidth))
        total = kernel if total is None else total + kernel
    return total


def unit_rows(rows: torch.Tensor) -> torch.Tensor:
    """``F.normalize(rows, dim=-1)`` (``x / max(|x|, 1e-12)``); under export with its norm spelled out."""
    if not exporting():
        return F.normalize(rows, dim=-1)
    return rows / torch.sqrt((rows * rows).sum(dim=-1, keepdim=True)).clamp_min(1e-12)


def frame_budgets(video_kernel: torch.Tensor, ratio: torch.Tensor | float, real: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """``(F, N)`` video kernels -> ``(F,)`` int64 tokens each frame keeps before reconciliation.

    ``ratio`` is ``1 - q``: a Python double (the eager reference, as vLLM writes it) or ``retention_ratio(q)``
    as a float32 tensor (the graph), which multiply float32 rows alike.
    ``real`` marks the frames of the video; the others (padding of a bucket) get 0 and enter neither the
    softmax nor its mean.
    """
    tokens = video_kernel.shape[-1]
    if real is None:
        frame_score = -video_kernel.mean(dim=-1)
        share = F.softmax((frame_score - frame_score.max()) / BUDGET_TEMPERATURE, dim=0)
        mean_share = share.mean()
    else:
        # Summed over a middle axis: ONNX Runtime adds a last axis in an order that follows where each row
        # starts in memory (rows of h*w floats start at different alignments), so identical frames could score
        # an ulp apart, which the temperature and the rounding of budgets amplify; over a middle axis every
        # output adds its inputs in index order.
        frame_score = -(video_kernel.reshape(*video_kernel.shape, 1).sum(dim=1).reshape(-1) / tokens)
        score = torch.where(real, frame_score, torch.full_like(frame_score, float("-inf")))
        share = F.softmax((score - score.max()) / BUDGET_TEMPERATURE, dim=0)  # exp(-inf) = 0 for padding
        mean_share = share.sum() / real.sum().to(share.dtype)
    scale = (ratio * ((1.0 + share) - mean_share)).clamp(max=1.0)
    budget = (scale * tokens).round().clamp(min=1, max=tokens)
    if real is not None:
        budget = torch.where(real, budget, torch.zeros_like(budget))
    return budget.to(torch.int64)


# ---------------------------------------------------------------------------------------------
# Eager reference: one video, unpadded
# ---------------------------------------------------------------------------------------------


def _similarity_and_budgets(embeds: torch.Tensor, frames: int, ratio: float) -> tuple[torch.Tensor, torch.Tensor]:
    variance = embeds.var(dim=0, unbiased=False)
    channels = torch.argsort(variance, stable=True)[: scoring_channels(embeds.shape[-1])]
    unit = F.normalize(embeds.index_select(-1, channels).reshape(frames, -1, channels.numel()), dim=-1)
    video_kernel = gaussian_kernels(unit, unit.mean(dim=(0, 1), keepdim=True))
    frame_kernel = gaussian_kernels(unit, unit.mean(dim=1, keepdim=True))
    return video_kernel + frame_kernel, frame_budgets(video_kernel, ratio)


def retention_mask(embeds: torch.Tensor, grid_thw: Sequence[int] | torch.Tensor, spatial_merge_size: int,
                   q: float) -> torch.BoolTensor:
    """Boolean mask over the ``T*h*w`` merged tokens (raster order) of the tokens VidCom2 keeps (the reference)."""
    q, (t, h, w) = checked_video(embeds, grid_thw, spatial_merge_size, q)
    # A Python double, as in vLLM: torch rounds it to the tensor's (or, for bf16/fp16, the op's) precision.
    similarity, budgets = _similarity_and_budgets(embeds, t, 1.0 - q)
    keep = torch.zeros(t, h * w, dtype=torch.bool, device=embeds.device)
    least_similar = torch.argsort(similarity, dim=1, stable=True)
    for frame, budget in enumerate(budgets.tolist()):
        keep[frame, least_similar[frame, :budget]] = True
    keep, flat_similarity = keep.reshape(-1), similarity.reshape(-1)
    surplus = int(budgets.sum()) - kept_token_count(h * w, t, q)
    if surplus > 0:  # drop the most similar of the kept tokens
        kept = keep.nonzero().reshape(-1)
        keep[kept[torch.argsort(flat_similarity[kept], descending=True, stable=True)[:surplus]]] = False
    elif surplus < 0:  # add the least similar of the others
        others = (~keep).nonzero().reshape(-1)
        keep[others[torch.argsort(flat_similarity[others], stable=True)[:-surplus]]] = True
    return keep


# ---------------------------------------------------------------------------------------------
# Exportable form: a ranking over a frame bucket
# ---------------------------------------------------------------------------------------------


def rank_candidates(embeds: torch.Tensor, bucket: int, frame_count: torch.Tensor, ratio: torch.Tensor,
                    extra: torch.Tensor | None = None) -> torch.Tensor:
    """VidCom2 over a frame bucket: ``(B*h*w,)`` int64 ranking whose first ``K(q, T)`` rows are the kept set.

    ``embeds`` is a video's merged rows padded to ``bucket`` temporal patches (``(B*h*w, D)``; what the padding
    rows hold never matters), ``frame_count`` one int64 ``T <= B``, ``ratio`` one float
    ``retention_ratio(q)``, ``extra`` optional scoring features ``(B*h*w, E)`` concatenated after ``embeds``.
    With ``S`` the per-frame selection (``c`` rows), the ranking is ``S`` in the reverse of vLLM's drop order
    (so any prefix ``K <= c`` is ``S`` less its ``c - K`` most similar rows), then the other real rows in vLLM's
    add order (least similar first), then padding rows in index order.

    The reference's quantities with static shapes: every statistic sums each frame's tokens, then the video's
    frames (padding frames left out), and divides by the real row count. Identical tokens get identical scores (ties stay ties) where each
    row of scoring channels is a whole number of SIMD vectors (16 floats: every Qwen width); see
    ``frame_budgets`` for the sums over tokens.
    """
    if not exporting():
        check_bucket_inputs(embeds.shape[0], bucket, frame_count)
        if ratio.numel() != 1 or not 0.0 < float(ratio.reshape(-1)[0]) <= 1.0:
            raise ValueError(f"ratio must be one value in (0, 1], got {ratio}; pass retention_ratio(q)")
    features = embeds if extra is None else torch.cat([embeds, extra], dim=-1)
    rows, width = features.shape
    frames = features.reshape(bucket, -1, width)
    tokens = frames.shape[1]
    real = real_frames(frame_count, bucket)
    real_count = frame_count.reshape(-1)[:1] * tokens
    row_count = real_count.to(features.dtype)

    def over_real_rows(per_frame: torch.Tensor) -> torch.Tensor:
        """``(B, C)`` sums over each frame's tokens -> ``(C,)`` sum over the video's frames (padding left out)."""
        return torch.where(real[:, None], per_frame, torch.zeros_like(per_frame)).sum(dim=0)

    # Population variance of each channel over the real rows; the lowest half scores the tokens.
    mean = over_real_rows(frames.sum(dim=1)) / row_count
    deviation = frames - mean
    variance = over_real_rows((deviation * deviation).sum(dim=1)) / row_count
    channels = ascending_order(variance)[: _channel_count(width)]
    unit = unit_rows(frames.index_select(-1, channels))

    unit_sums = unit.sum(dim=1)
    video_centre = over_real_rows(unit_sums) / row_count
    frame_centre = (unit_sums / tokens)[:, None, :]
    video_kernel = gaussian_kernels(unit, video_centre)
    similarity = video_kernel + gaussian_kernels(unit, frame_centre)
    budget = frame_budgets(video_kernel, ratio.reshape(-1)[:1].to(features.dtype), real)

    # Each frame's `budget` least similar tokens (ties: lower index), via the rank of every token in its frame.
    rank_in_frame = ascending_order(ascending_order(similarity, dim=1), dim=1)
    selected = (rank_in_frame < budget[:, None]).reshape(-1)
    flat_similarity = similarity.reshape(-1)
    sentinel = torch.full_like(flat_similarity, RANK_SENTINEL)
    unselected = real[:, None].expand(bucket, tokens).reshape(-1) & ~selected
    drop_order = descending_order(torch.where(selected, flat_similarity, -sentinel))
    add_order = ascending_order(torch.where(unselected, flat_similarity, sentinel))

    selected_count = budget.sum()
    position = torch.arange(rows, device=features.device)
    from_selected = drop_order.gather(0, (selected_count - 1 - position).clamp(min=0))
    from_added = add_order.gather(0, (position - selected_count).clamp(min=0))
    return torch.where(position < selected_count, from_selected,
                       torch.where(position < real_count, from_added, position))
