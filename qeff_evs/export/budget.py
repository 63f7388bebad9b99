"""What a streamed export needs, estimated from the model's shapes before anything is traced or written.

Disk: every weight as stored (``weights.stored_dtype``: fp32, or fp16 with ``--weight-dtype float16``), a tied
embedding twice (the embedding's table and the head's transposed copy), plus the graphs themselves (the RoPE tables
they carry). Memory: what the process holds at its peak: the interpreter and its libraries (``BASE_BYTES``,
measured), and the largest weight twice in fp32 (read from the checkpoint, then its folded copy, e.g. a transposed
LM head); nothing else grows with the model. ``check_budget`` refuses, in one line, an export the folder or the
machine cannot hold.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from qeff_evs.export.weights import FLOAT16, stored_dtype

GIB = 1 << 30
# Resident memory of an export process before its first weight: Python, torch, transformers, onnx, the hollow model
# and the traced graphs (measured at Qwen3-VL-8B widths, full depth: docs/results/export_memory.md).
BASE_BYTES = int(1.5 * GIB)
GRAPH_BYTES = 64 << 20  # the graphs' own protos (nodes, small constants), beside the tables counted below


@dataclass(frozen=True)
class ExportBudget:
    """A streamed export's estimated disk and peak memory, in bytes, and what decides the peak."""

    disk: int
    memory: int
    largest: str  # the largest weight's name (it decides the peak)
    weight_dtype: str

    def describe(self) -> str:
        return (f"about {self.disk / GIB:.1f} GiB of disk (weights in {self.weight_dtype}) and "
                f"{self.memory / GIB:.1f} GiB of memory at its peak")


def estimate_budget(model: nn.Module, weight_dtype: str, table_bytes: int = 0) -> ExportBudget:
    """The budget of exporting ``model`` (a hollow model: shapes only) with ``weight_dtype``; ``table_bytes``: the
    RoPE tables (and other constants) the graphs carry."""
    disk, largest, largest_name = 0, 0, ""
    for name, parameter in model.named_parameters(remove_duplicate=False):
        count = parameter.numel()
        kind = stored_dtype(tuple(parameter.shape), parameter.is_floating_point(), weight_dtype)
        disk += count * (2 if kind == FLOAT16 else 4)
        if count > largest:
            largest, largest_name = count, name
    return ExportBudget(disk=disk + table_bytes + GRAPH_BYTES, memory=BASE_BYTES + 2 * 4 * largest,
                        largest=largest_name, weight_dtype=weight_dtype)


def available_memory() -> int | None:
    """``MemAvailable`` of /proc/meminfo, in bytes (None where there is none)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def free_disk(folder: Path) -> int:
    """Free bytes on the file system of ``folder`` (or of its nearest existing parent)."""
    folder = Path(folder).resolve()
    while not folder.exists():
        folder = folder.parent
    return shutil.disk_usage(folder).free


def check_budget(budget: ExportBudget, out_dir: Path, written: int = 0) -> None:
    """Refuse an export that ``out_dir``'s disk (less ``written``, the weights an earlier run already wrote there) or
    the machine's free memory cannot hold; one line naming both numbers and what lowers them."""
    needed = max(budget.disk - written, 0)
    free = free_disk(out_dir)
    if needed > free:
        fix = ("free space there or export elsewhere" if budget.weight_dtype == FLOAT16 else
               "free space there, export elsewhere, or pass --weight-dtype float16 (half the weights' bytes)")
        raise ValueError(f"the export needs about {needed / GIB:.1f} GiB of disk in {out_dir} (weights in "
                         f"{budget.weight_dtype}), {free / GIB:.1f} GiB free there: {fix}")
    memory = available_memory()
    if memory is not None and budget.memory > memory:
        raise ValueError(f"the export needs about {budget.memory / GIB:.1f} GiB of memory at its peak (its largest "
                         f"weight, {budget.largest}, twice in fp32), {memory / GIB:.1f} GiB available: stop other "
                         "programs first (the peak does not grow with the number of layers)")

