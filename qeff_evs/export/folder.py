"""The export folder as one export, whole: claimed before anything is written into it, made servable last.

``claim_folder`` takes the folder for one export: it refuses a folder that holds something other than an export (an
export deletes what it did not write), takes the lock (``manifest.EXPORT_LOCK``, an ``flock`` a second export into
the same folder fails to get: it is refused, never interleaved; the kernel drops it when the process dies, however it
dies), then deletes ``manifest.json``, the record that makes the folder servable, before anything else is written:
from here until the export finishes, every command that reads the folder refuses it (``manifest.read_manifest``).
``FolderClaim.finish`` deletes every file of the folder the export neither wrote nor kept (a unit of another
checkpoint, a file of other options, a killed write's ``.partial``), so the folder holds what a fresh export holds;
the manifest is then written, atomically, and the lock released. ``disk_full`` turns a full disk, wherever the export
is writing, into one line naming the folder, the bytes written and the bytes still needed; the units written stay
resumable.
"""

from __future__ import annotations

import errno
import fcntl
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from qeff_evs.manifest import EXPORT_LOCK, MANIFEST_NAME, is_export_folder


@dataclass
class FolderClaim:
    """An export's hold on its folder: the lock and each file the folder held when it was taken (``before``: path ->
    (inode, modification time in ns), what tells a file rewritten since from one left as it was)."""

    folder: Path
    lock: BinaryIO
    before: dict[Path, tuple[int, int]] = field(default_factory=dict)

    def finish(self, kept: Iterable[Path] = ()) -> list[Path]:
        """Delete every file that was here before, is unchanged and is not in ``kept`` (the units kept from an
        earlier write), and the folders left empty; returns the deleted files."""
        kept = {Path(p) for p in kept}
        deleted = []
        for path, identity in self.before.items():
            try:
                stat = path.lstat()
            except FileNotFoundError:
                continue
            if (stat.st_ino, stat.st_mtime_ns) == identity and path not in kept:
                path.unlink()
                deleted.append(path)
        for root, folders, files in os.walk(self.folder, topdown=False):
            if Path(root) != self.folder and not os.listdir(root):
                os.rmdir(root)
        return deleted

    def release(self) -> None:
        fcntl.flock(self.lock, fcntl.LOCK_UN)
        self.lock.close()

    def __enter__(self) -> FolderClaim:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def claim_folder(folder: Path) -> FolderClaim:
    """Take ``folder`` for one export (the module docstring); ValueError in one line naming it where it cannot be."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{folder} is a file, not a folder: pass -o a folder for the export")
    if folder.is_dir() and any(folder.iterdir()) and not is_export_folder(folder):
        shown = ", ".join(sorted(p.name for p in folder.iterdir())[:3])
        raise ValueError(f"{folder} holds files that are not a qeff-evs export ({shown}...), which an export into it "
                         "would delete: export into an empty or new folder, or into an earlier export's")
    folder.mkdir(parents=True, exist_ok=True)
    lock = open(folder / EXPORT_LOCK, "a+b")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        lock.close()
        if error.errno not in (errno.EAGAIN, errno.EACCES):
            raise
        raise ValueError(f"another export is writing into {folder} (it holds {folder / EXPORT_LOCK}): wait for it to "
                         "finish, or export into another folder") from None
    (folder / MANIFEST_NAME).unlink(missing_ok=True)
    _sync_folder(folder)
    claim = FolderClaim(folder, lock)
    for root, _, files in os.walk(folder):
        for name in files:
            path = Path(root) / name
            if path != folder / EXPORT_LOCK:
                stat = path.lstat()
                claim.before[path] = (stat.st_ino, stat.st_mtime_ns)
    return claim


def _sync_folder(folder: Path) -> None:
    """Make a deletion or rename in ``folder`` durable (its directory entry flushed)."""
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


FULL = (errno.ENOSPC, errno.EDQUOT)
UNFINISHED = (".partial", ".tmp")  # a write cut short (``weights.WeightStore.write_unit``, ``Manifest.write``)


def folder_bytes(folder: Path) -> int:
    """Bytes of the finished files under ``folder`` (a write cut short not counted)."""
    return sum(path.stat().st_size for path in Path(folder).rglob("*")
               if path.is_file() and not path.name.endswith(UNFINISHED))


@contextmanager
def disk_full(folder: Path, expected: int) -> Iterator[None]:
    """Turn a full disk (or quota) under the block into a ValueError in one line: the folder, the bytes written there
    and about how many more the export needs (``expected``: its budget's disk); a write cut short is deleted, to free
    what it held."""
    try:
        yield
    except OSError as error:
        if error.errno not in FULL:
            raise
        for path in Path(folder).rglob("*"):
            if path.is_file() and path.name.endswith(UNFINISHED):
                path.unlink()
        written = folder_bytes(folder)
        needed = max(expected - written, 0)
        raise ValueError(f"the disk holding {folder} is full: {written:,} bytes of the export are written there, "
                         f"about {needed:,} more are needed ({needed / 2**30:.1f} GiB); free space there and run the "
                         "export again, it resumes at the first unit not written") from None
