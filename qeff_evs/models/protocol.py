"""The small protocol a model family implements to plug into export, runtime, serving, tests and the bench.

A family is one module under ``qeff_evs.models`` holding one class that implements ``ModelFamily`` and
registers itself with ``qeff_evs.models.registry.register_family``. The class says, as class
attributes and class methods, what the family *is*: its transformers ``model_type`` and classes, the
architecture name an export serves under, how its checkpoints preprocess video, how its tokenizer spells
its media tokens, which extra per-row tensors its vision rows carry (``ExtraRows``), how its config names
what the pipeline reads (``NormalizedConfig``), and its tiny test and realistic bench configs. An
instance, built from one checkpoint's config (and tokenizer), is that checkpoint's adapter: its special
ids, encoder and pruning graph wrappers, the encoder's host inputs and specialization symbols, and how a
video is laid out in the prompt before the encoder (only the kept count K known) and after it.

Nothing outside a family's module names the family: the pipeline reads every family-specific fact
through this protocol.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Protocol, Sequence

import numpy as np
import torch

from qeff_evs.manifest import LayerState, SpecialTokens
from qeff_evs.models.parakeet import subsampled_frames
from qeff_evs.positions import MediaBlock
from qeff_evs.weights.name_map import NameMap

SAMPLING_FPS = 2.0  # every family qeff-evs serves samples videos at 2 frames per second


@dataclass(frozen=True)
class VideoPreprocessing:
    """What differs by family in turning frames into patches; a family's ``preprocessing`` is its
    released checkpoints' values (a checkpoint's own processor config overrides them).

    ``min_pixels``/``max_pixels`` bound the resized frame: per frame, or over the whole clip,
    frames x height x width, with ``pixel_limits_per_video``, as HF's video processors do.

    Frame sampling is HF's video processor's: ``video_processor`` names its class (vLLM picks its video
    loader by that name and ``runtime/inputs/frame_sampling.py`` its sampling rule), and the class
    defaults follow: ``do_sample_frames``, ``sampling_fps`` (``fps``; ``None`` where the class has none),
    ``num_frames``, ``min_frames``, ``max_frames``.

    How pixels are made (``runtime/inputs/processor.py`` and ``frame_sizes.py`` implement each choice): ``resampler`` "pil" (HF's PIL
    processors: resize uint8 frames with PIL, then rescale and normalise) or "torch_antialias" (resize the float
    frames with torch's antialiased bicubic, then divide by 255 and normalise, no rounding between);
    ``patch_order`` "merge_blocks" (rows over merge windows first, each ``(channel, frame, y, x)``: Qwen's) or
    "raster" (rows in patch raster order, each ``(frame, channel, y, x)``: RADIO's tubelets); ``target_patches``
    (with ``keep_aspect``): frames are resized to one tile of about that many patches, its sides multiples of
    ``merge_size`` patches (Nemotron-H's rule) instead of by the pixel limits.
    """

    patch_size: int
    temporal_patch_size: int
    merge_size: int
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    min_pixels: int
    max_pixels: int
    pixel_limits_per_video: bool = False
    video_processor: str = "Qwen2VLVideoProcessor"
    do_sample_frames: bool = False
    sampling_fps: float | None = None
    num_frames: int | None = None
    min_frames: int = 4
    max_frames: int = 768
    resampler: str = "pil"
    patch_order: str = "merge_blocks"
    target_patches: int | None = None
    keep_aspect: bool = True


@dataclass(frozen=True)
class TokenStrings:
    """How a family's tokenizer spells its media tokens, as its chat template writes them.

    Example: a Qwen-VL family's are ``qeff_evs.models.qwen_vl.QWEN_TOKENS``.
    """

    image: str  # the pad a chat template emits once per image (the host expands it)
    video: str  # ... once per video
    image_block: str  # what a chat template writes for one image: markers around the pad
    video_block: str  # ... for one video; also the plain (template-less) prompt's video
    audio: str = ""  # ... once per audio item, in a family with audio ("" otherwise)

    def pad(self, modality: str) -> str:
        """The pad string of ``modality`` ("image", "video", "audio")."""
        return _by_modality(modality, self.image, self.video, self.audio)

    def block(self, modality: str) -> str:
        """The placeholder block a chat template writes for one item of ``modality``."""
        return _by_modality(modality, self.image_block, self.video_block, self.audio)

    @property
    def pads(self) -> tuple[str, ...]:
        """Every media pad a chat template may emit, in (image, video, audio) order."""
        return tuple(pad for pad in (self.image, self.video, self.audio) if pad)


def _by_modality(modality: str, image, video, audio=""):
    if modality.startswith("image"):
        return image
    if modality.startswith("video"):
        return video
    if modality.startswith("audio") and audio:
        return audio
    raise ValueError(f"this family takes images and videos, not {modality!r}")


@dataclass(frozen=True)
class ExtraRows:
    """A family tensor that travels with a media item's vision rows, row for row (Qwen3-VL's multi-level rows).

    On the host it is ``(levels, rows, hidden)`` beside the ``(rows, hidden)`` vision rows: the encoder
    outputs it, the pruning graph scores with it (``[rows | level 0 | level 1 | ...]`` along features, every
    extra's levels in ``extra_rows`` order as its ``score_extras`` input), the host keeps the same rows of it,
    and each prefill chunk sends the language graph its window of it, ``(levels, 1, window rows, hidden)``,
    whose level ``i`` is added to the media tokens' hidden states after decoder layer ``i``. Everywhere
    between, it rides in an ``extras`` mapping under ``name``.
    """

    name: str  # encoder output, language input (with its ``_RetainedState`` twin)


@dataclass(frozen=True)
class NormalizedConfig:
    """A checkpoint config read under the names the pipeline uses, whatever the family calls them.

    As Optimum's ``NormalizedConfig``: a family declares where its config keeps each value
    (``ConfigPaths``); everything outside the family reads these fields.
    """

    patch_size: int  # vision patch side, pixels
    temporal_patch_size: int  # frames per temporal patch
    merge_size: int  # patches per merged token, per side
    vision_hidden: int  # width of the rows the vision side emits (the language model's input width)
    num_layers: int  # decoder layers
    hidden_size: int  # decoder width
    vocab_size: int
    kv_heads: int
    head_dim: int
    max_positions: int  # the RoPE table length the checkpoint was trained for
    image_token_id: int | None
    video_token_id: int | None


@dataclass(frozen=True)
class ConfigPaths:
    """Where a family's config keeps each ``NormalizedConfig`` field: dotted attribute paths.

    ``read`` takes a transformers config or the dict of its ``config.json`` alike. ``head_dim`` may be
    absent from a config: it is then ``hidden_size // heads`` (``heads`` names the attention-head count).
    """

    patch_size: str
    temporal_patch_size: str
    merge_size: str
    vision_hidden: str
    num_layers: str
    hidden_size: str
    vocab_size: str
    kv_heads: str
    head_dim: str
    heads: str
    max_positions: str
    image_token_id: str
    video_token_id: str

    def get(self, config: Any, name: str) -> Any:
        """The value at field ``name``'s path, or None when any step of it is absent."""
        value = config
        for step in getattr(self, name).split("."):
            value = value.get(step) if isinstance(value, Mapping) else getattr(value, step, None)
            if value is None:
                return None
        return value

    def read(self, config: Any) -> NormalizedConfig:
        values = {f.name: self.get(config, f.name) for f in fields(NormalizedConfig)}
        if values["head_dim"] is None and values["hidden_size"] is not None:
            values["head_dim"] = int(values["hidden_size"]) // int(self.get(config, "heads"))
        missing = [getattr(self, name) for name, value in values.items()
                   if value is None and not name.endswith("token_id")]
        if missing:
            raise ValueError(f"{type(config).__name__} lacks {', '.join(missing)}; pass the checkpoint's full config")
        return NormalizedConfig(**{name: None if value is None else int(value) for name, value in values.items()})


@dataclass(frozen=True)
class ImageTiling:
    """Images cut into square tiles of one size, as InternVL's tiler cuts them (Nemotron-H's, in vLLM), and encoded by
    a graph of their own (``ModelFamily.image_encoder``): at most ``max_tiles`` tiles on the grid closest to the
    image's aspect ratio, plus a thumbnail of the whole image when there are several (``thumbnail``)."""

    tile_size: int  # pixels per tile side
    patch_size: int
    max_tiles: int
    thumbnail: bool

    def __post_init__(self) -> None:
        if self.tile_size < 1 or self.tile_size % self.patch_size:
            raise ValueError(f"a tile of {self.tile_size} px is not a positive multiple of the {self.patch_size} px "
                             "patch; the config's force_image_size must be one")
        check_max_tiles(self.max_tiles)

    @property
    def grid_hw(self) -> tuple[int, int]:
        """The patch grid of one tile."""
        side = self.tile_size // self.patch_size
        return side, side


def check_max_tiles(value: Any) -> int:
    """``max_num_tiles`` (vLLM's processor argument) as a positive int; ValueError naming the value otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"max_num_tiles must be a positive int, got {value!r}; pass e.g. "
                         "--mm-processor-kwargs '{\"max_num_tiles\": 12}'")
    return value


@dataclass(frozen=True)
class AudioFeatures:
    """How a checkpoint turns a waveform into its audio encoder's log-mel features and counts their rows (Parakeet's
    settings, as vLLM reads them from the config's ``sound_config``): clips of at most ``clip_seconds`` (the last at
    least ``min_clip_seconds``), pre-emphasis, an STFT, slaney mel filters, a log, per-clip normalisation, and a
    subsampling of ``stages`` convolutions of ``kernel`` and ``stride`` in time."""

    sampling_rate: int
    mels: int
    hop_length: int = 160
    win_length: int = 400
    n_fft: int = 512
    preemphasis: float = 0.97
    kernel: int = 3
    stride: int = 2
    stages: int = 3
    clip_seconds: float = 30.0  # vLLM's clip_duration_s (fixed there, not read from the config)
    min_clip_seconds: float = 0.1  # vLLM's clip_min_duration_s
    bucket_seconds: tuple[float, ...] = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)  # the audio encoder's clip specializations

    @property
    def bucket_frames(self) -> tuple[int, ...]:
        """The feature frames of each bucket: a clip of that length has ``samples // hop_length`` of them."""
        return tuple(int(round(seconds * self.sampling_rate)) // self.hop_length for seconds in self.bucket_seconds)


@dataclass(frozen=True)
class MediaInput:
    """A preprocessed video or image: patches in the family's order and its patch grid (an image's ``T`` is its
    tile count where its family tiles images, else 1)."""

    pixel_values: torch.Tensor  # (T*H*W, C*tp*p*p)
    grid_thw: tuple[int, int, int]  # patch grid (temporal patches, H patches, W patches)
    fps: float  # sampling rate of the frames the patches were made from
    frame_times: tuple[float, ...] = ()  # seconds of each sampled frame (timestamp layouts need them)
    kind: str = "video"  # "video" (pruned by EVS), "image" (grid T = 1, or its tiles) or "audio" (never pruned)
    pruning: Any = None  # a video's own models.pruning.VideoPruning (the request's choice); None: the engine's
    frame_indices: tuple[int, ...] = ()  # source index of each sampled frame (layouts that print them need them)
    source_fps: float = 0.0  # the source's frame rate as vLLM's loader reports it (0: unknown)
    # An audio item's feature frames per clip: ``pixel_values`` holds its clips' features one after another,
    # ``(sum of these, mels)``, and ``grid_thw`` is ``(clips, most frames, mels)``.
    clip_frames: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in ("video", "image", "audio"):
            raise ValueError(f"media kind must be 'video', 'image' or 'audio', got {self.kind!r}")
        if self.kind == "audio" and (not self.clip_frames or min(self.clip_frames) < 1):
            raise ValueError(f"an audio item has its clips' feature frames, got {self.clip_frames!r}")
        if self.kind == "image" and int(self.grid_thw[0]) < 1:
            raise ValueError(f"an image has one temporal patch or one per tile, got grid {tuple(self.grid_thw)}")


@dataclass(frozen=True)
class MediaLayout:
    """A video's prompt segment after encoding, described on its unpruned layout.

    ``unpruned_ids[keep]`` are the ids fed to the language graph; positions are computed on
    the unpruned ids with ``blocks`` and then restricted with ``keep``.
    """

    unpruned_ids: np.ndarray  # int64
    keep: np.ndarray  # bool, same length
    blocks: tuple[MediaBlock, ...]

    @property
    def ids(self) -> np.ndarray:
        return self.unpruned_ids[self.keep]


def audio_rows(features: AudioFeatures, clip_frames: Sequence[int]) -> int:
    """An audio item's rows: each clip's subsampled frames (vLLM's count), at least one."""
    return max(1, sum(subsampled_frames(int(f), features.kernel, features.stride, features.stages)
                      for f in clip_frames))


def item_grid(family: "ModelFamily", media: MediaInput) -> tuple[int, int, int]:
    """An item's rows as a merged grid ``(T, h, w)``: a video's or image's merged patch grid, an audio item's
    ``(1, 1, rows)`` (its rows are never pruned)."""
    if media.kind == "audio":
        return (1, 1, audio_rows(family.audio_features(), media.clip_frames))
    return family.merged_grid(media.grid_thw)


def image_layout(image_token_id: int, merged_grid: tuple[int, int, int]) -> MediaLayout:
    """An image is never pruned: h*w image pads, one M-RoPE block, everything kept."""
    _, h, w = merged_grid
    ids = np.full(h * w, image_token_id, dtype=np.int64)
    return MediaLayout(ids, np.ones(h * w, dtype=bool), (MediaBlock(1, h, w),))


class ModelFamily(Protocol):
    """What export, runtime, serving, the tiny test checkpoints and the bench need from a model family.

    Class attributes and class methods describe the family (``registry.register_family`` checks them);
    an instance, ``Family(config, tokenizer)``, adapts one checkpoint.
    """

    # ---- the family itself ------------------------------------------------------------------------
    model_type: ClassVar[str]  # transformers' model_type of its checkpoints; the family's name everywhere
    hf_architectures: ClassVar[tuple[str, ...]]  # Hugging Face's architecture names of its checkpoints
    serving_architecture: ClassVar[str]  # the name an export's config.json gives vLLM (our interface class)
    hf_processor: ClassVar[str]  # how transformers spells the family in the processor class names it mirrors
    config_class: ClassVar[type]  # transformers config class
    model_class: ClassVar[type]  # transformers ...ForConditionalGeneration class
    preprocessing: ClassVar[VideoPreprocessing]  # released checkpoints' video preprocessing
    token_strings: ClassVar[TokenStrings]
    config_paths: ClassVar[ConfigPaths]  # the config reader
    extra_rows: ClassVar[tuple[ExtraRows, ...]]  # tensors its vision rows carry (empty for most)
    pruning_methods: ClassVar[tuple[str, ...]]  # the pruning methods vLLM runs for it (an export carries only these)
    modalities: ClassVar[tuple[str, ...]]  # the media it serves ("video", "image"); another is refused per request
    rope: ClassVar[bool]  # whether its attention reads positions (RoPE tables); False: positions are KV slots only
    # How its checkpoints' tensor names (released, or save_pretrained's) become its module's state-dict names:
    # renames and per-expert tensors fused (``qeff_evs.weights.name_map``); an empty map where they are the same.
    weight_names: ClassVar[NameMap]

    @classmethod
    def tiny_tokenizer(cls):
        """The small tokenizer tests build in code: the family's special tokens and chat template."""

    @classmethod
    def tiny_config_kwargs(cls, tokenizer, text_layers: int, vision_layers: int) -> dict[str, Any]:
        """``config_class`` kwargs of a tiny random test model (ids from ``tokenizer``)."""

    @classmethod
    def prepare_tiny_model(cls, model, tokenizer) -> None:
        """Adjust a randomly initialised tiny model in place so greedy decoding behaves (no media tokens)."""

    @classmethod
    def tiny_generation_config(cls, tokenizer):
        """The ``GenerationConfig`` a tiny checkpoint is saved with."""

    @classmethod
    def tiny_preprocessor_config(cls, config) -> dict[str, Any]:
        """``preprocessor_config.json`` contents shaped like the released checkpoints' files."""

    @classmethod
    def realistic_config_kwargs(cls, text_layers: int, vision_layers: int) -> dict[str, Any]:
        """``config_class`` kwargs of a released checkpoint's widths with these depths (the bench's models)."""

    @classmethod
    def realistic_widths(cls, text_layers: int, vision_layers: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(text_config, vision_config)`` kwargs of a released checkpoint's widths with these depths."""

    # ---- one checkpoint's adapter -----------------------------------------------------------------
    name: str  # == model_type
    config: Any  # the checkpoint's transformers config
    normalized_config: NormalizedConfig
    extras: Mapping[str, int]  # this checkpoint's extra rows: ExtraRows.name -> levels

    def __init__(self, config, tokenizer=None) -> None: ...

    def special_tokens(self) -> SpecialTokens: ...

    def video_block_ids(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Ids before and after the video placeholder in the plain (template-less) prompt layout."""

    def prompt_target(self, modality: str) -> tuple[int, ...]:
        """The ids a prompt writes for one item of ``modality``, which the family's placeholder replaces (its pad
        where the pad stands for the item, as in Qwen's prompts; a longer text such as ``<video>`` elsewhere)."""

    def merged_grid(self, grid_thw: Sequence[int]) -> tuple[int, int, int]: ...

    def encoder(self, model: torch.nn.Module) -> torch.nn.Module:
        """Exportable encoder: F temporal patches + one frame's host inputs in, merged rows [+ extras] out."""

    def pruning_ranking(self, method: str) -> torch.nn.Module:
        """Exportable pruning graph of ``method`` (``models.pruning.PruningRanking``): a video's merged rows padded
        to a frame bucket [+ its extras as ``score_extras``] in, a ranking out."""

    def language_graph(self, model: torch.nn.Module, media_token_ids: Sequence[int] | None = None,
                       rope_positions: int | None = None, prefill_seq_len: int | None = None) -> torch.nn.Module:
        """The language step the language ONNX is traced from (``models.language.LanguageGraph`` or its like);
        ``prefill_seq_len``: the compiled prefill length, for a graph that unrolls its prefill per length."""

    def kv_layers(self) -> tuple[int, ...]:
        """Decoder layers with a KV cache (``past_key.{i}``/``past_value.{i}``): every layer for most families."""

    def layer_states(self) -> tuple[LayerState, ...]:
        """The per-row state the other layers keep in the language graph (a hybrid family's); empty for most."""

    def layer_kinds(self) -> tuple[str, ...]:
        """Each decoder layer's kind, e.g. ``full_attention`` / ``linear_attention``: a streamed export traces one
        layer per kind and stamps the others from its graph (``models.language_parts``). Layers whose parameters
        differ in name, shape or dtype, or that add different extra-row levels, are told apart without it; name here
        what the weights cannot tell (a computation chosen by the config alone)."""

    def image_tiling(self) -> ImageTiling | None:
        """How the checkpoint tiles images when they have a graph of their own; None where images go through the
        video encoder (one temporal patch, the image in each of its frames)."""

    def image_encoder(self, model: torch.nn.Module) -> torch.nn.Module:
        """Exportable image encoder (where ``image_tiling`` is set): F tiles + one tile's host inputs in, rows out,
        with the video encoder's interface."""

    def image_encoder_symbols(self, grid_hw: Sequence[int], frames: int) -> dict[str, int]:
        """Values of the image encoder's dynamic symbols for calls of ``frames`` tiles of grid ``(H, W)``."""

    def audio_features(self) -> AudioFeatures | None:
        """The checkpoint's audio feature settings; None where it serves no audio (a family without audio, or a
        checkpoint of an audio family without an audio config); ValueError naming why for an audio config that
        cannot be encoded."""

    def audio_encoder(self, model: torch.nn.Module) -> torch.nn.Module:
        """Exportable audio encoder (``audio_features`` set): one clip's padded features and mask in, rows out."""

    def encoder_host_inputs(self, grid_hw: Sequence[int], frames: int) -> dict[str, np.ndarray]:
        """Every encoder input except ``pixel_values``, for calls of ``frames`` patches of grid ``(H, W)``."""

    def encoder_symbols(self, grid_hw: Sequence[int], frames: int) -> dict[str, int]:
        """Values of the encoder graph's dynamic symbols for one (frame grid, F) specialization."""

    def pruning_symbols(self, grid_hw: Sequence[int], bucket: int) -> dict[str, int]:
        """Values of the pruning graphs' dynamic symbols for one (frame grid, bucket of temporal patches)."""

    def placeholder_ids(self, video: MediaInput, kept: int) -> np.ndarray:
        """The video's prompt segment before encoding (only K known). Same length as after."""

    def video_layout(self, video: MediaInput, kept_indices: np.ndarray) -> MediaLayout:
        """The video's real segment once the encoder has chosen the kept tokens."""

    def hf_video_inputs(self, input_ids: torch.Tensor, video: MediaInput) -> dict[str, torch.Tensor]:
        """transformers' own ``generate`` keyword arguments for ``input_ids (1, N)`` holding ``video``'s unpruned
        pads (pixels, grid, token types, and what the family's rope index reads): the baseline a user without a
        card would run on the same checkpoint and clip."""
