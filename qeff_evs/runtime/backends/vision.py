"""The vision side of one media item: frame batches through the encoder, then a pruning graph once
(docs/design.md#the-runtime).

Memory: one call's activations plus the item's accumulated merged rows. A last batch shorter than F is filled
with zero frames whose rows are dropped here, so encoder padding never reaches pruning.

Pruning (docs/design.md#pruning-semantics): the video's merged rows (and its extra rows, as ``score_extras``) are
zero-padded to the smallest frame bucket holding its ``T`` temporal patches; the method's graph ranks every row of the
bucket and the host keeps the first ``K(method, q, T)`` (``VideoPruning.kept_tokens``), gathering the rows and
the extra rows itself. Images, and videos that keep every token (q = 0; EVS at T = 1), skip the graph: it
would keep every row in order.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from qeff_evs import evs
from qeff_evs.models.protocol import MediaInput, ModelFamily, audio_rows, item_grid
from qeff_evs.models.pruning import VideoPruning, temporal_patch_bucket, pad_to_bucket, pruning_host_inputs
from qeff_evs.runtime.backends.base import EncoderSession, MergedRows, PruningSession, VisionResult, close_session
from qeff_evs.specializations.sets import check_frames_per_call

Progress = Callable[[str], None]


@dataclass
class VisionPipeline:
    """An encoder session run ``frames_per_call`` temporal patches at a time, and pruning sessions by method.

    ``buckets``: the export's frame buckets in temporal patches (``Manifest.temporal_patch_buckets``); a video is
    padded to the smallest that holds it (a compiled program runs only those shapes).
    """

    family: ModelFamily
    encoder: EncoderSession
    pruning: Mapping[str, PruningSession]
    frames_per_call: int
    buckets: tuple[int, ...]
    # The image encoder's session, where the export has one (``manifest.IMAGE_ENCODER``: its images are tiles with a
    # graph of their own); ``tiled_images``: whether it has, so that a backend without the session refuses images.
    image_encoder: EncoderSession | None = None
    tiled_images: bool = False
    # The audio encoder's session and its clip buckets in feature frames, where the export has one.
    audio_encoder: EncoderSession | None = None
    audio_buckets: tuple[int, ...] = ()
    # The encoder's host index inputs per frame grid (H, W): the same for every video of that
    # resolution at this F, so they are built once, not per video.
    _host_inputs: dict[tuple[int, int], dict[str, np.ndarray]] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        check_frames_per_call(self.frames_per_call, "frames_per_call")
        if not self.buckets or any(isinstance(b, bool) or int(b) != b or b < 1 for b in self.buckets):
            raise ValueError(f"buckets must be positive temporal patch counts, got {self.buckets!r}")
        self.buckets = tuple(sorted(int(b) for b in self.buckets))

    def audio_rows(self, media: MediaInput) -> MergedRows:
        """An audio item's rows: each clip padded to the smallest frame bucket holding it, one call each, its own
        rows kept (``models/parakeet.py``), the clips' rows in order."""
        if self.audio_encoder is None:
            raise ValueError("this export or backend runs no audio encoder (export a checkpoint with a sound_config; "
                             "the qaic backend does not load it yet); send images or videos")
        features = self.family.audio_features()
        pixels = np.asarray(media.pixel_values, dtype=np.float32)
        rows, start = [], 0
        for frames in media.clip_frames:
            fitting = [b for b in self.audio_buckets if b >= frames]
            if not fitting:
                raise ValueError(f"an audio clip of {frames} feature frames is longer than the export's largest audio "
                                 f"bucket ({max(self.audio_buckets)} frames); re-export this folder")
            bucket = min(fitting)
            padded = np.zeros((bucket, pixels.shape[1]), dtype=np.float32)
            padded[:frames] = pixels[start:start + frames]
            mask = np.zeros(bucket, dtype=np.int64)
            mask[:frames] = 1
            out = self.audio_encoder.encode(padded, {"feature_mask": mask})
            rows.append(out.rows[:audio_rows(features, (frames,))])
            start += frames
        return MergedRows(np.concatenate(rows), {})

    def merged_rows(self, media: MediaInput, progress: Progress | None = None) -> MergedRows:
        """The item's merged rows ``(T*h*w, hidden)`` (+ extras), encoded F temporal patches per call."""
        if media.kind == "audio":
            return self.audio_rows(media)
        t, big_h, big_w = (int(v) for v in media.grid_thw)
        _, h, w = self.family.merged_grid(media.grid_thw)
        f, patches, tokens = self.frames_per_call, big_h * big_w, h * w
        pixels = np.asarray(media.pixel_values, dtype=np.float32)
        if pixels.ndim != 2 or pixels.shape[0] != t * patches:
            raise ValueError(f"pixel_values of shape {pixels.shape} do not hold the {t * patches} patches of grid "
                             f"{tuple(media.grid_thw)}; pass the processor's output for this grid")
        encoder = self.encoder
        if media.kind == "image" and self.tiled_images:
            if self.image_encoder is None:
                raise ValueError("this backend runs no image encoder program (only ort, openvino and torch do); send "
                                 "videos, or serve images on another backend")
            encoder = self.image_encoder
        # The same taps for both encoders of a grid: they differ only in the first layer.
        host = self._host_inputs.get((big_h, big_w))
        if host is None:
            host = self._host_inputs[(big_h, big_w)] = self.family.encoder_host_inputs((big_h, big_w), f)
        rows, extras = None, {}
        for start in range(0, t, f):
            count = min(f, t - start)
            batch = pixels[start * patches:(start + count) * patches]
            if count < f:
                batch = np.concatenate([batch, np.zeros(((f - count) * patches, batch.shape[1]), batch.dtype)])
            out = encoder.encode(batch, host)
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

    def pruning_feeds(self, merged: MergedRows, merged_grid: tuple[int, int, int], pruning: VideoPruning
                      ) -> dict[str, np.ndarray]:
        """The pruning graph's inputs for a video's merged rows: padded to its bucket, by input name."""
        t, h, w = merged_grid
        bucket_rows = temporal_patch_bucket(t, self.buckets) * h * w
        feeds = {"merged_embeds": pad_to_bucket(merged.rows, bucket_rows)}
        # Every extra's levels, in the family's order, after the rows (vLLM scores the concatenation).
        scored = [merged.extras[rows.name] for rows in self.family.extra_rows if rows.name in merged.extras]
        if scored:
            feeds["score_extras"] = pad_to_bucket(np.concatenate(scored, axis=0), bucket_rows, axis=1)
        return {**feeds, **pruning_host_inputs(pruning.method, bucket_rows // (h * w), t, pruning.rate)}

    def prune(self, media: MediaInput, merged: MergedRows, pruning: VideoPruning) -> VisionResult:
        """The kept rows of an item: its method's ranking, first K kept; every row when K is all of them."""
        grid = item_grid(self.family, media)
        total = grid[0] * grid[1] * grid[2]
        k = pruning.kept_tokens(grid, media.kind)
        if k == total:
            return VisionResult(merged.rows, np.arange(total, dtype=np.int64), merged.extras)
        session = self.pruning.get(pruning.method)
        if session is None:
            raise ValueError(f"this vision pipeline runs the {', '.join(self.pruning) or 'no'} pruning graph(s), "
                             f"not {pruning.method!r}; open the sessions with that method")
        kept = evs.kept_from_ranking(session.rank(self.pruning_feeds(merged, grid, pruning)), k)
        if kept[-1] >= total:  # padding ranks after every real row: reaching it means a broken graph
            raise ValueError(f"the {pruning.method} pruning graph ranked padding row {int(kept[-1])} among the "
                             f"first {k} of a video of {total} rows; re-export this folder")
        return VisionResult(merged.rows[kept], kept, {name: value[..., kept, :] for name, value in merged.extras.items()})

    def encode(self, media: MediaInput, pruning: VideoPruning, progress: Progress | None = None) -> VisionResult:
        return self.prune(media, self.merged_rows(media, progress), pruning)

    def close(self) -> None:
        """Release every session's program (QAIC); nothing to do on the host backends."""
        close_session(self.encoder)
        for session in (self.image_encoder, self.audio_encoder):
            if session is not None:
                close_session(session)
        for session in self.pruning.values():
            close_session(session)
