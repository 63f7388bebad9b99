"""Reading videos into RGB uint8 frames: ``.npy`` arrays and anything PyAV (FFmpeg) can decode.

Two steps, so a long clip never has to sit in memory at full frame rate:

1. :func:`probe_video` reads the frame count, frame rate and size;
2. :func:`load_video` decodes the frames, optionally only those at ``frame_indices`` (the ones the
   sampler picked), converting just those to RGB.

A ``.npy`` file holds frames only, no frame rate: the caller passes ``fps``, and it defaults to
:data:`DEFAULT_ARRAY_FPS`, the rate Qwen-VL samples videos at (2), so an array of frames that were
already sampled at 2 fps passes through the sampler unchanged. For a container ``fps`` overrides
the rate the container reports (useful when it is missing or wrong).

Rotation metadata is ignored: frames come back as stored.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from qeff_evs.models.protocol import SAMPLING_FPS

DEFAULT_ARRAY_FPS = SAMPLING_FPS  # an array taken as already sampled passes the sampler unchanged
ARRAY_SUFFIX = ".npy"


@dataclass(frozen=True)
class VideoInfo:
    """What :func:`probe_video` learns without converting frames."""

    num_frames: int
    fps: float
    height: int
    width: int

    @property
    def duration_s(self) -> float:
        return self.num_frames / self.fps


@dataclass(frozen=True)
class DecodedVideo:
    """Decoded RGB frames.

    ``frames``: (T, H, W, 3) uint8. ``fps``: the source's frame rate (frame ``i`` of the source is
    at ``i / fps`` seconds). ``source_indices``: for each returned frame, its index in the source
    (``arange(T)`` when every frame was decoded).
    """

    frames: np.ndarray
    fps: float
    source_indices: np.ndarray

    @property
    def num_frames(self) -> int:
        return int(self.frames.shape[0])

    @property
    def timestamps_s(self) -> np.ndarray:
        """Time of each returned frame in seconds."""
        return self.source_indices / self.fps


def validate_frames(frames: np.ndarray, *, what: str = "video") -> np.ndarray:
    """Check that ``frames`` is a non-empty (T, H, W, 3) uint8 array and return it."""
    if not isinstance(frames, np.ndarray):
        raise ValueError(f"{what} must be a numpy array of shape (T, H, W, 3), got {type(frames).__name__}")
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(
            f"{what} must have shape (T, H, W, 3) (RGB frames, channels last), got {frames.shape}; "
            "add a frame axis for a single image and convert grayscale/RGBA to RGB"
        )
    if frames.dtype != np.uint8:
        raise ValueError(
            f"{what} must be uint8 (0..255), got {frames.dtype}; convert with "
            "np.clip(np.round(x * 255), 0, 255).astype(np.uint8) for [0, 1] floats"
        )
    if min(frames.shape[:3]) < 1:
        raise ValueError(f"{what} is empty: shape {frames.shape}")
    return frames


def _check_fps(fps: float, path: Path) -> float:
    value = float(fps)
    if not value > 0 or value == float("inf"):
        raise ValueError(f"fps for {path} must be a positive finite number, got {fps!r}")
    return value


def _check_indices(frame_indices: Sequence[int] | np.ndarray, num_frames: int, path: Path) -> np.ndarray:
    indices = np.asarray(frame_indices)
    if indices.ndim != 1 or indices.size == 0 or not np.issubdtype(indices.dtype, np.integer):
        raise ValueError(f"frame_indices must be a non-empty 1-D sequence of integers, got {frame_indices!r}")
    if indices.min() < 0 or indices.max() >= num_frames:
        raise ValueError(
            f"frame_indices must lie in [0, {num_frames}) for {path} ({num_frames} frames), "
            f"got min {int(indices.min())} max {int(indices.max())}"
        )
    return indices.astype(np.int64)


# ---------------------------------------------------------------------------------------------
# .npy arrays


def _open_array(path: Path) -> np.ndarray:
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as error:
        raise ValueError(f"cannot read {path} as a .npy array of frames: {error}") from error
    return validate_frames(array, what=f"array in {path}")


# ---------------------------------------------------------------------------------------------
# containers (PyAV)


def _open_container(path: Path):
    import av  # imported here so .npy input works without FFmpeg libraries

    try:
        container = av.open(str(path))
    except av.FFmpegError as error:
        raise ValueError(f"cannot decode {path} as a video: {error}") from error
    if not container.streams.video:
        container.close()
        raise ValueError(f"{path} has no video stream")
    return container


def _container_fps(stream, path: Path) -> float:
    for rate in (stream.average_rate, stream.guessed_rate, stream.base_rate):
        if rate is not None and rate > 0:
            return float(rate)
    raise ValueError(f"{path} reports no frame rate; pass fps=... to load it")


def _count_decoded_frames(container, stream) -> int:
    return sum(1 for _ in container.decode(stream))


def _probe_container(path: Path, fps: float | None) -> VideoInfo:
    container = _open_container(path)
    try:
        stream = container.streams.video[0]
        rate = _check_fps(fps, path) if fps is not None else _container_fps(stream, path)
        # The header count is 0 when the container does not store it; decoding is the fallback.
        num_frames = int(stream.frames) or _count_decoded_frames(container, stream)
        height, width = int(stream.codec_context.height), int(stream.codec_context.width)
    finally:
        container.close()
    if num_frames < 1:
        raise ValueError(f"{path} contains no decodable video frames")
    return VideoInfo(num_frames=num_frames, fps=rate, height=height, width=width)


def _decode_container(path: Path, fps: float | None, wanted: np.ndarray | None) -> DecodedVideo:
    import av

    container = _open_container(path)
    try:
        stream = container.streams.video[0]
        rate = _check_fps(fps, path) if fps is not None else _container_fps(stream, path)
        wanted_set = None if wanted is None else set(int(i) for i in wanted)
        kept: dict[int, np.ndarray] = {}
        count = 0
        for index, frame in enumerate(container.decode(stream)):
            count = index + 1
            if wanted_set is None or index in wanted_set:
                kept[index] = frame.to_ndarray(format="rgb24")
            if wanted_set is not None and len(kept) == len(wanted_set):
                break  # everything asked for is decoded; skip the rest of the file
    except av.FFmpegError as error:
        raise ValueError(f"cannot decode {path} as a video: {error}") from error
    finally:
        container.close()
    if count == 0:
        raise ValueError(f"{path} contains no decodable video frames")
    if wanted is None:
        order = np.arange(count, dtype=np.int64)
    else:
        missing = sorted(set(int(i) for i in wanted) - kept.keys())
        if missing:
            raise ValueError(
                f"{path} decoded to {count} frames, fewer than its header promised; frame indices "
                f"{missing[:8]} do not exist; sample from probe_video(...).num_frames = {count}"
            )
        order = wanted
    frames = np.stack([kept[int(i)] for i in order])
    return DecodedVideo(frames=validate_frames(frames, what=str(path)), fps=rate, source_indices=order)


# ---------------------------------------------------------------------------------------------
# public entry points


def _existing_path(path: str | Path) -> Path:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"video file {path} does not exist or is not a file")
    return path


def probe_video(path: str | Path, *, fps: float | None = None) -> VideoInfo:
    """Frame count, frame rate (``fps`` if given) and size of a ``.npy`` array or a video file."""
    path = _existing_path(path)
    if path.suffix.lower() == ARRAY_SUFFIX:
        array = _open_array(path)
        rate = _check_fps(DEFAULT_ARRAY_FPS if fps is None else fps, path)
        return VideoInfo(num_frames=int(array.shape[0]), fps=rate, height=int(array.shape[1]), width=int(array.shape[2]))
    return _probe_container(path, fps)


def load_video(
    path: str | Path,
    *,
    fps: float | None = None,
    frame_indices: Sequence[int] | np.ndarray | None = None,
) -> DecodedVideo:
    """Decode ``path`` into RGB uint8 frames.

    ``.npy`` files must hold a (T, H, W, 3) uint8 array; their frame rate is ``fps`` or
    :data:`DEFAULT_ARRAY_FPS`. Other files are decoded with PyAV; ``fps`` overrides the container's
    rate. ``frame_indices`` (any order, repeats allowed) returns only those source frames, in that
    order. Raises ``ValueError`` for missing, unreadable or malformed input.
    """
    path = _existing_path(path)
    if path.suffix.lower() == ARRAY_SUFFIX:
        array = _open_array(path)
        rate = _check_fps(DEFAULT_ARRAY_FPS if fps is None else fps, path)
        if frame_indices is None:
            order = np.arange(array.shape[0], dtype=np.int64)
        else:
            order = _check_indices(frame_indices, int(array.shape[0]), path)
        frames = np.ascontiguousarray(array[order])
        return DecodedVideo(frames=frames, fps=rate, source_indices=order)
    wanted = None
    if frame_indices is not None:
        # Bounds are checked against the decoded count (headers can be wrong); only the form here.
        wanted = _check_indices(frame_indices, np.iinfo(np.int64).max, path)
    return _decode_container(path, fps, wanted)
