"""PNG plots of a benchmark's results (matplotlib's object API with the Agg canvas: no global backend).

* ``latency_vs_q.png``: prefill and vision time against q, with the proportional and chunk limits;
* ``window_sweep.png``: vision bytes and language time per chunk against frames, both ways;
* ``vision_sweep.png``: the vision side's time per temporal patch and peak memory against frames;
* ``kept_tokens.png``: which merged tokens each temporal patch of the moving-square clip kept.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from qeff_evs.bench.timing import CPU, WALL
from qeff_evs.bench.window_sweep import QEFFICIENT, USER_VISION_SIZE

DPI = 80  # small files for the README
MIB = 1024 * 1024
MS = 1e3
TOKEN_PIXELS = 6  # each merged token drawn as a square of this many pixels
PRUNED_BRIGHTNESS = 0.15  # pruned tokens keep a faint trace of their colour
GAP = 2  # pixels between frames in the kept-token picture


def _save(figure: Figure, path: Path) -> Path:
    FigureCanvasAgg(figure)
    figure.tight_layout()
    figure.savefig(path, dpi=DPI)
    return path


def plot_latency_vs_q(results: dict, path: Path) -> Path:
    rows = results["pruning_sweep"]["rows"]
    q = [r["q"] for r in rows]
    figure = Figure(figsize=(6.4, 4.0))
    axes = figure.add_subplot()
    axes.plot(q, [r[CPU]["prefill_ms"] / MS for r in rows], "o-", label="language prefill, CPU time")
    axes.plot(q, [r[CPU]["proportional_ms"] / MS for r in rows], "--", label="proportional limit (K+text)/(V+text)")
    axes.plot(q, [r[CPU]["chunk_limit_ms"] / MS for r in rows], ":", label="chunk-count limit")
    axes.plot(q, [r[WALL]["prefill_ms"] / MS for r in rows], "o-", alpha=0.35, label="language prefill, wall time")
    axes.plot(q, [r[WALL]["vision_ms"] / MS for r in rows], "s-", label="vision graph, wall (smaller clip)")
    frames, size = results["pruning_sweep"]["language_clip"]
    axes.set_title(f"Prefill vs EVS pruning rate ({frames} frames {size}x{size})", fontsize=10)
    axes.set_xlabel("video pruning rate q")
    axes.set_ylabel("seconds (median)")
    axes.set_ylim(bottom=0)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    return _save(figure, path)


def plot_window_sweep(results: dict, path: Path) -> Path:
    ws = results["window_sweep"]
    rows = ws["rows"]
    frames = [r["frames"] for r in rows]
    figure = Figure(figsize=(8.0, 3.4))
    left, right = figure.add_subplot(1, 2, 1), figure.add_subplot(1, 2, 2)
    labels = {USER_VISION_SIZE: "user_vision_size (window rows)", QEFFICIENT: "QEfficient (all rows)"}
    for way, marker in ((USER_VISION_SIZE, "o-"), (QEFFICIENT, "s--")):
        left.plot(frames, [r[way]["bytes_per_chunk"] / MIB for r in rows], marker, label=labels[way])
        line, = right.plot(frames, [r[way]["ms_per_chunk"][CPU] for r in rows], marker, label=f"{labels[way]}, CPU")
        right.plot(frames, [r[way]["ms_per_chunk"][WALL] for r in rows], marker, color=line.get_color(), alpha=0.3,
                   label=f"{labels[way]}, wall")
    for axes in (left, right):
        axes.set_xscale("log", base=2)
        axes.set_xticks(frames, [str(f) for f in frames])
        axes.set_xlabel("frames")
        axes.grid(alpha=0.3)
    left.set_ylabel("vision input per chunk (MiB)")
    right.set_ylabel("language time per chunk (ms)")
    right.set_ylim(bottom=0)
    left.legend(fontsize=7)
    right.legend(fontsize=6)
    figure.suptitle(f"Prefill chunks of {ws['prefill_seq_len']}, q={ws['q']:g}, {ws['frame_size']}x{ws['frame_size']}",
                    fontsize=10)
    return _save(figure, path)


def plot_vision_sweep(results: dict, path: Path) -> Path:
    """Time per temporal patch and peak memory against frames: encoder calls + the EVS graph."""
    vs = results["vision_sweep"]
    rows = vs["rows"]
    frames = [r["frames"] for r in rows]
    figure = Figure(figsize=(8.0, 3.4))
    left, right = figure.add_subplot(1, 2, 1), figure.add_subplot(1, 2, 2)
    label = f"encoder ({vs['frames_per_call']} patches/call) + EVS"
    line, = left.plot(frames, [r["encoder"]["cpu_s_per_patch"] for r in rows], "o-", label=f"{label}, CPU")
    left.plot(frames, [r["encoder"]["wall_s_per_patch"] for r in rows], "o-", color=line.get_color(), alpha=0.3,
              label=f"{label}, wall")
    right.plot(frames, [r["encoder"]["peak_above_start_mb"] or 0.0 for r in rows], "o-", label=label)
    right.plot(frames, [r["accumulated_mb"] for r in rows], ":", color="grey", label="accumulated merged rows")
    if vs.get("call_peak_mb") is not None:
        right.plot(frames, [vs["call_peak_mb"] + r["accumulated_mb"] for r in rows], "-.",
                   color="grey", label="one encoder call + rows")
    for axes in (left, right):
        axes.set_xscale("log", base=2)
        axes.set_xticks(frames, [str(f) for f in frames])
        axes.set_xlabel("frames")
        axes.set_ylim(bottom=0)
        axes.grid(alpha=0.3)
        axes.legend(fontsize=6)
    left.set_ylabel("vision s per temporal patch")
    right.set_ylabel("peak memory above loaded graphs (MB)")
    figure.suptitle(f"Vision side, {vs['frame_size']}x{vs['frame_size']}, q={vs['q']:g}", fontsize=10)
    return _save(figure, path)


def token_colours(frames: np.ndarray, token_pixels: int, temporal_patch_size: int) -> np.ndarray:
    """``(T, H, W, 3)`` uint8 -> ``(t, h, w, 3)`` float in [0, 1]: mean colour of each merged token.

    The first frame of each temporal patch stands for it.
    """
    firsts = frames[::temporal_patch_size].astype(np.float64) / 255.0
    t, height, width, _ = firsts.shape
    h, w = height // token_pixels, width // token_pixels
    blocks = firsts[:, : h * token_pixels, : w * token_pixels].reshape(t, h, token_pixels, w, token_pixels, 3)
    return blocks.mean(axis=(2, 4))


def kept_token_mosaic(colours: np.ndarray, kept_rows: list[np.ndarray]) -> np.ndarray:
    """One row of frames per keep mask (plus the unpruned row first); pruned tokens are darkened."""
    t, h, w, _ = colours.shape
    cell_h, cell_w = h * TOKEN_PIXELS, w * TOKEN_PIXELS
    masks = [np.ones(t * h * w, dtype=bool), *kept_rows]
    mosaic = np.ones((len(masks) * (cell_h + GAP) - GAP, t * (cell_w + GAP) - GAP, 3))
    for row, mask in enumerate(masks):
        keep = mask.reshape(t, h, w)
        for frame in range(t):
            shade = np.where(keep[frame, ..., None], 1.0, PRUNED_BRIGHTNESS)
            cell = np.repeat(np.repeat(colours[frame] * shade, TOKEN_PIXELS, 0), TOKEN_PIXELS, 1)
            top, left = row * (cell_h + GAP), frame * (cell_w + GAP)
            mosaic[top:top + cell_h, left:left + cell_w] = cell
    return mosaic


def plot_kept_tokens(frames: np.ndarray, merged_grid: tuple[int, int, int], kept: dict[float, np.ndarray],
                     token_pixels: int, temporal_patch_size: int, path: Path) -> Path:
    """``kept``: q -> retained flat indices on ``merged_grid`` (from the vision graph)."""
    t, h, w = merged_grid
    colours = token_colours(frames, token_pixels, temporal_patch_size)[:t]
    rates = sorted(q for q in kept if q > 0)
    masks = []
    for q in rates:
        mask = np.zeros(t * h * w, dtype=bool)
        mask[np.asarray(kept[q], dtype=np.int64)] = True
        masks.append(mask)
    mosaic = kept_token_mosaic(colours, masks)
    figure = Figure(figsize=(max(4.0, mosaic.shape[1] / DPI + 1.2), mosaic.shape[0] / DPI + 0.9))
    axes = figure.add_subplot()
    axes.imshow(mosaic, interpolation="nearest")
    cell_h = h * TOKEN_PIXELS + GAP
    axes.set_yticks([i * cell_h + cell_h / 2 for i in range(len(rates) + 1)],
                    ["input"] + [f"q={q:g}" for q in rates], fontsize=8)
    cell_w = w * TOKEN_PIXELS + GAP
    axes.set_xticks([i * cell_w + cell_w / 2 for i in range(t)], [f"t{i}" for i in range(t)], fontsize=7)
    axes.set_title("EVS: kept merged tokens (dark = pruned)", fontsize=9)
    return _save(figure, path)
