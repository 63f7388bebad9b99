"""The picture of what EVS kept: each temporal patch of the clip as merged-token squares, pruned ones darkened.

One row per rate (the unpruned input first), one cell per temporal patch; each merged token is drawn in
the mean colour of its pixels in the patch's first frame.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from qeff_evs.bench import plots
from qeff_evs.bench.checkpoint import model_config
from qeff_evs.bench.config import BenchConfig
from qeff_evs.bench.workload import synthetic_clip
from qeff_evs.models.registry import family_class
from qeff_evs.runtime.inputs.preprocess_spec import VisionPreprocessSpec

TOKEN_PIXELS = 6  # each merged token drawn as a square of this many pixels
PRUNED_BRIGHTNESS = 0.15  # pruned tokens keep a faint trace of their colour
GAP = 2  # pixels between frames in the kept-token picture


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
    """``kept``: q -> kept flat indices on ``merged_grid`` (from the vision graph)."""
    t, h, w = merged_grid
    colours = token_colours(frames, token_pixels, temporal_patch_size)[:t]
    rates = sorted(q for q in kept if q > 0)
    masks = []
    for q in rates:
        mask = np.zeros(t * h * w, dtype=bool)
        mask[np.asarray(kept[q], dtype=np.int64)] = True
        masks.append(mask)
    mosaic = kept_token_mosaic(colours, masks)
    figure = plots.figure(max(4.0, mosaic.shape[1] / plots.DPI + 1.2), mosaic.shape[0] / plots.DPI + 0.9)
    axes = figure.add_subplot()
    axes.imshow(mosaic, interpolation="nearest")
    cell_h = h * TOKEN_PIXELS + GAP
    axes.set_yticks([i * cell_h + cell_h / 2 for i in range(len(rates) + 1)],
                    ["input"] + [f"q={q:g}" for q in rates], fontsize=8)
    cell_w = w * TOKEN_PIXELS + GAP
    axes.set_xticks([i * cell_w + cell_w / 2 for i in range(t)], [f"t{i}" for i in range(t)], fontsize=7)
    axes.set_title("EVS: kept merged tokens (dark = pruned)", fontsize=9)
    return plots.save(figure, path)


def plot_for_config(config: BenchConfig, merged_grid: tuple[int, int, int], kept: dict[float, np.ndarray],
                    path: Path) -> Path:
    """``plot_kept_tokens`` on the vision clip of ``config`` (rebuilt from its seed)."""
    vc = family_class(config.family).config_paths.read(model_config(config))
    spec = VisionPreprocessSpec.for_family(config.family, patch_size=vc.patch_size,
                                           temporal_patch_size=vc.temporal_patch_size, merge_size=vc.merge_size)
    clip = synthetic_clip(spec, config.vision_frames, config.vision_frame_size, config.seed)
    return plot_kept_tokens(clip.frames, merged_grid, kept, vc.patch_size * vc.merge_size, vc.temporal_patch_size,
                            path)
