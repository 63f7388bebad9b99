"""The bench's PNGs share this: matplotlib's object API on the Agg canvas (no global backend), small files.

matplotlib (the bench extra) is imported only when a figure is drawn, so the phase modules that define
their plots import without it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

DPI = 80  # small files for the docs pages


def figure(width: float, height: float):
    """A new ``matplotlib.figure.Figure`` of ``width`` x ``height`` inches."""
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height))


def side_by_side(width: float = 8.0, height: float = 3.4):
    """A new figure with two axes side by side: ``(figure, left, right)``."""
    new = figure(width, height)
    return new, new.add_subplot(1, 2, 1), new.add_subplot(1, 2, 2)


def frames_axis(axes, frames: Sequence[int]) -> None:
    """An x axis of frame counts: log 2, each count ticked."""
    axes.set_xscale("log", base=2)
    axes.set_xticks(frames, [str(f) for f in frames])
    axes.set_xlabel("frames")


def finish(axes, xlabel: str | None = None, ylabel: str | None = None, title: str | None = None,
           legend_size: int = 8, from_zero: bool = True) -> None:
    """The look the bench's charts share: labels, a small title, y from 0, a light grid, a small legend."""
    if title is not None:
        axes.set_title(title, fontsize=10)
    if xlabel is not None:
        axes.set_xlabel(xlabel)
    if ylabel is not None:
        axes.set_ylabel(ylabel)
    if from_zero:
        axes.set_ylim(bottom=0)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=legend_size)


def save(figure, path: Path) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(figure)
    figure.tight_layout()
    figure.savefig(path, dpi=DPI)
    return path
