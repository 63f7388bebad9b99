"""The stamped language graph: each kind of part traced once from the hollow model, one copy per decoder layer.

The language step is a prologue, one part per decoder layer and an epilogue (``qeff_evs.models.language_parts``).
This module traces the prologue, one layer of each kind (``language_parts.layer_kind``) and the epilogue, each on its
own with its parameters as inputs (``onnx_graph.trace_without_weights``), takes their weights out
(``weight_exprs.cut_weights``), and chains them by name into the language graph: the prologue, then for every decoder layer
the graph of its kind with that layer's retained inputs and outputs and weights, then the epilogue. Tracing costs the
same whatever the depth; the graph grows by one copy of a layer's nodes per layer, and its weights are written
afterwards, one tensor at a time (``weights.write_weights``).

With ``functions`` each kind becomes an ONNX local function and each layer one call of it (QEfficient's
``use_onnx_subfunctions``): the graph holds a kind's nodes once. ONNX Runtime inlines the calls when it loads the graph.

The stamped graph computes what ``export.language.export_language_graph`` traces from the whole model (the test
suite holds both to the same outputs); its nodes carry a part's names under a prefix (``layers.3/...``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import onnx
import torch
from onnx import helper

from qeff_evs.export.onnx_functions import attach_functions, rewrite_rms_norms
from qeff_evs.export.onnx_graph import ONNX_OPSET, trace_without_weights
from qeff_evs.export.weight_exprs import WeightExpr, cut_weights
from qeff_evs.export.weights import GraphWeight, rename_weights
from qeff_evs.models.graph_io import LanguageGraphIO
from qeff_evs.models.language import LanguageGraph
from qeff_evs.models.language_parts import (
    HIDDEN, HIDDEN_OUT, IMAGE_IDX_OUTPUT, SHARED, LayerPart, StepEpilogue, StepPrologue, layer_kind, shared_axes,
)
from qeff_evs.specializations import RETAINED_SUFFIX

_LOG = logging.getLogger(__name__)
LAYER_DOMAIN = "qeff_evs.layers"  # the domain of the layer functions (``functions``)
STEP = "step/"  # prefix of the prologue's outputs in the stamped graph
IGNORED_TRACE_MESSAGES = ("Converting a tensor to a Python boolean", "Exporting aten::index operator")


@dataclass
class TracedPart:
    """One part traced without weights: its graph (weights undefined) and each weight as a ``WeightExpr`` (its
    ``sources``: the part's parameter names)."""

    model: onnx.ModelProto
    exprs: dict[str, WeightExpr]

    @property
    def input_names(self) -> list[str]:
        return [value.name for value in self.model.graph.input]

    @property
    def output_names(self) -> list[str]:
        return [value.name for value in self.model.graph.output]


def trace_part(module: torch.nn.Module, inputs: Mapping[str, torch.Tensor], output_names: Sequence[str],
               dynamic_axes: Mapping[str, Mapping[int, str]]) -> TracedPart:
    """Trace ``module`` (inputs by name, in its order) with its parameters as inputs; cut out its weights and write its
    RMSNorms as ``CustomRMSNorm`` (compiler functions attached later, on the whole graph)."""
    names = list(inputs)
    axes = {name: axes for name, axes in dynamic_axes.items() if name in names or name in output_names}
    model, parameters = trace_without_weights(module, list(inputs.values()), input_names=names,
                                              output_names=output_names, dynamic_axes=axes,
                                              ignore_messages=IGNORED_TRACE_MESSAGES)
    for node in model.graph.node:
        if any(attr.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for attr in node.attribute):
            raise ValueError(f"{type(module).__name__} traced to a {node.op_type} with a subgraph; a stamped part "
                             "must be a flat graph")
    exprs = cut_weights(model, parameters)
    rewrite_rms_norms(model)
    attach_functions(model)  # the compiler functions' domains among its opset imports (a layer function needs them)
    del model.functions[:]  # their bodies go once into the whole graph
    return TracedPart(model, exprs)


def checkpoint_names(module: torch.nn.Module, names: Mapping[int, str]) -> dict[str, str]:
    """Each parameter of ``module`` (by its name there) -> its ``state_dict`` name in the model (by identity)."""
    return {name: names[id(p)] for name, p in module.named_parameters()}


def _renamed(nodes: Sequence[onnx.NodeProto], mapping: Mapping[str, str], prefix: str) -> list[onnx.NodeProto]:
    """Copies of ``nodes`` with each value named by ``mapping`` (else ``prefix`` + its name) and node names prefixed."""
    out = []
    for node in nodes:
        copy = onnx.NodeProto()
        copy.CopyFrom(node)
        copy.name = prefix + node.name
        for index, name in enumerate(copy.input):
            if name:
                copy.input[index] = mapping.get(name, prefix + name)
        for index, name in enumerate(copy.output):
            if name:
                copy.output[index] = mapping.get(name, prefix + name)
        out.append(copy)
    return out


def _value_info(value: onnx.ValueInfoProto, name: str) -> onnx.ValueInfoProto:
    copy = onnx.ValueInfoProto()
    copy.CopyFrom(value)
    copy.name = name
    return copy


@dataclass(frozen=True)
class StampedGraph:
    """The language graph (weights undefined until ``weights.attach_weights``) and its weights, in writing order."""

    model: onnx.ModelProto
    weights: list[GraphWeight]
    kinds: int  # distinct layer kinds traced


def stamped_language_graph(graph: LanguageGraph, inputs: Mapping[str, torch.Tensor], io: LanguageGraphIO,
                           names: Mapping[int, str], functions: bool = False) -> StampedGraph:
    """The language graph of ``graph`` (built on a hollow model, ``models.hollow``) for the contract ``io``, traced
    part by part on the example ``inputs`` (``export.language.language_dummy_inputs``, by name); ``names``: each
    parameter's ``state_dict`` name in the model (``models.hollow.parameter_names``), what its weights are read by."""
    axes = io.dynamic_axes
    prologue = StepPrologue(graph, io.input_names)
    prologue_inputs = {name: inputs[name] for name in prologue.input_names}
    with torch.no_grad():
        step = dict(zip(prologue.output_names, prologue(*prologue_inputs.values())))
    step_axes = {**shared_axes(io.comp_ctx_lengths), IMAGE_IDX_OUTPUT: {}}
    traced_prologue = trace_part(prologue, prologue_inputs, prologue.output_names, {**axes, **step_axes})

    kinds: dict[tuple, tuple[int, TracedPart]] = {}
    layer_of_kind: list[tuple[int, tuple]] = []
    for i in range(io.num_layers):
        kind = layer_kind(graph, i)
        if kind not in kinds:
            part = LayerPart(graph, i, io.continuous_batching)
            part_inputs = {}
            for name in part.input_names:
                graph_name = part.graph_names().get(name, name)
                part_inputs[name] = step[name] if name in step else inputs[graph_name]
            traced = trace_part(part, part_inputs, part.output_names,
                                part.dynamic_axes(io.comp_ctx_lengths, io.continuous_batching))
            kinds[kind] = (i, traced)
            _LOG.info("traced layer kind %d (layer %d): %d nodes", len(kinds), i, len(traced.model.graph.node))
        layer_of_kind.append((i, kind))
    epilogue = StepEpilogue(graph, io.logits_rows)
    epilogue_inputs = {HIDDEN: step[HIDDEN], "slots": step["slots"]}
    if io.logits_rows:
        epilogue_inputs["logits_rows"] = inputs["logits_rows"]
    traced_epilogue = trace_part(epilogue, epilogue_inputs, epilogue.output_names, epilogue.dynamic_axes())

    nodes: list[onnx.NodeProto] = []
    weights: list[GraphWeight] = []
    values: dict[str, onnx.ValueInfoProto] = {}
    functions_by_kind: dict[tuple, onnx.FunctionProto] = {}

    # The prologue: graph inputs keep their names, its outputs are the step's.
    mapping = {name: name for name in traced_prologue.input_names}
    mapping.update({name: STEP + name for name in traced_prologue.output_names})
    mapping[IMAGE_IDX_OUTPUT] = IMAGE_IDX_OUTPUT
    weights += rename_weights(traced_prologue.exprs, checkpoint_names(prologue, names), "embedding", mapping)
    nodes += _renamed(traced_prologue.model.graph.node, mapping, "prologue/")
    values.update({value.name: value for value in traced_prologue.model.graph.input})
    values[IMAGE_IDX_OUTPUT] = next(v for v in traced_prologue.model.graph.output if v.name == IMAGE_IDX_OUTPUT)

    hidden = STEP + HIDDEN
    for i, kind in layer_of_kind:
        first, traced = kinds[kind]
        part = LayerPart(graph, i, io.continuous_batching)
        own = part.graph_names()
        mapping = {name: (STEP + name if name in SHARED else own.get(name, name)) for name in traced.input_names}
        mapping[HIDDEN] = hidden
        hidden = f"layers.{i}/{HIDDEN_OUT}"
        mapping.update({name: own.get(name, name) for name in traced.output_names})
        mapping[HIDDEN_OUT] = hidden
        sources = checkpoint_names(part, names)
        if part_signature(part) != part_signature(LayerPart(graph, first, io.continuous_batching)):
            raise ValueError(f"decoder layer {i} has other parameters than layer {first} of its kind {kind[0]!r}")
        layer_weights = rename_weights(traced.exprs, sources, f"layers.{i}", mapping)
        weights += layer_weights
        for name in traced.input_names:
            if mapping[name] in io.input_names:
                values[mapping[name]] = _value_info(_input(traced, name), mapping[name])
        for name in traced.output_names:
            if own.get(name) is not None:
                values[own[name]] = _value_info(_output(traced, name), own[name])
        if functions:
            function = functions_by_kind.get(kind)
            if function is None:
                function = _layer_function(traced, f"Layer{len(functions_by_kind)}", kind)
                functions_by_kind[kind] = function
            call_inputs = [mapping[name] for name in traced.input_names] + [mapping[name] for name in sorted(traced.exprs)]
            nodes.append(helper.make_node(function.name, call_inputs, [mapping[n] for n in traced.output_names],
                                          name=f"layers.{i}", domain=LAYER_DOMAIN))
        else:
            nodes += _renamed(traced.model.graph.node, mapping, f"layers.{i}/")

    mapping = {HIDDEN: hidden, "slots": STEP + "slots", "logits_rows": "logits_rows", "logits": "logits"}
    weights += rename_weights(traced_epilogue.exprs, checkpoint_names(epilogue, names), "head", mapping)
    nodes += _renamed(traced_epilogue.model.graph.node, mapping, "epilogue/")
    values["logits"] = _output(traced_epilogue, "logits")
    if "logits_rows" in traced_epilogue.input_names:
        values["logits_rows"] = _input(traced_epilogue, "logits_rows")

    for name in io.vision_inputs:  # the window passes through, as the card's retained state keeps it
        nodes.append(helper.make_node("Identity", [name], [f"{name}{RETAINED_SUFFIX}"], name=f"{name}/retained"))
        values[f"{name}{RETAINED_SUFFIX}"] = _value_info(values[name], f"{name}{RETAINED_SUFFIX}")

    missing = [name for name in [*io.input_names, *io.output_names] if name not in values]
    if missing:
        raise ValueError(f"the stamped language graph lacks {missing}; every input must be read by some part")
    opsets = {opset.domain: opset.version for part in (traced_prologue, traced_epilogue, *(t for _, t in kinds.values()))
              for opset in part.model.opset_import}
    opsets[""] = ONNX_OPSET
    if functions:
        opsets[LAYER_DOMAIN] = 1
    model = helper.make_model(
        helper.make_graph(nodes, "language", [values[name] for name in io.input_names],
                          [values[name] for name in io.output_names]),
        opset_imports=[helper.make_opsetid(domain, version) for domain, version in opsets.items()],
        producer_name="qeff-evs", ir_version=traced_prologue.model.ir_version)
    model.functions.extend(functions_by_kind.values())
    attach_functions(model)
    return StampedGraph(model, _unique(weights), len(kinds))


def part_signature(part: LayerPart) -> tuple:
    return tuple((name, tuple(p.shape), p.dtype) for name, p in part.state_dict(keep_vars=True).items())


def _input(traced: TracedPart, name: str) -> onnx.ValueInfoProto:
    return next(value for value in traced.model.graph.input if value.name == name)


def _output(traced: TracedPart, name: str) -> onnx.ValueInfoProto:
    return next(value for value in traced.model.graph.output if value.name == name)


def _layer_function(traced: TracedPart, name: str, kind: tuple) -> onnx.FunctionProto:
    """A kind's graph as a local function: its boundary inputs then its weights (sorted by name) in, its outputs out."""
    graph = traced.model.graph
    return helper.make_function(
        LAYER_DOMAIN, name, [*traced.input_names, *sorted(traced.exprs)], traced.output_names, list(graph.node),
        list(traced.model.opset_import), doc_string=f"decoder layer of kind {kind[0]!r}"
        + (f", adding {[level for level in kind[1]]}" if kind[1] else ""))


def _unique(weights: Sequence[GraphWeight]) -> list[GraphWeight]:
    """One entry per initializer name (a weight two parts read, e.g. a tied embedding's raw table)."""
    seen: dict[str, GraphWeight] = {}
    for weight in weights:
        other = seen.setdefault(weight.name, weight)
        if other.key != weight.key:
            raise ValueError(f"two different weights are both named {weight.name!r}")
    return list(seen.values())
