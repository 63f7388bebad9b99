"""Inputs of one language-graph call: a prefill chunk with its window of vision rows, or a decode step.

Each prefill chunk receives only the retained vision rows its own window covers, zero-padded to
``user_vision_size``, with ``image_idx = 0``: the graph's k-th media token takes row k. Positions
are a slice of the request's int64 positions, so any chunking sees the same numbers.
"""

from __future__ import annotations

import numpy as np

from qeff_evs.models.graph_io import PAD_POSITION
from qeff_evs.runtime.backends.base import LanguageInputs
from qeff_evs.runtime.engine.request import PreparedPrompt
from qeff_evs.runtime.engine.window import window_slices



def gather_window(prompt: PreparedPrompt, computed: int, scheduled: int, user_vision_size: int,
                  hidden: int, levels: int) -> tuple[np.ndarray, np.ndarray | None, int]:
    """Rows of every media item overlapping ``[computed, computed+scheduled)``, zero-padded to U."""
    slices = window_slices(prompt.placeholders, computed, scheduled)
    rows = sum(s.num_rows for s in slices)
    if rows > user_vision_size:
        raise ValueError(
            f"a chunk needs {rows} vision rows but user_vision_size is {user_vision_size}; "
            "export with --user-vision-size >= --prefill-seq-len"
        )
    dtype = prompt.encoded[slices[0].item].rows.dtype if slices else np.float32
    window = np.zeros((1, user_vision_size, hidden), dtype=dtype)
    deepstack = np.zeros((levels, 1, user_vision_size, hidden), dtype=dtype) if levels else None
    at = 0
    for s in slices:
        enc = prompt.encoded[s.item]
        window[0, at:at + s.num_rows] = enc.rows[s.row_start:s.row_end]
        if deepstack is not None:
            deepstack[:, 0, at:at + s.num_rows] = enc.deepstack[:, s.row_start:s.row_end]
        at += s.num_rows
    return window, deepstack, rows


def prefill_step(prompt: PreparedPrompt, computed: int, scheduled: int, seq_len: int,
                 user_vision_size: int, hidden: int, levels: int, pad_token_id: int = 0) -> LanguageInputs:
    """The padded chunk ``[computed, computed+scheduled)`` as the prefill specialization wants it."""
    if scheduled > seq_len:
        raise ValueError(f"chunk of {scheduled} tokens exceeds the prefill length {seq_len}")
    ids = np.full((1, seq_len), pad_token_id, dtype=np.int64)
    ids[0, :scheduled] = prompt.ids[computed:computed + scheduled]
    position_ids = np.full((4, 1, seq_len), PAD_POSITION, dtype=np.int64)
    position_ids[0, 0, :scheduled] = np.arange(computed, computed + scheduled)
    position_ids[1:, 0, :scheduled] = prompt.positions[:, computed:computed + scheduled]
    window, deepstack, rows = gather_window(prompt, computed, scheduled, user_vision_size, hidden, levels)
    return LanguageInputs(ids, position_ids, window, deepstack, np.zeros((1, 1), dtype=np.int64), rows)


def decode_step(token_id: int, kv_slot: int, mrope_position: int) -> LanguageInputs:
    """One generated token: KV slot in row 0, the same M-RoPE position in rows 1..3."""
    position_ids = np.array([kv_slot] + [mrope_position] * 3, dtype=np.int64).reshape(4, 1, 1)
    return LanguageInputs(np.array([[token_id]], dtype=np.int64), position_ids, None, None,
                        np.zeros((1, 1), dtype=np.int64), 0)
