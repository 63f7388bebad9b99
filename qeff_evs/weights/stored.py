"""A checkpoint's tensors as floats by name: a quantized linear ``X`` shows as one fp32 ``X.weight``, dequantized.

``StoredWeights`` joins ``shards.Shards`` and the folder's ``LinearFormat`` (none for a float checkpoint): every
linear stored quantized (``X.<marker>`` present) becomes the name ``X.weight`` with the float shape, and its parts
and skipped tensors leave the listing; every other tensor is listed as stored. ``read`` gives fp32 (exact: bf16, fp16
and fp8 convert to fp32 without rounding; a quantized weight is dequantized in fp32), integer tensors as stored.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from qeff_evs.weights.linear_format import LinearFormat
from qeff_evs.weights.quantization import QuantizationRecord, linear_format, read_record
from qeff_evs.weights.shards import Shards

FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu)


@dataclass(frozen=True)
class QuantizedLinear:
    """One linear stored quantized: its parts' stored names by suffix."""

    parts: dict[str, str]


class StoredWeights:
    """The folder's tensors by float name; see the module docstring."""

    def __init__(self, shards: Shards, fmt: LinearFormat | None = None,
                 quantization: QuantizationRecord | None = None) -> None:
        self.shards = shards
        self.format = fmt
        self.quantization = quantization
        self._quantized: dict[str, QuantizedLinear] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        taken: set[str] = set()
        if fmt is not None:
            marker = "." + fmt.marker
            for name in shards.names():
                if not name.endswith(marker):
                    continue
                prefix = name[: -len(marker)]
                parts = {suffix: f"{prefix}.{suffix}" for suffix in fmt.parts}
                absent = [n for n in parts.values() if n not in shards]
                if absent:
                    raise ValueError(f"{shards.model_dir} stores {name} but not {', '.join(absent)}; a {fmt.method} "
                                     f"linear needs {', '.join(fmt.parts)}: the checkpoint is incomplete")
                parts.update({s: f"{prefix}.{s}" for s in fmt.optional if f"{prefix}.{s}" in shards})
                linear = QuantizedLinear(parts)
                self._quantized[f"{prefix}.weight"] = linear
                self._shapes[f"{prefix}.weight"] = tuple(fmt.shape({s: shards.shape(n) for s, n in parts.items()}))
                taken.update(parts.values())
                taken.update(f"{prefix}.{s}" for s in fmt.skipped)
        for name in shards.names():
            if name not in taken and name not in self._shapes:
                self._shapes[name] = shards.shape(name)

    @classmethod
    def open(cls, model_dir: str | Path) -> StoredWeights:
        """The folder's weights, its quantization record read from its config (refused if we do not read it)."""
        record = read_record(Path(model_dir))
        return cls(Shards(model_dir), None if record is None else linear_format(record, str(model_dir)), record)

    def names(self) -> tuple[str, ...]:
        return tuple(self._shapes)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(self._shapes)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def is_quantized(self, name: str) -> bool:
        return name in self._quantized

    def read(self, name: str) -> torch.Tensor:
        """fp32 for a float (or quantized) tensor, exact; an integer tensor as stored."""
        linear = self._quantized.get(name)
        if linear is not None:
            return self.format.dequantize({s: self.shards.read(n) for s, n in linear.parts.items()})
        tensor = self.shards.read(name)
        if tensor.dtype in FLOAT8:
            raise ValueError(f"{self.shards.model_dir} stores {name} in {tensor.dtype} without the scale that gives its "
                             "values; its config.json's quantization_config does not describe this checkpoint")
        return tensor.float() if tensor.is_floating_point() else tensor

    def stored_parts(self, name: str) -> tuple[str, ...]:
        """The stored tensors ``read(name)`` reads: a quantized linear's parts (in their suffixes' order), else
        ``name``."""
        linear = self._quantized.get(name)
        return (name,) if linear is None else tuple(linear.parts[s] for s in sorted(linear.parts))

    def reads_rows(self, name: str) -> bool:
        """Whether ``read_rows`` reads ``name`` (a float tensor stored as it is: not quantized, not fp8)."""
        return (name not in self._quantized and name in self.shards and self.shards.dtype(name).is_floating_point
                and self.shards.dtype(name) not in FLOAT8 and len(self.shards.shape(name)) >= 1)

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` (first axis) of a tensor ``reads_rows`` takes, fp32, exact."""
        if not self.reads_rows(name):
            raise ValueError(f"{name} is not a float tensor stored as it is; read it whole")
        return self.shards.read_rows(name, start, stop).float()

    def close(self) -> None:
        self.shards.close()
