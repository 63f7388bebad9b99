"""``video_url`` bytes -> frames: vLLM 0.32's video loaders, without the requests they fail on.

vLLM's frontend decodes a ``video_url`` with the loader its ``VIDEO_LOADER_REGISTRY`` names for the model's
video processor (``qwen2_vl`` for Qwen2.5-VL, ``qwen3_vl`` for Qwen3-VL/Qwen3.5), or the one
``--media-io-kwargs '{"video": {"video_backend": ...}}'`` / ``VLLM_VIDEO_LOADER_BACKEND`` names (``opencv``).
Those loaders raise on some videos, and vLLM answers HTTP 500 for what is the request's fault:

* a one-frame file: the ``qwen2_vl`` loader divides by zero, the others decode no frame (their end-of-stream
  probe leaves the capture past the only frame);
* bytes no video can be read from (an image sent as ``video_url``): OpenCV reports a negative frame count and
  every loader fails inside its own arithmetic (``torch.arange``, ``np.linspace``).

:func:`register_video_loaders` registers ours under the same three names (and the same video processors), while
the qeff-evs plugin is active: the frames and metadata dict are vLLM's wherever its loader works (the same
``frame_sampling`` rules and OpenCV reads ``qeff-evs run`` uses; ``tests/test_frame_sampling.py`` compares them on
its clips), a one-frame file delivers its frame (the processor pads it in time,
as for a one-frame array), and bytes no frame decodes from raise ``VLLMValidationError``: HTTP 400 naming the
video and what the bytes are.
"""

from __future__ import annotations

import io
from typing import Any, ClassVar

import numpy as np

from qeff_evs.runtime.inputs.loader_sampling import CODEC, GENERIC_LOADER, LOADER_NUM_FRAMES, LoaderSettings
from qeff_evs.runtime.inputs.processor import load_frames
from qeff_evs.vllm.surface import VIDEO_LOADER_REGISTRY, VideoLoader
from qeff_evs.vllm.surface import VLLMValidationError


def _image_format(data: bytes) -> str | None:
    """The image format Pillow reads ``data`` as (``"PNG"``, ``"JPEG"``...), or None."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:
            return image.format
    except (UnidentifiedImageError, OSError, ValueError):
        return None


def undecodable(data: bytes, reason: str) -> str:
    """The 400's line for a ``video_url`` no frame decodes from: what the bytes are where they are an image (the
    decoder's own account of an image, such as OpenCV's frame count of -2**63, says nothing to the sender), else
    why the decoder gave no frame."""
    image = _image_format(data)
    if image:
        return (f"video_url: no video frame can be decoded from the video's {len(data)} bytes: they hold a {image} "
                "image, not a video; send it as image_url")
    return (f"video_url: no video frame can be decoded from the video's {len(data)} bytes ({reason}); send a video "
            "file a decoder reads (mp4, mkv, webm, ...), complete")


class _ExportVideoLoader(VideoLoader):
    """One of vLLM's loaders (:attr:`rule`) as :mod:`qeff_evs.runtime.inputs.frame_sampling` reproduces it."""

    rule: ClassVar[str]

    @classmethod
    def load_bytes(cls, data: bytes, num_frames: int = LOADER_NUM_FRAMES, **kwargs: Any
                   ) -> tuple[np.ndarray, dict[str, Any]]:
        """``(frames, metadata)`` as vLLM's loader returns them; ``num_frames`` and ``kwargs``: what
        ``VideoMediaIO`` passes (the media-io kwargs, ``video_backend`` taken out)."""
        try:
            settings = LoaderSettings.from_media_io_kwargs({**kwargs, "num_frames": num_frames,
                                                            "video_backend": cls.rule}, default_loader=cls.rule)
        except ValueError as error:
            raise VLLMValidationError(f"media_io_kwargs for video: {error}", parameter="media_io_kwargs") from None
        try:
            loaded = load_frames(data, settings)
        except Exception as error:  # noqa: BLE001 - whatever the decoder makes of these bytes, they are the request's
            reason = str(error) if isinstance(error, ValueError) else f"{type(error).__name__}: {error}"
            raise VLLMValidationError(undecodable(data, reason),
                                      parameter="messages") from None
        metadata = loaded.metadata
        return loaded.frames, {"total_num_frames": metadata.total_num_frames, "fps": metadata.fps,
                               "duration": metadata.duration, "video_backend": CODEC,
                               "frames_indices": list(metadata.frames_indices),
                               "do_sample_frames": metadata.do_sample_frames}


class OpenCVLoader(_ExportVideoLoader):
    rule = GENERIC_LOADER


class Qwen2VLLoader(_ExportVideoLoader):
    rule = "qwen2_vl"


class Qwen3VLLoader(_ExportVideoLoader):
    rule = "qwen3_vl"


LOADERS: dict[str, type[_ExportVideoLoader]] = {
    loader.rule: loader for loader in (OpenCVLoader, Qwen2VLLoader, Qwen3VLLoader)}
# The video processors vLLM 0.32 maps to each name (vllm/multimodal/video.py's registrations).
VIDEO_PROCESSORS = {GENERIC_LOADER: None, "qwen2_vl": "Qwen2VLVideoProcessor",
                    "qwen3_vl": ("Qwen3VLVideoProcessor", "Cosmos3EdgeVideoProcessor")}


def register_video_loaders() -> None:
    """Ours under vLLM's names, in this process (the plugin calls it only while qeff-evs is active)."""
    for name, loader in LOADERS.items():
        VIDEO_LOADER_REGISTRY.register(name, video_processor=VIDEO_PROCESSORS[name])(loader)
