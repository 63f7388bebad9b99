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
