"""The safetensors files of a checkpoint folder, read one tensor at a time by its stored name.

A folder holds ``model.safetensors``, or shards listed by ``model.safetensors.index.json``'s ``weight_map`` (else every
``*.safetensors`` file in it). Each file starts with an 8-byte little-endian header length and a JSON header naming
every tensor's dtype, shape and byte range; names and shapes come from the headers alone. A tensor is read with one
positioned read into a fresh buffer: no file is memory-mapped, so nothing but the tensor being read counts in the
process's resident memory, and ``close`` closes the files.

What a tensor holds is known by content: ``digest`` is a SHA-256 of its stored bytes, taken from the bytes as they are
read (a whole tensor, or its rows read in order) or, when nothing has read them yet, by reading them (never
converting them; ``digest_all`` reads and hashes several tensors at once, on threads, each into a buffer of its own);
``header_digest`` covers every file's header. An export's resume compares these, never file names, sizes or times
(two fine-tunes copied with ``cp -p`` share all three).
"""

from __future__ import annotations

import hashlib
import math
import os
import struct
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from qeff_evs.weights.json_file import parse_json, read_json

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

# safetensors' dtype names -> torch's.
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F8_E8M0": torch.float8_e8m0fnu,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64, "BOOL": torch.bool,
}


@dataclass(frozen=True)
class StoredTensor:
    """Where one tensor lies: its file, dtype, shape and absolute byte range."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute offset of its first byte in ``file``
    end: int


# safetensors' own bound on a header's length (its MAX_HEADER_SIZE): a longer one is a damaged file.
MAX_HEADER_BYTES = 100_000_000


def read_header(path: Path) -> dict[str, StoredTensor]:
    """Every tensor of one safetensors file, from its header (no tensor data read). The header's length is checked
    against the file's size before it is read, and every entry (dtype, shape, byte range inside the file, no two
    ranges overlapping) before it is trusted: a damaged file is refused in one line naming it."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path} is not a safetensors file (shorter than its 8-byte header length)")
        (length,) = struct.unpack("<Q", head)
        if length > min(size - 8, MAX_HEADER_BYTES):
            raise ValueError(f"{path} is not a valid safetensors file: its header length says {length} bytes, the "
                             f"file holds {size} (download it again)")
        header = parse_json(f.read(length), f"{path}'s safetensors header")
    base = 8 + length
    tensors = {name: _entry(path, name, entry, base, size) for name, entry in header.items() if name != "__metadata__"}
    ranges = sorted((t.start, t.end, name) for name, t in tensors.items())
    for (_, end, before), (start, _, after) in zip(ranges, ranges[1:]):
        if start < end:
            raise ValueError(f"{path}: the bytes of tensors {before} and {after} overlap in its header; the file is "
                             "damaged (download it again)")
    return tensors


def _entry(path: Path, name: str, entry, base: int, size: int) -> StoredTensor:
    """One header entry as a ``StoredTensor``, every field checked (the module docstring's format)."""
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= set(entry):
        raise ValueError(f"{path}: header entry {name!r} lacks dtype, shape or data_offsets; the file is damaged "
                         "(download it again)")
    if entry["dtype"] not in DTYPES:
        raise ValueError(f"{path}: tensor {name} has dtype {entry['dtype']}, which qeff-evs does not read "
                         f"(it reads {', '.join(DTYPES)})")
    shape, offsets = entry["shape"], entry["data_offsets"]
    if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)
            and isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        raise ValueError(f"{path}: tensor {name} has shape {shape} and data_offsets {offsets}, which are not a "
                         "shape and a byte range; the file is damaged (download it again)")
    dtype = DTYPES[entry["dtype"]]
    begin, end = base + offsets[0], base + offsets[1]
    needed = math.prod(shape) * dtype.itemsize
    if end - begin != needed:
        raise ValueError(f"{path}: tensor {name} ({entry['dtype']} {shape}) needs {needed} bytes but its header gives "
                         f"it {end - begin}; the file is damaged (download it again)")
    if end > size:
        raise ValueError(f"{path} ends at byte {size}, inside tensor {name} (bytes {begin} to {end}); the file is "
                         "truncated (download it again)")
    return StoredTensor(path, dtype, tuple(shape), begin, end)


def shard_files(model_dir: Path) -> tuple[Path, ...]:
    """The folder's safetensors files: its index's, else ``model.safetensors``, else every ``*.safetensors``."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError(f"{index} has no weight_map of tensor names to shard files; restore the file from the "
                             "checkpoint's release")
        names = sorted(set(weight_map.values()))
        missing = [name for name in names if not (model_dir / name).is_file()]
        if missing:
            raise ValueError(f"{index} names {', '.join(missing)}, missing from {model_dir}; download every shard")
        return tuple(model_dir / name for name in names)
    if (model_dir / SINGLE_FILE).is_file():
        return (model_dir / SINGLE_FILE,)
    files = tuple(sorted(model_dir.glob("*.safetensors")))
    if not files:
        raise ValueError(f"{model_dir} holds no *.safetensors file; qeff-evs reads safetensors checkpoints "
                         "(convert a .bin checkpoint with save_pretrained(..., safe_serialization=True))")
    return files


DIGEST_BLOCK = 16 << 20  # bytes hashed per read when ``Shards.digest`` reads a tensor itself (one buffer a thread)
DIGEST_THREADS = 4  # tensors ``Shards.digest_all`` hashes at once (positioned reads and hashlib release the GIL)
_buffers = threading.local()


def _truncated(entry: StoredTensor, name: str) -> ValueError:
    return ValueError(f"{entry.file} ends inside tensor {name}; the file is truncated (download it again)")


def _hash_stored(name: str, entry: StoredTensor) -> str:
    """SHA-256 of the tensor's name and stored bytes, read ``DIGEST_BLOCK`` at a time into this thread's buffer."""
    buffer = getattr(_buffers, "block", None)
    if buffer is None:
        buffer = _buffers.block = memoryview(bytearray(DIGEST_BLOCK))
    running = _tensor_hash(name)
    descriptor = os.open(entry.file, os.O_RDONLY)
    try:
        at = entry.start
        while at < entry.end:
            count = os.preadv(descriptor, [buffer[:min(DIGEST_BLOCK, entry.end - at)]], at)
            if not count:
                raise _truncated(entry, name)
            running.update(buffer[:count])
            at += count
    finally:
        os.close(descriptor)
    return running.hexdigest()


def _tensor_hash(name: str):
    return hashlib.sha256(name.encode() + b"\0")


def _finish(running, data) -> str:
    running.update(memoryview(data))
    return running.hexdigest()


def _headers_digest(tensors: dict[str, StoredTensor]) -> str:
    """SHA-256 of every file's header as stored (its 8-byte length and JSON), in file-name order."""
    running = hashlib.sha256()
    for path in sorted({t.file for t in tensors.values()}):
        with open(path, "rb") as f:
            head = f.read(8)
            running.update(path.name.encode() + b"\0" + head + f.read(struct.unpack("<Q", head)[0]))
    return running.hexdigest()


class Shards:
    """The tensors of a checkpoint folder by stored name: dtype and shape from the headers, data on request."""

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir)
        self._tensors: dict[str, StoredTensor] = {}
        for path in shard_files(self.model_dir):
            for name, tensor in read_header(path).items():
                if name in self._tensors:
                    raise ValueError(f"tensor {name} is stored twice, in {self._tensors[name].file.name} and "
                                     f"{path.name}; remove the stale shard from {self.model_dir}")
                self._tensors[name] = tensor
        self._open: dict[Path, BinaryIO] = {}
        self._digests: dict[str, str] = {}
        self._running: dict[str, tuple[int, object]] = {}  # rows read in order so far: (next byte, hash)
        self.header_digest = _headers_digest(self._tensors)

    def names(self) -> tuple[str, ...]:
        return tuple(self._tensors)

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def entry(self, name: str) -> StoredTensor:
        try:
            return self._tensors[name]
        except KeyError:
            raise KeyError(f"{self.model_dir} stores no tensor {name!r}") from None

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entry(name).shape

    def dtype(self, name: str) -> torch.dtype:
        return self.entry(name).dtype

    def read(self, name: str) -> torch.Tensor:
        """The tensor as stored (its dtype and shape), in memory of its own."""
        entry = self.entry(name)
        data = self._read_bytes(name, entry, entry.start, entry.end)
        if name not in self._digests:
            self._digests[name] = _finish(_tensor_hash(name), data.numpy())
        return data.view(entry.dtype).reshape(entry.shape)

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` of the tensor along its first axis, as stored (rows lie contiguously in the file: one
        read of their bytes alone)."""
        entry = self.entry(name)
        rows = entry.shape[0] if entry.shape else 0
        if not 0 <= start <= stop <= rows:
            raise IndexError(f"rows {start}:{stop} of {name}, which has {rows}")
        row_bytes = (entry.end - entry.start) // rows if rows else 0
        begin, end = entry.start + start * row_bytes, entry.start + stop * row_bytes
        data = self._read_bytes(name, entry, begin, end)
        self._follow_rows(name, entry, begin, end, data)
        return data.view(entry.dtype).reshape(stop - start, *entry.shape[1:])

    def _follow_rows(self, name: str, entry: StoredTensor, begin: int, end: int, data: torch.Tensor) -> None:
        """Hash rows read in order from the first: the last block completes the tensor's digest."""
        if name in self._digests:
            return
        at, running = self._running.pop(name, (entry.start, None))
        if begin != at:
            return  # not in order: ``digest`` reads the tensor itself when asked
        running = running or _tensor_hash(name)
        running.update(memoryview(data.numpy()))
        if end == entry.end:
            self._digests[name] = running.hexdigest()
        else:
            self._running[name] = (end, running)

    def digest(self, name: str) -> str:
        """SHA-256 of the tensor's stored bytes (and its name): from the bytes already read, else read for it (in
        blocks of ``DIGEST_BLOCK``, nothing converted)."""
        if name not in self._digests:
            self._digests[name] = _hash_stored(name, self.entry(name))
        return self._digests[name]

    def digest_all(self, names: Sequence[str]) -> None:
        """``digest`` of each of ``names``, the ones not known yet read and hashed ``DIGEST_THREADS`` at a time."""
        missing = [name for name in dict.fromkeys(names) if name not in self._digests]
        entries = [self.entry(name) for name in missing]
        workers = min(DIGEST_THREADS, os.cpu_count() or 1, len(missing))
        if workers < 2:
            digests = list(map(_hash_stored, missing, entries))
        else:
            with ThreadPoolExecutor(workers) as pool:
                digests = list(pool.map(_hash_stored, missing, entries))
        self._digests.update(zip(missing, digests))

    def _read_bytes(self, name: str, entry: StoredTensor, begin: int, end: int) -> torch.Tensor:
        data = torch.empty(end - begin, dtype=torch.uint8)
        f = self._open.get(entry.file)
        if f is None:
            f = self._open[entry.file] = open(entry.file, "rb", buffering=0)
        view, done = memoryview(data.numpy()), 0
        f.seek(begin)
        while done < len(view):
            count = f.readinto(view[done:])
            if not count:
                raise _truncated(entry, name)
            done += count
        return data

    def close(self) -> None:
        """Close every file this reader opened (reading again reopens them)."""
        for f in self._open.values():
            f.close()
        self._open.clear()
