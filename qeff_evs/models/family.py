"""The part of a model-family adapter Qwen2.5-VL and Qwen3-VL share.

Token ids come from the checkpoint's config; images are never pruned (``image_layout``); the
encoder wrapper and its per-frame host inputs come from the family module, the EVS graph is shared.
A subclass only says how a video is laid out in the prompt, before (``video_placeholder``) and after (``real_video_layout``) encoding.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

import numpy as np
import torch.nn as nn

from qeff_evs import evs
from qeff_evs.manifest import SpecialTokens
from qeff_evs.models.protocol import MediaInput, MediaLayout, image_layout
from qeff_evs.models.vision_common import EncoderWrapper, EVSSelection, encoder_host_inputs, evs_symbols


class QwenVLFamily(abc.ABC):
    name = "qwen-vl"
    deepstack_levels = 0
    wrapper: type[EncoderWrapper] = EncoderWrapper

    def __init__(self, config, tokenizer=None) -> None:
        self.config = config
        self.vision_config = config.vision_config
        self.merge_size = int(self.vision_config.spatial_merge_size)
        self.tokenizer = tokenizer

    def special_tokens(self) -> SpecialTokens:
        c = self.config
        eos = getattr(c.text_config, "eos_token_id", None)
        eos = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
        return SpecialTokens(c.image_token_id, c.video_token_id, c.vision_start_token_id, c.vision_end_token_id, eos)

    def merged_grid(self, grid_thw: Sequence[int]) -> tuple[int, int, int]:
        return evs.merged_grid(grid_thw, self.merge_size)

    def encoder(self, model: nn.Module) -> EncoderWrapper:
        return self.wrapper.from_model(model)

    def evs_selection(self) -> EVSSelection:
        return EVSSelection(deepstack=self.deepstack_levels > 0)

    def encoder_host_inputs(self, grid_hw: Sequence[int], frames: int) -> dict[str, np.ndarray]:
        return encoder_host_inputs(self.vision_config, self.wrapper.frame_inputs_fn, grid_hw, frames)

    def encoder_symbols(self, grid_hw: Sequence[int], frames: int) -> dict[str, int]:
        return self.wrapper.symbols_fn(self.vision_config, grid_hw, frames)

    def evs_symbols(self, grid_thw: Sequence[int], retained: int) -> dict[str, int]:
        return evs_symbols(self.merged_grid(grid_thw), retained)

    def placeholder_ids(self, media: MediaInput, retained: int) -> np.ndarray:
        if media.kind == "image":
            return image_layout(self.config.image_token_id, self.merged_grid(media.grid_thw)).ids
        return self.video_placeholder(media, retained)

    def video_layout(self, media: MediaInput, retained_indices: np.ndarray) -> MediaLayout:
        if media.kind == "image":
            return image_layout(self.config.image_token_id, self.merged_grid(media.grid_thw))
        return self.real_video_layout(media, retained_indices)

    def kept_mask(self, video: MediaInput, retained_indices: np.ndarray) -> np.ndarray:
        """Raster-order mask over the video's merged tokens."""
        t, h, w = self.merged_grid(video.grid_thw)
        keep = np.zeros(t * h * w, dtype=bool)
        keep[np.asarray(retained_indices, dtype=np.int64)] = True
        return keep

    @abc.abstractmethod
    def video_placeholder(self, video: MediaInput, retained: int) -> np.ndarray:
        """The video's prompt segment before encoding; the same length as the real one."""

    @abc.abstractmethod
    def real_video_layout(self, video: MediaInput, retained_indices: np.ndarray) -> MediaLayout:
        """The video's real segment once the encoder has chosen the retained tokens."""
