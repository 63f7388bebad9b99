"""What the Qwen-VL families (Qwen2.5-VL, Qwen3-VL) share: Qwen's media tokens, config names, tiny checkpoints.

``QwenVLFamily`` is the base of their ``ModelFamily`` classes: token ids come from the checkpoint's
config; images are never pruned (``image_layout``); the encoder wrapper and its per-frame host inputs
come from the family module, the EVS graph is shared. A subclass declares its names and classes and
says how a video is laid out in the prompt, before (``video_placeholder``) and after
(``real_video_layout``) encoding. The tiny test tokenizer is Qwen's special tokens and chat template
on a small byte-level BPE (``tiny.train_tokenizer``).
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn as nn

from qeff_evs import evs
from qeff_evs.manifest import LayerState, SpecialTokens
from qeff_evs.models.language import LanguageGraph
from qeff_evs.models.protocol import (
    ConfigPaths,
    ExtraRows,
    MediaInput,
    MediaLayout,
    NormalizedConfig,
    TokenStrings,
    image_layout,
)
from qeff_evs.models.pruning import PRUNING_METHODS, PruningRanking, pruning_symbols
from qeff_evs.models.vision_common import EncoderWrapper, encoder_host_inputs
from qeff_evs.weights.name_map import NameMap

# Qwen's added special tokens, in Qwen's relative order; in the tiny tokenizer they take the ids after
# the BPE vocabulary.
ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END, VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)

QWEN_TOKENS = TokenStrings(image=IMAGE_PAD, video=VIDEO_PAD, image_block=VISION_START + IMAGE_PAD + VISION_END,
                           video_block=VISION_START + VIDEO_PAD + VISION_END)

# Qwen-style chat template: <|im_start|>role\n...<|im_end|>\n per message; content lists render
# video and image items as one vision block each (the runtime expands the pad token later).
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- else -%}"
    "{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'video' -%}"
    "{{- '" + QWEN_TOKENS.video_block + "' -}}"
    "{%- elif item['type'] == 'image' -%}"
    "{{- '" + QWEN_TOKENS.image_block + "' -}}"
    "{%- elif item['type'] == 'text' -%}"
    "{{- item['text'] -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)

# Where both Qwen-VL configs keep what the pipeline reads.
QWEN_VL_CONFIG_PATHS = ConfigPaths(
    patch_size="vision_config.patch_size", temporal_patch_size="vision_config.temporal_patch_size",
    merge_size="vision_config.spatial_merge_size", vision_hidden="vision_config.out_hidden_size",
    num_layers="text_config.num_hidden_layers", hidden_size="text_config.hidden_size",
    vocab_size="text_config.vocab_size", kv_heads="text_config.num_key_value_heads",
    head_dim="text_config.head_dim", heads="text_config.num_attention_heads",
    max_positions="text_config.max_position_embeddings",
    image_token_id="image_token_id", video_token_id="video_token_id",
)

# Weight std for the random init of tiny test models. The HF default (0.02) gives nearly flat logits,
# so greedy decoding repeats one token and top-2 gaps sit near float noise; 0.3 spreads logits (std ~2)
# so greedy tokens vary and ORT-vs-PyTorch argmax parity is not decided by rounding.
INITIALIZER_RANGE = 0.3

MEDIA_IDS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")


def _token_id(tokenizer, token: str) -> int:
    token_id = tokenizer.convert_tokens_to_ids(token)
    # Qwen3.5's tokenizer class names <|endoftext|> its unk token: that token is there, not unknown.
    if token_id is None or (token_id == tokenizer.unk_token_id and token != tokenizer.unk_token):
        raise ValueError(f"tokenizer has no {token!r} token; build it with tiny.build_tokenizer()")
    return int(token_id)


def special_token_ids(tokenizer) -> dict[str, int]:
    """The ids a Qwen-VL config needs, read from the tokenizer (never hard-coded)."""
    return {
        "image_token_id": _token_id(tokenizer, IMAGE_PAD),
        "video_token_id": _token_id(tokenizer, VIDEO_PAD),
        "vision_start_token_id": _token_id(tokenizer, VISION_START),
        "vision_end_token_id": _token_id(tokenizer, VISION_END),
        "bos_token_id": _token_id(tokenizer, ENDOFTEXT),
        "eos_token_id": _token_id(tokenizer, IM_END),
        "pad_token_id": _token_id(tokenizer, ENDOFTEXT),
    }


class QwenVLFamily(abc.ABC):
    """The Qwen-VL ``ModelFamily`` base; subclasses declare the family and its video layout."""

    # Declared by each family (ModelFamily's class attributes).
    model_type: ClassVar[str] = ""
    hf_architectures: ClassVar[tuple[str, ...]] = ()
    serving_architecture: ClassVar[str] = ""
    hf_processor: ClassVar[str] = ""
    config_class: ClassVar[type | None] = None
    model_class: ClassVar[type | None] = None
    preprocessing = None
    token_strings: ClassVar[TokenStrings] = QWEN_TOKENS
    config_paths: ClassVar[ConfigPaths] = QWEN_VL_CONFIG_PATHS
    extra_rows: ClassVar[tuple[ExtraRows, ...]] = ()
    pruning_methods: ClassVar[tuple[str, ...]] = PRUNING_METHODS
    modalities: ClassVar[tuple[str, ...]] = ("video", "image")
    rope: ClassVar[bool] = True
    weight_names: ClassVar[NameMap] = NameMap()  # released names are the module's (Qwen3-VL, Qwen3.5)
    wrapper: ClassVar[type[EncoderWrapper]] = EncoderWrapper
    language_graph_class: ClassVar[type[LanguageGraph]] = LanguageGraph  # the step ``language_graph`` builds

    def __init__(self, config, tokenizer=None) -> None:
        self.config = config
        self.vision_config = config.vision_config
        self.merge_size = int(self.vision_config.spatial_merge_size)
        self.tokenizer = tokenizer
        self.name = self.model_type
        self.extras: dict[str, int] = {}

    @property
    def normalized_config(self) -> NormalizedConfig:
        return self.config_paths.read(self.config)

    # ---- tiny test checkpoints and realistic bench configs ----------------------------------------

    @classmethod
    def tiny_tokenizer(cls):
        from qeff_evs.models.tiny import train_tokenizer

        # eos/pad named after the special tokens are added, so the ids follow Qwen's order.
        return train_tokenizer(SPECIAL_TOKENS, eos_token=IM_END, pad_token=ENDOFTEXT, chat_template=CHAT_TEMPLATE)

    @classmethod
    def tiny_config_kwargs(cls, tokenizer, text_layers: int = 2, vision_layers: int = 2) -> dict[str, Any]:
        ids = special_token_ids(tokenizer)
        text = dict(
            vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=text_layers,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
            initializer_range=INITIALIZER_RANGE,
            **{k: ids[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")},
        )
        vision = dict(
            depth=vision_layers, hidden_size=64, intermediate_size=128, num_heads=4, out_hidden_size=64,
            spatial_merge_size=2, temporal_patch_size=2, in_channels=3, initializer_range=INITIALIZER_RANGE,
        )
        cls.tiny_widths(text, vision, vision_layers)
        return dict(text_config=text, vision_config=vision, **{k: ids[k] for k in MEDIA_IDS})

    @classmethod
    @abc.abstractmethod
    def tiny_widths(cls, text: dict[str, Any], vision: dict[str, Any], vision_layers: int) -> None:
        """Add the family's own tiny text/vision config fields to ``text`` and ``vision`` in place."""

    @classmethod
    def prepare_tiny_model(cls, model, tokenizer) -> None:
        """Zero the output rows of the vision placeholder/marker tokens.

        A trained model never generates them; a random one does, and a generated <|video_pad|> fed back
        would be taken for a media placeholder. With the other logits spread (std ~2), a logit of exactly 0
        never wins greedy decoding. (With tied embeddings this also zeros their input rows, harmless:
        pad rows are replaced by vision embeddings.)
        """
        ids = special_token_ids(tokenizer)
        media = [ids[k] for k in MEDIA_IDS]
        with torch.no_grad():
            model.get_output_embeddings().weight[media] = 0.0

    @classmethod
    def tiny_generation_config(cls, tokenizer):
        """Greedy decoding that stops at <|im_end|> or <|endoftext|>, as the released instruct checkpoints do."""
        from transformers import GenerationConfig

        ids = special_token_ids(tokenizer)
        return GenerationConfig(bos_token_id=ids["bos_token_id"],
                                eos_token_id=[ids["eos_token_id"], ids["bos_token_id"]],
                                pad_token_id=ids["pad_token_id"], do_sample=False)

    @classmethod
    def tiny_preprocessor_config(cls, config) -> dict[str, Any]:
        vision = config.vision_config
        return {
            "patch_size": vision.patch_size,
            "temporal_patch_size": vision.temporal_patch_size,
            "merge_size": vision.spatial_merge_size,
            "do_resize": True,
            "do_rescale": True,
            "rescale_factor": 1 / 255,
            "do_normalize": True,
            "do_convert_rgb": True,
            "image_mean": list(cls.preprocessing.image_mean),
            "image_std": list(cls.preprocessing.image_std),
            **cls.released_pixel_limits(),
            "image_processor_type": "Qwen2VLImageProcessor",
        }

    @classmethod
    @abc.abstractmethod
    def released_pixel_limits(cls) -> dict[str, Any]:
        """The pixel-limit keys of the released checkpoints' ``preprocessor_config.json``."""

    @classmethod
    def realistic_config_kwargs(cls, text_layers: int = 2, vision_layers: int = 2) -> dict[str, Any]:
        """Released widths; the special ids are the tiny tokenizer's, which the bench's checkpoints are saved with (a
        runtime that finds the media tokens by their text, as OpenVINO GenAI does, must find them at the config's ids;
        the released ids, 151652-151656, are past that tokenizer's end)."""
        text, vision = cls.realistic_widths(text_layers, vision_layers)
        ids = special_token_ids(cls.tiny_tokenizer())
        return dict(text_config={**text, "bos_token_id": ids["bos_token_id"], "eos_token_id": ids["eos_token_id"]},
                    vision_config=vision, tie_word_embeddings=True, **{k: ids[k] for k in MEDIA_IDS})

    @classmethod
    @abc.abstractmethod
    def realistic_widths(cls, text_layers: int, vision_layers: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(text_config, vision_config)`` kwargs: a released checkpoint's widths at these depths."""

    # ---- one checkpoint ----------------------------------------------------------------------------

    def special_tokens(self) -> SpecialTokens:
        c = self.config
        eos = getattr(c.text_config, "eos_token_id", None)
        eos = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
        return SpecialTokens(c.image_token_id, c.video_token_id, c.vision_start_token_id, c.vision_end_token_id, eos)

    def video_block_ids(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return (int(self.config.vision_start_token_id),), (int(self.config.vision_end_token_id),)

    def prompt_target(self, modality: str) -> tuple[int, ...]:
        return (self.special_tokens().media_pad(modality),)

    def merged_grid(self, grid_thw: Sequence[int]) -> tuple[int, int, int]:
        return evs.merged_grid(grid_thw, self.merge_size)

    def encoder(self, model: nn.Module) -> EncoderWrapper:
        return self.wrapper.from_model(model)

    def pruning_ranking(self, method: str) -> PruningRanking:
        return PruningRanking(method, score_levels=sum(self.extras.get(rows.name, 0) for rows in self.extra_rows))

    def language_graph(self, model: nn.Module, media_token_ids: Sequence[int] | None = None,
                       rope_positions: int | None = None, prefill_seq_len: int | None = None) -> LanguageGraph:
        return self.language_graph_class(model, media_token_ids, rope_positions)

    def kv_layers(self) -> tuple[int, ...]:
        return tuple(range(self.normalized_config.num_layers))

    def layer_states(self) -> tuple[LayerState, ...]:
        return ()

    def layer_kinds(self) -> tuple[str, ...]:
        return ("decoder",) * self.normalized_config.num_layers

    def image_tiling(self) -> None:
        return None  # an image is one temporal patch through the video encoder

    def image_encoder(self, model: nn.Module) -> None:
        return None

    def image_encoder_symbols(self, grid_hw: Sequence[int], frames: int) -> dict[str, int]:
        raise ValueError(f"{self.name} encodes images with its video encoder; it has no image encoder graph")

    def audio_features(self) -> None:
        return None  # no audio tower

    def audio_encoder(self, model: nn.Module) -> None:
        return None

    def encoder_host_inputs(self, grid_hw: Sequence[int], frames: int) -> dict[str, np.ndarray]:
        return encoder_host_inputs(self.vision_config, self.wrapper.frame_inputs_fn, grid_hw, frames)

    def encoder_symbols(self, grid_hw: Sequence[int], frames: int) -> dict[str, int]:
        return self.wrapper.symbols_fn(self.vision_config, grid_hw, frames)

    def pruning_symbols(self, grid_hw: Sequence[int], bucket: int) -> dict[str, int]:
        _, h, w = self.merged_grid((1, *grid_hw))
        return pruning_symbols(h * w, bucket)

    def placeholder_ids(self, media: MediaInput, kept: int) -> np.ndarray:
        if media.kind == "image":
            return image_layout(self.config.image_token_id, self.merged_grid(media.grid_thw)).ids
        return self.video_placeholder(media, kept)

    def video_layout(self, media: MediaInput, kept_indices: np.ndarray) -> MediaLayout:
        if media.kind == "image":
            return image_layout(self.config.image_token_id, self.merged_grid(media.grid_thw))
        return self.real_video_layout(media, kept_indices)

    def hf_video_inputs(self, input_ids: torch.Tensor, video: MediaInput) -> dict[str, torch.Tensor]:
        # transformers 5's mm_token_type_ids: 2 on video pads, 0 elsewhere.
        return {"pixel_values_videos": torch.as_tensor(video.pixel_values),
                "video_grid_thw": torch.tensor([list(video.grid_thw)]),
                "mm_token_type_ids": (input_ids == int(self.config.video_token_id)).to(torch.int32) * 2}

    def kept_mask(self, video: MediaInput, kept_indices: np.ndarray) -> np.ndarray:
        """Raster-order mask over the video's merged tokens."""
        t, h, w = self.merged_grid(video.grid_thw)
        keep = np.zeros(t * h * w, dtype=bool)
        keep[np.asarray(kept_indices, dtype=np.int64)] = True
        return keep

    @abc.abstractmethod
    def video_placeholder(self, video: MediaInput, kept: int) -> np.ndarray:
        """The video's prompt segment before encoding; the same length as the real one."""

    @abc.abstractmethod
    def real_video_layout(self, video: MediaInput, kept_indices: np.ndarray) -> MediaLayout:
        """The video's real segment once the encoder has chosen the kept tokens."""
