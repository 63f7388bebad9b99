"""Fine-grained FP8 (``quant_method: fp8``; Qwen's "-FP8" releases, DeepSeek's): e4m3 weights with block scales.

A converted linear stores ``weight`` (float8_e4m3fn, ``(out, in)``) and ``weight_scale_inv``
(``(ceil(out / b0), ceil(in / b1))`` for ``weight_block_size [b0, b1]``, in bf16, fp16 or fp32 by release); despite
its name the scale multiplies: the weight is ``weight * scale_inv[row // b0, col // b1]``, blocks at the bottom and
right edges cut short when ``b`` does not divide the shape. Without ``weight_block_size`` the scale is ``weight_scale``,
one per tensor (vLLM's serialised FP8). Computed in fp32: the fp8 value and the scale are exact there, so the product
rounds once.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from qeff_evs.weights.linear_format import LinearFormat, require

METHOD = "fp8"


def block_grid(shape: Sequence[int], block: Sequence[int]) -> tuple[int, int]:
    """How many ``block``s cover a ``shape`` matrix, per axis (edge blocks cut short)."""
    return math.ceil(int(shape[0]) / int(block[0])), math.ceil(int(shape[1]) / int(block[1]))


def scale_grid(scale: torch.Tensor, shape: Sequence[int], block: Sequence[int]) -> torch.Tensor:
    """``scale`` (one value per ``block`` of a ``shape`` matrix) spread to every element, fp32, ``shape``.

    Example: shape (3, 5), block (2, 2), scale (2, 3): rows 0-1 take scale row 0, row 2 scale row 1; columns 0-1,
    2-3 and 4 scale columns 0, 1 and 2.
    """
    rows, cols = int(shape[0]), int(shape[1])
    grid = block_grid(shape, block)
    require(tuple(scale.shape) == grid, f"a scale of shape {list(scale.shape)} does not cover a {[rows, cols]} weight "
            f"in blocks of {list(block)} (it needs {list(grid)})")
    full = scale.float().repeat_interleave(int(block[0]), 0).repeat_interleave(int(block[1]), 1)
    return full[:rows, :cols]


def scaled(weight: torch.Tensor, scale: torch.Tensor, block: Sequence[int] | None) -> torch.Tensor:
    """``weight`` (fp8) times its scale, fp32: ``block`` given, one scale per block; else one per tensor (a single
    value) or per output channel (``(out,)`` or ``(out, 1)``), read from the scale's shape."""
    rows, cols = weight.shape
    if block is None:
        if scale.numel() == 1:
            block = (rows, cols)
            scale = scale.reshape(1, 1)
        else:
            require(scale.numel() == rows and scale.shape[0] == rows,
                    f"a scale of shape {list(scale.shape)} is neither one per tensor nor one per row of a "
                    f"{[rows, cols]} weight")
            block = (1, cols)
            scale = scale.reshape(rows, 1)
    b0, b1 = int(block[0]), int(block[1])
    if rows % b0 == 0 and cols % b1 == 0 and tuple(scale.shape) == (rows // b0, cols // b1):
        # Whole blocks (released widths): one fp32 copy, scaled in place block by block (the same products).
        grid = weight.float().view(rows // b0, b0, cols // b1, b1)
        return grid.mul_(scale.float()[:, None, :, None]).view(rows, cols)
    return weight.float() * scale_grid(scale, (rows, cols), block)


def block_size(config: Mapping[str, Any]) -> tuple[int, int] | None:
    block = config.get("weight_block_size")
    if block is None:
        return None
    require(len(block) == 2 and all(int(b) > 0 for b in block),
            f"weight_block_size {block} is not two positive sizes [rows, columns]")
    return int(block[0]), int(block[1])


def linear_format(config: Mapping[str, Any]) -> LinearFormat:
    fmt = str(config.get("fmt", "e4m3"))
    require(fmt == "e4m3", f"fp8 checkpoint with fmt {fmt!r}: qeff-evs reads e4m3 (float8_e4m3fn) weights")
    block = block_size(config)
    scale = "weight_scale_inv" if block is not None else "weight_scale"

    def shape(shapes):
        return tuple(shapes["weight"])

    def dequantize(parts):
        return scaled(parts["weight"], parts[scale], block)

    return LinearFormat(METHOD, marker=scale, parts=("weight", scale), shape=shape, dequantize=dequantize,
                        skipped=("input_scale",), settings={"weight_block_size": block, "scale": scale})
