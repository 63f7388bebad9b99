"""``qeff-evs encode``: the vision side of one video (encoder calls, then its pruning graph), timed and reported."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from qeff_evs import evs
from qeff_evs.models.protocol import MediaInput
from qeff_evs.models.pruning import VideoPruning
from qeff_evs.runtime.backends.vision import Progress
from qeff_evs.runtime.builders import video_pruning
from qeff_evs.runtime.export_bundle import ExportBundle
from qeff_evs.runtime.sessions import vision_pipeline


@dataclass(frozen=True)
class EncodeReport:
    """What ``qeff-evs encode`` prints: the vision side of one video, without the language model."""

    frames: int  # sampled frames
    resolution: tuple[int, int]  # (height, width) in pixels the encoder saw
    merged_grid: tuple[int, int, int]  # (T, h, w)
    frames_per_call: int
    kept_indices: np.ndarray  # (K,) int64, ascending raster indices
    seconds: dict[str, float]  # encoder, pruning, total
    pruning: VideoPruning = VideoPruning()

    @property
    def kept_tokens_per_frame(self) -> list[int]:
        t, h, w = self.merged_grid
        return evs.tokens_per_frame_kept(self.kept_indices, t, h * w)

    def kept_map(self) -> list[str]:
        """Per temporal patch, its h rows of w marks: ``#`` kept, ``.`` pruned."""
        t, h, w = self.merged_grid
        keep = np.zeros(t * h * w, dtype=bool)
        keep[self.kept_indices] = True
        lines = []
        for f, frame in enumerate(keep.reshape(t, h, w)):
            lines.append(f"temporal patch {f}: {int(frame.sum())}/{h * w} kept")
            lines += ["  " + "".join("#" if k else "." for k in row) for row in frame]
        return lines

    def to_json(self) -> dict:
        return {"frames": self.frames, "resolution": list(self.resolution), "merged_grid": list(self.merged_grid),
                "frames_per_call": self.frames_per_call, "video_pruning_method": self.pruning.method,
                "video_pruning_rate": self.pruning.rate, "kept_tokens": int(len(self.kept_indices)),
                "kept_tokens_per_frame": self.kept_tokens_per_frame,
                "kept_indices": self.kept_indices.tolist(), "seconds": dict(self.seconds)}


def encode_video(bundle: ExportBundle, video: MediaInput, backend: str = "ort", device: str | None = None,
                 progress: Progress | None = None, device_ids=None,
                 pruning: VideoPruning | None = None) -> EncodeReport:
    """Only the vision side of one video: encoder calls of F temporal patches, then its pruning graph once
    (``pruning``: default the export's method and rate)."""
    pruning = video_pruning(bundle) if pruning is None else pruning
    bundle.manifest.check_pruning(pruning.method, pruning.rate)
    bundle.manifest.check_video(video.grid_thw)  # fails clearly when no specialization serves this grid
    vision = vision_pipeline(bundle, backend, device, device_ids=device_ids, method=pruning.method)
    try:
        started = time.perf_counter()
        merged = vision.merged_rows(video, progress)
        encoded = time.perf_counter()
        result = vision.prune(video, merged, pruning)
        done = time.perf_counter()
    finally:
        vision.close()
    t, big_h, big_w = video.grid_thw
    patch = bundle.preprocess.patch_size
    frames = len(video.frame_times) or t * bundle.preprocess.temporal_patch_size
    return EncodeReport(frames, (big_h * patch, big_w * patch), bundle.family.merged_grid(video.grid_thw),
                        vision.frames_per_call, result.kept_indices.astype(np.int64),
                        {"encoder": encoded - started, "pruning": done - encoded, "total": done - started}, pruning)
