"""Releasing a read-only file mapping's pages (runtime/backends/file_pages.py): the process's resident set drops by
them, the bytes read afterwards are the file's, and only read-only mappings under the folder are touched."""

from __future__ import annotations

import mmap
import sys
from pathlib import Path

import numpy as np
import pytest

from qeff_evs.runtime.backends import file_pages

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/maps is Linux's")

MAPS = """\
7f0000000000-7f0000100000 r--p 00000000 08:01 11 /exports/a/language/weights/layers.0.data
7f0000100000-7f0000200000 rw-p 00000000 08:01 12 /exports/a/language/weights/cache.data
7f0000200000-7f0000300000 r--s 00000000 08:01 13 /exports/a/vision/weights/blocks.0.data
7f0000300000-7f0000400000 r--p 00000000 08:01 14 /exports/ab/language/weights/layers.0.data
7f0000400000-7f0000500000 rw-p 00000000 00:00 0
7f0000500000-7f0000600000 r-xp 00000000 08:01 15 /usr/lib/libc.so.6
"""


def test_only_read_only_mappings_of_files_under_the_folder():
    assert file_pages.read_only_file_mappings(MAPS, Path("/exports/a")) == [
        (0x7F0000000000, 0x7F0000100000), (0x7F0000200000, 0x7F0000300000)]
    assert file_pages.read_only_file_mappings(MAPS, Path("/elsewhere")) == []


def resident_kib(path: Path) -> int:
    """This process's resident KiB of mappings of ``path`` (``/proc/self/smaps``)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5 and not fields[0].endswith(":"):
            inside = fields[-1] == str(path)
        elif inside and fields[0] == "Rss:":
            total += int(fields[1])
    return total


def test_release_drops_the_pages_and_the_bytes_read_again_are_the_files(tmp_path):
    folder = tmp_path / "export"
    folder.mkdir()
    data = np.random.default_rng(0).standard_normal(4 << 20).astype(np.float32)  # 16 MiB
    path = (folder / "weights.data").resolve()
    data.tofile(path)
    with open(path, "rb") as handle:
        mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    view = np.frombuffer(mapped, dtype=np.float32)
    try:
        assert float(view.sum()) == float(data.sum())  # every page read: resident
        before = resident_kib(path)
        assert before >= 15 * 1024
        assert file_pages.release(tmp_path / "elsewhere") == 0
        assert file_pages.release(folder) == len(mapped)
        assert resident_kib(path) < before // 8
        np.testing.assert_array_equal(view, data)
    finally:
        del view
        mapped.close()
