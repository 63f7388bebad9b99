"""Releasing the export's weight pages from this process once a runtime has made its own copies of them.

OpenVINO maps an ONNX graph's external-data files read-only and keeps the mappings for as long as the compiled model
lives, though its CPU plugin computes from weights it has repacked (or converted to bf16) into memory of its own:
every page of the fp32 files it read while compiling would stay counted in this process. ``release`` tells the kernel
(``madvise(MADV_DONTNEED)``) that this process no longer needs the pages of such read-only file mappings. Nothing is
lost: the files are unchanged, so a page read again (an embedding row the Gather reads) comes back from the page
cache or the file. Where the platform has no ``/proc/self/maps`` or ``madvise`` it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from pathlib import Path

MADV_DONTNEED = 4  # Linux


def read_only_file_mappings(maps: str, folder: Path) -> list[tuple[int, int]]:
    """``(start, end)`` of each mapping in ``maps`` (``/proc/self/maps``' text) of a file under ``folder`` that nobody
    can write through (permissions ``r--``): dropping its pages loses nothing."""
    prefix = str(Path(folder).resolve()).rstrip("/") + "/"
    spans = []
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) < 6 or not fields[1].startswith("r--") or not fields[5].startswith(prefix):
            continue
        start, end = (int(address, 16) for address in fields[0].split("-"))
        spans.append((start, end))
    return spans


def release(folder: Path) -> int:
    """Drop this process's resident pages of the read-only file mappings under ``folder``; the mappings' bytes."""
    if not sys.platform.startswith("linux"):
        return 0
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return 0
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    released = 0
    for start, end in read_only_file_mappings(maps, folder):
        if libc.madvise(start, end - start, MADV_DONTNEED) == 0:
            released += end - start
    return released
