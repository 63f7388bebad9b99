"""The vision side of one media item: frame batches through the encoder, then EVS once (DESIGN §5).

Memory: one call's activations plus the item's accumulated merged rows. A last batch shorter than
F is filled with zero frames whose rows are dropped here, so padding never reaches EVS. Images, and
videos that keep every token (q = 0), skip the EVS graph: its selection would keep every row in order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from qeff_evs.models.protocol import MediaInput, ModelFamily
from qeff_evs.models.vision_common import evs_host_inputs
from qeff_evs.runtime.backends.base import EncoderSession, EVSSession, MergedRows, VisionResult, close_session

Progress = Callable[[str], None]


@dataclass
class VisionPipeline:
    """An encoder session run ``frames_per_call`` temporal patches at a time, and an EVS session."""

    family: ModelFamily
    encoder: EncoderSession
    evs: EVSSession
    frames_per_call: int
    # The encoder's host index inputs per frame grid (H, W): the same for every video of that
    # resolution at this F, so they are built once, not per video.
    _host_inputs: dict[tuple[int, int], dict[str, np.ndarray]] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.frames_per_call, bool) or int(self.frames_per_call) != self.frames_per_call \
                or self.frames_per_call < 1:
            raise ValueError(f"frames_per_call must be a positive integer, got {self.frames_per_call!r}")

    def merged_rows(self, media: MediaInput, progress: Progress | None = None) -> MergedRows:
        """The item's merged rows ``(T*h*w, hidden)`` (+ extras), encoded F temporal patches per call."""
        t, big_h, big_w = (int(v) for v in media.grid_thw)
        _, h, w = self.family.merged_grid(media.grid_thw)
        f, patches, tokens = self.frames_per_call, big_h * big_w, h * w
        pixels = np.asarray(media.pixel_values, dtype=np.float32)
        if pixels.ndim != 2 or pixels.shape[0] != t * patches:
            raise ValueError(f"pixel_values of shape {pixels.shape} do not hold the {t * patches} patches of grid "
                             f"{tuple(media.grid_thw)}; pass the processor's output for this grid")
        host = self._host_inputs.get((big_h, big_w))
        if host is None:
            host = self._host_inputs[(big_h, big_w)] = self.family.encoder_host_inputs((big_h, big_w), f)
        rows, extras = None, {}
        for start in range(0, t, f):
            count = min(f, t - start)
            batch = pixels[start * patches:(start + count) * patches]
            if count < f:
                batch = np.concatenate([batch, np.zeros(((f - count) * patches, batch.shape[1]), batch.dtype)])
            out = self.encoder.encode(batch, host)
            if rows is None:  # sized once the hidden width is known; the item's rows, nothing more
                rows = np.empty((t * tokens, out.rows.shape[-1]), dtype=out.rows.dtype)
                extras = {name: np.empty((*value.shape[:-2], t * tokens, value.shape[-1]), dtype=value.dtype)
                          for name, value in out.extras.items()}
            kept = slice(start * tokens, (start + count) * tokens)
            rows[kept] = out.rows[:count * tokens]
            for name, value in extras.items():  # rows are the second-to-last axis of every extra
                value[..., kept, :] = out.extras[name][..., :count * tokens, :]
            if progress is not None:
                progress(f"encoded temporal patches {start + count}/{t}")
        return MergedRows(rows, extras)

    def prune(self, media: MediaInput, merged: MergedRows, retained: int) -> VisionResult:
        """The EVS graph over a video keeping K < T*h*w tokens; otherwise every row, in order."""
        grid = self.family.merged_grid(media.grid_thw)
        total = grid[0] * grid[1] * grid[2]
        if retained == total:
            return VisionResult(merged.rows, np.arange(total, dtype=np.int64), merged.extras)
        if media.kind == "image":
            raise ValueError(f"an image keeps all {total} of its tokens, asked to keep {retained}")
        # The EVS graph's inputs by name: each extra enters under its family-declared input name.
        extras = {rows.evs_input: merged.extras[rows.name] for rows in self.family.extra_rows
                  if rows.name in merged.extras}
        return self.evs.select({"merged_embeds": merged.rows, **extras, **evs_host_inputs(grid, retained)})

    def encode(self, media: MediaInput, retained: int, progress: Progress | None = None) -> VisionResult:
        return self.prune(media, self.merged_rows(media, progress), retained)

    def close(self) -> None:
        """Release both sessions' programs (QAIC); nothing to do on the host backends."""
        close_session(self.encoder)
        close_session(self.evs)
