"""Video -> vision-encoder patches, the way Hugging Face's Qwen-VL processors do it (without torchvision).

Pipeline per request (docs/design.md#specializations): pick frames (:func:`sample_frame_indices`, whose frame count
must be one the vision graph was exported for), pick the exported frame size closest in aspect ratio
(``frame_sizes.choose_resolution``), then :func:`preprocess_video`: resize every frame with PIL, rescale by
1/255, normalise, repeat the last frame up to a multiple of ``temporal_patch_size`` and cut the clip
into patches in HF's order.

:func:`video_file_frames` / :func:`delivered_video_frames` pick the frames vLLM 0.32 would encode instead
(any count up to the export's limit; ``frame_sampling.py``) and :func:`video_size` says how the exported
size compares with HF's; the runtime moves to them with the frame-bucketed pruning graph.

Numerics follow transformers' PIL image processor (``Qwen2VLImageProcessorPil``) exactly: PIL
resampling on uint8, rescale in float64 then cast to float32, normalise in float32. HF's *video*
processors resize with torchvision instead, whose bicubic differs from PIL's by a few grey levels;
torchvision is not available here, so PIL is the reference.

Patch order (what the vision tower's ``pixel_values`` rows mean): rows run over
``(t, block_row, block_col, row_in_block, col_in_block)`` where a block is the
``merge_size x merge_size`` window of patches that the merger fuses into one token; each row is
``(channel, frame_in_temporal_patch, y, x)`` flattened.

A family's ``VideoPreprocessing`` may choose otherwise (its docstring): frames resized by torch's antialiased
bicubic on float pixels (``resampler`` "torch_antialias", what vLLM's and transformers' Nemotron-H processors do), to
one tile near ``target_patches`` patches (:func:`patch_budget_size`), cut into patches in raster order with each row
``(frame_in_temporal_patch, channel, y, x)`` (``patch_order`` "raster").
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from qeff_evs.runtime.inputs.frame_sampling import ProcessorSettings, SampledClip, frame_rule, sample_clip
from qeff_evs.runtime.inputs.loader_sampling import (
    ClipMetadata,
    LoaderSettings,
    loader_frame_indices,
    loader_metadata,
    vllm_loader_failure,
)
from qeff_evs.runtime.inputs.frame_sizes import check_exported_size, choose_resolution
from qeff_evs.runtime.inputs.preprocess_spec import PIL_BICUBIC, VisionPreprocessSpec
from qeff_evs.runtime.inputs.video_io import (
    ARRAY_SUFFIX,
    decode_video_frames,
    load_video,
    read_video_source,
    validate_frames,
)
from qeff_evs.specializations.sets import check_frame_size


# ---------------------------------------------------------------------------------------------
# frame sampling


@dataclass(frozen=True)
class SampledFrames:
    """Which source frames to feed the encoder.

    ``indices``: source frame indices, ascending. ``fps``: effective sampling rate, HF's
    ``sampled_fps`` = samples / source frames * source fps (Qwen2.5-VL's ``second_per_grid`` is
    ``temporal_patch_size / fps``). ``timestamps``: each sampled frame's time in seconds,
    ``index / source fps`` (Qwen3-VL averages them per temporal patch for its timestamp text).
    """

    indices: np.ndarray
    fps: float
    timestamps: np.ndarray

    @property
    def num_frames(self) -> int:
        return int(self.indices.shape[0])


def sample_frame_indices(
    total_frames: int,
    video_fps: float,
    target_fps: float | None,
    allowed_counts: Sequence[int],
) -> SampledFrames:
    """Sample at ``target_fps`` and keep the largest exported frame count that the clip can fill.

    The clip offers ``int(total_frames / video_fps * target_fps)`` frames at the target rate (HF's
    count; ``None`` means every source frame), capped by ``total_frames``. The largest entry of
    ``allowed_counts`` not above that is used, spread uniformly over the whole clip as HF's
    Qwen3-VL does (``linspace(0, total-1, n)`` rounded half-to-even), so first and last frames are
    included. Frames are never duplicated to reach a count: a clip too short for every exported
    count is a ``ValueError``.
    """
    if int(total_frames) != total_frames or total_frames < 1:
        raise ValueError(f"total_frames must be a positive integer, got {total_frames!r}")
    total_frames = int(total_frames)
    if not video_fps > 0 or math.isinf(video_fps):
        raise ValueError(f"video_fps must be a positive finite number, got {video_fps!r}")
    if target_fps is not None and (not target_fps > 0 or math.isinf(target_fps)):
        raise ValueError(f"target_fps must be a positive finite number or None, got {target_fps!r}")
    def is_count(c: object) -> bool:
        return isinstance(c, (int, np.integer)) and not isinstance(c, bool) and c >= 1

    if len(allowed_counts) == 0 or not all(is_count(c) for c in allowed_counts):
        raise ValueError(f"allowed_counts must be positive integers (the exported frame counts), got {allowed_counts!r}")
    counts = sorted({int(c) for c in allowed_counts})

    if target_fps is None:
        available = total_frames
    else:
        available = min(total_frames, int(total_frames / video_fps * target_fps))
    fitting = [c for c in counts if c <= available]
    if not fitting:
        duration = total_frames / video_fps
        rate = "its native rate" if target_fps is None else f"{target_fps:g} fps"
        raise ValueError(
            f"video of {total_frames} frames at {video_fps:g} fps ({duration:.2f} s) gives only {available} "
            f"frames at {rate}, fewer than every exported frame count {counts}; export a frame count "
            f"<= {available} or sample at a higher rate"
        )
    count = fitting[-1]
    indices = np.linspace(0, total_frames - 1, count).round().astype(np.int64)
    return SampledFrames(
        indices=indices,
        fps=count / total_frames * video_fps,
        timestamps=indices / float(video_fps),
    )


# ---------------------------------------------------------------------------------------------
# pixels


@dataclass(frozen=True)
class ProcessedVideo:
    """Vision-encoder input: ``pixel_values`` (t*gh*gw, C*tp*p*p) float32 and the patch grid (t, gh, gw)."""

    pixel_values: torch.Tensor
    grid_thw: tuple[int, int, int]

    @property
    def grid_thw_tensor(self) -> torch.Tensor:
        """(1, 3) int64, the form HF's ``video_grid_thw`` / ``image_grid_thw`` take."""
        return torch.tensor([self.grid_thw], dtype=torch.int64)


def resize_frames(frames: np.ndarray, size: Sequence[int], resample: int = PIL_BICUBIC) -> np.ndarray:
    """(T, H, W, 3) uint8 -> (T, h, w, 3) uint8 with PIL, on uint8 as HF's PIL processor does."""
    frames = validate_frames(frames)
    height, width = (int(v) for v in size)
    if frames.shape[1:3] == (height, width):
        return frames  # PIL returns an exact copy at the same size
    method = Image.Resampling(resample)
    return np.stack([np.asarray(Image.fromarray(frame).resize((width, height), resample=method)) for frame in frames])


def normalize_frames(frames: np.ndarray, spec: VisionPreprocessSpec) -> np.ndarray:
    """(T, H, W, 3) uint8 -> (T, 3, H, W) float32: ``(x * rescale - mean) / std``.

    The rescale runs in float64 and is cast to float32 before normalising in float32, which is the
    arithmetic HF's PIL processor does, so results match bit for bit.
    """
    scaled = (frames.astype(np.float64) * spec.rescale_factor).astype(np.float32)
    mean = np.asarray(spec.image_mean, dtype=np.float32)
    std = np.asarray(spec.image_std, dtype=np.float32)
    normalized = (scaled - mean) / std
    return np.ascontiguousarray(normalized.transpose(0, 3, 1, 2))


def torch_resize_normalize(frames: np.ndarray, size: Sequence[int], spec: VisionPreprocessSpec) -> np.ndarray:
    """(T, H, W, 3) uint8 -> (T, 3, h, w) float32 as vLLM's and transformers' Nemotron-H processors do it: torch's
    bicubic with antialiasing on the float pixels (skipped at the same size), then ``(x / 255 - mean) / std`` in
    float32, nothing rounded between."""
    pixels = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2).to(torch.float32)
    height, width = (int(v) for v in size)
    if tuple(pixels.shape[-2:]) != (height, width):
        pixels = torch.nn.functional.interpolate(pixels, size=(height, width), mode="bicubic", align_corners=False,
                                                 antialias=True)
    mean = torch.tensor(spec.image_mean, dtype=torch.float32).reshape(1, 3, 1, 1)
    std = torch.tensor(spec.image_std, dtype=torch.float32).reshape(1, 3, 1, 1)
    return ((pixels / (1.0 / spec.rescale_factor) - mean) / std).contiguous().numpy()


def pad_to_temporal_multiple(frames: np.ndarray, temporal_patch_size: int) -> np.ndarray:
    """Repeat the last frame until the count divides by ``temporal_patch_size`` (HF's padding)."""
    missing = -frames.shape[0] % temporal_patch_size
    if missing == 0:
        return frames
    return np.concatenate([frames, np.repeat(frames[-1:], missing, axis=0)], axis=0)


def patchify(frames: np.ndarray, spec: VisionPreprocessSpec) -> tuple[np.ndarray, tuple[int, int, int]]:
    """(T, C, H, W) float, T a multiple of temporal_patch_size -> (t*gh*gw, C*tp*p*p) rows and (t, gh, gw).

    Rows go over merge windows first (t, block row, block col, row in block, col in block) so the
    merger's ``merge_size**2`` consecutive rows are one output token; with ``patch_order`` "raster", over
    (t, patch row, patch col), each row ``(frame in temporal patch, channel, y, x)``.
    """
    num_frames, channels, height, width = frames.shape
    p, m, tp = spec.patch_size, spec.merge_size, spec.temporal_patch_size
    if num_frames % tp:
        raise ValueError(f"{num_frames} frames is not a multiple of temporal_patch_size {tp}; pad first")
    check_frame_size(height, width, p * m)
    grid_t, grid_h, grid_w = num_frames // tp, height // p, width // p
    if spec.patch_order == "raster":
        patches = frames.reshape(grid_t, tp, channels, grid_h, p, grid_w, p)
        # axes: 0 t, 1 frame-in-patch, 2 channel, 3 patch row, 4 y, 5 patch col, 6 x
        rows = patches.transpose(0, 3, 5, 1, 2, 4, 6).reshape(grid_t * grid_h * grid_w, tp * channels * p * p)
        return rows, (grid_t, grid_h, grid_w)
    blocks = frames.reshape(grid_t, tp, channels, grid_h // m, m, p, grid_w // m, m, p)
    # axes: 0 t, 1 frame-in-patch, 2 channel, 3 block row, 4 row-in-block, 5 y, 6 block col, 7 col-in-block, 8 x
    ordered = blocks.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    rows = ordered.reshape(grid_t * grid_h * grid_w, channels * tp * p * p)
    return rows, (grid_t, grid_h, grid_w)


def preprocess_video(frames: np.ndarray, size: Sequence[int], spec: VisionPreprocessSpec) -> ProcessedVideo:
    """Sampled RGB frames (T, H, W, 3) uint8 -> encoder patches at frame size ``size`` = (h, w).

    ``size`` must be a multiple of ``spec.factor`` (use :func:`choose_resolution`). A frame count
    that does not divide by ``temporal_patch_size`` is padded with copies of the last frame, as HF does.
    """
    frames = validate_frames(frames)
    height, width = check_exported_size(size, spec.factor)
    if spec.resampler == "torch_antialias":
        normalized = torch_resize_normalize(frames, (height, width), spec)
    else:
        normalized = normalize_frames(resize_frames(frames, (height, width), spec.resample), spec)
    normalized = pad_to_temporal_multiple(normalized, spec.temporal_patch_size)
    rows, grid = patchify(normalized, spec)
    return ProcessedVideo(pixel_values=torch.from_numpy(np.ascontiguousarray(rows)), grid_thw=grid)


def preprocess_image(image: np.ndarray, size: Sequence[int], spec: VisionPreprocessSpec) -> ProcessedVideo:
    """One RGB image (H, W, 3) uint8 -> patches with grid (1, gh, gw): the image fills every frame of the temporal patch."""
    if not isinstance(image, np.ndarray) or image.ndim != 3:
        shape = getattr(image, "shape", None)
        raise ValueError(f"image must be a (H, W, 3) uint8 array, got shape {shape}; use preprocess_video for clips")
    # A one-frame clip is padded with copies of itself up to temporal_patch_size: exactly HF's image path.
    return preprocess_video(image[None], size, spec)


# ---------------------------------------------------------------------------------------------
# frames and size as vLLM 0.32 picks them (frame_sampling.py), for the runtime's frame buckets


@dataclass(frozen=True)
class VideoFrames:
    """A video's frames as vLLM 0.32's processor would encode them.

    ``frames``: (n, H, W, 3) uint8, in order. ``clip``: their source indices, times and sampled rate (and
    ``vllm_fails`` for a short clip vLLM itself fails on). ``metadata``: what the processor was handed
    (vLLM's loader's metadata for a file).
    """

    frames: np.ndarray
    clip: SampledClip
    metadata: ClipMetadata


def video_file_frames(
    path: str | Path,
    spec: VisionPreprocessSpec,
    *,
    media_io_kwargs: Mapping[str, Any] | None = None,
    mm_processor_kwargs: Mapping[str, Any] | None = None,
    max_frames: int | None = None,
    array_fps: float | None = None,
    reader: str | None = None,
) -> VideoFrames:
    """The frames vLLM 0.32 encodes for ``video_url`` of this file with these kwargs, for ``spec``'s model.

    ``media_io_kwargs``: vLLM's ``--media-io-kwargs`` video entry (loader, ``num_frames``, ``fps``,
    ``max_frames``...; the loader defaults to the one vLLM resolves for the model). ``mm_processor_kwargs``:
    the video processor's (``fps``, ``num_frames``, ``do_sample_frames``, ``min_frames``, ``max_frames``).
    ``max_frames``: the export's limit (frame_sampling.py's docstring). ``reader``: ``"opencv"`` /
    ``"pyav"`` (default: OpenCV when installed). A ``.npy`` array is every frame of a clip at
    ``array_fps`` (default 2), as an ``LLM.generate`` caller passing all frames would describe it.
    """
    rule = frame_rule(spec.video_processor)
    if Path(path).suffix.lower() == ARRAY_SUFFIX:
        decoded = load_video(path, fps=array_fps)
        return delivered_video_frames(
            decoded.frames,
            {"total_num_frames": decoded.num_frames, "fps": decoded.fps, "do_sample_frames": True},
            spec, mm_processor_kwargs=mm_processor_kwargs, max_frames=max_frames)
    loader = LoaderSettings.from_media_io_kwargs(media_io_kwargs, default_loader=rule.vllm_loader)
    loader = loader.limited_to(max_frames)
    processor = ProcessorSettings.from_kwargs(spec, mm_processor_kwargs)
    loaded = load_frames(path, loader, reader=reader)
    clip = sample_clip(loaded.metadata, rule, processor, max_frames=max_frames, vllm_fails=loaded.vllm_fails)
    return VideoFrames(np.ascontiguousarray(loaded.frames[list(clip.positions)]), clip, loaded.metadata)


@dataclass(frozen=True)
class LoadedFrames:
    """What vLLM 0.32's video loader hands the model's processor for a file: the decoded frames and their
    metadata; ``vllm_fails``: why vLLM's own loader gives no frames here (a one-frame file, ...), or None."""

    frames: np.ndarray
    metadata: ClipMetadata
    vllm_fails: str | None


def load_frames(video: str | Path | bytes, loader: LoaderSettings, *, reader: str | None = None) -> LoadedFrames:
    """vLLM's loader step (frame_sampling.py's step 2, loader_sampling.py) on a video file or a video's bytes: the frames it picks,
    decoded. Frames vLLM's loader would fail on (a clip shorter than a temporal patch) are delivered all."""
    source = read_video_source(video, reader=reader)
    decoded = decode_video_frames(video, source, loader_frame_indices(source, loader), reader=reader)
    return LoadedFrames(decoded.frames, loader_metadata(source, loader, decoded.source_indices.tolist()),
                        vllm_loader_failure(source, loader))


def delivered_video_frames(
    frames: np.ndarray,
    metadata: Mapping[str, Any],
    spec: VisionPreprocessSpec,
    *,
    mm_processor_kwargs: Mapping[str, Any] | None = None,
    max_frames: int | None = None,
) -> VideoFrames:
    """The frames vLLM 0.32's processor encodes out of delivered ``frames`` (T, H, W, 3) uint8 and their
    vLLM ``metadata`` dict (``total_num_frames``, ``fps``, ``frames_indices``, ``do_sample_frames``): what a
    vLLM frontend hands a model's processor after its loader ran, or an ``LLM.generate`` caller's video."""
    frames = validate_frames(frames)
    delivered = ClipMetadata.from_vllm(metadata, len(frames))
    clip = sample_clip(delivered, frame_rule(spec.video_processor),
                       ProcessorSettings.from_kwargs(spec, mm_processor_kwargs), max_frames=max_frames)
    return VideoFrames(np.ascontiguousarray(frames[list(clip.positions)]), clip, delivered)


@dataclass(frozen=True)
class VideoSize:
    """The frame size a video is resized to.

    ``hf``: what HF's video processor would resize to (its ``smart_resize``: per frame for Qwen2.5-VL,
    over frames x pixels for Qwen3-VL); ``None`` where HF refuses the clip (Qwen3-VL, under two frames).
    ``exported``: the size we resize to: ``hf`` when the export compiled it, else the exported size
    closest in aspect ratio (``frame_sizes.choose_resolution``), since the encoder runs only compiled sizes.
    """

    hf: tuple[int, int] | None
    exported: tuple[int, int]

    @property
    def matches_hf(self) -> bool:
        return self.hf == self.exported


def video_size(video: VideoFrames, spec: VisionPreprocessSpec, exported: Sequence[Sequence[int]]) -> VideoSize:
    """HF's size for ``video``'s frames and the exported size we use (see :class:`VideoSize`)."""
    _, height, width, _ = video.frames.shape
    hf: tuple[int, int] | None = None
    if not (spec.pixel_limits_per_video and video.clip.num_frames < spec.temporal_patch_size):
        hf = spec.natural_size(height, width, video.clip.num_frames)
    sizes = [check_exported_size(size, spec.factor) for size in exported]
    if hf in sizes:
        return VideoSize(hf, hf)
    return VideoSize(hf, choose_resolution(height, width, sizes, spec.factor))
