"""Synthetic test clips: a still textured background with one bright square moving across it.

Such a clip is what EVS is built for: every token the square does not touch is identical from
one frame to the next (dissimilarity 0), so a pruned video should keep frame 0 plus mostly the
tokens along the square's path. Everything is deterministic from ``seed``, so tests and demos can
regenerate the exact same pixels.
"""

from __future__ import annotations

import numpy as np

# The background stays inside [BACKGROUND_LOW, BACKGROUND_HIGH]; the square is pure white, so it
# is always brighter than anything behind it.
BACKGROUND_LOW = 30
BACKGROUND_HIGH = 170
SQUARE_COLOR = (255, 255, 255)


def _check_positive(name: str, value: int) -> int:
    if int(value) != value or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def textured_background(height: int, width: int, *, seed: int = 0) -> np.ndarray:
    """A deterministic (H, W, 3) uint8 texture: coarse colour blobs plus fine grain.

    The coarse part gives neighbouring patches different content (so their embeddings differ),
    the grain keeps it from being piecewise constant.
    """
    height = _check_positive("height", height)
    width = _check_positive("width", width)
    rng = np.random.default_rng(seed)
    cell = 8  # pixels per coarse cell
    coarse = rng.uniform(0.0, 1.0, size=(-(-height // cell), -(-width // cell), 3))
    blobs = np.repeat(np.repeat(coarse, cell, axis=0), cell, axis=1)[:height, :width]
    grain = rng.uniform(0.0, 1.0, size=(height, width, 3))
    mix = 0.75 * blobs + 0.25 * grain
    span = BACKGROUND_HIGH - BACKGROUND_LOW
    return (BACKGROUND_LOW + np.floor(mix * span)).astype(np.uint8)


def moving_square_positions(
    num_frames: int, height: int, width: int, *, square: int, speed: float
) -> list[tuple[int, int]]:
    """Top-left corner ``(row, col)`` of the square in each frame.

    The square sits on the vertical centre line and moves horizontally by ``speed`` pixels per
    frame, bouncing off the left and right edges (a triangle wave), so it never jumps.
    """
    num_frames = _check_positive("num_frames", num_frames)
    height = _check_positive("height", height)
    width = _check_positive("width", width)
    square = _check_positive("square", square)
    if square > min(height, width):
        raise ValueError(f"square={square} does not fit in a {height}x{width} frame; use square <= {min(height, width)}")
    if not speed >= 0:
        raise ValueError(f"speed must be >= 0 pixels per frame, got {speed!r}")
    row = (height - square) // 2
    travel = width - square  # the left edge moves within [0, travel]
    positions = []
    for t in range(num_frames):
        if travel == 0:
            col = 0
        else:
            phase = (speed * t) % (2 * travel)
            col = int(phase if phase <= travel else 2 * travel - phase)
        positions.append((row, col))
    return positions


def moving_square_video(
    num_frames: int,
    height: int,
    width: int,
    *,
    square: int | None = None,
    speed: float | None = None,
    seed: int = 0,
) -> np.ndarray:
    """A (T, H, W, 3) uint8 clip: a still background from ``seed`` and a white square moving on it.

    ``square`` defaults to a quarter of the shorter side (at least 1 pixel); ``speed`` (pixels per
    frame) defaults to crossing the frame once over the clip. Positions follow
    :func:`moving_square_positions`.
    """
    num_frames = _check_positive("num_frames", num_frames)
    height = _check_positive("height", height)
    width = _check_positive("width", width)
    if square is None:
        square = max(1, min(height, width) // 4)
    if speed is None:
        speed = (width - square) / max(1, num_frames - 1)
    background = textured_background(height, width, seed=seed)
    video = np.repeat(background[None], num_frames, axis=0)
    for t, (row, col) in enumerate(moving_square_positions(num_frames, height, width, square=square, speed=speed)):
        video[t, row : row + square, col : col + square] = SQUARE_COLOR
    return video
