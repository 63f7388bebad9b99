"""A checkpoint's weights under a module's state-dict names: what the in-memory load and the streamed export read.

``ModuleWeights`` answers, for every name of the module's ``state_dict`` (tied names included): its shape (from the
safetensors headers, no data read) and its tensor, fp32, exact, in the module's layout, read when asked and held by no
one else (bf16 and fp16 converted, a quantized weight dequantized, per-expert tensors fused, a transposed fused
expert tensor swapped, one part of a stored fused tensor cut out of it). ``quantization`` is the folder's
quantization record (None for a float checkpoint).

``content_digest`` says what a set of module tensors is made from, by content: every file's header, the
quantization record, where each tensor comes from (its ``Source``) and a SHA-256 of each stored tensor it reads
(``Shards.digest``: taken from the bytes as they are read, or read for it, never converted). An export keeps a unit
of weights written earlier only if its digest is this one.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence

import torch

from qeff_evs.weights.name_map import Chunk, NameMap, PerExpert, Source, Stored, Transposed, plan, source_shape
from qeff_evs.weights.quantization import QuantizationRecord
from qeff_evs.weights.stored import StoredWeights


class ModuleWeights:
    """See the module docstring. Built by ``qeff_evs.models.checkpoint.open_weights``."""

    def __init__(self, stored: StoredWeights, module_shapes: Mapping[str, Sequence[int]],
                 tied: Mapping[str, Sequence[str]], name_map: NameMap) -> None:
        self.stored = stored
        self._shapes = stored.shapes()
        self._sources: dict[str, Source] = plan(name_map, {n: tuple(s) for n, s in module_shapes.items()}, tied,
                                                self._shapes, where=str(stored.shards.model_dir))

    @property
    def quantization(self) -> QuantizationRecord | None:
        return self.stored.quantization

    def names(self) -> tuple[str, ...]:
        return tuple(self._sources)

    def source(self, name: str) -> Source:
        try:
            return self._sources[name]
        except KeyError:
            raise KeyError(f"the model has no tensor {name!r}") from None

    def shape(self, name: str) -> tuple[int, ...]:
        return source_shape(self.source(name), self._shapes)

    def tensor(self, name: str) -> torch.Tensor:
        source = self.source(name)
        if isinstance(source, Stored):
            return self.stored.read(source.name)
        if isinstance(source, Transposed):
            return self.stored.read(source.name).transpose(1, 2).contiguous()
        if isinstance(source, Chunk):  # a copy: the whole stored tensor is not kept alive by its part
            return self.stored.read(source.name).chunk(source.count, dim=0)[source.index].clone()
        assert isinstance(source, PerExpert)
        fused = torch.empty(self.shape(name), dtype=torch.float32)
        for expert, names in enumerate(source.names):
            row = 0
            for part in names:
                rows = self._shapes[part][0]
                fused[expert, row:row + rows] = self.stored.read(part)
                row += rows
        return fused

    def row_range(self, name: str) -> tuple[str, int] | None:
        """Where ``name``'s rows (first axis) lie in a stored float tensor read by rows: its stored name and the row
        its first row is; None where it is made otherwise (dequantized, fused, transposed: read it whole)."""
        source = self.source(name)
        if isinstance(source, Stored) and self.stored.reads_rows(source.name):
            return source.name, 0
        if isinstance(source, Chunk) and self.stored.reads_rows(source.name):
            rows = self._shapes[source.name][0]
            if rows % source.count == 0:  # equal chunks (the plan checked the shape)
                return source.name, source.index * (rows // source.count)
        return None

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` of ``name``'s tensor, fp32, exact (a tensor ``row_range`` places)."""
        placed = self.row_range(name)
        if placed is None:
            raise ValueError(f"{name} is not read by rows; read it whole with tensor()")
        stored, first = placed
        if not 0 <= start <= stop <= self.shape(name)[0]:
            raise IndexError(f"rows {start}:{stop} of {name}, which has {self.shape(name)[0]}")
        return self.stored.read_rows(stored, first + start, first + stop)

    def stored_names(self, name: str) -> tuple[str, ...]:
        """The stored (float) tensors ``name``'s tensor is made from."""
        source = self.source(name)
        if isinstance(source, PerExpert):
            return tuple(part for names in source.names for part in names)
        return (source.name,)

    def layout_digest(self) -> str:
        """SHA-256 of the checkpoint's layout, none of its tensors' data: every file's header and the quantization
        record (what a graph traced from the checkpoint depends on besides its config: ``export.reuse``)."""
        record = self.quantization
        return hashlib.sha256((self.stored.shards.header_digest + json.dumps(
            None if record is None else record.to_json(), sort_keys=True)).encode()).hexdigest()

    def content_digest(self, names: Sequence[str]) -> str:
        """SHA-256 of what the module tensors ``names`` (in this order) are made from: the module docstring."""
        shards = self.stored.shards
        record = self.quantization
        running = hashlib.sha256(shards.header_digest.encode())
        running.update(json.dumps(None if record is None else record.to_json(), sort_keys=True).encode())
        parts = {name: [part for stored in self.stored_names(name) for part in self.stored.stored_parts(stored)]
                 for name in names}
        shards.digest_all([part for read in parts.values() for part in read])
        for name in names:
            running.update(f"\0{name}\0{self.source(name)!r}".encode())
            for part in parts[name]:
                running.update(shards.digest(part).encode())
        return running.hexdigest()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every tensor at once (the in-memory load's; tied names share one tensor)."""
        read: dict[Source, torch.Tensor] = {}
        for name, source in self._sources.items():
            if source not in read:
                read[source] = self.tensor(name)
        return {name: read[source] for name, source in self._sources.items()}

    def close(self) -> None:
        """Close the checkpoint's files (nothing stays mapped or open)."""
        self.stored.close()

    def __enter__(self) -> ModuleWeights:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
