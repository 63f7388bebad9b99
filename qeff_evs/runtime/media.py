"""Media intakes for a run: a video file or decoded frames, an image, or already-patchified pixels, each made into
the ``MediaInput`` the exported graphs take (sampled as vLLM would, resized to an exported size)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from qeff_evs.models.protocol import SAMPLING_FPS, MediaInput
from qeff_evs.runtime.export_bundle import ExportBundle
from qeff_evs.runtime.inputs.audio_features import USE_AUDIO_IN_VIDEO
from qeff_evs.runtime.inputs.image_tiles import (
    MAX_TILES_KEY, max_tiles_of, tile_patches, tile_pixels, without_tile_kwargs,
)
from qeff_evs.runtime.inputs.frame_sizes import choose_resolution
from qeff_evs.runtime.inputs.processor import (
    VideoFrames,
    delivered_video_frames,
    preprocess_image,
    preprocess_video,
    video_file_frames,
    video_size,
)
from qeff_evs.runtime.inputs.video_io import ARRAY_SUFFIX


def video_kwargs(bundle: ExportBundle, mm_processor_kwargs: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """The video processor's ``mm_processor_kwargs``: without the tiler's where the family tiles images and without
    ``use_audio_in_video`` where it serves audio (one processor takes them all in vLLM), else as given (a key the
    video processor does not know is refused there)."""
    if not mm_processor_kwargs:
        return mm_processor_kwargs
    kwargs = dict(mm_processor_kwargs)
    if USE_AUDIO_IN_VIDEO in kwargs and bundle.family.audio_features() is not None:
        kwargs.pop(USE_AUDIO_IN_VIDEO)
    if MAX_TILES_KEY not in kwargs:
        return kwargs
    try:
        bundle.family.image_tiling()
    except ValueError:
        return kwargs
    return without_tile_kwargs(kwargs)


def video_from_file(path: str | Path, bundle: ExportBundle, *, media_io_kwargs: Mapping[str, Any] | None = None,
                    mm_processor_kwargs: Mapping[str, Any] | None = None, array_fps: float | None = None,
                    reader: str | None = None) -> MediaInput:
    """The video vLLM 0.32 would encode for ``video_url`` of this file: its loader (``media_io_kwargs``, vLLM's
    ``--media-io-kwargs`` video entry) then the family's HF sampling rule (``mm_processor_kwargs``), at most the
    export's ``max_frames``; resized to HF's size where exported, else the exported size closest in aspect.

    A ``.npy`` array is every frame of a clip at ``array_fps`` (default 2), as an ``LLM.generate`` caller passing
    all frames would describe it.
    """
    if array_fps is not None and Path(path).suffix.lower() != ARRAY_SUFFIX:
        raise ValueError(f"a frame rate ({array_fps:g}) describes a .npy array's frames, not the file {path}, whose "
                         "container has its own; sample it with mm_processor_kwargs {\"fps\": X} (vLLM's "
                         "--mm-processor-kwargs) or media_io_kwargs {\"fps\": X} (--media-io-kwargs)")
    frames = video_file_frames(path, bundle.preprocess, media_io_kwargs=media_io_kwargs,
                               mm_processor_kwargs=video_kwargs(bundle, mm_processor_kwargs), max_frames=bundle.manifest.max_frames,
                               array_fps=array_fps, reader=reader)
    return _media_from_frames(frames, bundle)


def video_from_frames(frames: np.ndarray, metadata: Mapping[str, Any], bundle: ExportBundle, *,
                      mm_processor_kwargs: Mapping[str, Any] | None = None) -> MediaInput:
    """:func:`video_from_file` for frames already decoded: ``(T, H, W, 3)`` uint8 with vLLM's metadata dict
    (``total_num_frames``, ``fps``, [``frames_indices``, ``duration``, ``do_sample_frames``]): what vLLM's loader
    hands the processor, or an ``LLM.generate`` caller's ``(frames, metadata)``."""
    return _media_from_frames(delivered_video_frames(frames, metadata, bundle.preprocess,
                                                     mm_processor_kwargs=video_kwargs(bundle, mm_processor_kwargs),
                                                     max_frames=bundle.manifest.max_frames), bundle)


def _media_from_frames(video: VideoFrames, bundle: ExportBundle) -> MediaInput:
    spec = bundle.preprocess
    size = video_size(video, spec, bundle.manifest.resolutions)
    processed = preprocess_video(video.frames, size.exported, spec)
    return MediaInput(processed.pixel_values, tuple(processed.grid_thw), float(video.clip.sampled_fps),
                      tuple(float(t) for t in video.clip.frame_times),
                      frame_indices=tuple(int(i) for i in video.clip.indices), source_fps=float(video.metadata.fps))


def image_from_array(image: np.ndarray, bundle: ExportBundle,
                     mm_processor_kwargs: Mapping[str, Any] | None = None) -> MediaInput:
    """An RGB uint8 ``(H, W, 3)`` image (never pruned): cut into tiles where the family tiles images (at most the
    ``max_num_tiles`` of ``mm_processor_kwargs``, vLLM's processor argument), else resized to the exported size
    closest in aspect."""
    spec = bundle.preprocess
    tiling = bundle.family.image_tiling()
    if tiling is not None:
        bundle.manifest.image_encoder_entry()  # refuses an export without the image graph
        tiles, _ = tile_pixels(image, tiling, spec, max_tiles_of(mm_processor_kwargs))
        rows, grid = tile_patches(tiles, spec)
        return MediaInput(torch.from_numpy(rows), grid, 1.0, (), kind="image")
    size = choose_resolution(image.shape[0], image.shape[1], bundle.manifest.resolutions, spec.factor)
    processed = preprocess_image(image, size, spec)
    return MediaInput(processed.pixel_values, tuple(processed.grid_thw), 1.0, (), kind="image")


def video_from_patches(pixel_values_path: str | Path, grid_thw: tuple[int, int, int], fps: float | None,
                       bundle: ExportBundle | None = None) -> MediaInput:
    """Already-patchified pixels (``pixel_values_videos`` as transformers' processor returns them).

    ``fps``: the rate the frames were sampled at; ``None`` means Qwen-VL's default rate.
    """
    path = Path(pixel_values_path)
    if not path.is_file():
        raise ValueError(f"pixel values file {path} not found")
    fps = SAMPLING_FPS if fps is None else fps
    if not fps > 0:
        raise ValueError(f"--fps must be positive for pre-patchified pixels, got {fps!r}")
    pixels = torch.from_numpy(np.load(path)).to(torch.float32)
    t, h, w = (int(v) for v in grid_thw)
    if pixels.dim() != 2 or pixels.shape[0] != t * h * w:
        raise ValueError(
            f"pixel_values of shape {tuple(pixels.shape)} do not match --video-grid-thw {t},{h},{w} "
            f"(expected {t * h * w} rows of patches)")
    temporal_patch = 2
    if bundle is not None:
        spec = bundle.preprocess
        temporal_patch = spec.temporal_patch_size
        if pixels.shape[1] != spec.patch_dim:
            raise ValueError(
                f"pixel_values rows have {pixels.shape[1]} values but this model's patches have {spec.patch_dim} "
                f"(C*temporal_patch*patch*patch); patchify with the checkpoint's processor")
    frame_times = tuple(float(i) / fps for i in range(temporal_patch * t))
    return MediaInput(pixels, (t, h, w), float(fps), frame_times)
