"""The language step as three kinds of part with named tensor boundaries: what a stamped export traces.

``LanguageGraph.forward`` runs ``prologue``, then ``layer`` once per decoder layer, then ``epilogue``. Each of these
becomes a module here whose inputs and outputs are named tensors, so that each can be traced on its own and the
traced graphs chained by name (``qeff_evs.export.stamping``):

* ``StepPrologue``: the graph inputs it reads -> ``hidden_states`` and the tensors every layer reads from the step
  (``SHARED``: the attention mask, the KV addressing, the rotary cos/sin where the family's attention rotates by
  position, where the media tokens are), and
  ``image_idx_output``;
* ``LayerPart``: one decoder layer (and the family's extra rows added after it): ``hidden_states`` + ``SHARED`` [+
  ``batch_index``] [+ the extra rows] + the layer's own retained inputs under generic names (``past_key`` /
  ``past_value``, or its layer states' names) -> ``hidden_states_out`` + those retained outputs;
* ``StepEpilogue``: the last ``hidden_states`` -> ``logits``.

Chained, the parts compute what ``LanguageGraph.forward`` computes: they call its own methods. A part holds only the
modules it runs (the embedding, one decoder layer, the norm and head), so a trace of it sees only their parameters.

Layers of one kind (``layer_kind``: the family's word for it, the extra-row levels added after it, and the names,
shapes and dtypes of its parameters) trace to the same graph up to their weights: the exporter traces one layer of
each kind and stamps the others from it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from qeff_evs.models.graph_io import BATCH, BATCH_INDEX, COMP_CTX, CTX, FULL_BATCH, LOGITS_ROWS, NUM_LOGITS, SEQ, VISION
from qeff_evs.models.kv_cache import CacheAddressing, SlotKVCache
from qeff_evs.models.language import LanguageGraph, LayerStep, MediaMerge
from qeff_evs.specializations import RETAINED_SUFFIX

HIDDEN, HIDDEN_OUT = "hidden_states", "hidden_states_out"
SHARED = ("attention_mask", "slots", "write_slots", "read_indices", "read_length", "read_skipped", "rope_cos",
          "rope_sin", "media_tokens", "media_rows")
ROTARY = ("rope_cos", "rope_sin")  # not among a step's tensors where the model has no RoPE (Nemotron-H)
IMAGE_IDX_OUTPUT = "image_idx_output"
KEY, VALUE = "past_key", "past_value"
KEYS = "key_slots"  # the slots a step reads: comp_ctx_len with compute context lengths, else ctx_len


def shared_names(graph: LanguageGraph) -> tuple[str, ...]:
    """The ``SHARED`` tensors of ``graph``'s step: the rotary cos/sin only where it has RoPE tables."""
    return SHARED if graph.rope is not None else tuple(name for name in SHARED if name not in ROTARY)


def shared_axes(comp_ctx_lengths: bool) -> dict[str, dict[int, str]]:
    """Dynamic axes of ``hidden_states`` and the ``SHARED`` tensors (symbols as the language graph names them)."""
    keys = COMP_CTX if comp_ctx_lengths else CTX
    per_token = {0: BATCH, 1: SEQ}
    return {HIDDEN: per_token, HIDDEN_OUT: per_token, "attention_mask": {0: BATCH, 2: SEQ, 3: keys},
            "slots": per_token, "write_slots": per_token, "read_indices": {0: BATCH, 2: keys}, "read_length": {},
            "read_skipped": {0: BATCH, 2: keys}, "rope_cos": per_token, "rope_sin": per_token,
            "media_tokens": per_token, "media_rows": per_token}


class StepPrologue(nn.Module):
    """``LanguageGraph.prologue`` with named inputs (``input_names``) and outputs (``output_names``)."""

    def __init__(self, graph: LanguageGraph, input_names: Sequence[str]):
        super().__init__()
        if not graph.spec.kv_layers:
            raise ValueError("a language graph without KV layers has no slots to address; a stamped export needs one")
        self.embed_tokens = graph.text_model.embed_tokens
        self.rope = graph.rope
        self._graph = (graph,)  # not a submodule: only the modules above are this part's
        first_cache = f"{KEY}.{graph.spec.kv_layers[0]}"
        wanted = {"input_ids", "vision_embeds", "position_ids", "image_idx", first_cache, "comp_ctx_lengths"}
        self.input_names = [name for name in input_names if name in wanted]
        self.first_cache = first_cache
        self.output_names = [HIDDEN, *shared_names(graph), IMAGE_IDX_OUTPUT]

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        named = dict(zip(self.input_names, inputs))
        start = self._graph[0].prologue(named["input_ids"], named["vision_embeds"], named["position_ids"],
                                        named["image_idx"], named[self.first_cache], named.get("comp_ctx_lengths"))
        addressing = start.addressing
        return (start.hidden, start.attention_mask, start.slots, addressing.write_slots, addressing.read_indices,
                addressing.read_length, addressing.skipped, *(start.rotary or ()), start.merge.is_media,
                start.merge.rows, start.image_idx_output)


class LayerPart(nn.Module):
    """``LanguageGraph.layer`` for decoder layer ``layer_idx``, with named inputs and outputs (module docstring)."""

    def __init__(self, graph: LanguageGraph, layer_idx: int, continuous_batching: bool = False):
        super().__init__()
        spec = graph.spec
        self.layer = graph.text_model.layers[layer_idx]
        self._graph = (graph,)  # not a submodule: only this layer's modules are this part's
        self.layer_idx = layer_idx
        self.has_kv = layer_idx in spec.kv_layers
        self.states = tuple(state for state in spec.layer_states if layer_idx in state.layers)
        own = ([KEY, VALUE] if self.has_kv else []) + [state.name for state in self.states]
        self.own = tuple(own)
        cb = [BATCH_INDEX] if continuous_batching else []
        self.input_names = [HIDDEN, *shared_names(graph), *cb, *spec.extras, *own]
        self.output_names = [HIDDEN_OUT, *(f"{name}{RETAINED_SUFFIX}" for name in own)]

    def graph_names(self) -> dict[str, str]:
        """Each generic name of this layer's retained inputs and outputs -> its name in the language graph."""
        names = {}
        for name in self.own:
            names[name] = f"{name}.{self.layer_idx}"
            names[f"{name}{RETAINED_SUFFIX}"] = f"{name}.{self.layer_idx}{RETAINED_SUFFIX}"
        return names

    def dynamic_axes(self, comp_ctx_lengths: bool, continuous_batching: bool) -> dict[str, dict[int, str]]:
        rows = FULL_BATCH if continuous_batching else BATCH
        axes = {name: axis for name, axis in shared_axes(comp_ctx_lengths).items()}
        if continuous_batching:
            axes[BATCH_INDEX] = {0: BATCH}
        for name in self._graph[0].spec.extras:
            axes[name] = {2: VISION}
        for name in self.own:
            kv = {0: rows, 2: CTX} if name in (KEY, VALUE) else {0: rows}
            axes[name] = dict(kv)
            axes[f"{name}{RETAINED_SUFFIX}"] = dict(kv)
        return axes

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        named = dict(zip(self.input_names, inputs))
        graph, i = self._graph[0], self.layer_idx
        addressing = CacheAddressing(named["write_slots"], named["read_indices"], named["read_length"],
                                     named["read_skipped"])
        batch_index = named.get(BATCH_INDEX)
        kv = ([named[KEY]], [named[VALUE]], [i]) if self.has_kv else ([], [], [])
        cache = SlotKVCache(kv[0], kv[1], addressing, batch_index, kv[2])
        states = {state.input_name(i): named[state.name] for state in self.states}
        rotary = (named["rope_cos"], named["rope_sin"]) if ROTARY[0] in named else None
        step = LayerStep(named["attention_mask"], named["slots"], cache, rotary, batch_index, states)
        merge = MediaMerge(named["media_tokens"], named["media_rows"], None)
        hidden = graph.layer(i, named[HIDDEN], step, merge, {name: named[name] for name in graph.spec.extras})
        retained = ([cache.keys[0], cache.values[0]] if self.has_kv else []) + \
            [step.states[state.input_name(i)] for state in self.states]
        return (hidden, *retained)


class StepEpilogue(nn.Module):
    """``LanguageGraph.epilogue`` with named inputs and outputs."""

    def __init__(self, graph: LanguageGraph, logits_rows: bool):
        super().__init__()
        self.norm = graph.text_model.norm
        self.lm_head = graph.lm_head
        self._graph = (graph,)
        self.input_names = [HIDDEN, "slots", *([LOGITS_ROWS] if logits_rows else [])]
        self.output_names = ["logits"]

    def dynamic_axes(self) -> dict[str, dict[int, str]]:
        axes = {HIDDEN: {0: BATCH, 1: SEQ}, "slots": {0: BATCH, 1: SEQ}, "logits": {0: BATCH}}
        if LOGITS_ROWS in self.input_names:
            axes[LOGITS_ROWS] = {0: NUM_LOGITS}
            axes["logits"] = {0: BATCH, 1: NUM_LOGITS}
        return axes

    def forward(self, hidden: torch.Tensor, slots: torch.Tensor, logits_rows: torch.Tensor | None = None) -> torch.Tensor:
        return self._graph[0].epilogue(hidden, slots, logits_rows)


def parameter_signature(module: nn.Module) -> tuple[tuple[str, tuple[int, ...], str], ...]:
    """``(name, shape, dtype)`` of each of ``module``'s parameters, in order."""
    return tuple((name, tuple(p.shape), str(p.dtype)) for name, p in module.named_parameters())


def layer_kind(graph: LanguageGraph, layer_idx: int) -> tuple:
    """What makes decoder layer ``layer_idx`` trace to the graph of another (module docstring)."""
    spec = graph.spec
    # The level a layer adds is a constant of its graph: each level is a kind of its own.
    levels = tuple((name, layer_idx) for name, count in spec.extras.items() if layer_idx < count)
    return (spec.layer_kinds[layer_idx], levels, parameter_signature(graph.text_model.layers[layer_idx]))
