"""One encoded media item as named arrays: what an encoder instance ships to a prefill instance.

After the encoder and pruning graphs a media item is an ``EncodedMedia``: its K kept rows, their ascending
raster indices on the merged grid, the kept count of each temporal patch and the family's extra per-row
tensors (the family's extra rows of the kept tokens). That is all a prefill instance needs to fill the
item's placeholder (real layout, int64 positions from the indices) and to gather each chunk's window; it never
needs the pruned rows. Without pruning on the encoder side, vLLM's encoder disaggregation ships every row of
the unpruned merged grid; here only the kept rows travel, about ``1 - q`` of that.

Arrays, by name (every extra tensor under ``extra.<name>``, so a family's own tensors travel without this
module naming them):

  ``rows``              ``(K, hidden)``, the dtype the graphs produced
  ``kept_indices``  ``(K,)`` int64, ascending
  ``kept_per_frame``    ``(T,)`` int64, summing to K
  ``extra.<name>``      the family's extra rows, ``(levels, K, hidden)``
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from qeff_evs.runtime.engine.request import EncodedMedia

ROWS, INDICES, KEPT_PER_FRAME = "rows", "kept_indices", "kept_per_frame"
EXTRA_PREFIX = "extra."


def to_arrays(encoded: EncodedMedia) -> dict[str, np.ndarray]:
    """The arrays that carry ``encoded`` (contiguous, as they are written)."""
    arrays = {ROWS: encoded.rows, INDICES: np.asarray(encoded.kept_indices, dtype=np.int64),
              KEPT_PER_FRAME: np.asarray(encoded.kept_per_frame, dtype=np.int64)}
    arrays.update({EXTRA_PREFIX + name: value for name, value in encoded.extras.items()})
    return {name: np.ascontiguousarray(value) for name, value in arrays.items()}


def from_arrays(arrays: Mapping[str, np.ndarray]) -> EncodedMedia:
    """The ``EncodedMedia`` the arrays carry; a ValueError naming what does not fit together."""
    missing = [name for name in (ROWS, INDICES, KEPT_PER_FRAME) if name not in arrays]
    unknown = [name for name in arrays if name not in (ROWS, INDICES, KEPT_PER_FRAME)
               and not name.startswith(EXTRA_PREFIX)]
    if missing or unknown:
        raise ValueError(f"kept-row arrays {sorted(arrays)}: missing {missing}, unknown {unknown}; they were not "
                         "written by qeff-evs's to_arrays")
    rows, indices, kept = arrays[ROWS], np.asarray(arrays[INDICES]), np.asarray(arrays[KEPT_PER_FRAME])
    k = len(indices)
    if rows.ndim != 2 or rows.shape[0] != k or int(kept.sum()) != k:
        raise ValueError(f"kept rows {rows.shape}, {k} kept indices and per-frame counts summing to "
                         f"{int(kept.sum())} do not describe the same K tokens")
    if k and np.any(np.diff(indices) <= 0):
        raise ValueError("kept indices must be strictly ascending raster indices")
    extras = {name[len(EXTRA_PREFIX):]: value for name, value in arrays.items() if name.startswith(EXTRA_PREFIX)}
    wrong = {name: value.shape for name, value in extras.items() if value.ndim != 3 or value.shape[1] != k}
    if wrong:
        raise ValueError(f"extra rows {wrong} are not (levels, {k}, hidden) for the {k} kept tokens")
    return EncodedMedia(rows, indices.astype(np.int64), extras, tuple(int(c) for c in kept))


def nbytes(arrays: Mapping[str, np.ndarray]) -> int:
    """Bytes of the arrays' data."""
    return sum(int(value.nbytes) for value in arrays.values())


def unpruned_nbytes(arrays: Mapping[str, np.ndarray], total_rows: int) -> int:
    """Bytes of the same tensors for all ``total_rows`` rows of the unpruned merged grid (rows and extras;
    no indices): what an encoder instance would ship without pruning on its side."""
    k = len(arrays[INDICES])
    per_row = sum(int(value.nbytes) for name, value in arrays.items() if name not in (INDICES, KEPT_PER_FRAME))
    return per_row // k * total_rows if k else 0
