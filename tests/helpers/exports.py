"""A test's export of a tiny checkpoint: the pipeline a user runs, without torch.onnx's DeprecationWarnings
(the exporter's own, about its internals) in the test output."""

from __future__ import annotations

import warnings
from pathlib import Path

from qeff_evs.export.pipeline import ExportOptions, export_checkpoint


def export_quietly(checkpoint: Path, out: Path, options: ExportOptions) -> Path:
    """``export_checkpoint(checkpoint, out, options)``; returns ``out``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        export_checkpoint(checkpoint, out, options)
    return out
