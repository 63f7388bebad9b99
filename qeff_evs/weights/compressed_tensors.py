"""FP8 in compressed-tensors (``quant_method: compressed-tensors``, ``format: float-quantized``): llm-compressor's
releases (RedHat's "-FP8-dynamic", "-FP8").

A quantized linear stores ``weight`` (float8_e4m3fn, ``(out, in)``) and ``weight_scale``: one value (strategy
``tensor``), one per output channel (``channel``: ``(out, 1)``), or one per block (``block``: ``block_structure``);
static activation schemes add ``input_scale``, which is not a weight. The weight is ``weight * weight_scale`` (the
scale multiplies), in fp32. Which linears are quantized is what the checkpoint stores (``ignore`` lists the rest).
Other compressed-tensors formats (``pack-quantized`` int4, ``nvfp4-pack-quantized``, ...) are refused by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from qeff_evs.weights.fp8 import block_grid, scaled
from qeff_evs.weights.linear_format import LinearFormat, require

METHOD = "compressed-tensors"
READ_FORMATS = ("float-quantized", "naive-quantized")


def group_formats(config: Mapping[str, Any]) -> tuple[str, ...]:
    """Every storage format the config names: its own and each config group's."""
    groups = (config.get("config_groups") or {}).values()
    named = [config.get("format")] + [group.get("format") for group in groups]
    return tuple(dict.fromkeys(f for f in named if f))


def block_structure(config: Mapping[str, Any]) -> tuple[int, int] | None:
    """The block of a ``block`` weight strategy, if a config group has one (the same for every group)."""
    blocks = {tuple(int(b) for b in group["weights"]["block_structure"])
              for group in (config.get("config_groups") or {}).values()
              if (group.get("weights") or {}).get("strategy") == "block"}
    require(len(blocks) <= 1, f"compressed-tensors config groups with different weight blocks {sorted(blocks)}: "
            "qeff-evs reads one block structure per checkpoint")
    return next(iter(blocks), None)


def linear_format(config: Mapping[str, Any]) -> LinearFormat:
    formats = group_formats(config)
    unread = [f for f in formats if f not in READ_FORMATS]
    require(not unread, f"compressed-tensors format {', '.join(unread)}: qeff-evs reads its FP8 formats "
            f"({', '.join(READ_FORMATS)}); use the FP8 or unquantized release")
    for name, group in (config.get("config_groups") or {}).items():
        weights = group.get("weights") or {}
        require(weights.get("type", "float") == "float" and int(weights.get("num_bits", 8)) == 8,
                f"compressed-tensors group {name} holds {weights.get('num_bits')}-bit {weights.get('type')} weights: "
                "qeff-evs reads 8-bit float (FP8) weights")
    block = block_structure(config)

    def shape(shapes):
        return tuple(shapes["weight"])

    def dequantize(parts):
        weight, scale = parts["weight"], parts["weight_scale"]
        # One value per block where the scale is the block grid; a tensor or channel scale reads from its shape.
        blocked = block is not None and tuple(scale.shape) == block_grid(weight.shape, block)
        return scaled(weight, scale, block if blocked else None)

    return LinearFormat(METHOD, marker="weight_scale", parts=("weight", "weight_scale"), shape=shape,
                        dequantize=dequantize, skipped=("input_scale", "weight_zero_point"),
                        settings={"formats": formats, "block_structure": block})
