"""AWQ, 4-bit GEMM packing (``quant_method: awq``, ``version: gemm``; AutoAWQ's and Qwen's "-AWQ" releases).

A quantized linear stores ``qweight`` (int32, ``(in, out / 8)``), ``qzeros`` (int32, ``(in / group, out / 8)``) and
``scales`` (fp16, ``(in / group, out)``), packed along the output axis in AutoAWQ's interleaved order: bit slot ``i``
(shift ``4 * i``) of a word holds column ``AWQ_ORDER[i]`` of its group of 8 (vLLM undoes it with
``[0, 4, 1, 5, 2, 6, 3, 7]``, the inverse). The transposed weight is ``(q - z) * s`` per group of ``group`` input
rows, in fp32; the module's weight is its transpose ``(out, in)``. Other AWQ versions (GEMV, Marlin, ExLlama) pack
differently, and checkpoints without zero points (``zero_point: false``) are rare and read differently by different
kernels: both are refused by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from qeff_evs.weights.int_packing import unpack_last
from qeff_evs.weights.linear_format import LinearFormat, require

METHOD = "awq"
BITS = 4
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # bit slot i of a word holds column AWQ_ORDER[i] of its 8


def dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int,
               bits: int = BITS) -> torch.Tensor:
    """The ``(out, in)`` fp32 weight of one AWQ GEMM linear (module docstring)."""
    q = unpack_last(qweight, bits, AWQ_ORDER)  # (in, out)
    rows = q.shape[0]
    group = rows if group_size <= 0 else group_size
    groups = -(-rows // group)
    require(tuple(scales.shape) == (groups, q.shape[1]), f"AWQ scales of shape {list(scales.shape)} do not match a "
            f"{list(q.shape)} (in, out) weight in groups of {group} rows (expected {[groups, q.shape[1]]})")
    row_group = torch.arange(rows) // group
    z = unpack_last(qzeros, bits, AWQ_ORDER)[row_group]
    return ((q - z).float() * scales.float()[row_group]).t().contiguous()


def linear_format(config: Mapping[str, Any]) -> LinearFormat:
    version = str(config.get("version", "gemm")).lower()
    require(version == "gemm", f"AWQ version {version!r}: qeff-evs reads AutoAWQ's GEMM packing (version gemm)")
    bits = int(config.get("bits", config.get("w_bit", BITS)))
    require(bits == BITS, f"AWQ with {bits}-bit weights: qeff-evs reads 4-bit AWQ")
    group_size = int(config.get("group_size", config.get("q_group_size", 128)))
    require(bool(config.get("zero_point", True)), "AWQ without zero points (zero_point false): qeff-evs reads "
            "AutoAWQ's GEMM checkpoints with zero points")

    def shape(shapes):
        rows, words = shapes["qweight"]
        return words * (32 // bits), rows

    def read(parts):
        return dequantize(parts["qweight"], parts["qzeros"], parts["scales"], group_size, bits)

    return LinearFormat(METHOD, marker="qweight", parts=("qweight", "qzeros", "scales"), shape=shape,
                        dequantize=read, settings={"bits": bits, "group_size": group_size})
