"""Frame sizes: transformers' Qwen-VL size rules (its ``smart_resize`` functions, behind this module's one-line
checks), Nemotron-H's rule of one tile near a patch budget, and the exported size a clip is resized to
(``choose_resolution``)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction

from qeff_evs.specializations.sets import check_frame_size

MAX_ASPECT_RATIO = 200  # HF refuses frames more elongated than this


def _check_positive(height: int, width: int) -> None:
    if height < 1 or width < 1:
        raise ValueError(f"frame size must be positive, got {height}x{width}")


def _check_aspect(height: int, width: int) -> None:
    _check_positive(height, width)
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(
            f"aspect ratio of {height}x{width} exceeds {MAX_ASPECT_RATIO}:1; crop the frames first"
        )


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers' Qwen2-VL size rule for one frame (sides multiples of ``factor``, area in [min, max], shape
    kept), after this module's one-line checks of the size."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as qwen2_vl_rule

    _check_aspect(height, width)
    return tuple(qwen2_vl_rule(height, width, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels))


def smart_resize_video(
    num_frames: int,
    height: int,
    width: int,
    *,
    temporal_factor: int,
    factor: int,
    min_pixels: int,
    max_pixels: int,
) -> tuple[int, int]:
    """transformers' Qwen3-VL video size rule (like :func:`smart_resize`, but the limits bound frames x area; frames
    smaller than one ``factor`` are first scaled up), after this module's one-line checks."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize as qwen3_vl_rule

    if num_frames < temporal_factor:
        raise ValueError(f"need at least temporal_factor={temporal_factor} frames, got {num_frames}")
    _check_positive(height, width)  # before scaling up by factor / height
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        _check_aspect(int(height * scale), int(width * scale))
    else:
        _check_aspect(height, width)
    return tuple(qwen3_vl_rule(num_frames, height, width, temporal_factor=temporal_factor, factor=factor,
                               min_pixels=min_pixels, max_pixels=max_pixels))


def patch_budget_size(height: int, width: int, target_patches: int, keep_aspect: bool, patch_size: int,
                      merge_size: int) -> tuple[int, int]:
    """One tile of about ``target_patches`` patches, its sides multiples of ``merge_size`` patches (Nemotron-H's rule:
    vLLM's ``get_video_target_size_and_feature_size``, transformers' ``_compute_target_patches``).

    With ``keep_aspect`` the patch grid follows the frame's aspect (sides rounded half to even), then each side moves
    to a multiple of ``merge_size``: up when both rounded up stay within the budget, else down (never below one
    block); without it, the largest square of whole blocks within the budget.
    """
    _check_positive(height, width)
    divisor = merge_size
    if keep_aspect:
        aspect = width / max(height, 1)
        rows = max(round(math.sqrt(target_patches / aspect)), 1)
        cols = max(round(math.sqrt(target_patches * aspect)), 1)
        if divisor > 1:
            rows_up, cols_up = rows + (-rows) % divisor, cols + (-cols) % divisor
            if rows_up * cols_up <= target_patches:
                rows, cols = rows_up, cols_up
            else:
                rows, cols = max(divisor, rows - rows % divisor), max(divisor, cols - cols % divisor)
    else:
        side = max(divisor, (int(math.sqrt(target_patches)) // divisor) * divisor)
        rows = cols = side
    return rows * patch_size, cols * patch_size


def check_exported_size(size: Sequence[int], factor: int) -> tuple[int, int]:
    if len(size) != 2:
        raise ValueError(f"a frame size is (height, width), got {size!r}")
    height, width = (int(v) for v in size)
    check_frame_size(height, width, factor, exported=True)
    return height, width


def choose_resolution(
    height: int, width: int, exported: Sequence[Sequence[int]], factor: int
) -> tuple[int, int]:
    """The exported (height, width) closest in aspect ratio to a ``height x width`` video.

    Closeness is the ratio between the two aspect ratios, larger over smaller (so 2:1 is as far
    from 1:1 as 1:2), compared exactly with fractions. Ties go to the size whose pixel count is
    closest (same larger-over-smaller ratio) to the video's, so a small clip is not blown up to a
    big resolution needlessly; remaining ties to the earlier entry of ``exported``. Every exported
    size must be a multiple of ``factor`` (= patch_size * merge_size).
    """
    _check_positive(height, width)
    if not exported:
        raise ValueError("no exported resolutions to choose from; export at least one --height/--width")
    sizes = [check_exported_size(size, factor) for size in exported]

    def distance(size: tuple[int, int]) -> tuple[Fraction, Fraction]:
        out_h, out_w = size
        aspect = Fraction(out_h * width, out_w * height)
        area = Fraction(out_h * out_w, height * width)
        return max(aspect, 1 / aspect), max(area, 1 / area)

    best = min(range(len(sizes)), key=lambda i: (distance(sizes[i]), i))
    return sizes[best]
