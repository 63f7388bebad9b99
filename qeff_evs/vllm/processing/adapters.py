"""Adapters between vLLM's multimodal types and what qeff-evs's language graph needs.

vLLM describes a media item of a request with ``MultiModalFeatureSpec`` (``identifier`` = the
encoder-cache key, ``mm_position`` = a ``PlaceholderRange(offset, length, is_embed)``). From those
this module gives:

* the window of a prefill chunk: which rows of which cached encoder output it consumes, and the
  ``(1, user_vision_size, hidden)`` zero-padded window with ``image_idx = 0`` the language graph
  takes (docs/design.md#the-runtime);
* the placeholder a vLLM processor must reserve for an EVS video before the encoder runs: the
  family's own provisional layout (Qwen2.5-VL: K pads; Qwen3-VL: the lumped layout,
  ``L = sum_f(len(ts_f) + 2) + K``);
* converters between ``PlaceholderRange`` and ``qeff_evs.runtime.engine.window.Placeholder``, and
  ``MediaPlacement`` s for ``qeff_evs.runtime.engine.scheduler``.

vLLM objects are only read through their attributes; vLLM is imported only to build a
``PlaceholderRange``. Difference from vLLM's own Qwen3-VL EVS processor: vLLM marks every position
of the lumped placeholder as an embedding row (``is_embed=None``) because its encoder returns
vocabulary rows for the timestamps too; our language graph embeds that text itself, so our
reservation marks only the video pads (``num_embeds = K``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from qeff_evs.models.protocol import MediaInput, ModelFamily
from qeff_evs.models.pruning import VideoPruning
from qeff_evs.runtime.engine.executor import kept_count
from qeff_evs.runtime.engine.scheduler import MediaPlacement
from qeff_evs.runtime.engine.steps import VisionWindow, gather_window
from qeff_evs.runtime.engine.window import Placeholder, WindowSlice, window_slices

# --- placeholder conversion -------------------------------------------------------------------


def to_placeholder(placeholder_range: Any) -> Placeholder:
    """Our ``Placeholder`` from a vLLM ``PlaceholderRange`` (``is_embed`` tensor -> bool array)."""
    mask = placeholder_range.is_embed
    if mask is not None:
        mask = np.asarray(mask.detach().cpu().numpy() if hasattr(mask, "detach") else mask, dtype=bool)
    return Placeholder(int(placeholder_range.offset), int(placeholder_range.length), mask)


def to_placeholder_range(placeholder: Placeholder):
    """vLLM's ``PlaceholderRange`` for our ``Placeholder`` (needs vLLM installed)."""
    try:
        import torch
        from qeff_evs.vllm.surface import PlaceholderRange
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ValueError(
            "building a vLLM PlaceholderRange needs vLLM; install it with `pip install --no-deps vllm==0.32.0` "
            f"plus the 'vllm' extra: bash scripts/install.sh --vllm ({error})") from error
    mask = None if placeholder.is_embed is None else torch.from_numpy(placeholder.is_embed.copy())
    return PlaceholderRange(offset=placeholder.offset, length=placeholder.length, is_embed=mask)


def feature_placeholders(features: Sequence[Any]) -> list[Placeholder]:
    return [to_placeholder(f.mm_position) for f in features]


def media_items(features: Sequence[Any]) -> tuple[MediaPlacement, ...]:
    """Scheduler media items (keyed by the feature's encoder-cache ``identifier``)."""
    return tuple(MediaPlacement(str(f.identifier), to_placeholder(f.mm_position)) for f in features)


# --- the window of one prefill chunk ---------------------------------------------------------------


def feature_window_slices(features: Sequence[Any], computed: int, scheduled: int) -> list[WindowSlice]:
    """Rows of each feature's cached encoder output that chunk ``[computed, computed+scheduled)`` uses.

    ``WindowSlice.item`` indexes ``features``; slices come in prompt order.
    """
    return window_slices(feature_placeholders(features), computed, scheduled)


@dataclass(frozen=True)
class FeatureRows:
    """One cached vLLM encoder output as host arrays."""

    rows: np.ndarray  # (rows, hidden)
    extras: Mapping[str, np.ndarray]  # the family's extra rows by name, (levels, rows, hidden)


def gather_feature_window(features: Sequence[Any], encoder_outputs: Mapping[str, Any], computed: int,
                          scheduled: int, user_vision_size: int, hidden: int,
                          extras: Mapping[str, int] | None = None,
                          extra_outputs: Mapping[str, Mapping[str, Any]] | None = None) -> VisionWindow:
    """The chunk's vision rows (``gather_window``) from vLLM features and encoder outputs by identifier.

    ``encoder_outputs[identifier]`` is an item's ``(rows, hidden)`` output; for each of the family's
    extra rows (``extras``: name -> levels), ``extra_outputs[name][identifier]`` holds its
    ``(levels, rows, hidden)`` rows.
    """
    extra_outputs = extra_outputs or {}
    outputs = {key: FeatureRows(_as_array(value), {name: _as_array(by_key[key])
                                                   for name, by_key in extra_outputs.items() if key in by_key})
               for key, value in encoder_outputs.items()}
    return gather_window(feature_placeholders(features), [str(f.identifier) for f in features], outputs,
                         computed, scheduled, user_vision_size, hidden, extras)


def _as_array(value: Any) -> np.ndarray:
    if hasattr(value, "detach"):  # torch tensor
        return value.detach().cpu().numpy()
    return np.asarray(value)


# --- placeholders a vLLM processor reserves for an EVS video ---------------------------------------


@dataclass(frozen=True)
class EvsReservation:
    """A video's placeholder, sized before the encoder runs (only K is known then)."""

    length: int  # prompt positions the placeholder spans
    num_video_rows: int  # K: encoder rows our language graph merges at the video pads
    is_embed: np.ndarray | None  # pad positions of the provisional layout; None = every position

    def placeholder(self, offset: int) -> Placeholder:
        return Placeholder(offset, self.length, self.is_embed)

    def placeholder_range(self, offset: int):
        return to_placeholder_range(self.placeholder(offset))


def evs_reservation(family: ModelFamily, media: MediaInput, pruning: VideoPruning) -> EvsReservation:
    """The family's own provisional placeholder (the one our engine puts in the prompt), sized by K.

    E.g. Qwen2.5-VL: K video pads; Qwen3-VL: the lumped layout ``[K, 0, ..., 0]``, ``L = sum_f(len(ts_f) + 2) + K``,
    whose length is the real layout's too, whatever split EVS picks; only its pads are embedding rows.
    """
    k = kept_count(family, media, pruning)
    ids = family.placeholder_ids(media, k)
    placeholder = Placeholder.of_ids(0, ids, family.special_tokens().media_pads)
    return EvsReservation(placeholder.length, k, placeholder.is_embed)
