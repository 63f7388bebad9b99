"""Steps 1 and 2 of ``frame_sampling``'s three, as pure functions: a container as vLLM's OpenCV decoder sees it
(:class:`SourceVideo`), and which of its frames vLLM 0.32's video loader decodes for a ``video_url``
(:class:`LoaderSettings`, :func:`loader_frame_indices`) with the metadata it hands the processor
(:class:`ClipMetadata`, :func:`loader_metadata`). Written here because vLLM's loaders decode as they choose (their
choices are what the export's frame buckets must hold before any frame is read)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

GENERIC_LOADER = "opencv"  # VLLM_VIDEO_LOADER_BACKEND's default: uniform sampling, no model rule
LOADERS = (GENERIC_LOADER, "qwen2_vl", "qwen3_vl")
CODEC = "opencv"  # the only decoder ("backend" in the media-io kwargs) a CPU vLLM has
LOADER_NUM_FRAMES = 32  # VideoMediaIO's num_frames when --media-io-kwargs names none
LOADER_MAX_FRAMES = 768  # the qwen loaders' ceiling on max_frames
LOADER_MAX_FPS = 30  # the qwen loaders' ceiling on fps
QWEN_LOADER_FPS = 2  # the qwen loaders' fps when none is given
UNKNOWN_FPS_AS = 24.0  # the rate vLLM's qwen3_vl loader reports for a source whose rate is 0
MEDIA_IO_VIDEO_KEYS = frozenset(
    {"video_backend", "backend", "num_frames", "fps", "max_duration", "min_frames", "max_frames",
     "temporal_patch_size", "frame_recovery"})


# ---------------------------------------------------------------------------------------------
# 1. the container


@dataclass(frozen=True)
class SourceVideo:
    """A container as vLLM's OpenCV decoder sees it (vLLM's ``VideoSourceMetadata``).

    ``total_frames``: OpenCV's frame count (the header's, else duration x rate), lowered to the frames
    really presentable when an end-of-stream seek shows fewer. ``fps``: OpenCV's rate (the stream's
    average frame rate; 0 when unknown). ``duration``: ``total_frames / fps`` (0 when the rate is unknown),
    what vLLM computes, not the container's own duration.
    """

    total_frames: int
    fps: float
    duration: float

    @classmethod
    def of(cls, total_frames: int, fps: float) -> SourceVideo:
        """The source vLLM describes with this frame count and rate (duration derived as vLLM does)."""
        return cls(int(total_frames), float(fps), total_frames / fps if fps > 0 else 0.0)


# ---------------------------------------------------------------------------------------------
# 2. vLLM's video loader


def setting_count(value: Any, name: str, *, minimum: int = 1) -> int:
    """A frame-sampling setting that must be an integer >= ``minimum``; ValueError naming it otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def setting_integer(value: Any, name: str) -> int:
    """A frame-sampling setting that must be an integer; ValueError naming it otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return int(value)


def setting_rate(value: Any, name: str) -> float:
    """A frame-sampling setting that must be a finite number; ValueError naming it otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.number)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class LoaderSettings:
    """vLLM's video loader and its ``--media-io-kwargs '{"video": {...}}'`` (``VideoMediaIO``).

    ``video_backend``: the loader (one of :data:`LOADERS`). ``num_frames``: frames wanted by the plain
    ``opencv`` loader (<= 0: all; the qwen loaders ignore it). ``fps``: target rate; ``None`` is the
    loader's default (``opencv``: the source's rate, ``qwen*``: 2). ``min_frames``/``max_frames``/
    ``temporal_patch_size``: the qwen loaders' sampling kwargs (``None``: 4 / 768 / 2).
    """

    video_backend: str = GENERIC_LOADER
    num_frames: int = LOADER_NUM_FRAMES
    fps: float | None = None
    min_frames: int | None = None
    max_frames: int | None = None
    temporal_patch_size: int | None = None

    def __post_init__(self) -> None:
        if self.video_backend not in LOADERS:
            raise ValueError(f"video_backend must be one of {LOADERS} (vLLM 0.32's loaders for Qwen-VL), "
                             f"got {self.video_backend!r}")

    @classmethod
    def from_media_io_kwargs(cls, kwargs: Mapping[str, Any] | None, *, default_loader: str) -> LoaderSettings:
        """Settings from vLLM's video media-io kwargs (what ``--media-io-kwargs`` holds under ``"video"``).

        ``default_loader`` is the loader vLLM resolves for the model (:attr:`FrameRule.vllm_loader`).
        Keys vLLM's loaders ignore for files (``max_duration``) are accepted; keys qeff-evs cannot honour
        (another decoder, ``frame_recovery``) and unknown keys are refused.
        """
        kwargs = dict(kwargs or {})
        unknown = sorted(set(kwargs) - MEDIA_IO_VIDEO_KEYS)
        if unknown:
            raise ValueError(f"unknown video media-io kwargs {unknown}; qeff-evs reads {sorted(MEDIA_IO_VIDEO_KEYS)}")
        if kwargs.get("backend", CODEC) != CODEC:
            raise ValueError(f"video decoder backend {kwargs['backend']!r} is not available here; "
                             f"use {CODEC!r} (vLLM's default)")
        if kwargs.get("frame_recovery", False):
            raise ValueError("frame_recovery=True is not supported: qeff-evs encodes the frames that decode, "
                             "as vLLM does without it; drop frame_recovery")
        settings: dict[str, Any] = {"video_backend": kwargs.get("video_backend") or default_loader}
        if "num_frames" in kwargs:
            settings["num_frames"] = setting_integer(kwargs["num_frames"], "num_frames")
        if "fps" in kwargs:
            settings["fps"] = setting_rate(kwargs["fps"], "fps")
        for name in ("min_frames", "max_frames", "temporal_patch_size"):
            if name in kwargs:
                settings[name] = setting_count(kwargs[name], name)
        return cls(**settings)

    def limited_to(self, max_frames: int | None) -> LoaderSettings:
        """These settings with the export's frame limit as vLLM's: the qwen loaders' ``max_frames``,
        the plain loader's ``num_frames`` (which has no ``max_frames``)."""
        if max_frames is None:
            return self
        limit = setting_count(max_frames, "max_frames")
        if self.video_backend == GENERIC_LOADER:
            return replace(self, num_frames=limit if self.num_frames <= 0 else min(self.num_frames, limit))
        return replace(self, max_frames=min(self.max_frames or LOADER_MAX_FRAMES, limit))


def loader_source(source: SourceVideo, settings: LoaderSettings) -> SourceVideo:
    """The source as the loader reports it: vLLM's ``qwen3_vl`` loader takes an unknown rate (0) for 24 fps
    (HF's Qwen3-VL assumption), the others keep it."""
    if settings.video_backend == "qwen3_vl" and not source.fps > 0:
        return SourceVideo(source.total_frames, UNKNOWN_FPS_AS, source.duration)
    return source


def _uniform_loader(source: SourceVideo, settings: LoaderSettings) -> list[int]:
    # vLLM 0.32 VideoBackend.compute_frames_index_to_sample: the fewer of num_frames and duration x fps,
    # spread with a truncating linspace; every frame when that is all of them.
    total, count = source.total_frames, source.total_frames
    fps = -1.0 if settings.fps is None else settings.fps
    if settings.num_frames > 0:
        count = min(settings.num_frames, total)
    if fps > 0:
        count = min(count, math.floor(source.duration * fps))
    count = max(1, count)
    if count == total:
        return list(range(total))
    return np.linspace(0, total - 1, count, dtype=int).tolist()


def _qwen3_loader(source: SourceVideo, settings: LoaderSettings) -> list[int]:
    # vLLM 0.32 Qwen3VLVideoBackend: HF Qwen3-VL's fps rule at load time (rounded linspace).
    source = loader_source(source, settings)
    fps = min(QWEN_LOADER_FPS if settings.fps is None else settings.fps, LOADER_MAX_FPS)
    min_frames = 4 if settings.min_frames is None else settings.min_frames
    max_frames = min(settings.max_frames or LOADER_MAX_FRAMES, LOADER_MAX_FRAMES)
    count = int(source.total_frames / source.fps * fps)
    count = min(max(count, min_frames), max_frames, source.total_frames)
    return np.linspace(0, source.total_frames - 1, count).round().astype(int).tolist()


def _qwen2_loader(source: SourceVideo, settings: LoaderSettings) -> list[int]:
    # vLLM 0.32 Qwen2VLVideoBackend: HF Qwen2-VL's fps rule at load time (count floored to a multiple
    # of the temporal patch, float32 arange), its tail clamped to the last frame.
    total = source.total_frames
    if not source.fps > 0:
        raise ValueError("the video reports no frame rate; vLLM's qwen2_vl loader refuses such clips. "
                         "Re-mux it with a frame rate, or choose the opencv loader with a num_frames")
    patch = settings.temporal_patch_size or 2
    fps = min(QWEN_LOADER_FPS if settings.fps is None else settings.fps, LOADER_MAX_FPS)
    min_frames = 4 if settings.min_frames is None else settings.min_frames
    max_frames = min(settings.max_frames or LOADER_MAX_FRAMES, LOADER_MAX_FRAMES)
    max_frames = math.floor(min(max_frames, total) / patch) * patch
    count = min(max(total / source.fps * fps, min_frames), max_frames, total)
    count = math.floor(count / patch) * patch
    if count == 0:  # fewer frames than one temporal patch: vLLM divides by zero; we keep them all
        return list(range(total))
    indices = torch.arange(0, total, total / count).int()
    return torch.clamp(indices, max=total - 1).tolist()


_LOADER_RULES: dict[str, Callable[[SourceVideo, LoaderSettings], list[int]]] = {
    GENERIC_LOADER: _uniform_loader, "qwen2_vl": _qwen2_loader, "qwen3_vl": _qwen3_loader}


def loader_frame_indices(source: SourceVideo, settings: LoaderSettings) -> tuple[int, ...]:
    """Source frames vLLM's loader decodes (its ``compute_frames_index_to_sample``), ascending, each once
    (its OpenCV reader decodes a set: ``qwen2_vl``'s clamped tail can repeat the last index).

    Example: 100 frames at 30 fps; ``qwen3_vl`` at 2 fps -> int(100 / 30 * 2) = 6 frames,
    ``linspace(0, 99, 6).round()`` = (0, 20, 40, 59, 79, 99).
    """
    if source.total_frames < 1:
        raise ValueError(f"the video has no frames (frame count {source.total_frames})")
    return tuple(sorted(set(_LOADER_RULES[settings.video_backend](source, settings))))


def vllm_loader_failure(source: SourceVideo, settings: LoaderSettings) -> str | None:
    """Why vLLM's loader gives no frames for this source where qeff-evs decodes them, or ``None`` (vLLM 0.33 reads
    one-frame files, which 0.32's OpenCV loader could not)."""
    patch = settings.temporal_patch_size or 2
    if settings.video_backend == "qwen2_vl" and source.total_frames < patch:
        return f"vLLM's qwen2_vl loader divides by zero on clips shorter than {patch} frames"
    return None


@dataclass(frozen=True)
class ClipMetadata:
    """What vLLM hands the model's processor with a video's frames (the loader's metadata dict, or an
    ``LLM.generate`` caller's).

    ``total_num_frames``/``fps``/``duration``: the whole source. ``frames_indices``: the source index of
    each delivered frame. ``do_sample_frames``: whether the processor may sample again (the loader sets
    it when it delivered every frame).
    """

    total_num_frames: int
    fps: float
    duration: float
    frames_indices: tuple[int, ...]
    do_sample_frames: bool

    def __post_init__(self) -> None:
        setting_count(self.total_num_frames, "total_num_frames")
        if any(not 0 <= i < self.total_num_frames for i in self.frames_indices):
            raise ValueError(f"frames_indices must lie in [0, {self.total_num_frames}), got {self.frames_indices}")

    @classmethod
    def from_vllm(cls, metadata: Mapping[str, Any], num_frames: int) -> ClipMetadata:
        """vLLM's metadata dict for ``num_frames`` delivered frames, checked.

        ``frames_indices`` may be absent when every frame of the source is delivered; ``duration``
        defaults to ``total_num_frames / fps``; ``do_sample_frames`` to ``False`` (vLLM's default).
        """
        for key in ("total_num_frames", "fps"):
            if metadata.get(key) is None:
                raise ValueError(f"video metadata needs {key!r} (vLLM's loader sets total_num_frames, fps, "
                                 f"frames_indices); got keys {sorted(metadata)}")
        total = setting_count(metadata["total_num_frames"], "total_num_frames")
        fps = setting_rate(metadata["fps"], "metadata fps")
        indices = metadata.get("frames_indices")
        if indices is None:
            if num_frames != total:
                raise ValueError(f"video metadata has no frames_indices for {num_frames} frames of a "
                                 f"{total}-frame source; pass the source index of each frame")
            indices = range(total)
        indices = tuple(int(i) for i in indices)
        if len(indices) != num_frames:
            raise ValueError(f"frames_indices has {len(indices)} entries for {num_frames} frames")
        duration = metadata.get("duration")
        duration = (total / fps if fps > 0 else 0.0) if duration is None else float(duration)
        return cls(total, fps, duration, indices, bool(metadata.get("do_sample_frames", False)))


def loader_metadata(source: SourceVideo, settings: LoaderSettings, decoded: Sequence[int]) -> ClipMetadata:
    """The metadata vLLM's loader returns for the frames that ``decoded`` (vLLM's ``create_hf_metadata``)."""
    source = loader_source(source, settings)
    decoded = tuple(int(i) for i in decoded)
    return ClipMetadata(source.total_frames, source.fps, source.duration, decoded,
                        do_sample_frames=len(decoded) == source.total_frames)
