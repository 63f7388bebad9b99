"""Quantized checkpoints written by the tests themselves, in each release's layout, with an independent fp32 answer.

Every packer here quantizes a float weight its own way (numpy, its own bit packing), writes the tensors a release
stores for that linear, and returns beside them the weight those tensors stand for, computed from the integer
codes and scales it chose (never by unpacking what it wrote, and never with qeff-evs's code):

* ``fp8_block``: fine-grained FP8 (Qwen's "-FP8"): e4m3 ``weight`` and a ``weight_scale_inv`` per block
  (blocks may not divide the shape; the scale in bf16, fp16 or fp32);
* ``fp8_compressed``: compressed-tensors FP8 (RedHat's): ``weight`` and ``weight_scale`` per tensor, per output
  channel or per block;
* ``awq``: AutoAWQ's GEMM packing: ``qweight``/``qzeros`` with 8 columns per int32 in its interleaved order,
  ``scales`` fp16;
* ``gptq``: ``qweight`` packed along the input, ``qzeros`` along the output (stored ``zero - 1`` in AutoGPTQ's
  format, the zero itself in ``gptq_v2``), ``scales``, ``g_idx`` (scattered groups with ``desc_act``), sym or asym.

``quantize_checkpoint`` turns a ``save_pretrained`` folder into a quantized release (its decoder's linears packed,
per-expert MoE tensors as releases store them, the rest in the release's float dtype, ``quantization_config`` in
config.json) and a float reference folder holding the same weights dequantized (fp32) in the layout transformers
reads: the same checkpoint by an independent path.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from helpers.release_layouts import FUSED, experts_split, read_all, rewrite, write_shards

FP8_MAX = 448.0
AWQ_SLOT_COLUMN = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ: bit slot i of a word holds column AWQ_SLOT_COLUMN[i] of its 8


@dataclass
class Packed:
    stored: dict[str, torch.Tensor]  # suffix -> tensor, what the release stores for the linear
    dequantized: torch.Tensor  # (out, in) fp32: what those tensors stand for


def to_words(values: np.ndarray) -> np.ndarray:
    """Unsigned 32-bit patterns (int64 holding 0..2**32-1) as the int32 a checkpoint stores."""
    return (values & 0xFFFFFFFF).astype(np.uint32).view(np.int32)


def pack_columns(codes: np.ndarray, bits: int, slot_column=None) -> np.ndarray:
    """``(rows, cols)`` codes -> ``(rows, cols * bits / 32)`` int32: word ``c`` holds columns ``c * n ..``; bit slot
    ``i`` holds column ``slot_column[i]`` of them (default ``i``)."""
    n = 32 // bits
    slot_column = slot_column or tuple(range(n))
    words = np.zeros((codes.shape[0], codes.shape[1] // n), dtype=np.int64)
    for slot, column in enumerate(slot_column):
        words |= codes[:, column::n].astype(np.int64) << (bits * slot)
    return to_words(words)


def pack_rows(codes: np.ndarray, bits: int) -> np.ndarray:
    """``(rows, cols)`` codes -> ``(rows * bits / 32, cols)`` int32, rows ``r * n + i`` in word ``r``'s slot ``i``."""
    return pack_columns(codes.T, bits).T.copy()


def block_max(weight: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    rows, cols = weight.shape
    grid = np.zeros((math.ceil(rows / block[0]), math.ceil(cols / block[1])), dtype=np.float32)
    for i in range(grid.shape[0]):
        for j in range(grid.shape[1]):
            grid[i, j] = np.abs(weight[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]]).max()
    return grid


def fp8_from_scales(weight: torch.Tensor, scales: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(e4m3 codes, fp32 dequantized)`` of ``weight`` with one scale (already in its stored dtype) per block."""
    rows, cols = weight.shape
    spread = np.repeat(np.repeat(scales.float().numpy(), block[0], 0), block[1], 1)[:rows, :cols]
    codes = torch.from_numpy(np.clip(weight.numpy() / spread, -FP8_MAX, FP8_MAX)).to(torch.float8_e4m3fn)
    return codes, torch.from_numpy(codes.float().numpy() * spread)


def fp8_block(weight: torch.Tensor, block: tuple[int, int], scale_dtype: torch.dtype) -> Packed:
    scales = torch.from_numpy(np.maximum(block_max(weight.numpy(), block), 1e-6) / FP8_MAX).to(scale_dtype)
    codes, dequantized = fp8_from_scales(weight, scales, block)
    return Packed({"weight": codes, "weight_scale_inv": scales}, dequantized)


def fp8_compressed(weight: torch.Tensor, strategy: str, scale_dtype: torch.dtype = torch.float32,
                   block: tuple[int, int] = (32, 32)) -> Packed:
    rows, cols = weight.shape
    grid = {"tensor": (rows, cols), "channel": (1, cols), "block": block}[strategy]
    scales = torch.from_numpy(np.maximum(block_max(weight.numpy(), grid), 1e-6) / FP8_MAX).to(scale_dtype)
    codes, dequantized = fp8_from_scales(weight, scales, grid)
    stored_scale = scales.reshape(1) if strategy == "tensor" else scales
    return Packed({"weight": codes, "weight_scale": stored_scale}, dequantized)


def asymmetric(values: np.ndarray, bits: int, axis: int, min_zero: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``(fp16 scale, integer zero)`` over ``axis`` of ``values``, min..max onto 0..2**bits-1."""
    top = (1 << bits) - 1
    low, high = np.minimum(values.min(axis), 0), np.maximum(values.max(axis), 0)
    scale = np.maximum((high - low) / top, 1e-4).astype(np.float16)
    zero = np.clip(np.round(-low / scale.astype(np.float32)), min_zero, top).astype(np.int64)
    return scale, zero


def awq(weight: torch.Tensor, group: int, bits: int = 4) -> Packed:
    transposed = weight.numpy().T  # (in, out)
    rows, cols = transposed.shape
    grouped = transposed.reshape(rows // group, group, cols)
    scale, zero = asymmetric(grouped, bits, axis=1)  # (groups, out)
    scale32 = scale.astype(np.float32)
    codes = np.clip(np.round(grouped / scale32[:, None] + zero[:, None]), 0, (1 << bits) - 1).astype(np.int64)
    dequantized = ((codes - zero[:, None]).astype(np.float32) * scale32[:, None]).reshape(rows, cols).T
    return Packed({"qweight": torch.from_numpy(pack_columns(codes.reshape(rows, cols), bits, AWQ_SLOT_COLUMN)),
                   "qzeros": torch.from_numpy(pack_columns(zero, bits, AWQ_SLOT_COLUMN)),
                   "scales": torch.from_numpy(scale)}, torch.from_numpy(np.ascontiguousarray(dequantized)))


def gptq(weight: torch.Tensor, group: int, *, bits: int = 4, sym: bool = True, desc_act: bool = False,
         checkpoint_format: str = "gptq", seed: int = 0) -> Packed:
    transposed = weight.numpy().T  # (in, out)
    rows, cols = transposed.shape
    groups = rows // group
    g_idx = np.arange(rows) // group
    if desc_act:  # activation order: each group's rows scattered over the input
        g_idx = g_idx[np.random.default_rng(seed).permutation(rows)]
    top = (1 << bits) - 1
    scale = np.zeros((groups, cols), np.float16)
    zero = np.zeros((groups, cols), np.int64)
    for g in range(groups):
        values = transposed[g_idx == g]
        if sym:
            scale[g] = np.maximum(np.abs(values).max(0) / (top // 2), 1e-4).astype(np.float16)
            zero[g] = 1 << (bits - 1)
        else:  # AutoGPTQ's format cannot store a zero of 0 (it stores zero - 1)
            scale[g], zero[g] = asymmetric(values, bits, axis=0, min_zero=1 if checkpoint_format == "gptq" else 0)
    scale32 = scale.astype(np.float32)
    codes = np.clip(np.round(transposed / scale32[g_idx] + zero[g_idx]), 0, top).astype(np.int64)
    dequantized = ((codes - zero[g_idx]).astype(np.float32) * scale32[g_idx]).T
    stored_zero = zero - (1 if checkpoint_format == "gptq" else 0)
    return Packed({"qweight": torch.from_numpy(pack_rows(codes, bits)),
                   "qzeros": torch.from_numpy(pack_columns(stored_zero, bits)),
                   "scales": torch.from_numpy(scale), "g_idx": torch.from_numpy(g_idx.astype(np.int32))},
                  torch.from_numpy(np.ascontiguousarray(dequantized)))


@dataclass(frozen=True)
class Release:
    """One quantized release's layout: its config record, float dtype, and how it packs one linear."""

    name: str
    quantization_config: dict
    float_dtype: torch.dtype
    pack: Callable[[torch.Tensor], Packed]
    # Whether a linear of this (out, in) shape packs (a quantizer leaves one that does not in float: a tiny Mamba
    # in_proj's 100 outputs fill no whole 32-bit word of 4-bit codes).
    fits: Callable[[tuple[int, ...]], bool] = lambda shape: True


def fp8_release(block=(32, 48), scale_dtype=torch.bfloat16) -> Release:
    config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block),
              "modules_to_not_convert": ["lm_head", "model.visual", "mlp.gate", "shared_expert_gate", "in_proj_a",
                                         "in_proj_b"]}
    return Release(f"fp8_{block[0]}x{block[1]}_{str(scale_dtype)[6:]}", config, torch.bfloat16,
                   lambda w: fp8_block(w, block, scale_dtype))


def compressed_release(strategy="channel", scale_dtype=torch.float32) -> Release:
    weights = {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, "dynamic": False}
    if strategy == "block":
        weights["block_structure"] = [32, 32]
    config = {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
              "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "format": "float-quantized",
                                            "input_activations": {"num_bits": 8, "type": "float",
                                                                  "strategy": "token", "dynamic": True}}},
              "ignore": ["lm_head", "re:.*visual.*", "re:.*mlp.gate$"]}
    return Release(f"compressed_fp8_{strategy}", config, torch.bfloat16,
                   lambda w: fp8_compressed(w, strategy, scale_dtype))


def awq_release(group=16) -> Release:
    config = {"quant_method": "awq", "bits": 4, "group_size": group, "version": "gemm", "zero_point": True,
              "modules_to_not_convert": ["visual"]}
    return Release("awq", config, torch.float16, lambda w: awq(w, group), packs_int(4, group))


def gptq_release(group=16, bits=4, sym=True, desc_act=False, checkpoint_format="gptq") -> Release:
    config = {"quant_method": "gptq", "bits": bits, "group_size": group, "sym": sym, "desc_act": desc_act,
              "checkpoint_format": checkpoint_format}
    name = f"gptq_{bits}bit_{'sym' if sym else 'asym'}{'_act' if desc_act else ''}_{checkpoint_format}"
    return Release(name, config, torch.float16,
                   lambda w: gptq(w, group, bits=bits, sym=sym, desc_act=desc_act, checkpoint_format=checkpoint_format),
                   packs_int(bits, group))


def packs_int(bits: int, group: int) -> Callable[[tuple[int, ...]], bool]:
    """Whether an (out, in) linear packs as ``bits``-bit codes in int32 words with groups of ``group`` inputs."""
    return lambda shape: shape[0] % (32 // bits) == 0 and shape[1] % group == 0 and shape[1] % (32 // bits) == 0


# The linears a release quantizes: the decoder's, but not the routers, the shared expert's gate or Gated DeltaNet's
# small projections (Qwen's FP8 releases leave those in bf16, as do the others).
DECODER_LINEAR = re.compile(r"(^|\.)layers\.\d+\..*\.weight$")
KEPT_FLOAT = re.compile(r"mlp\.gate\.weight$|shared_expert_gate\.weight$|in_proj_[ab]\.weight$|conv1d\.weight$")


def quantized_linear(name: str, tensor: torch.Tensor) -> bool:
    return (tensor.dim() == 2 and "visual" not in name and bool(DECODER_LINEAR.search(name))
            and not KEPT_FLOAT.search(name))


def fuse_experts(tensors: dict[str, torch.Tensor], like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert tensors fused back where ``like`` (the saved checkpoint) holds them fused (Qwen3-VL-MoE)."""
    out = dict(tensors)
    for name, fused in like.items():
        match = FUSED.match(name)
        if not match:
            continue
        prefix, kind = match.groups()
        rows = []
        for e in range(fused.shape[0]):
            parts = ("down_proj",) if kind == "down_proj" else ("gate_proj", "up_proj")
            rows.append(torch.cat([out.pop(f"{prefix}.{e}.{p}.weight") for p in parts], dim=0))
        out[name] = torch.stack(rows)
    return out


def quantize_checkpoint(saved: Path, release: Release, quantized: Path, reference: Path) -> tuple[Path, Path]:
    """``saved`` (a save_pretrained folder) as ``release`` stores it, and its fp32 reference (module docstring)."""
    original = read_all(saved)
    per_expert = experts_split(original)  # releases store experts one by one (a no-op where they already are)
    stored, dequantized = {}, {}
    for name, tensor in per_expert.items():
        if quantized_linear(name, tensor) and release.fits(tuple(tensor.shape)):
            packed = release.pack(tensor.float())
            prefix = name[: -len(".weight")]
            stored.update({f"{prefix}.{suffix}": t for suffix, t in packed.stored.items()})
            dequantized[name] = packed.dequantized
        else:
            stored[name] = tensor.to(release.float_dtype) if tensor.is_floating_point() else tensor
            dequantized[name] = stored[name].float() if tensor.is_floating_point() else tensor

    def with_record(config: dict) -> dict:
        return {**config, "quantization_config": release.quantization_config,
                "dtype": str(release.float_dtype).removeprefix("torch.")}

    rewrite(saved, quantized, lambda _: stored, shards=2, config=with_record)
    rewrite(saved, reference, lambda _: fuse_experts(dequantized, original))
    return quantized, reference


def reader_folder(folder: Path, release: Release, tensors: dict[str, torch.Tensor]) -> Path:
    """A folder with only ``tensors`` and a config.json carrying ``release``'s record (for the format tests)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"quantization_config": release.quantization_config}))
    write_shards(tensors, folder)
    return folder
