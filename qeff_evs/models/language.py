"""The language-model step both backends run: merge vision rows, attend over a slot KV cache, emit logits.

One step takes a chunk of ``seq_len`` tokens (a prefill chunk, or one decode token per row) and:

1. embeds ``input_ids`` and, in a prefill chunk, replaces every media token (image pad or video pad)
   with a row of ``vision_embeds``: the k-th media token of the chunk takes row ``image_idx + k``. A
   decode step (seq_len 1) embeds every token as text, as QEfficient and Hugging Face do;
2. runs the transformers decoder layers with rows 1..3 of ``position_ids`` as M-RoPE positions (cos/sin
   looked up in fp32 tables, ``qeff_evs.models.rope``) and row 0 as KV-cache slots
   (``qeff_evs.models.kv_cache``); a family's extra rows (``ExtraRows``), gathered with the same
   indices, add their level ``i`` to the media tokens after decoder layer ``i``;
3. returns the logits of each row's last valid token, ``image_idx`` advanced by the chunk's media
   tokens, and the updated caches.

With ``batch_index`` (continuous batching, QEfficient's ``full_batch_size`` mode) the caches hold
``full_batch_size`` requests and batch row ``b`` reads and writes cache row ``batch_index[b, 0]``;
the rows no batch row names come back unchanged (``qeff_evs.models.kv_cache.SlotKVCache``).

A hybrid family (``LanguageSpec.kv_layers`` / ``layer_states``) caches keys and values only in some
layers and keeps other per-row state in the rest; its graph (a ``LanguageGraph`` subclass in the
family's module) runs those layers in ``decoder_layer``, reading and writing ``LayerStep.states``.

The module drives the family's own transformers submodules (embedding, decoder layers, norm,
lm_head; the rotary embedding only to fill the tables) directly, so every family with a standard decoder shares
it, no class is swapped, and no boolean indexing (which would export as NonZero) is involved. What the family
is (its config's names, its extra rows) comes from the family registry by the config's ``model_type``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from collections.abc import Mapping
from typing import NamedTuple, Sequence

import numpy as np

import torch
from torch import nn

from qeff_evs.manifest import LayerState
from qeff_evs.models.graph_io import BATCH_INDEX, COMP_CTX_LENGTHS, LOGITS_ROWS, LanguageGraphIO, check_batch_index
from qeff_evs.models.kv_cache import CacheAddressing, SlotKVCache, cache_addressing, cache_slots, slot_attention_mask
from qeff_evs.models.registry import family_for_config
from qeff_evs.models.rope import RopeTable


@dataclass(frozen=True)
class LanguageSpec:
    """Shapes and ids of a model's language graph, read from its transformers config."""

    num_layers: int
    hidden_size: int
    vocab_size: int
    kv_heads: int
    head_dim: int
    media_token_ids: tuple[int, ...]  # image pad, video pad
    extras: dict[str, int]  # the family's extra rows: name -> levels (empty for most families)
    max_positions: int  # config.max_position_embeddings: the default RoPE table length
    kv_layers: tuple[int, ...] = ()  # decoder layers with a KV cache (every layer for most families)
    layer_states: tuple[LayerState, ...] = ()  # the other layers' per-row state (a hybrid family's)
    layer_kinds: tuple[str, ...] = ()  # each decoder layer's kind, as the family names it (ModelFamily.layer_kinds)

    @property
    def io_kv_layers(self) -> tuple[int, ...] | None:
        """``kv_layers`` as ``LanguageGraphIO`` / ``LanguageShape`` take it: None when every layer has one."""
        return None if self.kv_layers == tuple(range(self.num_layers)) else self.kv_layers


def language_spec(hf_model: nn.Module) -> LanguageSpec:
    """Read the language-graph spec of a registered family's ``...ForConditionalGeneration`` model."""
    family = family_for_config(hf_model.config)
    config = family.normalized_config
    media = tuple(int(i) for i in (config.image_token_id, config.video_token_id) if i is not None)
    if not media:
        raise ValueError(
            f"{type(hf_model.config).__name__} sets neither image_token_id nor video_token_id; "
            "the language graph needs the media pad ids to merge vision rows"
        )
    return LanguageSpec(
        num_layers=config.num_layers,
        hidden_size=config.hidden_size,
        vocab_size=config.vocab_size,
        kv_heads=config.kv_heads,
        head_dim=config.head_dim,
        media_token_ids=media,
        extras=dict(family.extras),
        max_positions=config.max_positions,
        kv_layers=tuple(family.kv_layers()),
        layer_states=tuple(family.layer_states()),
        layer_kinds=tuple(family.layer_kinds()),
    )


def _text_model_and_head(hf_model: nn.Module) -> tuple[nn.Module, nn.Module]:
    inner = getattr(hf_model, "model", None)
    text_model = getattr(inner, "language_model", None)
    lm_head = getattr(hf_model, "lm_head", None)
    if text_model is None or lm_head is None:
        raise ValueError(
            f"{type(hf_model).__name__} lacks .model.language_model or .lm_head; pass the "
            "ForConditionalGeneration model (transformers >= 5), not its inner model"
        )
    return text_model, lm_head


class MediaMerge(NamedTuple):
    """Where a chunk's media tokens are and which vision rows they read."""

    is_media: torch.Tensor  # (B, S) bool: a media pad id at a valid (slot >= 0) position
    rows: torch.Tensor  # (B, S) int64 row of vision_embeds for each token (clamped for non-media)
    count: torch.Tensor  # (B,) int64 media tokens per row


def media_rows(
    input_ids: torch.Tensor,
    position_slots: torch.Tensor,
    image_idx: torch.Tensor,
    media_token_ids: torch.Tensor,
    last_vision_row: torch.Tensor,
    is_prefill: torch.Tensor,
) -> MediaMerge:
    """The k-th media token of each row reads vision row ``image_idx + k`` (cumsum, no NonZero).

    Padding positions never count as media, whatever id the host padded with, and nothing does in a
    decode step (``is_prefill`` False).
    """
    is_media = (input_ids[..., None] == media_token_ids).any(-1) & (position_slots >= 0) & is_prefill
    running = torch.cumsum(is_media.to(torch.int64), dim=1)
    # Clamped into [0, vision_size - 1] so every gather stays in the buffer: non-media tokens before
    # the chunk's first media token point at image_idx - 1, and torch.where discards their rows.
    # (A host sending fewer rows than media tokens would read the last row instead of failing.)
    rows = (running - 1 + image_idx.reshape(())).clamp(min=0)
    rows = torch.minimum(rows, last_vision_row)
    return MediaMerge(is_media=is_media, rows=rows, count=is_media.sum(dim=1))


class LanguageGraphOutput(NamedTuple):
    logits: torch.Tensor  # (B, 1, vocab) fp32, last valid position of each row; (B, 0, vocab) with no logits rows
    image_idx_output: torch.Tensor  # (1, 1) int64
    past_keys: list[torch.Tensor]  # per KV layer (B or full_batch_size, kv_heads, ctx_len, head_dim)
    past_values: list[torch.Tensor]
    states: dict[str, torch.Tensor]  # the layer states after the step, by input name ({} for most families)


class LayerStep(NamedTuple):
    """What every decoder layer of one step shares; a layer with its own state writes it into ``states``."""

    attention_mask: torch.Tensor | None  # (B, 1, S, ctx_len) additive, over the KV slots
    slots: torch.Tensor  # (B, S) int64 KV slot of each token (position_ids[0]); -1 padding
    cache: SlotKVCache
    rotary: tuple[torch.Tensor, torch.Tensor] | None  # M-RoPE cos, sin; None for a model without RoPE
    batch_index: torch.Tensor | None
    states: dict[str, torch.Tensor]  # layer states by input name, replaced as layers run


class StepStart(NamedTuple):
    """What the step computes before its first decoder layer (``LanguageGraph.prologue``): the layers' input and what
    every layer reads from the step. A stamped export traces this part on its own, so these are the tensors a layer's
    traced graph takes from it (``qeff_evs.models.language_parts``)."""

    hidden: torch.Tensor  # (B, S, hidden): embedded tokens with the chunk's vision rows merged in
    attention_mask: torch.Tensor | None  # (B, 1, S, keys) additive; None without KV layers
    slots: torch.Tensor  # (B, S) int64 KV slot of each token
    addressing: CacheAddressing | None  # KV writes and reads; None without KV layers
    rotary: tuple[torch.Tensor, torch.Tensor] | None  # M-RoPE cos, sin (B, S, head_dim); None without RoPE
    merge: MediaMerge  # where the media tokens are (a family's extra rows are added there)
    image_idx_output: torch.Tensor  # (1, 1) int64


class LanguageGraph(nn.Module):
    """One language-model step over a slot KV cache; the module the language ONNX is traced from.

    It shares (does not copy) the parameters of ``hf_model``. ``media_token_ids`` defaults to the
    config's image and video pad ids. ``trace_seq_len``: the chunk length the exporter must trace
    with (None: any; a graph that unrolls its prefill per length sets the compiled prefill length).
    """

    trace_seq_len: int | None = None

    def __init__(self, hf_model: nn.Module, media_token_ids: Sequence[int] | None = None,
                 rope_positions: int | None = None):
        super().__init__()
        self.spec = language_spec(hf_model)
        if media_token_ids is not None:
            self.spec = dataclasses.replace(self.spec, media_token_ids=tuple(int(i) for i in media_token_ids))
        self.text_model, self.lm_head = self.text_parts(hf_model)
        # A text model without a rotary embedding reads positions only as KV slots (no RoPE table).
        rotary = getattr(self.text_model, "rotary_emb", None)
        self.rope = None if rotary is None else RopeTable(rotary, rope_positions or self.spec.max_positions)
        self.register_buffer(
            "media_token_ids", torch.tensor(self.spec.media_token_ids, dtype=torch.int64), persistent=False
        )

    @staticmethod
    def text_parts(hf_model: nn.Module) -> tuple[nn.Module, nn.Module]:
        """``(text model, lm_head)`` of the family's model: the text model exposes ``embed_tokens``, ``layers``,
        ``norm`` (and ``rotary_emb`` when its attention rotates by position); a family whose model names them
        otherwise overrides this."""
        return _text_model_and_head(hf_model)

    def forward(
        self,
        input_ids: torch.Tensor,
        vision_embeds: torch.Tensor,
        position_ids: torch.Tensor,
        image_idx: torch.Tensor,
        past_keys: Sequence[torch.Tensor],
        past_values: Sequence[torch.Tensor],
        extras: Mapping[str, torch.Tensor] | None = None,
        batch_index: torch.Tensor | None = None,
        states: Mapping[str, torch.Tensor] | None = None,
        comp_ctx_lengths: torch.Tensor | None = None,
        logits_rows: torch.Tensor | None = None,
    ) -> LanguageGraphOutput:
        """``extras``: each of the family's extra rows by name, ``(levels, 1, vision_size, hidden)``;
        ``past_keys``/``past_values``: one per KV layer (``spec.kv_layers``); ``states``: the layer states
        by input name (``{state}.{layer}``, ``(rows, *row_shape)``); ``comp_ctx_lengths``: a ``(comp_ctx_len,)``
        tensor whose length is how many slots of the KV rows the step reads (None: all ``ctx_len``);
        ``logits_rows``: a ``(num_logits,)`` tensor whose length, 1 or 0, is how many logits each row gets (None: 1);
        with 0 the LM head runs on no rows, which is what a chunk whose logits nobody reads saves."""
        extras, states = dict(extras or {}), dict(states or {})
        self._check_inputs(position_ids, past_keys, past_values, extras, batch_index, states)
        self._check_comp_ctx_len(position_ids, past_keys, comp_ctx_lengths)
        self._check_logits_rows(logits_rows)
        start = self.prologue(input_ids, vision_embeds, position_ids, image_idx,
                              past_keys[0] if past_keys else None, comp_ctx_lengths)
        cache = SlotKVCache(past_keys, past_values, start.addressing, batch_index, self.spec.kv_layers)
        step = LayerStep(start.attention_mask, start.slots, cache, start.rotary, batch_index, states)
        hidden = start.hidden
        for layer_idx in range(len(self.text_model.layers)):
            hidden = self.layer(layer_idx, hidden, step, start.merge, extras)
        logits = self.epilogue(hidden, start.slots, logits_rows)
        return LanguageGraphOutput(logits, start.image_idx_output, cache.keys, cache.values, step.states)

    def prologue(self, input_ids: torch.Tensor, vision_embeds: torch.Tensor, position_ids: torch.Tensor,
                 image_idx: torch.Tensor, first_cache: torch.Tensor | None,
                 comp_ctx_lengths: torch.Tensor | None = None) -> StepStart:
        """Everything before the first decoder layer: embed the chunk, merge its vision rows, address the KV
        caches (``first_cache``: any layer's, for ``ctx_len``), look up the rotary tables."""
        text = self.text_model
        # Padding rows may carry id -1 (vllm-qaic); their embedding is never used, it only has to exist.
        hidden = text.embed_tokens(torch.where(input_ids < 0, 0, input_ids))
        slots = position_ids[0]

        # Taken from a Range over the shape so vision_size stays a graph symbol under tracing.
        last_vision_row = torch.arange(vision_embeds.shape[1], device=input_ids.device).max()
        # Decode (one token per row) embeds every token as text, as QEfficient and HF do: a generated
        # media pad has no vision row of its own. A Range over the shape keeps seq_len a graph symbol.
        is_prefill = torch.arange(input_ids.shape[1], device=input_ids.device).max() > 0
        merge = media_rows(input_ids, slots, image_idx, self.media_token_ids, last_vision_row, is_prefill)
        vision_rows = vision_embeds[0][merge.rows].to(hidden.dtype)  # (B, S, hidden)
        hidden = torch.where(merge.is_media[..., None], vision_rows, hidden)

        # A Range over comp_ctx_lengths' shape keeps comp_ctx_len a graph symbol.
        key_slots = None if comp_ctx_lengths is None else torch.arange(comp_ctx_lengths.shape[0], device=hidden.device)
        attention_mask = addressing = None
        if first_cache is not None:
            read = cache_slots(first_cache) if key_slots is None else key_slots
            addressing = cache_addressing(slots, read, first_cache.shape[3])
            attention_mask = slot_attention_mask(slots, read, hidden.dtype)
        image_idx_output = (image_idx.reshape(()) + merge.count.max()).reshape(1, 1)
        rotary = None if self.rope is None else self.rope(position_ids[1:], hidden.dtype)
        return StepStart(hidden, attention_mask, slots, addressing, rotary, merge, image_idx_output)

    def layer(self, layer_idx: int, hidden: torch.Tensor, step: LayerStep, merge: MediaMerge,
              extras: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Decoder layer ``layer_idx`` (``decoder_layer``), then the level ``layer_idx`` of each of the family's extra
        rows added to the media tokens (``extras``: by name, ``(levels, 1, vision_size, hidden)``)."""
        hidden = self.decoder_layer(layer_idx, self.text_model.layers[layer_idx], hidden, step)
        for name in self.spec.extras:
            if layer_idx < extras[name].shape[0]:
                extra = extras[name][layer_idx, 0][merge.rows].to(hidden.dtype)
                hidden = torch.where(merge.is_media[..., None], hidden + extra, hidden)
        return hidden

    def epilogue(self, hidden: torch.Tensor, slots: torch.Tensor, logits_rows: torch.Tensor | None = None) -> torch.Tensor:
        """After the last decoder layer: the logits of each row's last valid token (``(B, 1, vocab)`` fp32; none with
        a ``logits_rows`` of length 0)."""
        # Only each row's last valid token (largest slot; padding is -1) needs logits.
        last = slots.argmax(dim=1)
        batch_rows = torch.arange(hidden.shape[0], device=hidden.device)
        # (B, hidden) then unsqueeze, so the graph knows the middle axis of the logits is exactly 1.
        last_hidden = hidden[batch_rows, last].unsqueeze(1)
        if logits_rows is not None:  # a Slice to the input's length keeps num_logits a graph symbol
            last_hidden = last_hidden[:, : logits_rows.shape[0]]
        return self.lm_head(self.text_model.norm(last_hidden)).float()

    def decoder_layer(self, layer_idx: int, layer: nn.Module, hidden: torch.Tensor, step: LayerStep) -> torch.Tensor:
        """One decoder layer of the step: transformers' own layer over the slot KV cache (a hybrid
        family's graph runs its other layers here, over ``step.states``)."""
        return layer(
            hidden,
            attention_mask=step.attention_mask,
            position_ids=step.slots,
            past_key_values=step.cache,
            position_embeddings=step.rotary,
        )

    def attention(self, layer: nn.Module, hidden: torch.Tensor, step: LayerStep) -> torch.Tensor:
        """A decoder layer's self-attention alone over the slot KV cache, for a graph that runs the rest of the
        layer itself (``hidden``: after the layer's input norm)."""
        return layer.self_attn(hidden_states=hidden, attention_mask=step.attention_mask, position_ids=step.slots,
                               past_key_values=step.cache, position_embeddings=step.rotary)[0]

    def feed_forward(self, layer_idx: int, layer: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """A decoder layer's MLP, for a graph that runs the rest of the layer itself (``hidden``: after the
        layer's post-attention norm): transformers' own, unless a family's graph computes it otherwise."""
        return layer.mlp(hidden)

    @staticmethod
    def _check_comp_ctx_len(position_ids, past_keys, comp_ctx_lengths) -> None:
        if torch.jit.is_tracing() or comp_ctx_lengths is None or not past_keys:
            return
        length, ctx_len, last = comp_ctx_lengths.shape[0], past_keys[0].shape[2], int(position_ids[0].max())
        if not last < length <= ctx_len:
            raise ValueError(
                f"comp_ctx_lengths has length {length} but the step's last KV slot is {last} and ctx_len {ctx_len}: "
                f"a step reads only that many slots, so pick a length in ({last}, {ctx_len}] (the smallest the "
                "export has)")

    @staticmethod
    def _check_logits_rows(logits_rows) -> None:
        if torch.jit.is_tracing() or logits_rows is None:
            return
        if logits_rows.dim() != 1 or logits_rows.shape[0] > 1:
            raise ValueError(f"logits_rows has shape {tuple(logits_rows.shape)}; pass (1,) for the logits of each row's "
                             "last valid token or (0,) for none")

    def _check_inputs(self, position_ids, past_keys, past_values, extras, batch_index, states) -> None:
        if torch.jit.is_tracing():
            return
        if position_ids.dim() != 3 or position_ids.shape[0] != 4:
            raise ValueError(
                f"position_ids must be (4, batch, seq_len) (KV slot row + M-RoPE t/h/w), got "
                f"{tuple(position_ids.shape)}; prepend the slot row to the 3-row M-RoPE positions"
            )
        layers = len(self.spec.kv_layers)
        if len(past_keys) != layers or len(past_values) != layers:
            raise ValueError(
                f"expected {layers} past keys and values (one per KV layer {list(self.spec.kv_layers)}), got "
                f"{len(past_keys)} and {len(past_values)}"
            )
        expected = {name: state.row_shape for state in self.spec.layer_states for name in state.input_names}
        if set(states) != set(expected):
            raise ValueError(f"expected the layer states {sorted(expected)}, got {sorted(states)}")
        rows = past_keys[0].shape[0] if past_keys else None
        for name, row_shape in expected.items():
            shape = tuple(states[name].shape)
            if shape[1:] != row_shape or (rows is not None and shape[0] != rows):
                raise ValueError(f"{name} has shape {shape}, expected ({rows or 'rows'}, *{row_shape}) (one row per "
                                 "KV cache row)")
        for name, levels in self.spec.extras.items():
            if name not in extras:
                raise ValueError(
                    f"this model has {levels} levels of {name}; pass {name} (levels, 1, vision_size, hidden)")
            if extras[name].shape[0] != levels:
                raise ValueError(f"{name} has {extras[name].shape[0]} levels, the model has {levels}; pass the "
                                 f"vision graph's {name} output unchanged")
        if batch_index is not None:
            check_batch_index(batch_index, position_ids, cache_rows=past_keys[0].shape[0])


class ExportableLanguageGraph(nn.Module):
    """``LanguageGraph`` with flat tensor inputs/outputs in graph order (what the exporter traces)."""

    def __init__(self, graph: LanguageGraph, continuous_batching: bool = False, comp_ctx_lengths: bool = False,
                 logits_rows: bool = False):
        super().__init__()
        self.graph = graph
        spec = graph.spec
        self.io = LanguageGraphIO(spec.num_layers, tuple(spec.extras), continuous_batching, spec.io_kv_layers,
                                  spec.layer_states, comp_ctx_lengths, logits_rows)

    @property
    def spec(self) -> LanguageSpec:
        return self.graph.spec

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        names = self.io.input_names
        if len(inputs) != len(names):
            raise ValueError(f"expected {len(names)} inputs ({names}), got {len(inputs)}")
        named = dict(zip(names, inputs))
        layers = self.spec.kv_layers
        step = self.graph(
            named["input_ids"],
            named["vision_embeds"],
            named["position_ids"],
            named["image_idx"],
            [named[f"past_key.{i}"] for i in layers],
            [named[f"past_value.{i}"] for i in layers],
            extras={name: named[name] for name in self.io.extras},
            batch_index=named.get(BATCH_INDEX),
            states={name: named[name] for name in self.io.state_inputs},
            comp_ctx_lengths=named.get(COMP_CTX_LENGTHS),
            logits_rows=named.get(LOGITS_ROWS),
        )
        retained = [named[name] for name in self.io.vision_inputs]
        updated = dict(step.states)
        for at, i in enumerate(layers):
            updated[f"past_key.{i}"], updated[f"past_value.{i}"] = step.past_keys[at], step.past_values[at]
        return (step.logits, *retained, step.image_idx_output, *(updated[name] for name in self.io.layer_inputs()))

    @torch.no_grad()
    def run(self, feeds: Mapping[str, torch.Tensor | np.ndarray]) -> dict[str, torch.Tensor]:
        """Eager step with ONNX names in and out (the PyTorch reference backend's session call)."""
        missing = [name for name in self.io.input_names if name not in feeds]
        if missing:
            raise ValueError(f"language step is missing inputs {missing}; feed every name in {self.io.input_names}")
        device = next(self.parameters()).device
        inputs = [torch.as_tensor(feeds[name]).to(device) for name in self.io.input_names]
        return dict(zip(self.io.output_names, self(*inputs)))
