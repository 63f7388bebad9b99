"""Which frames of a video are encoded, and when each was shown: vLLM 0.32's video loader, then the model's
Hugging Face sampling rule (transformers 5.19), as pure functions.

A video reaches a Qwen-VL vision tower in three steps (the first two in ``loader_sampling.py``, the third here):

1. **The container**, read the way vLLM's OpenCV decoder reads it (``video_io.read_video_source``):
   :class:`SourceVideo` (frame count, frame rate, duration).
2. **vLLM's video loader** (``vllm/multimodal/video.py``, for ``video_url``) picks the frames to decode
   from the source and ``--media-io-kwargs '{"video": {...}}'`` (:class:`LoaderSettings`,
   :func:`loader_frame_indices`) and hands the processor the decoded frames with their
   :class:`ClipMetadata` (:func:`loader_metadata`). ``LLM.generate`` callers pass frames and metadata
   themselves and skip this step.
3. **The model's processor** (vLLM's ``qwen3_vl.py`` / ``qwen2_5_vl.py`` around HF's
   ``Qwen3VLVideoProcessor`` / ``Qwen2VLVideoProcessor``) keeps the delivered frames or samples them
   again (:class:`FrameRule`, :class:`ProcessorSettings`, :func:`sample_clip`) -> :class:`SampledClip`:
   source frame indices, each frame's time in seconds, the sampled frame rate.

The loader is the one vLLM resolves for the checkpoint's video processor (``qwen2_vl`` / ``qwen3_vl``,
:attr:`FrameRule.vllm_loader`); it falls back to ``VLLM_VIDEO_LOADER_BACKEND`` (default ``opencv``) only
when vLLM cannot name the processor (no ``video_processor_type`` in the model folder and no torchvision
to map ``model_type``), and ``{"video_backend": ...}`` in the media-io kwargs overrides both.

**The export's frame limit.** An export serves at most ``max_frames`` frames (its largest frame bucket
times the temporal patch size). That limit is vLLM's ``max_frames`` on both sides: the loader's
(``--media-io-kwargs '{"video": {"max_frames": M}}'``; for the plain ``opencv`` loader, which has no
``max_frames``, its ``num_frames`` capped at M) and the processor's (``--mm-processor-kwargs
'{"max_frames": M}'``). Frames delivered pre-sampled and still more than M (``LLM.generate``, or a vLLM
frontend whose loader ran without the limit) are spread down to M as HF's Qwen3-VL processor would with
``do_sample_frames=True, num_frames=M`` on those frames (a rounded linspace, first and last kept; vLLM has
no rule here). An explicit ``num_frames`` above M is refused.

**Where vLLM 0.32 itself fails** on a short clip (fewer frames than the temporal patch), we still
serve it, padded by repeating the last frame as HF's patchify does; :attr:`SampledClip.vllm_fails`
says why vLLM would not (its OpenCV probe leaves a one-frame file unreadable, its ``qwen2_vl`` loader
and HF's Qwen2-VL rule divide by a zero frame count, HF's Qwen3-VL resize needs two frames). Requests
on which vLLM fails for any other reason are refused with a ``ValueError`` naming the value and the fix.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from qeff_evs.models.protocol import VideoPreprocessing
from qeff_evs.runtime.inputs.loader_sampling import GENERIC_LOADER, ClipMetadata, setting_count, setting_rate

PROCESSOR_VIDEO_KEYS = frozenset({"fps", "num_frames", "do_sample_frames", "min_frames", "max_frames"})


# ---------------------------------------------------------------------------------------------
# 3. the model's processor


@dataclass(frozen=True)
class ProcessorSettings:
    """HF video-processor sampling settings: the checkpoint's, overridden by ``mm_processor_kwargs``.

    ``do_sample_frames``: ``None`` unless the request sets it (then the rule decides, see
    :attr:`FrameRule.keeps_loader_flag`); ``default_do_sample_frames`` is the processor's own.
    ``fps``/``num_frames`` are mutually exclusive (HF raises when both are set).
    """

    temporal_patch_size: int
    fps: float | None
    num_frames: int | None
    min_frames: int
    max_frames: int
    default_do_sample_frames: bool
    do_sample_frames: bool | None = None

    @classmethod
    def from_kwargs(cls, defaults: VideoPreprocessing,
                    kwargs: Mapping[str, Any] | None = None) -> ProcessorSettings:
        """``defaults``: the checkpoint's processor config read over the family's class defaults (a
        ``VisionPreprocessSpec``); ``kwargs``: the server's and request's video ``mm_processor_kwargs``,
        merged and flat (vLLM's per-video lists are the caller's to pick from)."""
        kwargs = dict(kwargs or {})
        unknown = sorted(set(kwargs) - PROCESSOR_VIDEO_KEYS)
        if unknown:
            raise ValueError(f"video processor kwargs {unknown} are not supported; qeff-evs honours "
                             f"{sorted(PROCESSOR_VIDEO_KEYS)}")
        fps = kwargs.get("fps", defaults.sampling_fps)
        if fps is not None and not setting_rate(fps, "fps") > 0:
            raise ValueError(f"fps must be > 0, got {fps!r}")
        num_frames = kwargs.get("num_frames", defaults.num_frames)
        if "num_frames" in kwargs and "fps" not in kwargs:
            fps = None  # vLLM clears the processor's fps when only num_frames is asked for
        if fps is not None and num_frames is not None:
            raise ValueError("num_frames and fps are mutually exclusive (HF's video processors refuse both); "
                             "pass one")
        do_sample = kwargs.get("do_sample_frames")
        if do_sample is not None and not isinstance(do_sample, bool):
            raise ValueError(f"do_sample_frames must be true or false, got {do_sample!r}")
        return cls(
            temporal_patch_size=setting_count(defaults.temporal_patch_size, "temporal_patch_size"),
            fps=None if fps is None else setting_rate(fps, "fps"),
            num_frames=None if num_frames is None else setting_count(num_frames, "num_frames"),
            min_frames=setting_count(kwargs.get("min_frames", defaults.min_frames), "min_frames"),
            max_frames=setting_count(kwargs.get("max_frames", defaults.max_frames), "max_frames"),
            default_do_sample_frames=bool(defaults.do_sample_frames),
            do_sample_frames=do_sample,
        )


class _ShortClip(Exception):
    """The rule has no frame count for a clip shorter than one temporal patch (HF divides by zero)."""


def _spread(total: int, count: int) -> np.ndarray:
    """``count`` positions spread over ``total`` frames, first and last included (rounded linspace)."""
    return np.linspace(0, total - 1, count).round().astype(int)


def _qwen3_positions(total: int, source_fps: float, settings: ProcessorSettings) -> np.ndarray:
    # HF 5.19 Qwen3VLVideoProcessor.sample_frames: rounded linspace over the clip; the count from fps is
    # clamped to [min_frames, max_frames] and the clip, an explicit num_frames is taken as it is.
    count = settings.num_frames
    if count is None and settings.fps is not None:
        count = int(total / source_fps * settings.fps)
        count = min(max(count, settings.min_frames), settings.max_frames, total)
    if count is None:
        count = min(max(total, settings.min_frames), settings.max_frames)
    return _spread(total, count)


def _qwen2_positions(total: int, source_fps: float, settings: ProcessorSettings) -> np.ndarray:
    # HF 5.19 Qwen2VLVideoProcessor.sample_frames: num_frames rounded to the temporal patch, or the fps
    # count clamped and floored to it; indices from a float32 arange (not clamped: HF indexes with them).
    patch, count = settings.temporal_patch_size, settings.num_frames
    if count is not None:
        count = round(count / patch) * patch
    elif settings.fps is not None:
        if not source_fps > 0:
            raise ValueError("the video reports no frame rate; Qwen2-VL's processor cannot sample it by fps. "
                             "Pass num_frames instead")
        max_frames = math.floor(min(settings.max_frames, total) / patch) * patch
        count = min(max(total / source_fps * settings.fps, settings.min_frames), max_frames, total)
        count = math.floor(count / patch) * patch
    if count is None:
        raise ValueError("Qwen2-VL's processor was asked to sample frames with neither fps nor num_frames "
                         "(HF fails on this); pass one, or do_sample_frames=false")
    if count > total:
        raise ValueError(f"num_frames={count} exceeds the clip's {total} frames (HF refuses it); ask for fewer")
    if count == 0:
        if total < patch:
            raise _ShortClip
        raise ValueError(f"Qwen2-VL's processor rounds this request to 0 frames (num_frames or max_frames below "
                         f"{patch}; HF divides by zero); ask for at least {patch}")
    positions = torch.arange(0, total, total / count).int().numpy()
    if positions.max() >= total:
        raise ValueError(f"Qwen2-VL's processor picks frame {int(positions.max())} of a {total}-frame clip "
                         f"for num_frames={count} (its float32 step overshoots; vLLM fails); ask for "
                         f"another count")
    return positions


def _qwen3_stamps(total: int, source_fps: float, settings: ProcessorSettings) -> np.ndarray:
    # vLLM 0.32 Qwen3VLProcessingInfo._get_video_second_idx, which times the frames for the prompt: HF's
    # rule, except that an explicit num_frames is clamped to [min_frames, max_frames] and the clip too.
    count = settings.num_frames
    if count is None:
        if settings.fps is None:
            raise ValueError("the video processor has no fps and the request neither fps nor num_frames "
                             "(vLLM 0.32 fails on it); pass one")
        count = int(total / source_fps * settings.fps)
    return _spread(total, min(max(count, settings.min_frames), settings.max_frames, total))


@dataclass(frozen=True)
class FrameRule:
    """One HF video processor's sampling rule and how vLLM 0.32's model processor drives it.

    ``vllm_loader``: the loader vLLM resolves for this processor. ``keeps_loader_flag``: whether vLLM
    passes the loader's ``do_sample_frames`` to the processor (Qwen3-VL) or drops it so the processor's
    own default decides (Qwen2.5-VL). ``resize_needs_full_patch``: HF's resize fails on a clip shorter
    than one temporal patch (Qwen3-VL's smart_resize budgets frames x pixels). ``rounds_num_frames``: an
    explicit num_frames is rounded to a multiple of the temporal patch (Qwen2-VL). ``positions``: HF's
    ``sample_frames``. ``stamps``: the frames vLLM times when the processor samples, where it computes
    them apart from HF (Qwen3-VL's prompt timestamps); ``None``: the sampled frames' own times.
    """

    video_processor: str
    vllm_loader: str
    keeps_loader_flag: bool
    resize_needs_full_patch: bool
    rounds_num_frames: bool
    positions: Callable[[int, float, ProcessorSettings], np.ndarray]
    stamps: Callable[[int, float, ProcessorSettings], np.ndarray] | None = None

    def requested_count(self, num_frames: int, temporal_patch_size: int) -> int:
        """The frames an explicit ``num_frames`` gives under this rule."""
        if self.rounds_num_frames:
            return round(num_frames / temporal_patch_size) * temporal_patch_size
        return num_frames


def _never_samples(total: int, source_fps: float, settings: ProcessorSettings) -> np.ndarray:
    # vLLM 0.32's Nemotron-H processor (nano_nemotron_vl.py) encodes every frame the loader delivered.
    raise ValueError("vLLM's Nemotron-H processor encodes every frame its video loader delivers and samples none "
                     "itself; drop do_sample_frames and choose the frames with --media-io-kwargs "
                     "'{\"video\": {\"num_frames\": N}}'")


FRAME_RULES = {
    "Qwen2VLVideoProcessor": FrameRule("Qwen2VLVideoProcessor", "qwen2_vl", keeps_loader_flag=False,
                                       resize_needs_full_patch=False, rounds_num_frames=True,
                                       positions=_qwen2_positions),
    "Qwen3VLVideoProcessor": FrameRule("Qwen3VLVideoProcessor", "qwen3_vl", keeps_loader_flag=True,
                                       resize_needs_full_patch=True, rounds_num_frames=False,
                                       positions=_qwen3_positions, stamps=_qwen3_stamps),
    # vLLM names no loader for it: the generic one (its num_frames, default 32), every delivered frame kept.
    "NemotronH_Omni_Reasoning_V3VideoProcessor": FrameRule(
        "NemotronH_Omni_Reasoning_V3VideoProcessor", GENERIC_LOADER, keeps_loader_flag=False,
        resize_needs_full_patch=False, rounds_num_frames=False, positions=_never_samples),
}


def frame_rule(video_processor: str) -> FrameRule:
    """The rule of HF video processor class ``video_processor`` (a ``VideoPreprocessing.video_processor``)."""
    if video_processor not in FRAME_RULES:
        raise ValueError(f"no frame rule for video processor {video_processor!r}; known: {sorted(FRAME_RULES)}")
    return FRAME_RULES[video_processor]


@dataclass(frozen=True)
class SampledClip:
    """The frames the model's processor encodes, in order.

    ``positions``: index of each into the delivered frames. ``indices``: its source frame index.
    ``frame_times``: the seconds vLLM stamps the frames with (Qwen3-VL's timestamps average them per
    temporal patch, padded with the last): ``index / fps``, except where the processor samples and vLLM
    times its own picks: an explicit num_frames outside [min_frames, clip] (vLLM clamps it, HF does not;
    then there can be fewer times than frames, covering as many patches) or a clip the loader had already
    sampled (vLLM times the positions as source indices; :func:`sample_clip`). ``sampled_fps``: HF's
    ``VideoMetadata.sampled_fps`` = frames / source frames x source rate (Qwen2.5-VL's
    ``second_per_grid_ts`` is ``temporal_patch_size / sampled_fps``). ``temporal_patch_size``: frames per
    temporal patch (a short last patch repeats its last frame). ``vllm_fails``: why vLLM 0.32 itself fails
    on this clip where we serve it (short clips), else ``None``.
    """

    positions: tuple[int, ...]
    indices: tuple[int, ...]
    frame_times: tuple[float, ...]
    sampled_fps: float
    temporal_patch_size: int
    vllm_fails: str | None = None

    @property
    def num_frames(self) -> int:
        return len(self.indices)

    @property
    def grid_t(self) -> int:
        """Temporal patches: frames padded up to a multiple of the temporal patch size."""
        return -(-self.num_frames // self.temporal_patch_size)



def sample_clip(
    metadata: ClipMetadata,
    rule: FrameRule,
    settings: ProcessorSettings,
    *,
    max_frames: int | None = None,
    vllm_fails: str | None = None,
) -> SampledClip:
    """The frames the processor encodes out of the delivered ones (``metadata.frames_indices``).

    The processor samples when ``settings.do_sample_frames`` says so, else (request silent) when the
    loader's flag does (:attr:`FrameRule.keeps_loader_flag`) or its own default does. Sampling runs the
    rule over the whole source (``total_num_frames``) and takes its picks as positions in the delivered
    frames, as HF does: exact when every frame was delivered; when the loader had already sampled, vLLM
    0.32 encodes the delivered frames at those positions and stamps them with the positions' times (kept
    here for parity), or fails when a position lies past the delivered frames (refused here).
    ``max_frames``: the export's limit (module docstring). ``vllm_fails``: the loader's failure note
    (:func:`vllm_loader_failure`).

    Example (Qwen3-VL, default settings): a 300-frame 30 fps file through the ``qwen3_vl`` loader
    delivers 20 frames with ``do_sample_frames=False``; the processor keeps them.
    """
    delivered = len(metadata.frames_indices)
    if delivered == 0:
        raise ValueError("the video has no decodable frames (vLLM 0.32's OpenCV loader returns none for "
                         "one-frame files); send it as a clip of two or more frames")
    if not metadata.fps > 0:
        raise ValueError("the video reports no frame rate (fps 0; vLLM 0.32 fails on it); re-mux it with a "
                         "frame rate or pass fps in its metadata")
    limit = None if max_frames is None else setting_count(max_frames, "max_frames")
    if limit is not None:
        settings = replace(settings, max_frames=min(settings.max_frames, limit))
    if settings.do_sample_frames is not None:
        do_sample = settings.do_sample_frames
    else:
        do_sample = metadata.do_sample_frames if rule.keeps_loader_flag else settings.default_do_sample_frames

    patch, total = settings.temporal_patch_size, metadata.total_num_frames
    if do_sample:
        requested = settings.num_frames
        if limit is not None and requested is not None and rule.requested_count(requested, patch) > limit:
            raise ValueError(f"num_frames={requested} exceeds this export's maximum of {limit} frames; "
                             f"ask for at most {limit} or export a larger frame bucket")
        try:
            positions = rule.positions(total, metadata.fps, settings)
        except _ShortClip:
            positions = np.arange(delivered)
            vllm_fails = vllm_fails or (f"HF's {rule.video_processor} divides by zero on clips shorter than "
                                        f"{patch} frames")
        if positions.max() >= delivered:
            raise ValueError(
                f"do_sample_frames samples the whole {total}-frame clip but only {delivered} frames were "
                f"delivered (vLLM 0.32's processor fails indexing frame {int(positions.max())}); drop "
                "do_sample_frames or have the loader decode every frame")
        stamps = positions  # HF takes its picks for source indices, delivered or not
        if rule.stamps is not None:
            stamps = rule.stamps(total, metadata.fps, settings)
            if -(-len(stamps) // patch) != -(-len(positions) // patch):
                raise ValueError(
                    f"num_frames={requested} gives {len(positions)} frames but vLLM 0.32 times "
                    f"{len(stamps)} of this {total}-frame clip (it clamps num_frames to "
                    f"[{settings.min_frames}, {min(settings.max_frames, total)}], HF does not) and fails; "
                    "ask for a count in that range")
    else:
        positions = np.arange(delivered)
        stamps = np.asarray(metadata.frames_indices, dtype=np.int64)
    if limit is not None and len(positions) > limit:
        # Delivered pre-sampled and still too long: spread the limit over them as HF's num_frames rule
        # (Qwen3-VL's; Qwen2-VL's float32 arange can overshoot the clip) would.
        keep = _spread(len(positions), limit)
        positions, stamps = positions[keep], stamps[keep]
    if rule.resize_needs_full_patch and len(positions) < patch:
        vllm_fails = vllm_fails or (f"HF's {rule.video_processor} cannot resize a clip shorter than {patch} "
                                    "frames")

    positions_tuple = tuple(int(p) for p in positions)
    return SampledClip(
        positions=positions_tuple,
        indices=tuple(metadata.frames_indices[p] for p in positions_tuple),
        frame_times=tuple(int(i) / metadata.fps for i in stamps),
        sampled_fps=len(positions_tuple) / total * metadata.fps,  # HF's VideoMetadata.sampled_fps
        temporal_patch_size=patch,
        vllm_fails=vllm_fails,
    )
