"""Nodes kept in fp32 on an fp16 card (``qaic-compile -node-precision-info``), and their emulation here.

``-convert-to-fp16`` runs every op in fp16; a node-precision file (``FP32NodeInstanceNames:``, a list of
node output names) keeps the listed nodes in fp32. A Gated DeltaNet layer needs this for its recurrent
state: stored in fp16 it is rounded after every decode step, and a slow head (decay ~1e-4 per token)
drifts by about 1 % of its norm per 256 tokens, while the rest of the layer in fp16 costs ~0.15 %
(``benchmarks/gdn_layer_bench.py precision``). The fp32 island is small: the ops the state itself
flows through from its input to its ``_RetainedState`` output (gather, reset, decay, the add of each
rank update, scatter); the reads of the state (matmuls) and everything else stay fp16.

:func:`state_path` finds that island in an exported graph, :func:`node_precision_yaml` writes the
file, and :func:`keep_in_fp32` turns ``qeff_evs.export.fp16.convert_to_fp16``'s emulation of the
card into the emulation of the card with that file: the island's outputs are not rounded, and an fp16
op reading an island tensor reads it rounded, as the card's conversion at the island's edge does.
"""

from __future__ import annotations

from collections.abc import Iterable

import onnx
from onnx import TensorProto, helper

# Names convert_to_fp16 gives its rounding: an op output ``t`` is produced as ``t__raw`` then
# ``Cast(fp16) -> t__raw__half``... see qeff_evs.export.fp16; a graph input ``x`` is read as ``x__fp16``.
RAW, HALF, INPUT = "__raw", "__half", "__fp16"
ROUNDED = "__fp16_read"


# Ops through which the state itself flows: data movement and elementwise arithmetic. A contraction
# (MatMul, a reduction) of the state is a *read* of it (q S, k S) and stays fp16.
STATE_OPS = frozenset({"Identity", "Cast", "Where", "Add", "Sub", "Mul", "Neg", "Unsqueeze", "Squeeze", "Reshape",
                       "Expand", "Slice", "Concat", "Transpose", "CtxGather", "CtxGatherCB", "CtxScatter",
                       "CtxScatterCB"})


def state_path(model: onnx.ModelProto, state_input: str, state_output: str) -> list[str]:
    """Node outputs the state flows through from graph input ``state_input`` to ``state_output``, in
    graph order: outputs of ``STATE_OPS`` nodes with an input already on the path (the decay, the
    rank-update Add, the reset Where, gather and scatter), that lead to ``state_output``."""
    producers = {name: node for node in model.graph.node for name in node.output}
    if state_input not in {value.name for value in model.graph.input} or state_output not in producers:
        raise ValueError(f"{state_input!r} must be a graph input and {state_output!r} a node output of the graph")
    carried = {state_input}
    for node in model.graph.node:  # graph order is topological
        if node.op_type in STATE_OPS and any(name in carried for name in node.input):
            carried.update(node.output)
    leads, frontier = {state_output}, [state_output]
    while frontier:
        node = producers.get(frontier.pop())
        for name in node.input if node is not None else ():
            if name in carried and name not in leads:
                leads.add(name)
                frontier.append(name)
    return [name for node in model.graph.node for name in node.output if name in leads]


def node_precision_yaml(names: Iterable[str]) -> str:
    """A ``-node-precision-info`` file keeping the nodes whose (first) outputs are ``names`` in fp32 (written by
    yaml, which quotes a name YAML would read otherwise: ``*a``, ``x: y``)."""
    import yaml

    return yaml.safe_dump({"FP32NodeInstanceNames": [str(name) for name in names]}, default_flow_style=False,
                          sort_keys=False)


def keep_in_fp32(converted: onnx.ModelProto, tensors: Iterable[str], inputs: Iterable[str] = ()) -> onnx.ModelProto:
    """``converted`` (from ``convert_to_fp16``) with ``tensors`` produced in fp32 and graph ``inputs`` read
    unrounded (fp32 custom I/O); fp16 ops reading any of them read them rounded to fp16."""
    model = onnx.ModelProto()
    model.CopyFrom(converted)
    graph = model.graph
    producers = {name: node for node in graph.node for name in node.output}
    # tensor -> its two rounding Casts, for float tensors convert_to_fp16 rounded
    kept: dict[str, list[onnx.NodeProto]] = {}
    for name in tensors:
        back = producers.get(name)
        down = producers.get(back.input[0]) if back is not None and back.op_type == "Cast" else None
        if down is not None and down.op_type == "Cast" and down.input[0] == f"{name}{RAW}":
            kept[name] = [down, back]
    island = {id(producers[f"{name}{RAW}"]) for name in kept}
    for name in inputs:
        read = f"{name}{INPUT}"
        back = producers.get(read)
        if back is None:
            raise ValueError(f"{name!r} is not a float graph input of the converted model")
        kept[read] = [producers[back.input[0]], back]
    for casts in kept.values():
        for cast in casts:
            cast.op_type = "Identity"
            del cast.attribute[:]
    rounding: dict[str, list[onnx.NodeProto]] = {}
    for name in kept:
        readers = [node for node in graph.node if name in node.input and id(node) not in island
                   and node.op_type != "Identity"]
        if not readers:
            continue
        rounded = f"{name}{ROUNDED}"
        rounding[name] = [helper.make_node("Cast", [name], [f"{rounded}{HALF}"], to=TensorProto.FLOAT16),
                          helper.make_node("Cast", [f"{rounded}{HALF}"], [rounded], to=TensorProto.FLOAT)]
        for node in readers:
            for index, value in enumerate(node.input):
                if value == name:
                    node.input[index] = rounded
    nodes = []
    for node in graph.node:
        nodes.append(node)
        for name in node.output:
            nodes.extend(rounding.get(name, ()))
    del graph.node[:]
    graph.node.extend(nodes)
    return model


# A sparse MoE router as exported: MatMul -> Softmax -> [Cast] -> TopK, the TopK values renormalised by ReduceSum and
# Div (``qeff_evs.models.sparse_moe.route``); or MatMul -> Sigmoid, a bias Added for the choice, TopK, the chosen
# scores gathered (GatherElements) and renormalised, the choice first limited to the best groups (Reshape, Where)
# where the router has groups (Nemotron-H's).
ROUTER_SCORES = frozenset({"Softmax", "Sigmoid"})
ROUTER_OPS = frozenset({"Cast", "TopK", "ReduceSum", "Div", "Add", "GatherElements", "Reshape", "Where"})


def router_paths(model: onnx.ModelProto) -> list[list[str]]:
    """Each MoE router of the graph, in graph order, as the float node outputs from its logits to its renormalised
    weights: the logits MatMul, the Softmax (or Sigmoid), casts, a choice bias, the TopK values or the gathered
    scores, their sum and quotient. A router is a Softmax or Sigmoid over a MatMul whose scores (through casts and a
    bias) feed a TopK; an attention Softmax feeds none, nor does a gate's Sigmoid."""
    producers = {name: node for node in model.graph.node for name in node.output}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in model.graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    paths = []
    for node in model.graph.node:
        logits = producers.get(node.input[0]) if node.op_type in ROUTER_SCORES else None
        if logits is None or logits.op_type != "MatMul":
            continue
        path, frontier = [logits.output[0], node.output[0]], [node.output[0]]
        while frontier:
            name = frontier.pop()
            if producers[name].op_type == "Div":  # the renormalised weights: the router ends here
                continue
            for reader in readers.get(name, ()):
                if reader.op_type in ROUTER_OPS and reader.output[0] not in path:
                    path.append(reader.output[0])
                    frontier.append(reader.output[0])
        if any(producers[name].op_type == "TopK" for name in path):
            paths.append(path)
    return paths
