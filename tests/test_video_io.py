"""Video input: synthetic clips, .npy arrays and PyAV-decoded files.

References: the clip we encode ourselves (decode must give it back: exactly for lossless ffv1,
within codec error for lossy mp4), and the known square trajectory.
"""

from __future__ import annotations

from pathlib import Path

import av
import numpy as np
import pytest

from qeff_evs.runtime.inputs.synthetic import (
    BACKGROUND_HIGH,
    SQUARE_COLOR,
    moving_square_positions,
    moving_square_video,
    textured_background,
)
from qeff_evs.runtime.inputs.video_io import DEFAULT_ARRAY_FPS, load_video, probe_video

T, H, W = 12, 64, 96


@pytest.fixture(scope="module")
def clip() -> np.ndarray:
    return moving_square_video(T, H, W, square=16, speed=7, seed=3)


def encode(path: Path, frames: np.ndarray, *, codec: str, pix_fmt: str, fps: int, options=None) -> Path:
    """Write ``frames`` with PyAV; the test's own encoder, independent of the code under test."""
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=fps)
        stream.height, stream.width = frames.shape[1:3]
        stream.pix_fmt = pix_fmt
        if options:
            stream.options = options
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


# ------------------------------------------------------------------------------------------------
# synthetic clips


def test_moving_square_video_shape_dtype_and_determinism(clip):
    assert clip.shape == (T, H, W, 3) and clip.dtype == np.uint8
    np.testing.assert_array_equal(clip, moving_square_video(T, H, W, square=16, speed=7, seed=3))
    assert not np.array_equal(clip, moving_square_video(T, H, W, square=16, speed=7, seed=4))


def test_moving_square_video_square_and_still_background(clip):
    background = textured_background(H, W, seed=3)
    assert background.max() <= BACKGROUND_HIGH < 255
    positions = moving_square_positions(T, H, W, square=16, speed=7)
    for t, (row, col) in enumerate(positions):
        inside = np.zeros((H, W), dtype=bool)
        inside[row : row + 16, col : col + 16] = True
        assert (clip[t][inside] == SQUARE_COLOR).all()
        np.testing.assert_array_equal(clip[t][~inside], background[~inside])
    # Motion: the square moves every frame, bouncing inside the frame.
    cols = [c for _, c in positions]
    assert all(0 <= c <= W - 16 for c in cols)
    assert all(abs(b - a) == 7 or b in (0, W - 16) or a in (0, W - 16) for a, b in zip(cols, cols[1:]))
    assert len(set(cols)) == T


def test_moving_square_video_defaults_cross_the_frame_once():
    video = moving_square_video(5, 40, 80)  # square 10, speed (80-10)/4
    first = np.argwhere((video[0] == 255).all(-1))
    last = np.argwhere((video[-1] == 255).all(-1))
    assert first[:, 1].min() == 0 and last[:, 1].max() == 79


@pytest.mark.parametrize(
    "kwargs",
    [dict(num_frames=0, height=8, width=8), dict(num_frames=2, height=8, width=8, square=9),
     dict(num_frames=2, height=8, width=8, speed=-1), dict(num_frames=2, height=0, width=8)],
)
def test_moving_square_video_rejects_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        moving_square_video(**kwargs)


# ------------------------------------------------------------------------------------------------
# .npy arrays


def test_npy_round_trip_default_and_explicit_fps(tmp_path, clip):
    path = tmp_path / "clip.npy"
    np.save(path, clip)
    video = load_video(path)
    np.testing.assert_array_equal(video.frames, clip)
    assert video.fps == DEFAULT_ARRAY_FPS == 2.0
    np.testing.assert_array_equal(video.source_indices, np.arange(T))
    assert load_video(path, fps=25).fps == 25.0
    info = probe_video(path, fps=5)
    assert (info.num_frames, info.fps, info.height, info.width) == (T, 5.0, H, W)
    assert info.duration_s == pytest.approx(T / 5)


def test_npy_frame_indices_any_order(tmp_path, clip):
    path = tmp_path / "clip.npy"
    np.save(path, clip)
    video = load_video(path, frame_indices=[11, 0, 4, 4])
    np.testing.assert_array_equal(video.frames, clip[[11, 0, 4, 4]])
    np.testing.assert_allclose(video.timestamps_s, np.array([11, 0, 4, 4]) / DEFAULT_ARRAY_FPS)
    with pytest.raises(ValueError, match=r"\[0, 12\)"):
        load_video(path, frame_indices=[12])
    with pytest.raises(ValueError, match="non-empty"):
        load_video(path, frame_indices=[])


@pytest.mark.parametrize(
    "array, message",
    [
        (np.zeros((4, 8, 8), np.uint8), r"\(T, H, W, 3\)"),
        (np.zeros((4, 8, 8, 4), np.uint8), r"\(T, H, W, 3\)"),
        (np.zeros((4, 8, 8, 3), np.float32), "uint8"),
        (np.zeros((0, 8, 8, 3), np.uint8), "empty"),
    ],
)
def test_npy_wrong_shape_or_dtype(tmp_path, array, message):
    path = tmp_path / "bad.npy"
    np.save(path, array)
    with pytest.raises(ValueError, match=message):
        load_video(path)


def test_unreadable_inputs(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_video(tmp_path / "missing.mp4")
    garbage = tmp_path / "garbage.mp4"
    garbage.write_bytes(b"not a video at all" * 50)
    with pytest.raises(ValueError, match="cannot decode"):
        load_video(garbage)
    with pytest.raises(ValueError, match="cannot decode"):
        probe_video(garbage)
    fake_npy = tmp_path / "fake.npy"
    fake_npy.write_bytes(b"nope")
    with pytest.raises(ValueError, match="cannot read"):
        load_video(fake_npy)
    pickled = tmp_path / "objects.npy"
    np.save(pickled, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError, match="cannot read"):
        load_video(pickled)
    with pytest.raises(ValueError, match="does not exist"):
        probe_video(tmp_path / "missing.npy")


def test_bad_fps_rejected(tmp_path, clip):
    path = tmp_path / "clip.npy"
    np.save(path, clip)
    for fps in (0, -2.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="fps"):
            load_video(path, fps=fps)


# ------------------------------------------------------------------------------------------------
# containers


def test_lossless_mkv_decodes_exactly(tmp_path, clip):
    # ffv1 with an RGB pixel format is lossless; Matroska stores no frame count, so the probe
    # has to count by decoding.
    path = encode(tmp_path / "clip.mkv", clip, codec="ffv1", pix_fmt="bgr0", fps=10)
    info = probe_video(path)
    assert (info.num_frames, info.fps, info.height, info.width) == (T, 10.0, H, W)
    video = load_video(path)
    assert video.frames.dtype == np.uint8 and video.frames.shape == (T, H, W, 3)
    assert video.fps == 10.0
    np.testing.assert_array_equal(video.frames, clip)


def test_mp4_decodes_close_to_source(tmp_path, clip):
    # H.264 at qp 0 in 4:4:4 is near-lossless; only RGB<->YUV rounding remains.
    path = encode(tmp_path / "clip.mp4", clip, codec="libx264", pix_fmt="yuv444p", fps=15, options={"qp": "0"})
    video = load_video(path)
    assert video.frames.shape == (T, H, W, 3) and video.fps == 15.0
    error = np.abs(video.frames.astype(np.int16) - clip.astype(np.int16))
    assert error.max() <= 3 and error.mean() < 1.0


def test_lossy_mpeg4_still_recognisable(tmp_path, clip):
    path = encode(tmp_path / "clip.mp4", clip, codec="mpeg4", pix_fmt="yuv420p", fps=8, options={"qscale": "2"})
    video = load_video(path, frame_indices=[0, T - 1])
    assert video.fps == 8.0
    error = np.abs(video.frames.astype(np.int16) - clip[[0, T - 1]].astype(np.int16))
    assert error.mean() < 12
    # The square stays the brightest thing in the frame, where the source put it.
    for decoded, source in zip(video.frames, clip[[0, T - 1]]):
        bright = decoded.mean(-1) > 220
        square = (source == 255).all(-1)
        assert (bright & square).sum() > 0.8 * square.sum()


def test_container_frame_indices_match_full_decode(tmp_path, clip):
    path = encode(tmp_path / "clip.mkv", clip, codec="ffv1", pix_fmt="bgr0", fps=10)
    picked = load_video(path, frame_indices=[9, 2, 2, 0])
    np.testing.assert_array_equal(picked.frames, clip[[9, 2, 2, 0]])
    np.testing.assert_array_equal(picked.source_indices, [9, 2, 2, 0])
    np.testing.assert_allclose(picked.timestamps_s, [0.9, 0.2, 0.2, 0.0])
    with pytest.raises(ValueError, match="do not exist"):
        load_video(path, frame_indices=[0, T])
    assert load_video(path, fps=4).fps == 4.0  # caller override of the container's rate
