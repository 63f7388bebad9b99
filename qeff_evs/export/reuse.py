"""A graph an earlier export wrote into the folder, taken instead of tracing it again, by content.

A streamed export's graph file (and what is written with it: a language graph's tables) is what tracing the hollow
model gives, with each weight pointed at its bytes in the weight units. The trace depends on the checkpoint's files
other than its tensors' data (config.json, the tokenizer, the shard index, every safetensors header: names, dtypes,
shapes), on the settings the graph is exported with (``settings``: the example sizes, the weight dtype, a language
graph's options) and on the code that traces it (``code_digest``: every source file of qeff-evs and the versions of
the libraries that trace and serialize); never on a tensor's values (the hollow model's stand-ins are traced).
``GraphReuse.key`` hashes all of them.

Beside each graph, ``<graph>.graph.json`` records that key, the SHA-256 of each file written with the graph, and each
weight the graph reads: its key and source tensors (what its unit's digest is made from, ``weights.unit_digest``) and
where the graph points (file, offset, length, dims, type). An export takes the earlier graph (``GraphReuse.take``) only
when the record's key is its own, every file has its recorded digest, every unit the graph reads is kept by content
(``weights.pending_units``: stored already, or written earlier from the same bytes) and points where the record says;
otherwise it traces the graph, having deleted the record first (``forget``), and writes the record last, atomically
(``record``): a graph killed half-way, a graph edited since (by hand or by a tool) or another checkpoint's is
never taken. So what the folder holds afterwards is what a fresh export writes.
"""

from __future__ import annotations

import functools
import hashlib
import json
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import astuple, dataclass, field
from pathlib import Path

from qeff_evs.export.weights import WeightStore, pending_units, replace_text, say_kept

RECORD_SUFFIX = ".graph.json"
RECORD_VERSION = 1


def record_path(graph: Path) -> Path:
    """``vision/encoder.onnx`` -> ``vision/encoder.graph.json``."""
    return graph.with_name(graph.stem + RECORD_SUFFIX)


@functools.cache
def code_digest() -> str:
    """SHA-256 of the code a graph comes from: every ``.py`` file of the qeff_evs package (by path and content), the
    Python, torch, onnx, protobuf (which serializes the graph), transformers and numpy versions."""
    import google.protobuf
    import numpy
    import onnx
    import torch
    import transformers

    package = Path(__file__).resolve().parents[1]
    running = hashlib.sha256(f"{sys.version}|torch {torch.__version__}|onnx {onnx.__version__}|protobuf "
                             f"{google.protobuf.__version__}|transformers {transformers.__version__}|numpy "
                             f"{numpy.__version__}".encode())
    for path in sorted(package.rglob("*.py")):
        running.update(b"\0" + str(path.relative_to(package)).encode() + b"\0" + path.read_bytes())
    return running.hexdigest()


def checkpoint_digest(model_dir: Path, reader) -> str | None:
    """SHA-256 of what a trace reads of the checkpoint: every file of its folder but the safetensors (by name and
    content), and the reader's ``layout_digest`` (every header, the quantization record); None for a reader that
    cannot say (no graph is then taken from an earlier export)."""
    layout = getattr(reader, "layout_digest", None)
    if layout is None:
        return None
    running = hashlib.sha256(layout().encode())
    for path in sorted(Path(model_dir).iterdir()):
        if path.is_file() and path.suffix != ".safetensors":
            running.update(b"\0" + path.name.encode() + b"\0" + path.read_bytes())
    return running.hexdigest()


@dataclass(frozen=True)
class RecordedWeight:
    """A weight as a graph's record holds it: what ``weights.pending_units`` needs (``key``, ``sources``, ``unit``)
    and where the graph points (``stored``: ``weights.Stored`` as a list)."""

    key: str
    sources: tuple[str, ...]
    unit: str
    stored: list


def _stored(store: WeightStore, key: str) -> list:
    return json.loads(json.dumps(astuple(store.stored[key])))  # tuples as JSON gives them back: lists


def file_digest(path: Path) -> str:
    running = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(16 << 20):
            running.update(block)
    return running.hexdigest()


@dataclass
class GraphReuse:
    """The graphs of one export into ``folder``: ``base`` (``code_digest`` and ``checkpoint_digest``) is what every
    graph's key starts from; ``kept`` collects the files taken from the earlier export (which the folder's claim must
    not delete)."""

    folder: Path
    base: str
    kept: list[Path] = field(default_factory=list)

    def key(self, graph: Path, settings: Mapping) -> str:
        text = json.dumps({"record": RECORD_VERSION, "graph": str(graph.relative_to(self.folder)),
                           "settings": settings}, sort_keys=True, default=repr)
        return hashlib.sha256(f"{self.base}|{text}".encode()).hexdigest()

    def take(self, graph: Path, settings: Mapping, store: WeightStore | None, reader,
             progress: Callable[[str], None], label: str = "weights") -> bool:
        """Take the earlier export's ``graph`` (the module docstring says when); whether it was taken. ``label``
        names its weights in the progress, as ``weights.write_weights`` does."""
        path = record_path(graph)
        try:
            record = json.loads(path.read_text())
            files = dict(record["files"])
            weights = [RecordedWeight(w["key"], tuple(w["sources"]), w["unit"], w["stored"])
                       for w in record["weights"]]
            matches = record["key"] == self.key(graph, settings)
        except (OSError, ValueError, KeyError, TypeError):
            return False  # none, cut short or of another version: traced again
        named = [self.folder / name for name in files]
        if not matches or str(graph.relative_to(self.folder)) not in files or (weights and store is None) \
                or any(not p.is_file() or file_digest(p) != digest for p, digest in zip(named, files.values())):
            return False
        if weights:
            units, pending = pending_units(weights, store, reader)
            if pending or any(_stored(store, w.key) != w.stored for w in weights):
                return False
            say_kept(progress, label, len(units), pending)
        progress(f"{graph.relative_to(self.folder)}: the earlier export's graph (the same checkpoint, settings and "
                 f"code{'; every weight it reads kept' if weights else ''}), not traced again")
        self.kept += [*named, path]
        return True

    def record_files(self, files: Mapping[str, str]) -> dict[str, str]:
        """The record beside each graph of ``files`` (file key -> path) that this export wrote or took, under the
        key ``<graph>_record``: the manifest names every file of the folder."""
        return {f"{role}_record": str(record_path(Path(relative))) for role, relative in files.items()
                if relative.endswith(".onnx") and record_path(self.folder / relative).is_file()}

    def forget(self, graph: Path) -> None:
        """Delete ``graph``'s record before the graph is written again."""
        record_path(graph).unlink(missing_ok=True)

    def record(self, graph: Path, settings: Mapping, files: Sequence[Path], weights: Sequence,
               store: WeightStore | None) -> None:
        """Record what ``graph`` (and ``files``, written with it) was made from, once they are written."""
        names = {str(p.relative_to(self.folder)): file_digest(p) for p in [graph, *files]}
        entries = [dict(key=w.key, sources=list(w.sources), unit=w.unit, stored=_stored(store, w.key))
                   for w in weights]
        replace_text(record_path(graph), json.dumps(
            {"key": self.key(graph, settings), "files": names, "weights": entries}, indent=1) + "\n")
