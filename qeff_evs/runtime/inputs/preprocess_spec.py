"""The vision preprocessing spec of a checkpoint: its family's ``VideoPreprocessing`` with what the checkpoint's own
processor files say (patch, merge and temporal patch sizes, mean and std, the resize rule and pixel limits), read from
its folder as transformers' processors read them (``spec_from_pretrained_dir``)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from PIL import Image

from qeff_evs.models.protocol import SAMPLING_FPS, VideoPreprocessing
from qeff_evs.models.registry import family_class, family_classes, family_names, preprocess_defaults
from qeff_evs.runtime.inputs.frame_sampling import frame_rule
from qeff_evs.runtime.inputs.frame_sizes import patch_budget_size, smart_resize, smart_resize_video

PIL_BICUBIC = int(Image.Resampling.BICUBIC)  # 3, what every Qwen-VL checkpoint asks for
RESAMPLERS = ("pil", "torch_antialias")
PATCH_ORDERS = ("merge_blocks", "raster")
RGB_CHANNELS = 3

VIDEO_CONFIG_FILE = "video_preprocessor_config.json"
IMAGE_CONFIG_FILE = "preprocessor_config.json"
MODEL_CONFIG_FILE = "config.json"


@dataclass(frozen=True, kw_only=True)
class VisionPreprocessSpec(VideoPreprocessing):
    """Everything that turns RGB frames into one model family's vision-encoder input: the family's
    ``VideoPreprocessing`` (which :meth:`natural_size` applies) plus what every family shares.
    ``target_fps`` is the default sampling rate.
    """

    family: str
    resample: int = PIL_BICUBIC
    rescale_factor: float = 1 / 255
    target_fps: float = SAMPLING_FPS

    def __post_init__(self) -> None:
        if self.family not in family_names():
            raise ValueError(f"family must be one of {family_names()}, got {self.family!r}")
        for name in ("patch_size", "temporal_patch_size", "merge_size", "min_pixels", "max_pixels"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.min_pixels > self.max_pixels:
            raise ValueError(f"min_pixels {self.min_pixels} exceeds max_pixels {self.max_pixels}; swap them")
        for name in ("image_mean", "image_std"):
            value = getattr(self, name)
            if len(value) != self.in_channels:
                raise ValueError(f"{name} needs {self.in_channels} values (R, G, B), got {value!r}")
            object.__setattr__(self, name, tuple(float(v) for v in value))
        if any(s == 0 for s in self.image_std):
            raise ValueError(f"image_std must not contain 0, got {self.image_std}")
        try:
            Image.Resampling(self.resample)
        except ValueError:
            raise ValueError(f"resample must be a PIL resampling code (3 = bicubic), got {self.resample!r}") from None
        if not self.rescale_factor > 0:
            raise ValueError(f"rescale_factor must be > 0, got {self.rescale_factor!r}")
        if not self.target_fps > 0:
            raise ValueError(f"target_fps must be > 0, got {self.target_fps!r}")
        frame_rule(self.video_processor)
        for name in ("min_frames", "max_frames", "num_frames"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.sampling_fps is not None and not self.sampling_fps > 0:
            raise ValueError(f"the processor's fps must be > 0, got {self.sampling_fps!r}")
        if self.resampler not in RESAMPLERS:
            raise ValueError(f"resampler must be one of {RESAMPLERS}, got {self.resampler!r}")
        if self.patch_order not in PATCH_ORDERS:
            raise ValueError(f"patch_order must be one of {PATCH_ORDERS}, got {self.patch_order!r}")
        if self.target_patches is not None and (isinstance(self.target_patches, bool)
                                                or not isinstance(self.target_patches, int) or self.target_patches < 1):
            raise ValueError(f"target_patches must be a positive integer, got {self.target_patches!r}")

    @property
    def in_channels(self) -> int:
        return RGB_CHANNELS

    @property
    def factor(self) -> int:
        """Frame sides must be multiples of this: one merged token covers factor x factor pixels."""
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        """Length of one ``pixel_values`` row: C * temporal_patch_size * patch_size**2."""
        return self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size

    @classmethod
    def for_family(cls, family: str, /, **overrides: Any) -> VisionPreprocessSpec:
        """The family's released-checkpoint preprocessing (its ``preprocessing``), with ``overrides``."""
        if family not in family_names():
            raise ValueError(f"unknown model family {family!r}; expected one of {family_names()}")
        return replace(cls(family=family, **asdict(preprocess_defaults(family))), **overrides)

    @classmethod
    def from_pretrained_dir(cls, path: str | Path, model_config: Any = None) -> VisionPreprocessSpec:
        """Read a checkpoint directory's processor configs, falling back to the model config and defaults.

        ``video_preprocessor_config.json`` wins over ``preprocessor_config.json`` (this spec is for
        video). Patch sizes missing from both come from ``model_config.vision_config`` (a
        transformers config, a dict, or ``None`` to read ``config.json``); a processor patch size
        that contradicts the vision config is an error, since the encoder could not consume it.
        """
        return spec_from_pretrained_dir(path, model_config)

    def natural_size(self, height: int, width: int, num_frames: int | None = None) -> tuple[int, int]:
        """The frame size HF's video processor would resize to (before any export constraint)."""
        if self.target_patches is not None:
            return patch_budget_size(height, width, self.target_patches, self.keep_aspect, self.patch_size,
                                     self.merge_size)
        if self.pixel_limits_per_video:
            if num_frames is None:
                raise ValueError(f"{self.family} bounds pixels over the whole clip: pass num_frames")
            return smart_resize_video(
                num_frames,
                height,
                width,
                temporal_factor=self.temporal_patch_size,
                factor=self.factor,
                min_pixels=self.min_pixels,
                max_pixels=self.max_pixels,
            )
        return smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"cannot read processor config {path}: {error}") from error
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _field(obj: Any, key: str) -> Any:
    """``obj[key]`` for mappings, ``obj.key`` for config objects, ``None`` when absent."""
    if obj is None:
        return None
    if isinstance(obj, Mapping):
        return obj.get(key)
    return getattr(obj, key, None)


def _family_from(model_config: Any, processor_config: Mapping[str, Any]) -> str:
    model_type = str(_field(model_config, "model_type") or "")
    for family in family_names():
        if model_type.startswith(family):  # a variant ("<family>_moe") preprocesses as its family
            return family
    names = " ".join(
        str(processor_config.get(key, ""))
        for key in ("processor_class", "video_processor_type", "image_processor_type")
    )
    for family in family_classes():
        if family.hf_processor in names:
            return family.model_type
    raise ValueError(
        f"cannot tell the model family from model_type {model_type!r} or processor classes {names.strip()!r}; "
        f"pass a model config whose model_type is one of {family_names()}"
    )


# (spec field, processor-config key, type) read as they are, when the processor config sets them.
# ``fps`` feeds both today's sampler (target_fps) and HF's sampling rule (sampling_fps). Nemotron-H's processor
# spells mean/std ``norm_mean``/``norm_std`` and its tile ``video_target_num_patches``/``video_maintain_aspect_ratio``.
_PROCESSOR_FIELDS = (
    ("image_mean", "image_mean", tuple),
    ("image_std", "image_std", tuple),
    ("image_mean", "norm_mean", tuple),
    ("image_std", "norm_std", tuple),
    ("target_patches", "video_target_num_patches", int),
    ("keep_aspect", "video_maintain_aspect_ratio", bool),
    ("rescale_factor", "rescale_factor", float),
    ("resample", "resample", int),
    ("target_fps", "fps", float),
    ("sampling_fps", "fps", float),
    ("do_sample_frames", "do_sample_frames", bool),
    ("num_frames", "num_frames", int),
    ("min_frames", "min_frames", int),
    ("max_frames", "max_frames", int),
)


def _pixel_limits(config: Mapping[str, Any]) -> dict[str, int]:
    limits: dict[str, int] = {}
    size = config.get("size") or {}
    if isinstance(size, Mapping):
        if size.get("shortest_edge") is not None:
            limits["min_pixels"] = int(size["shortest_edge"])
        if size.get("longest_edge") is not None:
            limits["max_pixels"] = int(size["longest_edge"])
    # Older checkpoints spell the limits out; HF lets them override ``size``.
    if config.get("min_pixels") is not None:
        limits["min_pixels"] = int(config["min_pixels"])
    if config.get("max_pixels") is not None:
        limits["max_pixels"] = int(config["max_pixels"])
    return limits


def spec_from_pretrained_dir(path: str | Path, model_config: Any = None) -> VisionPreprocessSpec:
    """See :meth:`VisionPreprocessSpec.from_pretrained_dir`."""
    directory = Path(path)
    if not directory.is_dir():
        raise ValueError(f"checkpoint directory {directory} does not exist")
    if model_config is None and (directory / MODEL_CONFIG_FILE).is_file():
        model_config = _read_json(directory / MODEL_CONFIG_FILE)

    processor_config: dict[str, Any] = {}
    for name in (IMAGE_CONFIG_FILE, VIDEO_CONFIG_FILE):  # later files override earlier ones
        if (directory / name).is_file():
            processor_config.update(_read_json(directory / name))

    family = _family_from(model_config, processor_config)
    paths = family_class(family).config_paths
    overrides: dict[str, Any] = {}
    for spec_key, processor_key in (
        ("patch_size", "patch_size"),
        ("temporal_patch_size", "temporal_patch_size"),
        ("merge_size", "merge_size"),
    ):
        from_processor = processor_config.get(processor_key)
        from_vision = paths.get(model_config, spec_key)
        if from_processor is not None and from_vision is not None and int(from_processor) != int(from_vision):
            raise ValueError(
                f"{processor_key}={from_processor} in the processor config of {directory} contradicts "
                f"{getattr(paths, spec_key)}={from_vision}; fix the checkpoint's processor config"
            )
        chosen = from_processor if from_processor is not None else from_vision
        if chosen is not None:
            overrides[spec_key] = int(chosen)

    for spec_key, processor_key, cast in _PROCESSOR_FIELDS:
        if processor_config.get(processor_key) is not None:
            overrides[spec_key] = cast(processor_config[processor_key])
    overrides.update(_pixel_limits(processor_config))
    # Switched-off steps become identity values, so the arithmetic stays the same code path.
    if processor_config.get("do_rescale") is False:
        overrides["rescale_factor"] = 1.0
    if processor_config.get("do_normalize") is False:
        overrides["image_mean"], overrides["image_std"] = (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)
    return VisionPreprocessSpec.for_family(family, **overrides)
