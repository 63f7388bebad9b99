"""How a quantized format stores one linear layer: the shape every format module fills in.

A quantized checkpoint stores a linear ``X`` as several tensors ``X.<suffix>`` (its packed weight, scales, zeros, ...)
in place of the float ``X.weight``. ``LinearFormat`` names them and holds the format's pure functions: the float
weight's shape from the stored shapes, and its dequantization to fp32 from the stored tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

Shapes = Mapping[str, tuple[int, ...]]  # suffix -> stored shape
Parts = Mapping[str, torch.Tensor]  # suffix -> stored tensor


@dataclass(frozen=True)
class LinearFormat:
    """One format's stored linear ``X``: ``X.<marker>`` present means ``X`` is quantized; its float weight, named
    ``X.weight``, is ``dequantize({suffix: X.<suffix>})`` of shape ``shape({suffix: stored shape})``, ``(out, in)``."""

    method: str  # the quant_method, as the checkpoint's config names it
    marker: str  # the suffix whose presence says a linear is stored quantized
    parts: tuple[str, ...]  # suffixes read to dequantize (each must be stored)
    shape: Callable[[Shapes], tuple[int, int]]
    dequantize: Callable[[Parts], torch.Tensor]
    optional: tuple[str, ...] = ()  # suffixes read when stored (GPTQ's g_idx)
    skipped: tuple[str, ...] = ()  # stored beside the linear, not a weight of the module (activation scales)
    settings: Mapping[str, Any] | None = None  # what the format read from the config, for the record


def require(condition: bool, message: str) -> None:
    """A format's check of a config value or stored tensor: ValueError with ``message`` when it fails."""
    if not condition:
        raise ValueError(message)
