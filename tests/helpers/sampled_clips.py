"""Synthetic clips saved as ``.npy`` and read back through the export's frame sampler, with the frames
transformers' Qwen3-VL sampler picks (the reference the timestamps are checked against)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from qeff_evs.runtime.inputs.synthetic import moving_square_video
from qeff_evs.runtime.media import video_from_file


@dataclasses.dataclass(frozen=True)
class Clip:
    """A synthetic clip saved as .npy, and how the sampler should read it."""

    name: str
    frames: int
    height: int
    width: int
    seed: int
    source_fps: float  # the .npy's frame rate; sampled at the preprocessor's 2 fps

    def hf_frame_indices(self, count: int) -> list[int]:
        """Transformers' Qwen3-VL sampler: ``linspace(0, total - 1, n)`` rounded."""
        return np.linspace(0, self.frames - 1, count).round().astype(int).tolist()


def sampled_clips(folder: Path, clips: Iterable[Clip], bundle) -> dict:
    """``{name: (MediaInput, HF frame indices, source fps)}``, each clip read as ``bundle``'s export reads it."""
    out = {}
    for clip in clips:
        path = folder / f"{clip.name}.npy"
        np.save(path, moving_square_video(clip.frames, clip.height, clip.width, seed=clip.seed))
        video = video_from_file(path, bundle, array_fps=clip.source_fps)
        indices = clip.hf_frame_indices(2 * video.grid_thw[0])
        # the sampler's times are the HF sampler's frames over the source rate
        assert video.frame_times == tuple(i / clip.source_fps for i in indices)
        out[clip.name] = (video, indices, clip.source_fps)
    return out
