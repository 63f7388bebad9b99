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

**As vLLM reads them.** :func:`read_video_source` and :func:`decode_video_frames` read a container the way
vLLM 0.32's video loader does (``vllm/multimodal/video_decoders/opencv.py``), so the frame indices of
``frame_sampling.py`` mean the same frames: with OpenCV (``opencv-python-headless``, the ``vllm`` extra)
when it is installed, the same calls on the same bytes; without it (the base install), PyAV computing
OpenCV's numbers: the stream's average frame rate, the header's frame count (else duration x rate,
rounded), lowered to the demuxed frame count when that is 2+ lower (OpenCV finds it by seeking to the
end). The PyAV numbers equal OpenCV's for files whose header counts frames (mp4, mov) and for
constant-rate mkv/webm; a variable-rate file without a header count can differ (OpenCV numbers frames
from timestamps when it seeks), and PyAV does not apply rotation metadata where OpenCV does.
"""

from __future__ import annotations

import importlib.util
import io
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from qeff_evs.models.protocol import SAMPLING_FPS
from qeff_evs.runtime.inputs.loader_sampling import SourceVideo

DEFAULT_ARRAY_FPS = SAMPLING_FPS  # an array taken as already sampled passes the sampler unchanged
ARRAY_SUFFIX = ".npy"
VIDEO_READERS = ("opencv", "pyav")  # how read_video_source / decode_video_frames read a container


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


def _open_container(path: Path | str, data: bytes | None = None):
    """PyAV's container for the file ``path``, or for ``data`` (a video's bytes; ``path`` then only names it)."""
    import av  # imported here so .npy input works without FFmpeg libraries

    try:
        container = av.open(str(path) if data is None else io.BytesIO(data))
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


# ---------------------------------------------------------------------------------------------
# containers as vLLM 0.32's OpenCV loader reads them


def video_reader(reader: str | None = None) -> str:
    """``reader`` checked, or the default: ``"opencv"`` (vLLM's decoder) when installed, else ``"pyav"``."""
    if reader is None:
        return "opencv" if importlib.util.find_spec("cv2") is not None else "pyav"
    if reader not in VIDEO_READERS:
        raise ValueError(f"video reader must be one of {VIDEO_READERS}, got {reader!r}")
    return reader


def _opencv_capture(name: str, buffer: io.BytesIO):
    """An OpenCV capture over ``buffer`` (the file's bytes) through the stream-buffered backend vLLM 0.32
    opens video bytes with (the first one available whose plugin API is 1.2 or newer). The caller keeps
    ``buffer`` alive until it releases the capture: OpenCV reads it without holding a reference."""
    import cv2

    registry = cv2.videoio_registry
    backend = None
    for candidate in registry.getStreamBufferedBackends():
        if not registry.hasBackend(candidate):
            continue
        if not registry.isBackendBuiltIn(candidate):
            _, abi, api = registry.getStreamBufferedBackendPluginVersion(candidate)
            if (abi, api) < (1, 2):
                continue
        backend = candidate
        break
    if backend is None:
        raise ValueError("this OpenCV build cannot decode video from memory; install opencv-python-headless "
                         "or read with reader='pyav'")
    capture = cv2.VideoCapture(buffer, backend, [])
    if not capture.isOpened():
        raise ValueError(f"cannot decode {name} as a video (OpenCV could not open it)")
    return capture


def _opencv_source(name: str, data: bytes) -> SourceVideo:
    import cv2

    buffer = io.BytesIO(data)
    capture = _opencv_capture(name, buffer)
    try:
        total = int(capture.get(cv2.CAP_PROP_FRAME_COUNT))
        if total < 1:  # -2**63 (a count it cannot tell) where the bytes are no video stream, an image's included
            raise ValueError(f"cannot decode {name} as a video (OpenCV opens it but finds no video frame in it)")
        fps = float(capture.get(cv2.CAP_PROP_FPS))
        # An edit list can hide decoded frames the header counts; the position after seeking to the end is
        # the presentable count, trusted when the stream really ends there and it is 2+ lower.
        if capture.set(cv2.CAP_PROP_POS_AVI_RATIO, 1.0):
            visible = int(capture.get(cv2.CAP_PROP_POS_FRAMES))
            if not capture.grab() and 0 < visible < total - 1:
                total = visible
    finally:
        capture.release()
    return SourceVideo.of(total, fps)


def _opencv_frames(name: str, data: bytes, wanted: set[int]) -> tuple[list[np.ndarray], list[int]]:
    import cv2

    # A fresh capture: vLLM reads through the one it probed, which a one-frame file leaves at its end.
    buffer = io.BytesIO(data)
    capture = _opencv_capture(name, buffer)
    frames, decoded = [], []
    try:
        for index in range(max(wanted) + 1):
            if not capture.grab():
                continue  # an unreadable frame is skipped, as vLLM does
            if index in wanted:
                ok, frame = capture.retrieve()
                if ok:
                    frames.append(cv2.cvtColor(frame, cv2.COLOR_BGR2RGB))
                    decoded.append(index)
    finally:
        capture.release()
    return frames, decoded


def _pyav_source(name: str, data: bytes) -> SourceVideo:
    container = _open_container(name, data)
    try:
        stream = container.streams.video[0]
        fps = float(stream.average_rate) if stream.average_rate else 0.0  # OpenCV's CAP_PROP_FPS
        total = int(stream.frames)
        if total == 0:  # no count in the header: OpenCV rounds duration x rate
            if container.duration:
                seconds = container.duration / 1_000_000  # AV_TIME_BASE
            else:
                seconds = float(stream.duration * stream.time_base) if stream.duration else 0.0
            total = math.floor(seconds * fps + 0.5)
        visible = sum(1 for packet in container.demux(stream) if packet.size and not packet.is_discard)
    finally:
        container.close()
    if total > 0 and 0 < visible < total - 1:
        total = visible
    return SourceVideo.of(total, fps)


def _pyav_frames(name: str, data: bytes, wanted: set[int]) -> tuple[list[np.ndarray], list[int]]:
    import av

    container = _open_container(name, data)
    frames, decoded, last = [], [], max(wanted)
    try:
        for index, frame in enumerate(container.decode(container.streams.video[0])):
            if index in wanted:
                frames.append(frame.to_ndarray(format="rgb24"))
                decoded.append(index)
            if index >= last:
                break
    except av.FFmpegError as error:
        raise ValueError(f"cannot decode {name} as a video: {error}") from error
    finally:
        container.close()
    return frames, decoded


def _named_bytes(video: str | Path | bytes) -> tuple[str, bytes]:
    """A video file's (name, bytes), or ``("the video's bytes", video)`` for bytes already read (a
    ``video_url``'s)."""
    if isinstance(video, bytes):
        return f"the video's {len(video)} bytes", video
    path = _existing_path(video)
    if path.suffix.lower() == ARRAY_SUFFIX:
        raise ValueError(f"{path} is an array of frames, not a container; load it with load_video")
    return str(path), path.read_bytes()


def read_video_source(video: str | Path | bytes, *, reader: str | None = None) -> SourceVideo:
    """Frame count, rate and duration of a video file (or a video's bytes) as vLLM 0.32's OpenCV loader reads
    them.

    ``reader``: ``"opencv"`` or ``"pyav"`` (default: :func:`video_reader`); see the module docstring for
    where the two can differ.
    """
    name, data = _named_bytes(video)
    return (_opencv_source if video_reader(reader) == "opencv" else _pyav_source)(name, data)


def decode_video_frames(
    video: str | Path | bytes, source: SourceVideo, frame_indices: Sequence[int], *, reader: str | None = None
) -> DecodedVideo:
    """The frames at ``frame_indices`` (ascending source indices) of a video file (or a video's bytes) that
    decode, as vLLM's loader gets them.

    Frames are read in order up to the last index asked for; one that does not decode is left out, as
    vLLM leaves it out (``source_indices`` says which came back). ``source`` gives the rate. Raises
    ``ValueError`` when none decodes.
    """
    name, data = _named_bytes(video)
    wanted = set(int(i) for i in frame_indices)
    if not wanted or min(wanted) < 0:
        raise ValueError(f"frame_indices must be non-empty and non-negative, got {list(frame_indices)[:8]}")
    read = _opencv_frames if video_reader(reader) == "opencv" else _pyav_frames
    frames, decoded = read(name, data, wanted)
    if not frames:
        raise ValueError(f"{name} decoded none of the {len(wanted)} frames asked for (of {source.total_frames})")
    return DecodedVideo(frames=validate_frames(np.stack(frames), what=name), fps=source.fps,
                        source_indices=np.asarray(decoded, dtype=np.int64))
