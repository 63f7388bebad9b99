"""Images cut into tiles as vLLM 0.34's Nemotron-H processor cuts them (InternVL's tiler), for families whose images
have an encoder graph of their own (``ModelFamily.image_tiling``).

The grid is the one, among every ``columns x rows`` of at most ``max_tiles`` tiles, whose aspect ratio is closest to
the image's (a tie goes to the later grid when the image is large enough to fill half of it, InternVL's rule); the
whole image is resized once to ``tile * columns x tile * rows`` and cut into tiles in raster order, and a thumbnail
(the whole image resized to one tile) follows them when the grid has several. Pixels are resized and normalised as
the family's video frames are (``processor.torch_resize_normalize``). The rule is written here because vLLM's copy
cannot be imported without torchvision and transformers has none (its Nemotron-H processor tiles dynamically).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from qeff_evs.models.protocol import ImageTiling, check_max_tiles
from qeff_evs.runtime.inputs.preprocess_spec import VisionPreprocessSpec
from qeff_evs.runtime.inputs.processor import patchify, torch_resize_normalize

MAX_TILES_KEY = "max_num_tiles"  # vLLM's processor argument (server --mm-processor-kwargs, or per request)


@dataclass(frozen=True)
class TileGrid:
    """Where an image's tiles come from: ``columns x rows`` tiles of the resized image, then the thumbnail."""

    columns: int
    rows: int
    thumbnail: bool

    @property
    def tiles(self) -> int:
        return self.columns * self.rows + int(self.thumbnail)


def candidate_grids(max_tiles: int) -> list[tuple[int, int]]:
    """Every ``(columns, rows)`` of at most ``max_tiles`` tiles, fewest tiles first.

    Grids of the same tile count keep the order a Python set of them iterates in, built in the order InternVL's
    builds it (by the larger side, then columns, then rows): on an exact tie of aspect ratios that order decides."""
    grids = set()
    for side in range(1, max_tiles + 1):
        for columns in range(1, side + 1):
            for rows in range(1, side + 1):
                if columns * rows <= max_tiles:
                    grids.add((columns, rows))
    return sorted(grids, key=lambda grid: grid[0] * grid[1])


def choose_grid(width: int, height: int, tiling: ImageTiling, max_tiles: int | None = None) -> TileGrid:
    """The tile grid of a ``width x height`` image (``max_tiles``: the request's ``max_num_tiles``, default the
    tiling's)."""
    if width < 1 or height < 1:
        raise ValueError(f"an image is at least 1x1 pixels, got {width}x{height}")
    limit = tiling.max_tiles if max_tiles is None else check_max_tiles(max_tiles)
    aspect = width / height
    best, best_distance = (1, 1), float("inf")
    for columns, rows in candidate_grids(limit):
        distance = abs(aspect - columns / rows)
        if distance < best_distance:
            best, best_distance = (columns, rows), distance
        elif distance == best_distance and width * height > 0.5 * tiling.tile_size ** 2 * columns * rows:
            best = (columns, rows)
    columns, rows = best
    return TileGrid(columns, rows, tiling.thumbnail and columns * rows > 1)


def without_tile_kwargs(mm_processor_kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """The video processor's share of ``mm_processor_kwargs`` (vLLM hands one processor both): all but the tiler's."""
    return {key: value for key, value in (mm_processor_kwargs or {}).items() if key != MAX_TILES_KEY}


def max_tiles_of(mm_processor_kwargs: Mapping[str, Any] | None) -> int | None:
    """The ``max_num_tiles`` a request or server asks for, checked; None when it asks for none."""
    value = (mm_processor_kwargs or {}).get(MAX_TILES_KEY)
    return None if value is None else check_max_tiles(value)


def tile_pixels(image: np.ndarray, tiling: ImageTiling, spec: VisionPreprocessSpec,
                max_tiles: int | None = None) -> tuple[np.ndarray, TileGrid]:
    """An RGB uint8 ``(H, W, 3)`` image -> its tiles ``(tiles, 3, S, S)`` float32 (raster order, the thumbnail last)
    and their grid."""
    if not isinstance(image, np.ndarray) or image.ndim != 3 or image.shape[-1] != 3 or image.dtype != np.uint8:
        raise ValueError(f"an image must be RGB uint8 (H, W, 3), got {getattr(image, 'dtype', type(image))} "
                         f"{getattr(image, 'shape', '')}")
    height, width = image.shape[:2]
    grid = choose_grid(width, height, tiling, max_tiles)
    side = tiling.tile_size
    resized = torch_resize_normalize(image[None], (side * grid.rows, side * grid.columns), spec)[0]
    tiles = resized.reshape(3, grid.rows, side, grid.columns, side).transpose(1, 3, 0, 2, 4)
    tiles = tiles.reshape(grid.columns * grid.rows, 3, side, side)
    if grid.thumbnail:
        tiles = np.concatenate([tiles, torch_resize_normalize(image[None], (side, side), spec)])
    return np.ascontiguousarray(tiles), grid


def tile_patches(tiles: np.ndarray, spec: VisionPreprocessSpec) -> tuple[np.ndarray, tuple[int, int, int]]:
    """Tiles ``(N, 3, S, S)`` -> patch rows ``(N * S/p * S/p, 3*p*p)``, each ``(channel, y, x)`` in raster order (the
    image patch projection's), and the grid ``(N, S/p, S/p)``."""
    return patchify(tiles, dataclasses.replace(spec, temporal_patch_size=1, patch_order="raster"))
