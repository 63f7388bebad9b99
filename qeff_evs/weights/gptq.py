"""GPTQ (``quant_method: gptq``; AutoGPTQ's and GPTQModel's releases): 2-, 4- or 8-bit weights packed along the input.

A quantized linear stores ``qweight`` (int32, ``(in * bits / 32, out)``: word ``r`` holds input rows ``r * n`` to
``r * n + n - 1``, ``n = 32 / bits``, lowest bits first), ``scales`` (``(groups, out)``), ``qzeros`` (int32,
``(groups, out * bits / 32)``, packed along the output) and, with activation order (``desc_act``), ``g_idx``
(``(in,)``: the group of each input row; without it row ``k`` is in group ``k // group_size``). The transposed
weight is ``(q - z[g]) * s[g]`` per input row, in fp32; the module's weight is its transpose.

Zero points: AutoGPTQ's format (``checkpoint_format: gptq``, the default) stores ``zero - 1``; GPTQModel's
``gptq_v2`` stores the zero itself. A symmetric checkpoint (``sym: true``) has the zero ``2 ** (bits - 1)`` and its
``qzeros`` are not read, as vLLM's GPTQ kernels take it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from qeff_evs.weights.int_packing import unpack_first, unpack_last
from qeff_evs.weights.linear_format import LinearFormat, require

METHOD = "gptq"
READ_BITS = (2, 4, 8)
# checkpoint_format -> what is added to a stored zero to get the zero
ZERO_OFFSET = {"gptq": 1, "gptq_v2": 0}


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int, *,
               qzeros: torch.Tensor | None = None, zero_offset: int = 1,
               g_idx: torch.Tensor | None = None) -> torch.Tensor:
    """The ``(out, in)`` fp32 weight of one GPTQ linear (module docstring); ``qzeros`` None: symmetric."""
    q = unpack_first(qweight, bits)  # (in, out)
    rows, cols = q.shape
    if g_idx is None:
        row_group = torch.arange(rows) // (rows if group_size <= 0 else group_size)
    else:
        require(tuple(g_idx.shape) == (rows,), f"GPTQ g_idx of shape {list(g_idx.shape)} for {rows} input rows")
        row_group = g_idx.long()
    require(scales.shape[1] == cols and int(row_group.max()) < scales.shape[0],
            f"GPTQ scales of shape {list(scales.shape)} do not cover a {[rows, cols]} (in, out) weight's groups")
    if qzeros is None:
        z = torch.full((1, cols), 1 << (bits - 1), dtype=torch.int32)
    else:
        z = (unpack_last(qzeros, bits)[:, :cols] + zero_offset)[row_group]
    return ((q - z).float() * scales.float()[row_group]).t().contiguous()


def linear_format(config: Mapping[str, Any]) -> LinearFormat:
    bits = int(config.get("bits", 4))
    require(bits in READ_BITS, f"GPTQ with {bits}-bit weights: qeff-evs reads {', '.join(map(str, READ_BITS))}-bit "
            "GPTQ (3-bit words straddle int32 boundaries)")
    fmt = str(config.get("checkpoint_format", "gptq")).lower()
    require(fmt in ZERO_OFFSET, f"GPTQ checkpoint_format {fmt!r}: qeff-evs reads {', '.join(ZERO_OFFSET)}")
    group_size = int(config.get("group_size", 128))
    sym = bool(config.get("sym", True))
    parts = ("qweight", "scales") if sym else ("qweight", "scales", "qzeros")

    def shape(shapes):
        words, cols = shapes["qweight"]
        return cols, words * (32 // bits)

    def read(parts):
        return dequantize(parts["qweight"], parts["scales"], bits, group_size, qzeros=parts.get("qzeros"),
                          zero_offset=ZERO_OFFSET[fmt], g_idx=parts.get("g_idx"))

    return LinearFormat(METHOD, marker="qweight", parts=parts, shape=shape, dequantize=read,
                        optional=("g_idx",), skipped=("qzeros",) if sym else (),
                        settings={"bits": bits, "group_size": group_size, "sym": sym, "checkpoint_format": fmt,
                                  "desc_act": bool(config.get("desc_act", False))})
