"""The weights of a streamed export: each initializer a traced graph cuts out (``weight_exprs.cut_weights``), computed
from the checkpoint's tensors and written to its file.

A graph traced from a hollow module (``onnx_graph.trace_without_weights``) takes the module's parameters as inputs
and keeps every op on them that constant folding would have folded (the ``Transpose`` in front of each ``MatMul``, a
``Reshape`` of a convolution kernel, Qwen3.5's ``1 + w`` norm scale). ``cut_weights`` takes those ops out of the graph:
each value they produce that the rest of the graph reads becomes an initializer described by a ``WeightExpr`` (the
ops, and the parameters they start from). ``write_weights`` later computes each one from the checkpoint's tensors,
one at a time, and appends it to an external-data file (``WeightStore``); ``attach_weights`` points the graph at
them. So the graph holds what the in-memory export's constant folding would have given it, and no weight is ever in
memory twice.

Weights are written in units (the embedding, one decoder layer, a vision block...), one file each, in order, each
with an index that records what it was written from: ``unit_digest``, a SHA-256 of the writer's settings
(``settings_stamp``), the unit's weights (``GraphWeight.key``) and the content of the checkpoint tensors they read
(``ModuleWeights.content_digest``: headers and each tensor's stored bytes). A unit whose index carries the digest the
checkpoint gives now is not written again, whatever the folder held before: an interrupted export resumes at the first
unit not yet written, and another checkpoint's unit (even one of the same names, sizes and times) is rewritten.
Checking a digest reads the checkpoint's bytes (hashing them), never converts or writes them.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from qeff_evs.export.weight_exprs import LAYOUT_OPS, WeightExpr

FLOAT32, FLOAT16 = "float32", "float16"
WEIGHT_DTYPES = (FLOAT32, FLOAT16)
_STORED = {FLOAT32: TensorProto.FLOAT, FLOAT16: TensorProto.FLOAT16}
# The file offset of each weight of ALIGNED_FROM bytes or more is a multiple of ALIGNMENT (the page size any runtime
# maps files with).
ALIGNMENT = 1 << 16
ALIGNED_FROM = 1 << 20
WEIGHTS_DIR = "weights"
# A matrix of more than BY_ROWS_ABOVE fp32 bytes (an embedding, an LM head: a vocabulary's rows, read whole, would be
# in memory as stored and in fp32, ~3.5 GiB at 8B widths) is read and written ROW_BLOCK bytes of rows at a time.
# Below it a whole read holds no more than three blocks would, and writes in long runs.
ROW_BLOCK = 128 << 20
BY_ROWS_ABOVE = 4 * ROW_BLOCK
Progress = Callable[[str], None]


@dataclass(frozen=True)
class GraphWeight:
    """One initializer of a graph, and where it comes from: ``expr`` over the checkpoint tensors ``sources`` (module
    ``state_dict`` names, one per ``expr.sources``), written with the weights of ``unit``."""

    name: str
    expr: WeightExpr
    sources: tuple[str, ...]
    unit: str

    @property
    def key(self) -> str:
        """What the stored bytes are: equal for two graphs' weights computed alike from the same tensors."""
        return "|".join([*self.sources, self.expr.signature()])


def weight_name(sources: Sequence[str], expr: WeightExpr) -> str:
    """An initializer's name: its checkpoint tensor's, with the ops that made it (``...q_proj.weight:Transpose``)."""
    base = "+".join(sources)
    return f"{base}:{expr.ops}" if expr.ops else base


@dataclass(frozen=True)
class Stored:
    """Where a weight's bytes are: ``location`` (relative to the graph's folder), offset, length, dims, ONNX type."""

    location: str
    offset: int
    length: int
    dims: tuple[int, ...]
    data_type: int


def stored_dtype(dims: Sequence[int], float_weight: bool, dtype: str) -> str:
    """The dtype a float weight is stored in: ``dtype`` for matrices and larger; vectors (norm scales, biases, gates)
    stay fp32 whatever the weight dtype: they weigh nothing, and keeping them saves a Cast per use."""
    if not float_weight or dtype == FLOAT32 or len(dims) < 2:
        return FLOAT32
    return dtype


@dataclass
class WeightStore:
    """The weight files of one export folder (``folder``, a graph's ``weights/``): written unit by unit, each weight
    once (``key``), whatever graphs read it. ``stamp`` (``settings_stamp``) names the settings the bytes depend on;
    a unit is kept only where its index records the digest the checkpoint gives now (``unit_digest``)."""

    folder: Path
    dtype: str
    stamp: str
    stored: dict[str, Stored] = field(default_factory=dict)
    reused: list[Path] = field(default_factory=list)  # the files of the units kept from an earlier export

    def unit_paths(self, unit: str) -> tuple[Path, Path]:
        return self.folder / f"{unit}.data", self.folder / f"{unit}.json"

    def resume(self, unit: str, keys: Sequence[str], digest: Callable[[], str]) -> bool:
        """Take an earlier write of ``unit`` holding ``keys`` whose index records ``digest()`` (called only when the
        files are there and complete: it reads the checkpoint); whether there was one."""
        data, index = self.unit_paths(unit)
        if not (data.is_file() and index.is_file()):
            return False
        try:
            record = json.loads(index.read_text())
            tensors = {entry["key"]: entry for entry in record["tensors"]}
        except (ValueError, KeyError, TypeError):
            return False  # an index cut short or from another version: the unit is written again
        if set(keys) - set(tensors) or data.stat().st_size != record.get("size") or "digest" not in record \
                or record["digest"] != digest():
            return False
        for key in keys:
            entry = tensors[key]
            self.stored[key] = Stored(f"{WEIGHTS_DIR}/{data.name}", entry["offset"], entry["length"],
                                      tuple(entry["dims"]), entry["data_type"])
        self.reused += [data, index]
        return True

    def _write_weight(self, out, weight: GraphWeight, reader) -> dict:
        """Append one weight to ``out`` (aligned), holding the source tensor and at most one computed copy of it: a
        transposed matrix (every linear layer's) is written a block of columns at a time from its source; a matrix
        over ``BY_ROWS_ABOVE`` stored as it is (an embedding, an LM head) is read and written a block of rows at a
        time."""
        if _by_rows(weight, reader):
            return self._write_by_rows(out, weight, reader)
        sources = [_fp32(reader.tensor(name)) for name in weight.sources]
        if _is_transpose_2d(weight.expr):
            source = sources.pop()
            dims = source.shape[::-1]
            kind = np.dtype(_target(dims, source.dtype, self.dtype))
            step = max(1, (64 << 20) // (source.shape[0] * kind.itemsize))  # output rows per block: ~64 MiB
            pieces = (_transposed_block(source, start, step, kind) for start in range(0, source.shape[1], step))
        else:
            if self.dtype == FLOAT16 and all(node.op_type in LAYOUT_OPS for node in weight.expr.nodes) \
                    and all(s.ndim >= 2 for s in sources):
                sources = [s.astype(np.float16) for s in sources]  # a moved copy at half the bytes
            array = weight.expr.evaluate(sources)
            del sources
            dims, kind = array.shape, np.dtype(_target(array.shape, array.dtype, self.dtype))
            array = np.ascontiguousarray(array, dtype=kind)
            pieces = _chunks(array)
        length = int(np.prod(dims)) * kind.itemsize
        offset = _start_weight(out, length)
        for piece in pieces:
            out.write(memoryview(piece).cast("B"))
        if out.tell() - offset != length:
            raise AssertionError(f"{weight.name}: wrote {out.tell() - offset} bytes, expected {length}")
        return dict(key=weight.key, offset=offset, length=length, dims=[int(d) for d in dims],
                    data_type=helper.np_dtype_to_tensor_dtype(kind))

    def _write_by_rows(self, out, weight: GraphWeight, reader) -> dict:
        """``_write_weight`` of a large matrix, its source read ``ROW_BLOCK`` bytes of rows at a time: copied as it
        is, or (transposed) each block's rows become columns of the written matrix, placed row by row with positioned
        writes; neither the source nor the result is ever whole in memory."""
        (name,) = weight.sources
        rows, cols = reader.shape(name)
        transposed = _is_transpose_2d(weight.expr)
        dims = (cols, rows) if transposed else (rows, cols)
        kind = np.dtype(_target(dims, np.float32, self.dtype))
        length = rows * cols * kind.itemsize
        offset = _start_weight(out, length)  # as _write_weight aligns: the same file either way
        step = max(1, ROW_BLOCK // (cols * 4))
        out.flush()
        fd = out.fileno()
        for start in range(0, rows, step):
            block = reader.read_rows(name, start, min(start + step, rows))
            block = block.to(_torch_dtype(kind))
            if not transposed:
                _pwrite(fd, block.numpy(), offset + start * cols * kind.itemsize)
                continue
            columns = block.t().contiguous().numpy()  # (cols, block rows): a piece of each written row
            for row, piece in enumerate(columns):
                _pwrite(fd, piece, offset + (row * rows + start) * kind.itemsize)
            del columns
        out.seek(offset + length)
        if os.fstat(fd).st_size != offset + length:
            raise AssertionError(f"{weight.name}: the file ends at {os.fstat(fd).st_size}, expected {offset + length}")
        return dict(key=weight.key, offset=offset, length=length, dims=list(dims),
                    data_type=helper.np_dtype_to_tensor_dtype(kind))

    def write_unit(self, unit: str, weights: Sequence[GraphWeight], reader, digest: Callable[[], str]) -> int:
        """Compute and append every weight of ``unit`` not stored yet, then record ``digest()`` (taken after the
        reads: from the bytes as they were read) in its index; returns the bytes written. The old index goes before
        the new data replaces the old, and the new index is renamed into place: a unit killed half-way has no index
        and is written again."""
        data, index = self.unit_paths(unit)
        self.folder.mkdir(parents=True, exist_ok=True)
        partial = data.with_suffix(".data.partial")
        entries, written = [], 0
        with open(partial, "wb") as out:
            for weight in weights:
                if weight.key in self.stored or any(entry["key"] == weight.key for entry in entries):
                    continue
                entry = self._write_weight(out, weight, reader)
                entries.append(entry)
                written += entry["length"]
            out.flush()
            os.fsync(out.fileno())
        index.unlink(missing_ok=True)
        os.replace(partial, data)
        record = {"digest": digest(), "size": data.stat().st_size, "tensors": entries}
        replace_text(index, json.dumps(record, indent=1) + "\n")
        for entry in entries:
            self.stored[entry["key"]] = Stored(f"{WEIGHTS_DIR}/{data.name}", entry["offset"], entry["length"],
                                               tuple(entry["dims"]), entry["data_type"])
        return written


def replace_text(path: Path, text: str) -> None:
    """``path`` holds ``text`` whole or not at all: written beside it, then renamed over it."""
    temporary = path.with_name(path.name + ".tmp")
    with open(temporary, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)


def _target(dims: Sequence[int], dtype, store_dtype: str):
    """The numpy dtype a computed weight is stored in (a float one per ``stored_dtype``; others as they are)."""
    if not np.issubdtype(dtype, np.floating):
        return dtype
    return np.float16 if stored_dtype(dims, True, store_dtype) == FLOAT16 else np.float32


def _start_weight(out, length: int) -> int:
    """Pad ``out`` to ``ALIGNMENT`` for a weight of ``length`` bytes of ``ALIGNED_FROM`` or more; its offset."""
    if length >= ALIGNED_FROM and out.tell() % ALIGNMENT:
        out.write(b"\0" * (ALIGNMENT - out.tell() % ALIGNMENT))
    return out.tell()


def _by_rows(weight: GraphWeight, reader) -> bool:
    """Whether ``weight`` is written by ``WeightStore._write_by_rows``: a matrix of more than ``BY_ROWS_ABOVE`` fp32
    bytes, one checkpoint tensor as it is or transposed, that the reader reads by rows."""
    if len(weight.sources) != 1 or (weight.expr.nodes and not _is_transpose_2d(weight.expr)):
        return False
    (name,) = weight.sources
    if not hasattr(reader, "row_range") or reader.row_range(name) is None:
        return False
    shape = reader.shape(name)
    return len(shape) == 2 and shape[0] * shape[1] * 4 > BY_ROWS_ABOVE


def _pwrite(fd: int, array: np.ndarray, offset: int) -> None:
    """``array``'s bytes at ``offset`` of ``fd`` (a positioned write may write part of them: the rest follows)."""
    view = memoryview(np.ascontiguousarray(array)).cast("B")
    while len(view):
        count = os.pwrite(fd, view, offset)
        view, offset = view[count:], offset + count


def _torch_dtype(kind: np.dtype):
    import torch

    return torch.float16 if kind == np.float16 else torch.float32


def _is_transpose_2d(expr: WeightExpr) -> bool:
    return (len(expr.sources) == 1 and len(expr.nodes) == 1 and expr.nodes[0].op_type == "Transpose"
            and [helper.get_attribute_value(a) for a in expr.nodes[0].attribute if a.name == "perm"] == [[1, 0]])


def _transposed_block(source: np.ndarray, start: int, step: int, kind: np.dtype) -> np.ndarray:
    """Rows ``start:start + step`` of ``source.T`` in ``kind`` (PyTorch's copy: several times numpy's speed here)."""
    import torch

    block = torch.from_numpy(source)[:, start:start + step].t()
    return block.to(torch.float16 if kind == np.float16 else torch.float32).contiguous().numpy()


def _chunks(array: np.ndarray, budget: int = 64 << 20):
    """``array``'s bytes in pieces of about ``budget`` (views: nothing copied)."""
    flat = array.reshape(-1).view(np.uint8)
    for start in range(0, flat.size, budget):
        yield flat[start:start + budget]


def _fp32(tensor) -> np.ndarray:
    """A reader's tensor (fp32 torch, exact) as a numpy array, without a copy."""
    return tensor.detach().numpy() if hasattr(tensor, "detach") else np.asarray(tensor)


def unit_digest(store: WeightStore, weights: Sequence[GraphWeight], reader) -> str:
    """What a unit's bytes are made from: the store's settings, each weight's key (its sources and the ops on them)
    and the content of the checkpoint tensors they read (``reader.content_digest``)."""
    sources = list(dict.fromkeys(name for weight in weights for name in weight.sources))
    running = hashlib.sha256(store.stamp.encode())
    for weight in weights:
        running.update(f"\0{weight.key}".encode())
    running.update(reader.content_digest(sources).encode())
    return running.hexdigest()


def pending_units(weights: Sequence[GraphWeight], store: WeightStore, reader) -> tuple[dict[str, list], list[str]]:
    """``weights`` by unit (in first-use order), and the units among them neither stored yet nor kept from an earlier
    write (``WeightStore.resume``: its digest is the checkpoint's now). ``weights`` need only ``key``, ``sources`` and
    ``unit`` (a graph's record of them will do: ``export.reuse``)."""
    units: dict[str, list] = {}
    for weight in weights:
        units.setdefault(weight.unit, []).append(weight)

    def digest(unit: str) -> Callable[[], str]:
        return lambda: unit_digest(store, units[unit], reader)

    pending = [unit for unit, members in units.items()
               if not all(w.key in store.stored for w in members)
               and not store.resume(unit, [w.key for w in members], digest(unit))]
    return units, pending


def say_kept(progress: Progress, label: str, units: int, pending: Sequence[str]) -> None:
    if len(pending) < units:
        progress(f"{label}: {units - len(pending)} of {units} units already written, resuming at "
                 f"{pending[0] if pending else 'the end'}")


def write_weights(weights: Sequence[GraphWeight], store: WeightStore, reader, progress: Progress,
                  label: str = "weights") -> None:
    """Write every unit of ``weights`` (in first-use order) not already stored, with progress and a time estimate."""
    units, pending = pending_units(weights, store, reader)
    say_kept(progress, label, len(units), pending)
    started = time.perf_counter()
    for done, unit in enumerate(pending, start=1):
        written = store.write_unit(unit, units[unit], reader, lambda: unit_digest(store, units[unit], reader))
        elapsed = time.perf_counter() - started
        left = elapsed / done * (len(pending) - done)
        progress(f"{label}: {unit} written ({written / 2**20:,.0f} MiB), {done}/{len(pending)}, "
                 f"{elapsed:,.0f} s so far, about {left:,.0f} s left")


def _external(tensor: TensorProto, location: str, offset: int, length: int) -> TensorProto:
    """``tensor`` pointed at ``length`` bytes at ``offset`` of ``location`` (relative to the graph's folder)."""
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    return tensor


def attach_weights(model: onnx.ModelProto, weights: Sequence[GraphWeight], store: WeightStore) -> None:
    """Define each weight of ``model`` as an initializer in the store's files; a weight stored in fp16 where the graph
    reads fp32 is read through a ``Cast`` (which the card's fp16 conversion drops)."""
    casts = []
    for weight in weights:
        stored = store.stored[weight.key]
        tensor = TensorProto(name=weight.name, data_type=stored.data_type, dims=list(stored.dims))
        if stored.data_type == TensorProto.FLOAT16:
            tensor.name = f"{weight.name}:fp16"
            casts.append(helper.make_node("Cast", [tensor.name], [weight.name], name=f"{weight.name}:Cast",
                                          to=TensorProto.FLOAT))
        model.graph.initializer.append(_external(tensor, stored.location, stored.offset, stored.length))
    if casts:
        nodes = casts + list(model.graph.node)
        del model.graph.node[:]
        model.graph.node.extend(nodes)


TABLE_BYTES = 1 << 20  # a constant of at least this many bytes goes to the graph's tables file


def store_tables(model: onnx.ModelProto, store: WeightStore, unit: str, threshold: int | None = None) -> int:
    """Move each ``Constant`` of the main graph holding ``threshold`` bytes or more (the RoPE tables, whose size
    follows ``--rope-positions``) to an initializer in the store's file ``unit`` (the graph's own, rewritten by
    every export): the graph file stays small whatever the context (protobuf caps it at 2 GiB). Returns the bytes
    moved."""
    data, _ = store.unit_paths(unit)
    threshold = TABLE_BYTES if threshold is None else threshold
    kept, moved = [], []
    for node in model.graph.node:
        value = node.attribute[0].t if node.op_type == "Constant" and len(node.attribute) == 1 \
            and node.attribute[0].name == "value" else None
        if value is None or int(np.prod(value.dims)) * helper.tensor_dtype_to_np_dtype(value.data_type).itemsize \
                < threshold:
            kept.append(node)
            continue
        moved.append((node.output[0], numpy_helper.to_array(value)))
    if not moved:
        return 0
    store.folder.mkdir(parents=True, exist_ok=True)
    written = 0
    with open(data, "wb") as out:
        for name, array in moved:
            offset = _start_weight(out, max(array.nbytes, ALIGNED_FROM))  # every table aligned, whatever its size
            out.write(np.ascontiguousarray(array).tobytes())
            tensor = TensorProto(name=name, data_type=helper.np_dtype_to_tensor_dtype(array.dtype),
                                 dims=list(array.shape))
            model.graph.initializer.append(_external(tensor, f"{WEIGHTS_DIR}/{data.name}", offset, array.nbytes))
            written += array.nbytes
    del model.graph.node[:]
    model.graph.node.extend(kept)
    return written


def rename_weights(exprs: Mapping[str, WeightExpr], sources: Mapping[str, str], unit: str,
                   names: dict[str, str] | None = None) -> list[GraphWeight]:
    """The ``GraphWeight`` of each of a traced part's weights, its parameters named by the checkpoint (``sources``:
    parameter input name -> ``state_dict`` name). ``names`` (filled here): each weight's value name in the part ->
    its initializer name."""
    weights, used = [], {}
    for value, expr in exprs.items():
        checkpoint = tuple(sources[name] for name in expr.sources)
        name = weight_name(checkpoint, expr)
        used[name] = used.get(name, 0) + 1
        if used[name] > 1:  # the same ops on the same tensor with other constants (a Gather of another row)
            name = f"{name}#{used[name] - 1}"
        weight = GraphWeight(name, expr, checkpoint, unit)
        if names is not None:
            names[value] = weight.name
        weights.append(weight)
    return weights


# Bumped whenever the writer would write other bytes from the same tensors: units written before are written again.
WRITER_VERSION = 2


def settings_stamp(dtype: str) -> str:
    """The settings a unit's bytes depend on besides its weights and their tensors: the weight dtype, the alignment
    and the writer's version (``unit_digest`` hashes it)."""
    return f"writer {WRITER_VERSION}|{dtype}|align {ALIGNMENT} from {ALIGNED_FROM}"
