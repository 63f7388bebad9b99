"""What an export's language graph is, as the manifest records it: its special token ids (``SpecialTokens``), each
retained layer state (``LayerState``) and the graph's shape (``LanguageShape``: widths, KV layers, context and
vision window, compute context lengths)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

@dataclass(frozen=True)
class SpecialTokens:
    """The ids the host and the language graph look for; ``eos`` also holds generation_config.json's.

    The field names are manifest.json's keys; code outside the family reads ``media_pads``,
    ``media_pad(modality)`` and ``ids``.
    """

    image_pad: int
    video_pad: int
    vision_start: int
    vision_end: int
    eos: tuple[int, ...] = field(default=())
    audio_pad: int | None = None  # a family with audio (Nemotron-H Omni's <so_embedding>); absent before audio

    @property
    def media_pads(self) -> tuple[int, ...]:
        return (self.image_pad, self.video_pad) + (() if self.audio_pad is None else (self.audio_pad,))

    def media_pad(self, modality: str) -> int:
        """The pad id the language graph merges an item of ``modality`` ("image", "video", "audio") at."""
        if modality == "audio" and self.audio_pad is not None:
            return self.audio_pad
        if modality not in ("image", "video"):
            raise ValueError(f"this export takes images and videos, not {modality!r}")
        return self.image_pad if modality == "image" else self.video_pad

    @property
    def ids(self) -> tuple[int, ...]:
        """Every special id: the pads, the markers around media, the stop ids."""
        audio = () if self.audio_pad is None else (self.audio_pad,)
        return (self.image_pad, self.video_pad, *audio, self.vision_start, self.vision_end, *self.eos)


# Device precisions a retained state can declare (``LayerState.precision``): fp16 as the rest of the graph
# on the card, or fp32 (the state and the ops it flows through kept in fp32 by a node-precision file).
STATE_PRECISIONS = ("float16", "float32")


@dataclass(frozen=True)
class LayerState:
    """Retained state some decoder layers keep per request row in place of a KV cache (a linear-attention
    layer's convolution or recurrent state), as the language graph declares it.

    Layer ``i`` of ``layers`` has graph input ``{name}.{i}`` of shape ``(rows, *row_shape)`` and the
    output ``{name}.{i}_RetainedState``; ``rows`` is the KV rows (``full_batch_size``, or the batch).
    ``precision`` is its device type on an fp16 card (``STATE_PRECISIONS``).
    """

    name: str
    layers: tuple[int, ...]
    row_shape: tuple[int, ...]
    precision: str = "float16"

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(int(i) for i in self.layers))
        object.__setattr__(self, "row_shape", tuple(int(d) for d in self.row_shape))
        if self.precision not in STATE_PRECISIONS:
            raise ValueError(f"state {self.name!r} declares precision {self.precision!r}; expected one of "
                             f"{STATE_PRECISIONS}")

    def input_name(self, layer: int) -> str:
        return f"{self.name}.{layer}"

    @property
    def input_names(self) -> list[str]:
        return [self.input_name(i) for i in self.layers]

    def row_bytes(self, itemsize: int | None = None) -> int:
        """Bytes of one request row over all its layers, at ``itemsize`` (default: its device precision)."""
        size = itemsize if itemsize is not None else (2 if self.precision == "float16" else 4)
        return len(self.layers) * math.prod(self.row_shape) * size

    @classmethod
    def from_json(cls, raw: dict) -> "LayerState":
        return cls(raw["name"], tuple(raw["layers"]), tuple(raw["row_shape"]), raw.get("precision", "float16"))


@dataclass(frozen=True)
class LanguageShape:
    """Static facts of a compiled/exported language graph the host must honour."""

    num_layers: int
    kv_heads: int
    head_dim: int
    hidden: int
    ctx_len: int
    vision_size: int  # user_vision_size
    # The family's extra rows beside vision_embeds (qeff_evs.models.protocol.ExtraRows): name -> levels.
    extras: dict[str, int] = field(default_factory=dict)
    full_batch_size: int = 1  # KV cache rows; > 1 needs a graph exported with continuous batching
    decode_batch_size: int | None = None  # rows per decode call (the Decode specialization); None: full_batch_size
    vocab: int | None = None
    continuous_batching: bool = False  # the graph has a batch_index input (export --full-batch-size)
    rope_positions: int | None = None  # rows of the RoPE cos/sin tables: positions [0, rope_positions)
    # Decoder layers with a KV cache (``past_key.{i}``/``past_value.{i}``); None: every layer.
    kv_layers: tuple[int, ...] | None = None
    layer_states: tuple[LayerState, ...] = ()  # per-row state of the other layers (e.g. linear attention)
    # The lengths of a prefill call the export has specializations for (``Prefill<n>``, ``Prefill``), ascending, the
    # last prefill_seq_len; a call of one token is decode's. Filled by the Manifest from its prefill_seq_len and
    # short_prefill_lens (never written under language_shape). Empty: a shape made by hand, not read from an
    # export; its sessions run any length the graph file takes.
    prefill_lens: tuple[int, ...] = ()
    # Compute context lengths (docs/design.md#specializations), ascending, the last ctx_len: a call reads only the first
    # comp_ctx_len slots of its KV row. Empty: the graph has no comp_ctx_lengths input and every call reads
    # ctx_len (exports without a ladder, and every export written before it; their manifests lack the key).
    comp_ctx_lengths: tuple[int, ...] = ()
    # The graph takes logits_rows: a call whose logits nobody reads (a prefill chunk before the prompt's last) may
    # compute none. False: exports written before it (their manifests lack the key); every call computes one row.
    logits_rows: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "comp_ctx_lengths", tuple(int(n) for n in self.comp_ctx_lengths))
        if self.comp_ctx_lengths and self.comp_ctx_lengths[-1] != self.ctx_len:
            raise ValueError(f"compute context lengths {list(self.comp_ctx_lengths)} must end at ctx_len "
                             f"{self.ctx_len}; re-export this folder")
        if self.kv_layers is not None:
            object.__setattr__(self, "kv_layers", tuple(int(i) for i in self.kv_layers))
        object.__setattr__(self, "prefill_lens", tuple(sorted(int(n) for n in self.prefill_lens)))
        object.__setattr__(self, "layer_states", tuple(
            s if isinstance(s, LayerState) else LayerState.from_json(s) for s in self.layer_states))
        if self.full_batch_size < 1:
            raise ValueError(f"full_batch_size must be >= 1, got {self.full_batch_size}")
        decode = self.decode_rows
        if not 1 <= decode <= self.full_batch_size:
            raise ValueError(
                f"decode_batch_size={decode} must lie in [1, full_batch_size={self.full_batch_size}]: "
                "a decode call's rows need distinct KV cache rows"
            )

    @property
    def decode_rows(self) -> int:
        return self.full_batch_size if self.decode_batch_size is None else self.decode_batch_size

    @property
    def kv_layer_indices(self) -> tuple[int, ...]:
        return tuple(range(self.num_layers)) if self.kv_layers is None else self.kv_layers

    def comp_ctx_len(self, last_slot: int) -> int | None:
        """The compute context length a call whose largest KV slot is ``last_slot`` runs in: the smallest of
        ``comp_ctx_lengths`` holding it (None: the graph has no such input and reads all of ``ctx_len``)."""
        if not self.comp_ctx_lengths:
            return None
        if not 0 <= last_slot < self.ctx_len:
            raise ValueError(f"KV slot {last_slot} lies outside [0, ctx_len={self.ctx_len}); a request must fit "
                             "the export's context")
        return next(n for n in self.comp_ctx_lengths if n > last_slot)

    def kv_row_bytes(self, itemsize: int = 2) -> int:
        """Bytes of one request row's KV cache (keys and values of every KV layer over ``ctx_len``)."""
        return 2 * len(self.kv_layer_indices) * self.kv_heads * self.ctx_len * self.head_dim * itemsize

    def state_row_bytes(self) -> int:
        """Bytes of one request row's other retained state, each at its device precision."""
        return sum(state.row_bytes() for state in self.layer_states)
