"""QAIC backend entry point: needs the Cloud AI 100 Apps SDK's Python runtime (``qaicrt``)."""

from __future__ import annotations


def qaic_sessions(bundle):
    try:
        import qaicrt  # noqa: F401  (Apps SDK, /opt/qti-aic/dev/lib/x86_64)
    except ImportError:
        raise ValueError(
            "the qaic backend needs the Cloud AI 100 Apps SDK Python runtime `qaicrt`, which is not importable "
            "here; install the Apps SDK (and add its python path), run `qeff-evs compile` first, "
            "or use --backend ort / --backend torch") from None
    raise ValueError(
        "qaicrt was found, but running compiled QPCs is not wired into qeff-evs yet (planned with the serving "
        "engine); use --backend ort or --backend torch")
