"""The bench's PNGs share this: matplotlib's object API on the Agg canvas (no global backend), small files.

matplotlib (the bench extra) is imported only when a figure is drawn, so the phase modules that define
their plots import without it.
"""

from __future__ import annotations

from pathlib import Path

DPI = 80  # small files for the docs pages


def figure(width: float, height: float):
    """A new ``matplotlib.figure.Figure`` of ``width`` x ``height`` inches."""
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height))


def save(figure, path: Path) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(figure)
    figure.tight_layout()
    figure.savefig(path, dpi=DPI)
    return path
