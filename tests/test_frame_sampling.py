"""vLLM's frames: for clips written here, the frames we encode (source indices, times, sampled rate, HF's
resized size) are the ones vLLM 0.32's video loader hands the model's processor for the same bytes and
kwargs, followed by the family's Hugging Face sampling rule (transformers 5.19).

Oracles, none of them the code under test:
- vLLM 0.32's own loader: ``VideoMediaIO(...).load_bytes`` on the file's bytes (vllm/multimodal/media/video.py:
  its real loader classes, OpenCV decoder and metadata dict), and the loader classes'
  ``compute_frames_index_to_sample`` on synthetic sources.
- HF's sampling rules and resize: ``Qwen3VLVideoProcessor.sample_frames`` called unbound on a stand-in holding
  the processor's defaults (its module imports without torchvision; building the processor needs it), and
  Qwen3-VL's ``smart_resize``. Qwen2-VL's ``sample_frames``, ``smart_resize`` and class ``size`` are read out of
  ``video_processing_qwen2_vl.py`` with ``ast`` and executed, since that module imports torchvision first.
- vLLM 0.32's Qwen3-VL timestamps: ``Qwen3VLProcessingInfo._get_video_second_idx`` / ``_calculate_timestamps``,
  read out of ``vllm/model_executor/models/qwen3_vl.py`` with ``ast`` (it imports torchvision through
  transformers) and bound to a stand-in.
- vLLM's glue between loader and HF processor is restated in ``vllm_processor`` below, five lines with their
  source cited (which ``do_sample_frames`` reaches HF; HF indexing the delivered frames; vLLM's timestamp count
  assertion).
"""

from __future__ import annotations

import ast
import io
import json
import math
import types
from fractions import Fraction
from pathlib import Path
from typing import Any

import av
import numpy as np
import pytest
import torch
import transformers
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize as hf_smart_resize_qwen3
from transformers.video_utils import VideoMetadata

from qeff_evs.models.qwen3_vl import temporal_patch_times
from qeff_evs.runtime.inputs.frame_sampling import ProcessorSettings, frame_rule, sample_clip
from qeff_evs.runtime.inputs.loader_sampling import LoaderSettings, SourceVideo, loader_frame_indices, loader_metadata
from qeff_evs.runtime.inputs.frame_sizes import choose_resolution
from qeff_evs.runtime.inputs.preprocess_spec import VisionPreprocessSpec
from qeff_evs.runtime.inputs.processor import delivered_video_frames, video_file_frames, video_size
from qeff_evs.runtime.inputs.video_io import decode_video_frames, read_video_source

cv2 = pytest.importorskip("cv2")
vllm_video = pytest.importorskip("vllm.multimodal.video")
from vllm.multimodal.media.image import ImageMediaIO  # noqa: E402
from vllm.multimodal.media.video import VideoMediaIO  # noqa: E402
from vllm.multimodal.video_decoders import VideoSourceMetadata, VideoTargetMetadata  # noqa: E402

import vllm  # noqa: E402

FAMILIES = ("qwen2_5_vl", "qwen3_vl")
EXPORT_MAX = 16  # the export's largest bucket, in frames


# ------------------------------------------------------------------------------------------------
# oracles read out of modules that need torchvision to import


def _load_defs(path: Path, wanted: dict[str, str | None], namespace: dict[str, Any]) -> dict[str, Any]:
    """Execute the functions ``wanted`` (name -> enclosing class or None) of ``path`` in ``namespace``,
    decorators dropped. The source is the installed package's, unchanged."""
    tree = ast.parse(path.read_text())
    bodies = {None: tree.body}
    bodies.update({node.name: node.body for node in tree.body if isinstance(node, ast.ClassDef)})
    defs = []
    for name, owner in wanted.items():
        (node,) = [n for n in bodies[owner] if isinstance(n, ast.FunctionDef) and n.name == name]
        node.decorator_list = []
        defs.append(node)
    exec(compile(ast.Module(body=defs, type_ignores=[]), str(path), "exec"), namespace)
    return {name: namespace[name] for name in wanted}


def _class_attribute(path: Path, owner: str, name: str) -> Any:
    (cls,) = [n for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef) and n.name == owner]
    (node,) = [n for n in cls.body if isinstance(n, ast.Assign) and n.targets[0].id == name]
    return eval(compile(ast.Expression(node.value), str(path), "eval"))  # an arithmetic literal


QWEN2_FILE = Path(transformers.__file__).parent / "models/qwen2_vl/video_processing_qwen2_vl.py"
HF_QWEN2 = _load_defs(QWEN2_FILE, {"sample_frames": "Qwen2VLVideoProcessor", "smart_resize": None},
                      {"math": math, "torch": torch, "VideoMetadata": VideoMetadata})
QWEN2_SIZE = _class_attribute(QWEN2_FILE, "Qwen2VLVideoProcessor", "size")
VLLM_QWEN3 = _load_defs(
    Path(vllm.__file__).parent / "model_executor/models/qwen3_vl.py",
    {"_get_video_second_idx": "Qwen3VLProcessingInfo", "_calculate_timestamps": "Qwen3VLProcessingInfo"},
    {"np": np, "torch": torch, "Any": Any})

# The processors' defaults as HF's classes set them (what vLLM's processor instance holds for a
# checkpoint whose config does not override them).
HF_DEFAULTS = {
    "qwen2_5_vl": types.SimpleNamespace(fps=None, num_frames=None, temporal_patch_size=2, min_frames=4,
                                        max_frames=768, do_sample_frames=False, size=QWEN2_SIZE),
    "qwen3_vl": types.SimpleNamespace(fps=Qwen3VLVideoProcessor.fps, num_frames=None,
                                      temporal_patch_size=Qwen3VLVideoProcessor.temporal_patch_size,
                                      min_frames=Qwen3VLVideoProcessor.min_frames,
                                      max_frames=Qwen3VLVideoProcessor.max_frames,
                                      do_sample_frames=Qwen3VLVideoProcessor.do_sample_frames,
                                      size=Qwen3VLVideoProcessor.size),
}


class VllmFails(Exception):
    """vLLM 0.32 (or the HF processor it calls) raises on this request."""


def vllm_processor(family: str, frames: np.ndarray, metadata: dict, mm_kwargs: dict, max_frames: int | None):
    """What vLLM 0.32's model processor encodes: (source indices, Qwen3 timestamps, sampled fps, HF size)."""
    hf = types.SimpleNamespace(**vars(HF_DEFAULTS[family]))
    if max_frames is not None:  # --mm-processor-kwargs '{"max_frames": M}' builds the processor with it
        hf.max_frames = min(hf.max_frames, max_frames)
    for key in ("min_frames", "max_frames"):
        if key in mm_kwargs:
            setattr(hf, key, mm_kwargs[key])
    # qwen3_vl.py _call_hf_processor: the request's do_sample_frames, else the loader's; qwen2_5_vl.py
    # _get_hf_mm_inputs drops the loader's flag, so HF's own default decides.
    if "do_sample_frames" in mm_kwargs:
        do_sample = mm_kwargs["do_sample_frames"]
    else:
        do_sample = metadata.get("do_sample_frames", False) if family == "qwen3_vl" else hf.do_sample_frames
    meta = VideoMetadata(**{k: v for k, v in metadata.items() if k != "do_sample_frames"})
    timestamps = None
    try:
        if len(frames) == 0:
            raise VllmFails("no frames")
        if family == "qwen3_vl":
            info = types.SimpleNamespace(get_video_processor=lambda: hf)
            info._calculate_timestamps = types.MethodType(VLLM_QWEN3["_calculate_timestamps"], info)
            timestamps = VLLM_QWEN3["_get_video_second_idx"](
                info, meta, do_sample_frames=do_sample, sampled_fps=mm_kwargs.get("fps"),
                sampled_num_frames=mm_kwargs.get("num_frames"))
        if do_sample:  # HF's _decode_and_sample_videos: video[indices], metadata.frames_indices = indices
            if family == "qwen3_vl":
                positions = Qwen3VLVideoProcessor.sample_frames(
                    hf, meta, num_frames=mm_kwargs.get("num_frames"), fps=mm_kwargs.get("fps"))
            else:
                positions = HF_QWEN2["sample_frames"](
                    hf, meta, temporal_patch_size=2, min_frames=hf.min_frames, max_frames=hf.max_frames,
                    num_frames=mm_kwargs.get("num_frames"), fps=mm_kwargs.get("fps"))
            positions = np.asarray(positions, dtype=np.int64)
            frames = frames[positions]  # IndexError where HF's indices overshoot the delivered clip
            indices = np.asarray(metadata["frames_indices"], dtype=np.int64)[positions]  # the frames encoded
            meta.frames_indices = positions.tolist()
        else:
            indices = np.asarray(metadata["frames_indices"], dtype=np.int64)
        grid_t = -(-len(frames) // 2)
        if timestamps is not None:
            assert len(timestamps) == grid_t  # vLLM's get_replacement asserts it
        height, width = frames.shape[1:3]
        if family == "qwen3_vl":
            size = hf_smart_resize_qwen3(len(frames), height, width, temporal_factor=2, factor=32,
                                         min_pixels=hf.size["shortest_edge"], max_pixels=hf.size["longest_edge"])
        else:
            size = HF_QWEN2["smart_resize"](height, width, factor=28, min_pixels=hf.size["shortest_edge"],
                                            max_pixels=hf.size["longest_edge"])
    except (ValueError, ZeroDivisionError, IndexError, TypeError, AssertionError) as error:
        raise VllmFails(f"{type(error).__name__}: {error}") from error
    return tuple(int(i) for i in indices), timestamps, meta.sampled_fps, tuple(size)


def vllm_loader(data: bytes, family: str, media_io_kwargs: dict, max_frames: int | None):
    """vLLM 0.32's video_url loading of ``data``: its loader (the family's unless named) on the bytes."""
    kwargs = dict(media_io_kwargs)
    kwargs.setdefault("video_backend", {"qwen2_5_vl": "qwen2_vl", "qwen3_vl": "qwen3_vl"}[family])
    if max_frames is not None:  # the export limit as vLLM settings (frame_sampling.py's docstring)
        if kwargs["video_backend"] == "opencv":
            asked = kwargs.get("num_frames", 32)
            kwargs["num_frames"] = max_frames if asked <= 0 else min(asked, max_frames)
        else:
            kwargs["max_frames"] = min(kwargs.get("max_frames", 768), max_frames)
    try:
        return VideoMediaIO(ImageMediaIO(), **kwargs).load_bytes(data).media
    except ZeroDivisionError as error:
        raise VllmFails(f"loader: {error}") from error


def vllm_frames(data, family, media_io_kwargs, mm_kwargs, max_frames=None):
    frames, metadata = vllm_loader(data, family, media_io_kwargs, max_frames)
    return frames, metadata, vllm_processor(family, frames, metadata, mm_kwargs, max_frames)


# ------------------------------------------------------------------------------------------------
# clips


def _texture(height: int, width: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def write_clip(path: Path, count: int, fps: float, height: int, width: int, *, codec: str = "libx264",
               pts_ms: list[int] | None = None) -> Path:
    """``count`` distinct frames (a texture rolled by 3 px a frame) with PyAV; ``pts_ms``: a variable rate."""
    base = _texture(height, width, seed=count)
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=Fraction(fps).limit_denominator(1001))
        stream.height, stream.width, stream.pix_fmt = height, width, "yuv420p"
        if pts_ms is not None:
            stream.codec_context.time_base = Fraction(1, 1000)
        for index in range(count):
            frame = av.VideoFrame.from_ndarray(np.roll(base, 3 * index, axis=1), format="rgb24")
            if pts_ms is not None:
                frame.pts, frame.time_base = pts_ms[index], Fraction(1, 1000)
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def write_clip_opencv(path: Path, count: int, fps: float, height: int, width: int) -> Path:
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), fps, (width, height))
    base = _texture(height, width, seed=count)
    for index in range(count):
        writer.write(np.ascontiguousarray(np.roll(base, 3 * index, axis=1)[..., ::-1]))
    writer.release()
    return path


VFR_MS = [0, 33, 66, 200, 233, 400, 433, 466, 800, 833, 1200, 1233]
CLIPS = {  # name -> (writer, frames, fps, height, width, extra)
    "h264_30fps_90f.mp4": (write_clip, 90, 30, 48, 64, {}),
    "h264_24fps_3f.mp4": (write_clip, 3, 24, 48, 64, {}),
    "h264_1f.mp4": (write_clip, 1, 30, 32, 32, {}),
    "h264_25fps_40f.mkv": (write_clip, 40, 25, 40, 72, {}),
    "vp9_12fps_20f.mkv": (write_clip, 20, 12, 32, 48, {"codec": "libvpx-vp9"}),
    "mpeg4_ntsc_60f.mp4": (write_clip, 60, 30000 / 1001, 52, 70, {"codec": "mpeg4"}),
    "h264_vfr_12f.mp4": (write_clip, 12, 30, 48, 64, {"pts_ms": VFR_MS}),
    "h264_vfr_12f.mkv": (write_clip, 12, 30, 48, 64, {"pts_ms": VFR_MS}),
    "h264_60fps_600f.mp4": (write_clip, 600, 60, 32, 32, {}),  # 10 s: longer than EXPORT_MAX at 2 fps
    "h264_30fps_2f.mkv": (write_clip, 2, 30, 32, 48, {}),
    "h264_5fps_7f.mp4": (write_clip, 7, 5, 36, 64, {}),
    "mp4v_15fps_33f_opencv.mp4": (write_clip_opencv, 33, 15, 48, 80, {}),
    "ffv1_50fps_200f.mkv": (write_clip, 200, 50, 80, 32, {"codec": "ffv1"}),
}


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("clips")
    return {name: writer(folder / name, count, fps, height, width, **extra)
            for name, (writer, count, fps, height, width, extra) in CLIPS.items()}


# ------------------------------------------------------------------------------------------------
# the container and the loader


@pytest.mark.parametrize("reader", ["opencv", "pyav"])
def test_reader_sees_the_container_and_frames_vllm_decodes(clips, reader):
    """Frame count, rate and duration as vLLM's loader reports them, and bit-equal frames."""
    for name, path in clips.items():
        frames, metadata = vllm_loader(path.read_bytes(), "qwen2_5_vl", {"video_backend": "opencv",
                                                                          "num_frames": -1}, None)
        source = read_video_source(path, reader=reader)
        assert source == SourceVideo(metadata["total_num_frames"], metadata["fps"], metadata["duration"]), name
        decoded = decode_video_frames(path, source, range(source.total_frames), reader=reader)
        assert decoded.source_indices.tolist() == metadata["frames_indices"], name
        np.testing.assert_array_equal(decoded.frames, frames, err_msg=name)


def test_variable_rate_clips_are_read_with_opencv_numbers(clips):
    """The variable-rate mp4 reports its average rate, not its 30 fps base; the mkv has no header count, so
    duration x rate overcounts and the end-of-stream correction brings it back to the 12 frames."""
    mp4 = read_video_source(clips["h264_vfr_12f.mp4"], reader="pyav")
    assert mp4.total_frames == 12 and mp4.fps < 20
    mkv = read_video_source(clips["h264_vfr_12f.mkv"], reader="pyav")
    capture = cv2.VideoCapture(str(clips["h264_vfr_12f.mkv"]))
    assert int(capture.get(cv2.CAP_PROP_FRAME_COUNT)) > 12 + 1
    capture.release()
    assert mkv.total_frames == 12 and mkv.fps == 30


LOADER_SOURCES = [VideoSourceMetadata(total, fps, total / fps)
                  for total in (1, 2, 3, 4, 5, 7, 17, 30, 41, 64, 97, 300, 451, 1000)
                  for fps in (1, 5, 12.5, 24, 30000 / 1001, 60)]
LOADER_KWARGS = [{}, {"num_frames": 8}, {"num_frames": -1}, {"fps": 1}, {"fps": 3.5, "num_frames": 10},
                 {"max_frames": 6}, {"min_frames": 2, "max_frames": 40}, {"fps": 60}, {"temporal_patch_size": 4}]


@pytest.mark.parametrize("backend", ["opencv", "qwen2_vl", "qwen3_vl"])
def test_loader_indices_equal_vllm_loader_classes(backend):
    loader = {"opencv": vllm_video.VideoBackend, "qwen2_vl": vllm_video.Qwen2VLVideoBackend,
              "qwen3_vl": vllm_video.Qwen3VLVideoBackend}[backend]
    default_fps = -1 if backend == "opencv" else 2
    for source in LOADER_SOURCES:
        for kwargs in LOADER_KWARGS:
            target = VideoTargetMetadata(kwargs.get("num_frames", 32), kwargs.get("fps", default_fps), 300)
            sampling = {k: v for k, v in kwargs.items() if k not in ("num_frames", "fps")}
            try:
                expected = sorted(set(loader.compute_frames_index_to_sample(source, target, **sampling)))
            except ZeroDivisionError:  # vLLM's qwen2_vl loader on clips shorter than a temporal patch
                expected = list(range(source.total_frames_num))
            settings = LoaderSettings.from_media_io_kwargs({**kwargs, "video_backend": backend},
                                                           default_loader="opencv")
            ours = loader_frame_indices(SourceVideo.of(source.total_frames_num, source.original_fps), settings)
            assert list(ours) == expected, (backend, source, kwargs)


# ------------------------------------------------------------------------------------------------
# the whole path: file -> loader -> processor


MEDIA_IO_CASES = [{}, {"video_backend": "opencv"}, {"video_backend": "opencv", "num_frames": 8},
                  {"video_backend": "opencv", "fps": 4}, {"fps": 1}, {"fps": 6, "max_frames": 10}]
PROCESSOR_CASES = [{}, {"do_sample_frames": True, "fps": 1}, {"do_sample_frames": True, "num_frames": 4},
                   {"do_sample_frames": False}]


def _assert_same_frames(family, spec, ours, expected, context):
    indices, timestamps, sampled_fps, size = expected
    assert ours.clip.indices == indices, context
    assert ours.clip.vllm_fails is None, context
    assert ours.clip.sampled_fps == pytest.approx(sampled_fps, rel=1e-12), context
    if family == "qwen3_vl":  # the timestamps vLLM writes into the prompt, computed as our family does
        assert temporal_patch_times(ours.clip.frame_times, 2) == list(timestamps), context
    assert video_size(ours, spec, [size]).hf == size, context


def _assert_served_short_clip(ours, context):
    """vLLM fails; we serve every frame of a clip shorter than one temporal patch and say why vLLM does not."""
    assert ours.clip.vllm_fails and ours.clip.num_frames < ours.clip.temporal_patch_size, context
    assert ours.clip.positions == tuple(range(len(ours.metadata.frames_indices))), context


def _compare(family, spec, ours, vllm_run, context) -> str:
    """``ours`` (a VideoFrames, or None when we refused) against ``vllm_run`` (a thunk returning vLLM's
    delivered frames and expected result): served alike, refused alike, or a short clip only we serve."""
    try:
        frames, expected = vllm_run()
    except VllmFails:
        if ours is None:
            return "refused"
        _assert_served_short_clip(ours, context)
        return "short"
    assert ours is not None, context
    _assert_same_frames(family, spec, ours, expected, context)
    np.testing.assert_array_equal(ours.frames, frames[list(ours.clip.positions)], err_msg=str(context))
    return "served"


@pytest.fixture(scope="module")
def vllm_loaded(clips):
    """vLLM's loader output per (clip, family, media-io kwargs, export limit), decoded once."""
    cache: dict = {}

    def load(name, family, media_io, max_frames):
        key = (name, family, tuple(sorted(media_io.items())), max_frames)
        if key not in cache:
            try:
                cache[key] = vllm_loader(clips[name].read_bytes(), family, media_io, max_frames)
            except VllmFails as error:
                cache[key] = error
        if isinstance(cache[key], VllmFails):
            raise cache[key]
        return cache[key]
    return load


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("max_frames", [None, EXPORT_MAX])
def test_file_frames_equal_vllm_loader_then_hf_rule(clips, vllm_loaded, family, max_frames):
    """``video_url`` / ``qeff-evs run`` on a file: our reader, loader rule and processor rule end to end."""
    spec = VisionPreprocessSpec.for_family(family)
    outcomes = []
    for name, path in clips.items():
        for media_io in MEDIA_IO_CASES:
            context = (name, media_io, max_frames)
            try:
                ours = video_file_frames(path, spec, media_io_kwargs=media_io, max_frames=max_frames)
            except ValueError:
                ours = None

            def run(name=name, media_io=media_io):
                frames, metadata = vllm_loaded(name, family, media_io, max_frames)
                return frames, vllm_processor(family, frames, metadata, {}, max_frames)
            outcomes.append(_compare(family, spec, ours, run, context))
            if ours is not None and max_frames is not None:
                assert ours.clip.num_frames <= max_frames, context
    # Without processor kwargs every file is served: as vLLM does, or padded where vLLM fails on a short clip.
    assert "refused" not in outcomes and "short" in outcomes


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("max_frames", [None, EXPORT_MAX])
def test_loaded_frames_equal_vllm_processor_for_processor_kwargs(clips, vllm_loaded, family, max_frames):
    """What a vLLM frontend hands our processor after its loader ran, with mm_processor_kwargs."""
    spec = VisionPreprocessSpec.for_family(family)
    outcomes = []
    for name in clips:
        for media_io in MEDIA_IO_CASES:
            try:
                frames, metadata = vllm_loaded(name, family, media_io, max_frames)
            except VllmFails:
                continue  # the loader itself fails: nothing reaches a processor
            for mm in PROCESSOR_CASES:
                context = (name, media_io, mm, max_frames)
                try:
                    ours = delivered_video_frames(frames, metadata, spec, mm_processor_kwargs=mm,
                                                  max_frames=max_frames)
                except ValueError:
                    ours = None
                outcomes.append(_compare(family, spec, ours,
                                         lambda: (frames, vllm_processor(family, frames, metadata, mm, max_frames)),
                                         context))
    assert outcomes.count("served") > outcomes.count("refused") > 0  # both kinds of outcome compared


@pytest.mark.parametrize("family", FAMILIES)
def test_pyav_reader_gives_vllm_frames_too(clips, family):
    """The base install (no OpenCV) reads with PyAV: same plans and pixels on every clip, default kwargs."""
    spec = VisionPreprocessSpec.for_family(family)
    for name, path in clips.items():
        ours = video_file_frames(path, spec, reader="pyav", max_frames=EXPORT_MAX)
        reference = video_file_frames(path, spec, reader="opencv", max_frames=EXPORT_MAX)
        assert ours.clip == reference.clip and ours.metadata == reference.metadata, name
        np.testing.assert_array_equal(ours.frames, reference.frames, err_msg=name)


def test_export_limit_is_vllm_max_frames(clips):
    """The 10 s clip: Qwen3-VL's loader would take 20 frames at 2 fps; the export's 16 is its max_frames."""
    path = clips["h264_60fps_600f.mp4"]
    spec = VisionPreprocessSpec.for_family("qwen3_vl")
    unlimited = video_file_frames(path, spec)
    limited = video_file_frames(path, spec, max_frames=EXPORT_MAX)
    assert unlimited.clip.num_frames == 20 and limited.clip.num_frames == EXPORT_MAX
    _, _, expected = vllm_frames(path.read_bytes(), "qwen3_vl", {"max_frames": EXPORT_MAX},
                                 {"max_frames": EXPORT_MAX}, None)
    assert limited.clip.indices == expected[0]
    assert limited.clip.frame_times[-1] == 599 / 60  # spread over the whole clip, last frame kept


# ------------------------------------------------------------------------------------------------
# frames delivered with metadata (LLM.generate, or a vLLM frontend after its loader)


@pytest.mark.parametrize("family", FAMILIES)
def test_delivered_frames_follow_vllm_processor(family):
    spec = VisionPreprocessSpec.for_family(family)
    rng = np.random.default_rng(0)
    for total, fps, indices, flag, mm in [
        (300, 30.0, list(range(0, 300, 15)), False, {}),  # pre-sampled by a loader
        (9, 3.0, list(range(9)), True, {}),  # every frame, the processor samples
        (9, 3.0, list(range(9)), True, {"fps": 1.0}),
        (50, 25.0, list(range(50)), True, {"num_frames": 6}),
        (1, 2.0, [0], False, {}),  # one frame: padded
    ]:
        frames = rng.integers(0, 256, (len(indices), 30, 40, 3), dtype=np.uint8)
        metadata = {"total_num_frames": total, "fps": fps, "duration": total / fps, "frames_indices": indices,
                    "do_sample_frames": flag}
        ours = delivered_video_frames(frames, metadata, spec, mm_processor_kwargs=mm)
        try:
            expected = vllm_processor(family, frames, metadata, mm, None)
        except VllmFails:
            _assert_served_short_clip(ours, (total, mm))
            continue
        _assert_same_frames(family, spec, ours, expected, (total, mm))
        np.testing.assert_array_equal(ours.frames, frames[list(ours.clip.positions)])


@pytest.mark.parametrize("family", FAMILIES)
def test_delivered_clip_longer_than_the_export_is_spread_to_its_maximum(family):
    """40 frames delivered pre-sampled, export maximum 16: HF Qwen3-VL's num_frames rule on those frames."""
    spec = VisionPreprocessSpec.for_family(family)
    indices = list(range(0, 400, 10))
    frames = np.zeros((40, 32, 32, 3), dtype=np.uint8)
    metadata = {"total_num_frames": 400, "fps": 20.0, "frames_indices": indices, "do_sample_frames": False}
    ours = delivered_video_frames(frames, metadata, spec, max_frames=EXPORT_MAX)
    positions = Qwen3VLVideoProcessor.sample_frames(HF_DEFAULTS["qwen3_vl"], VideoMetadata(40, fps=2.0),
                                                    num_frames=EXPORT_MAX)
    assert ours.clip.indices == tuple(indices[p] for p in positions)
    assert ours.clip.sampled_fps == EXPORT_MAX / 400 * 20.0


def test_npy_array_is_every_frame_of_a_clip_at_its_rate(tmp_path):
    """``qeff-evs run`` on a .npy: all frames delivered at 2 fps (or the rate given), the processor samples."""
    frames = np.random.default_rng(1).integers(0, 256, (9, 30, 40, 3), dtype=np.uint8)
    np.save(tmp_path / "clip.npy", frames)
    for family in FAMILIES:
        spec = VisionPreprocessSpec.for_family(family)
        for fps, mm in [(None, {}), (6.0, {"do_sample_frames": True, "fps": 2.0})]:
            ours = video_file_frames(tmp_path / "clip.npy", spec, array_fps=fps, mm_processor_kwargs=mm)
            metadata = {"total_num_frames": 9, "fps": fps or 2.0, "duration": 9 / (fps or 2.0),
                        "frames_indices": list(range(9)), "do_sample_frames": True}
            _assert_same_frames(family, spec, ours, vllm_processor(family, frames, metadata, mm, None), (family, fps))
            np.testing.assert_array_equal(ours.frames, frames[list(ours.clip.positions)])


def test_checkpoint_processor_config_sets_the_sampling_defaults(tmp_path):
    """A Qwen2.5-VL checkpoint whose video processor samples at 1 fps by default: HF's rule with those."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl", "vision_config": {
        "patch_size": 14, "temporal_patch_size": 2, "spatial_merge_size": 2}}))
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps(
        {"do_sample_frames": True, "fps": 1.0, "min_frames": 2, "max_frames": 64}))
    spec = VisionPreprocessSpec.from_pretrained_dir(tmp_path)
    assert (spec.do_sample_frames, spec.sampling_fps, spec.min_frames, spec.max_frames) == (True, 1.0, 2, 64)
    frames = np.zeros((30, 28, 28, 3), dtype=np.uint8)
    ours = delivered_video_frames(frames, {"total_num_frames": 30, "fps": 10.0}, spec)
    hf = types.SimpleNamespace(fps=1.0, num_frames=None)
    expected = HF_QWEN2["sample_frames"](hf, VideoMetadata(30, fps=10.0), temporal_patch_size=2, min_frames=2,
                                         max_frames=64)
    assert ours.clip.indices == tuple(expected.tolist()) == (0, 15)  # 3 s at 1 fps, floored to a patch


# ------------------------------------------------------------------------------------------------
# sizes and refusals


def test_video_size_prefers_hf_size_when_exported():
    spec = VisionPreprocessSpec.for_family("qwen2_5_vl")
    frames = np.zeros((4, 360, 640, 3), dtype=np.uint8)
    video = delivered_video_frames(frames, {"total_num_frames": 4, "fps": 2.0}, spec)
    hf = HF_QWEN2["smart_resize"](360, 640, factor=28, min_pixels=QWEN2_SIZE["shortest_edge"],
                                  max_pixels=QWEN2_SIZE["longest_edge"])
    assert video_size(video, spec, [(336, 336), hf]).exported == hf
    other = video_size(video, spec, [(336, 336), (336, 588)])
    assert other.hf == hf and not other.matches_hf
    assert other.exported == choose_resolution(360, 640, [(336, 336), (336, 588)], 28)
    one = delivered_video_frames(frames[:1], {"total_num_frames": 1, "fps": 2.0},
                                 VisionPreprocessSpec.for_family("qwen3_vl"))
    assert video_size(one, VisionPreprocessSpec.for_family("qwen3_vl"), [(64, 64)]).hf is None  # HF refuses t=1


@pytest.mark.parametrize("kwargs, message", [
    ({"fps": 1, "num_frames": 4}, "mutually exclusive"),
    ({"num_frames": 40}, "exceeds this export's maximum of 16"),
    ({"size": {"shortest_edge": 1}}, "not supported"),
    ({"do_sample_frames": "yes"}, "true or false"),
    ({"do_sample_frames": True, "num_frames": 2}, "clamps num_frames to [4, 16]"),
    ({"fps": 0}, "fps must be > 0"),
])
def test_processor_kwargs_vllm_cannot_serve_are_refused(kwargs, message):
    spec = VisionPreprocessSpec.for_family("qwen3_vl")
    metadata = {"total_num_frames": 100, "fps": 10.0, "do_sample_frames": True}
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        delivered_video_frames(np.zeros((100, 32, 32, 3), np.uint8), metadata, spec,
                               mm_processor_kwargs=kwargs, max_frames=EXPORT_MAX)


@pytest.mark.parametrize("kwargs, message", [
    ({"backend": "torchcodec"}, "not available"),
    ({"frame_recovery": True}, "frame_recovery"),
    ({"num_frame": 8}, "unknown video media-io kwargs"),
    ({"video_backend": "molmo2"}, "video_backend must be one of"),
    ({"max_frames": 0}, ">= 1"),
])
def test_media_io_kwargs_we_cannot_honour_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LoaderSettings.from_media_io_kwargs(kwargs, default_loader="qwen3_vl")


def test_resampling_a_presampled_clip_is_refused():
    spec = VisionPreprocessSpec.for_family("qwen3_vl")
    metadata = {"total_num_frames": 100, "fps": 10.0, "frames_indices": list(range(0, 100, 10))}
    with pytest.raises(ValueError, match="whole 100-frame clip but only 10 frames were delivered"):
        delivered_video_frames(np.zeros((10, 32, 32, 3), np.uint8), metadata, spec,
                               mm_processor_kwargs={"do_sample_frames": True})


def test_sample_clip_is_pure_over_metadata():
    """The rule needs no file: a 300-frame 30 fps clip through the qwen3_vl loader keeps its 20 frames."""
    spec = VisionPreprocessSpec.for_family("qwen3_vl")
    source = SourceVideo.of(300, 30.0)
    settings = LoaderSettings.from_media_io_kwargs(None, default_loader="qwen3_vl")
    metadata = loader_metadata(source, settings, loader_frame_indices(source, settings))
    clip = sample_clip(metadata, frame_rule(spec.video_processor), ProcessorSettings.from_kwargs(spec))
    assert clip.num_frames == 20 and clip.grid_t == 10 and not metadata.do_sample_frames
    assert clip.indices == tuple(np.linspace(0, 299, 20).round().astype(int))


# ------------------------------------------------------------------------------------------------
# the plugin's video_url loader (qeff_evs.vllm.processing.video_loader) against vLLM's own


PLUGIN_LOADER_CASES = [{}, {"num_frames": 8}, {"num_frames": -1}, {"fps": 1}, {"fps": 6, "max_frames": 10},
                       {"min_frames": 2, "max_frames": 40}]


def _image_bytes(fmt: str) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(_texture(48, 64, seed=1)).save(buffer, format=fmt)
    return buffer.getvalue()


@pytest.mark.parametrize("backend", ["qwen2_vl", "qwen3_vl", "opencv"])
def test_plugin_loader_equals_vllm_loader_where_it_works(clips, backend):
    """vLLM's ``VideoMediaIO`` with its own loader, and the same call with ours: bit-equal frames and an equal
    metadata dict on every clip and kwargs where vLLM's loader delivers frames; the one-frame file, where it
    fails or delivers none, delivers its one frame with ours."""
    from qeff_evs.vllm.processing.video_loader import LOADERS

    compared = 0
    for name, path in clips.items():
        data = path.read_bytes()
        for kwargs in PLUGIN_LOADER_CASES:
            media_io = VideoMediaIO(ImageMediaIO(), video_backend=backend, **kwargs)
            ours = LOADERS[backend].load_bytes(data, num_frames=media_io.num_frames, **media_io.kwargs)
            try:
                frames, metadata = media_io.load_bytes(data).media
            except ZeroDivisionError:  # vLLM's qwen2_vl loader on a clip shorter than a temporal patch
                frames, metadata = np.zeros((0,)), None
            if len(frames) == 0:
                assert name == "h264_1f.mp4", (name, kwargs)
                assert len(ours[0]) == 1 and ours[1]["frames_indices"] == [0] and ours[1]["total_num_frames"] == 1
                continue
            np.testing.assert_array_equal(ours[0], frames, err_msg=str((name, kwargs)))
            assert ours[1] == metadata, (name, kwargs)
            compared += 1
    # vLLM 0.34 reads the one-frame file, but for its qwen2_vl loader, which divides by zero on it
    assert compared == (len(clips) - (backend == "qwen2_vl")) * len(PLUGIN_LOADER_CASES)


@pytest.mark.parametrize("what", ["png", "jpeg", "garbage", "truncated"])
def test_plugin_loader_refuses_undecodable_bytes_by_name(clips, what):
    """Bytes no frame decodes from: vLLM's loaders raise errors vLLM answers with HTTP 500 (ZeroDivisionError,
    RuntimeError from torch.arange, numpy's ufunc errors); ours raise vLLM's validation error (HTTP 400) that names
    the video_url and, for an image, says to send it as image_url."""
    from vllm.exceptions import VLLMValidationError

    from qeff_evs.vllm.processing.video_loader import LOADERS

    data = {"png": lambda: _image_bytes("PNG"), "jpeg": lambda: _image_bytes("JPEG"),
            "garbage": lambda: b"\x00\x01 not a video " * 100,
            "truncated": lambda: clips["h264_30fps_90f.mp4"].read_bytes()[:200]}[what]()
    for backend, loader in LOADERS.items():
        with pytest.raises(VLLMValidationError, match="video_url: no video frame can be decoded") as error:
            loader.load_bytes(data, num_frames=32)
        if what in ("png", "jpeg"):  # what the bytes are, not the decoder's account of them (a count of -2**63)
            assert str(error.value).startswith(
                f"video_url: no video frame can be decoded from the video's {len(data)} bytes: they hold a "
                f"{what.upper()} image, not a video; send it as image_url"), (backend, str(error.value))
        assert str(-2**63) not in str(error.value) and "frame count" not in str(error.value), backend
