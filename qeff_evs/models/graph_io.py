"""Names, order and dynamic axes of every graph's inputs and outputs, and the constants hosts share.

The language graph follows QEfficient's dual-QPC contract (docs/design.md#the-three-graphs):

Inputs, in order: ``input_ids (batch_size, seq_len)``, ``vision_embeds (1, vision_size, hidden)``, then each of the
family's extra rows (``ExtraRows``) by its name, ``(levels, 1, vision_size, hidden)``, ``position_ids (4, batch_size,
seq_len)``, ``image_idx (1, 1)``, then ``past_key.{i}``, ``past_value.{i}`` per layer ``(batch_size, kv_heads,
ctx_len, head_dim)``, with compute context lengths (docs/design.md#specializations) ``comp_ctx_lengths
(comp_ctx_len,)`` (int64; only its length counts: attention gathers and masks the first ``comp_ctx_len`` slots of the
``ctx_len``-long caches, QEfficient's form), with logits rows ``logits_rows (num_logits,)`` (int64; only its length
counts: 1, the logits of each row's last valid token, or 0, none: a prefill chunk before the prompt's last, whose
logits nobody reads, then skips the LM head and reads none of its weights), and with continuous batching
``batch_index (batch_size, 1)``, the caches then having ``full_batch_size`` rows. Outputs: ``logits (batch_size,
num_logits, vocab)`` (``num_logits`` 1 without ``logits_rows``), ``vision_embeds_RetainedState``, each extra's
``_RetainedState``, ``image_idx_output (1, 1)``, ``past_key.{i}_RetainedState``, ``past_value.{i}_RetainedState``.

A hybrid model (``LanguageShape.kv_layers``, ``layer_states``) keeps a KV cache only in some layers and
other retained state in the rest: layer ``i`` then has ``past_key.{i}``/``past_value.{i}`` or, for each
``LayerState`` naming it, ``{state}.{i}`` of shape ``(rows, *row_shape)``, with their ``_RetainedState``
outputs, in layer order where the KV caches would be. Such a state has only the rows axis.

A vision graph (encoder, EVS) declares its interface as a ``VisionGraphSpec``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from qeff_evs.manifest import LanguageShape, LayerState
from qeff_evs.specializations import COMP_CTX_SYMBOL, NUM_LOGITS_SYMBOL, RETAINED_SUFFIX

BATCH, SEQ, VISION, CTX = "batch_size", "seq_len", "vision_size", "ctx_len"
FULL_BATCH = "full_batch_size"  # KV cache rows under continuous batching (QEfficient's symbol)
COMP_CTX = COMP_CTX_SYMBOL  # slots a call reads of its KV row (the length of comp_ctx_lengths)
COMP_CTX_LENGTHS = "comp_ctx_lengths"  # the per-call input whose length is COMP_CTX (QEfficient's name)
NUM_LOGITS = NUM_LOGITS_SYMBOL  # logits a call computes per batch row (the length of logits_rows): 1, or 0
LOGITS_ROWS = "logits_rows"  # the per-call input whose length is NUM_LOGITS
BATCH_INDEX = "batch_index"
PAD_POSITION = -1  # position (and KV slot) of a padding token: every row of position_ids
PAD_BATCH_INDEX = -1  # batch_index of an unused decode row (vllm-qaic); its writes are skipped

Axes = Mapping[int, str]


@dataclass(frozen=True)
class VisionGraphSpec:
    """Graph interface: ``inputs``/``outputs`` map each name (in order) to its dynamic axes."""

    inputs: Mapping[str, Axes]
    outputs: Mapping[str, Axes]

    @property
    def input_names(self) -> list[str]:
        return list(self.inputs)

    @property
    def output_names(self) -> list[str]:
        return list(self.outputs)

    @property
    def dynamic_axes(self) -> dict[str, dict[int, str]]:
        return {name: dict(axes) for name, axes in {**self.inputs, **self.outputs}.items() if axes}

    @property
    def symbols(self) -> set[str]:
        return {symbol for axes in {**self.inputs, **self.outputs}.values() for symbol in axes.values()}


@dataclass(frozen=True)
class LanguageGraphIO:
    """Names (in graph order) and dynamic axes of the language graph's inputs and outputs."""

    num_layers: int
    extras: tuple[str, ...] = ()  # names of the family's extra rows (ExtraRows.name), in graph order
    continuous_batching: bool = False
    kv_layers: tuple[int, ...] | None = None  # layers with a KV cache; None: every layer
    layer_states: tuple[LayerState, ...] = ()  # the other layers' retained state
    comp_ctx_lengths: bool = False  # the graph takes comp_ctx_lengths (an export with a context-length ladder)
    logits_rows: bool = False  # the graph takes logits_rows (a call may compute no logits)

    def __post_init__(self) -> None:
        object.__setattr__(self, "extras", tuple(self.extras))
        object.__setattr__(self, "layer_states", tuple(self.layer_states))
        if self.kv_layers is not None:
            object.__setattr__(self, "kv_layers", tuple(int(i) for i in self.kv_layers))

    @classmethod
    def of_shape(cls, shape: LanguageShape) -> "LanguageGraphIO":
        """The I/O of the graph an export's ``LanguageShape`` describes."""
        return cls(shape.num_layers, tuple(shape.extras), shape.continuous_batching, shape.kv_layers,
                   shape.layer_states, bool(shape.comp_ctx_lengths), shape.logits_rows)

    @property
    def kv_layer_indices(self) -> tuple[int, ...]:
        return tuple(range(self.num_layers)) if self.kv_layers is None else self.kv_layers

    def layer_inputs(self) -> list[str]:
        """Every retained per-layer input (KV caches and layer states), in layer order."""
        kv = set(self.kv_layer_indices)
        names = []
        for i in range(self.num_layers):
            if i in kv:
                names += [f"past_key.{i}", f"past_value.{i}"]
            names += [state.input_name(i) for state in self.layer_states if i in state.layers]
        return names

    def _kv(self, suffix: str = "") -> list[str]:
        return [f"{name}{suffix}" for name in self.layer_inputs()]

    @property
    def state_inputs(self) -> list[str]:
        """The layer-state inputs (not KV), in graph order."""
        states = {name for state in self.layer_states for name in state.input_names}
        return [name for name in self.layer_inputs() if name in states]

    @property
    def vision_inputs(self) -> list[str]:
        """The retained vision window: ``vision_embeds`` and the extras."""
        return ["vision_embeds", *self.extras]

    @property
    def input_names(self) -> list[str]:
        # batch_index follows the caches, as in QEfficient's forward signature.
        cb = [BATCH_INDEX] if self.continuous_batching else []
        ccl = [COMP_CTX_LENGTHS] if self.comp_ctx_lengths else []
        logits = [LOGITS_ROWS] if self.logits_rows else []
        return ["input_ids", *self.vision_inputs, "position_ids", "image_idx", *self._kv(), *ccl, *logits, *cb]

    @property
    def output_names(self) -> list[str]:
        retained = [f"{name}{RETAINED_SUFFIX}" for name in self.vision_inputs]
        return ["logits", *retained, "image_idx_output", *self._kv(RETAINED_SUFFIX)]

    @property
    def dynamic_axes(self) -> dict[str, dict[int, str]]:
        rows = FULL_BATCH if self.continuous_batching else BATCH
        axes = {
            "input_ids": {0: BATCH, 1: SEQ},
            "vision_embeds": {1: VISION},
            "position_ids": {1: BATCH, 2: SEQ},
            "logits": {0: BATCH},
            f"vision_embeds{RETAINED_SUFFIX}": {1: VISION},
        }
        for name in self.extras:
            axes[name] = {2: VISION}
            axes[f"{name}{RETAINED_SUFFIX}"] = {2: VISION}
        if self.continuous_batching:
            axes[BATCH_INDEX] = {0: BATCH}
        if self.comp_ctx_lengths:
            axes[COMP_CTX_LENGTHS] = {0: COMP_CTX}
        if self.logits_rows:
            axes[LOGITS_ROWS] = {0: NUM_LOGITS}
            axes["logits"] = {0: BATCH, 1: NUM_LOGITS}
        states = set(self.state_inputs)
        for name in self.layer_inputs():
            layer_axes = {0: rows} if name in states else {0: rows, 2: CTX}
            axes[name] = dict(layer_axes)
            axes[f"{name}{RETAINED_SUFFIX}"] = dict(layer_axes)
        return axes


def language_io_names(
    num_layers: int, extras: Sequence[str] = (), continuous_batching: bool = False,
    kv_layers: Sequence[int] | None = None, layer_states: Sequence[LayerState] = (),
) -> tuple[list[str], list[str]]:
    """``(input_names, output_names)`` of the language graph, in graph order (``extras``: extra rows' names)."""
    io = LanguageGraphIO(num_layers, tuple(extras), continuous_batching,
                         None if kv_layers is None else tuple(kv_layers), tuple(layer_states))
    return io.input_names, io.output_names


def state_shapes(shape: LanguageShape) -> dict[str, tuple[int, ...]]:
    """Dims of every retained input of the language graph an export's shape describes (KV rows =
    ``full_batch_size``): the vision window, the extras, the KV caches and the layer states."""
    rows = shape.full_batch_size
    kv = (rows, shape.kv_heads, shape.ctx_len, shape.head_dim)
    dims = {"vision_embeds": (1, shape.vision_size, shape.hidden)}
    for name, levels in shape.extras.items():
        dims[name] = (levels, 1, shape.vision_size, shape.hidden)
    by_name = {name: (rows, *state.row_shape) for state in shape.layer_states for name in state.input_names}
    for name in LanguageGraphIO.of_shape(shape).layer_inputs():
        dims[name] = by_name.get(name, kv)
    return dims


def check_batch_index(batch_index, position_ids, cache_rows: int) -> None:
    """Checks of a continuous-batching call's ``batch_index`` (numpy or CPU/GPU torch), host or eager graph.

    It must be ``(batch, 1)`` int64. Real rows (any slot >= 0) need distinct cache rows in
    ``[0, full_batch_size)``. A padding row (all slots -1) writes nothing (its KV writes are skipped), so
    it may name any cache row or ``PAD_BATCH_INDEX`` (-1, vllm-qaic's convention for unused decode rows).
    """
    batch_index, position_ids = _host(batch_index), _host(position_ids)
    batch = position_ids.shape[1]
    if batch_index.ndim != 2 or batch_index.shape != (batch, 1):
        raise ValueError(
            f"batch_index must be (batch_size, 1) = ({batch}, 1), one cache row per batch row, got "
            f"{tuple(batch_index.shape)}"
        )
    if batch_index.dtype != np.int64:
        raise ValueError(f"batch_index must be int64, got {batch_index.dtype}; cast it on the host")
    rows = batch_index.reshape(-1).tolist()
    real = (position_ids[0] >= 0).any(axis=1).tolist()
    real_rows = [row for row, is_real in zip(rows, real) if is_real]
    outside = [row for row in real_rows if not 0 <= row < cache_rows]
    if outside:
        raise ValueError(
            f"batch_index {rows} sends requests to cache rows {outside} outside [0, full_batch_size={cache_rows}); "
            "give each request a row the KV cache has")
    if len(set(real_rows)) != len(real_rows):
        raise ValueError(
            f"batch_index {rows} names one cache row for two requests; give each request of a call its own row"
        )
    pads = [row for row, is_real in zip(rows, real) if not is_real and not PAD_BATCH_INDEX <= row < cache_rows]
    if pads:
        raise ValueError(
            f"batch_index {rows} gives padding rows {pads}; use {PAD_BATCH_INDEX} (vllm-qaic's padding) or any "
            f"row in [0, {cache_rows})")


def _host(array) -> np.ndarray:
    """A numpy view of a numpy array or a torch tensor (any device)."""
    return array.detach().cpu().numpy() if hasattr(array, "detach") else np.asarray(array)
