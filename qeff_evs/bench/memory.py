"""Peak resident memory of this process between two points, from Linux's /proc (no extra packages).

Writing "5" to ``/proc/self/clear_refs`` resets the peak (``VmHWM``) to the current resident size,
so ``reset_peak(); work(); peak_mb()`` is the highest resident size reached during ``work``.
Elsewhere (no /proc) every reading is ``None`` and the reports say "n/a".
"""

from __future__ import annotations

from pathlib import Path

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")
_RESET_PEAK = "5"


def _status_mb(field: str) -> float | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024.0  # the kernel reports kB
    except OSError:
        return None
    return None


def resident_mb() -> float | None:
    return _status_mb("VmRSS")


def peak_mb() -> float | None:
    return _status_mb("VmHWM")


def reset_peak() -> bool:
    try:
        _CLEAR_REFS.write_text(_RESET_PEAK)
    except OSError:
        return False
    return True


def peak_above(call) -> float | None:
    """Run ``call`` once; the peak resident MB it reached above the resident size before it (None without /proc)."""
    start = resident_mb()
    reset_peak()
    call()
    peak = peak_mb()
    return None if peak is None or start is None else peak - start


def process_status(pid: int) -> dict[str, float]:
    """``VmHWM``, ``VmRSS``, ``RssAnon``, ``RssFile`` of process ``pid`` in MiB (empty once it has gone)."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return {}
    fields = ("VmHWM", "VmRSS", "RssAnon", "RssFile")
    return {line.split(":")[0]: int(line.split()[1]) / 1024.0 for line in lines if line.split(":")[0] in fields}


def watch_process(process, interval: float = 0.1) -> dict[str, float]:
    """Wait for ``process`` (a ``subprocess.Popen``), sampling its memory every ``interval`` s: the largest
    ``VmHWM``, ``RssAnon`` and ``RssFile`` seen, in MiB (a spike shorter than ``interval`` may be missed; the kernel's
    ``ru_maxrss`` is no better here: a forked child's starts from its parent's size). A process that reports its own
    ``VmHWM`` when it ends is exact (``bench.export_scaling``)."""
    import time

    peak = {"VmHWM": 0.0, "RssAnon": 0.0, "RssFile": 0.0}
    while process.poll() is None:
        sample = process_status(process.pid)
        for key in peak:
            peak[key] = max(peak[key], sample.get(key, 0.0))
        time.sleep(interval)
    return peak
