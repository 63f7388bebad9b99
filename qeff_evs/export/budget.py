"""What a streamed export needs, estimated from the model's shapes before anything is traced or written.

Disk: every weight as stored (``weights.stored_dtype``: fp32, or fp16 with ``--weight-dtype float16``), a tied
embedding twice (the embedding's table and the head's transposed copy), plus the graphs themselves (the RoPE tables
they carry). Memory: what the process holds at its peak: the interpreter and its libraries with the hollow model and
the traced graphs (``BASE_BYTES``, measured), and the largest weight being read whole: its stored bytes and their
fp32 conversion, 1.5x its fp32 bytes for a bf16 checkpoint (the reader's), after which only its fp32 copy and a block
of what is written stay (a matrix read by rows, as the embedding and the LM head are, holds a block of rows three
times at most); nothing else grows with the model. ``check_budget`` refuses, in one line, an export the folder or the
machine cannot hold.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from qeff_evs.export.weights import BY_ROWS_ABOVE, FLOAT16, ROW_BLOCK, stored_dtype

GIB = 1 << 30
# Resident memory of an export process besides the weight it reads: Python, torch, transformers, onnx, the hollow
# model and the traced graphs (measured at Qwen3-VL-8B widths: docs/results/export_scaling.md).
BASE_BYTES = int(0.75 * GIB)
READ_FACTOR = 1.5  # the largest weight's fp32 bytes, times this: read as bf16, converted to fp32
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


def estimate_budget(model: nn.Module, weight_dtype: str, table_bytes: int = 0,
                    by_rows: Callable[[str], bool] = lambda name: False) -> ExportBudget:
    """The budget of exporting ``model`` (a hollow model: shapes only) with ``weight_dtype``; ``table_bytes``: the
    RoPE tables (and other constants) the graphs carry; ``by_rows(name)``: whether the reader reads that tensor by rows
    (a matrix over ``BY_ROWS_ABOVE`` is then never whole in memory: its block, in fp32 and transposed)."""
    disk, largest, largest_name = 0, 0, ""
    for name, parameter in model.named_parameters(remove_duplicate=False):
        count = parameter.numel()
        kind = stored_dtype(tuple(parameter.shape), parameter.is_floating_point(), weight_dtype)
        disk += count * (2 if kind == FLOAT16 else 4)
        held = READ_FACTOR * 4 * count
        if parameter.dim() == 2 and 4 * count > BY_ROWS_ABOVE and by_rows(name):
            held = 3 * ROW_BLOCK
        if held > largest:
            largest, largest_name = held, name
    return ExportBudget(disk=disk + table_bytes + GRAPH_BYTES, memory=BASE_BYTES + int(largest),
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
                         f"weight, {budget.largest}, read in fp32), {memory / GIB:.1f} GiB available: stop other "
                         "programs first (the peak does not grow with the number of layers)")

