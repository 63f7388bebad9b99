"""Inputs of one prefill-chunk call of the language graph: the chunk's ids, positions and window of vision rows.

Each prefill chunk receives only the kept vision rows its own window covers, zero-padded to
``user_vision_size``, with ``image_idx = 0``: the graph's k-th media token takes row k. Positions
are a slice of the request's int64 positions, so any chunking sees the same numbers. Every caller
(single-request and serving engines through the executor, the vLLM adapters, the bench) builds its
chunks here; decode calls are assembled by the backends (``decode_batch``).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from qeff_evs.models.graph_io import PAD_POSITION
from qeff_evs.runtime.backends.base import LanguageInputs
from qeff_evs.runtime.engine.window import Placeholder, window_slices


class EncodedRows(Protocol):
    """An encoded media item as the window reads it (``EncodedMedia`` is one)."""

    rows: np.ndarray  # (K, hidden)
    extras: Mapping[str, np.ndarray]  # the family's extra rows by name, (levels, K, hidden)


class ChunkPrompt(Protocol):
    """A request's prompt as a chunk reads it (``PromptPlan`` and ``PreparedPrompt`` are ones)."""

    ids: np.ndarray  # (N,) int64
    positions: np.ndarray  # (3, N) int64
    placeholders: list[Placeholder]
    encoded: Sequence[EncodedRows | None]  # per media item; None until encoded


@dataclass(frozen=True)
class VisionWindow:
    """Language-graph vision inputs of one prefill chunk."""

    vision_embeds: np.ndarray  # (1, user_vision_size, hidden), real rows first, zeros after
    extras: Mapping[str, np.ndarray]  # by name, (levels, 1, user_vision_size, hidden), same rows
    image_idx: np.ndarray  # (1, 1) int64, always 0: the chunk's k-th media token takes row k
    num_rows: int


def gather_window(placeholders: Sequence[Placeholder], keys: Sequence[Hashable],
                  outputs: Mapping[Hashable, EncodedRows], computed: int, scheduled: int,
                  user_vision_size: int, hidden: int, extras: Mapping[str, int] | None = None) -> VisionWindow:
    """Rows of every media item overlapping ``[computed, computed+scheduled)``, in prompt order, zero-padded to U.

    Item ``i`` sits at ``placeholders[i]`` and its encoder output is ``outputs[keys[i]]``. ``extras``
    (the family's extra rows: name -> levels) are windowed alike.
    """
    extras = dict(extras or {})
    slices = window_slices(list(placeholders), computed, scheduled)
    num_rows = sum(s.num_rows for s in slices)
    if num_rows > user_vision_size:
        raise ValueError(
            f"chunk [{computed}, {computed + scheduled}) needs {num_rows} vision rows but user_vision_size is "
            f"{user_vision_size}; export with --user-vision-size >= --prefill-seq-len")
    used = [keys[s.item] for s in slices]
    missing = [k for k in used if k not in outputs or any(name not in outputs[k].extras for name in extras)]
    if missing:
        raise ValueError(f"encoder outputs missing for {missing}; encode those items before the chunk that uses them")
    dtype = outputs[used[0]].rows.dtype if used else np.float32
    window = np.zeros((1, user_vision_size, hidden), dtype=dtype)
    extra_windows = {name: np.zeros((levels, 1, user_vision_size, hidden), dtype=dtype)
                     for name, levels in extras.items()}
    at = 0
    for s, key in zip(slices, used):
        encoded = outputs[key]
        window[0, at:at + s.num_rows] = encoded.rows[s.row_start:s.row_end]
        for name, extra in extra_windows.items():
            extra[:, 0, at:at + s.num_rows] = encoded.extras[name][:, s.row_start:s.row_end]
        at += s.num_rows
    return VisionWindow(window, extra_windows, np.zeros((1, 1), dtype=np.int64), num_rows)


def prefill_step(prompt: ChunkPrompt, computed: int, scheduled: int, seq_len: int,
                 user_vision_size: int, hidden: int, extras: Mapping[str, int] | None = None,
                 pad_token_id: int = 0, wants_logits: bool = True) -> LanguageInputs:
    """The padded chunk ``[computed, computed+scheduled)`` as the prefill specialization wants it.

    ``extras``: the family's extra rows (name -> levels), windowed with the vision rows. ``wants_logits``: False
    for a chunk before the prompt's last (``LanguageInputs.wants_logits``).
    """
    if scheduled > seq_len:
        raise ValueError(f"chunk of {scheduled} tokens exceeds the prefill length {seq_len}")
    ids = np.full((1, seq_len), pad_token_id, dtype=np.int64)
    ids[0, :scheduled] = prompt.ids[computed:computed + scheduled]
    position_ids = np.full((4, 1, seq_len), PAD_POSITION, dtype=np.int64)
    position_ids[0, 0, :scheduled] = np.arange(computed, computed + scheduled)
    position_ids[1:, 0, :scheduled] = prompt.positions[:, computed:computed + scheduled]
    encoded = {item: e for item, e in enumerate(prompt.encoded) if e is not None}
    window = gather_window(prompt.placeholders, range(len(prompt.placeholders)), encoded, computed, scheduled,
                           user_vision_size, hidden, extras)
    return LanguageInputs(ids, position_ids, window.vision_embeds, window.extras, window.image_idx,
                          window.num_rows, wants_logits)
