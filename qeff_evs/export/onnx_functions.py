"""QEfficient's compiler-known ops as ONNX local functions, attached to our exported graphs.

The AIC compiler recognises a few functions by domain and name and lowers them with its own
kernels; every other runtime (ONNX Runtime here) inlines their bodies, which use standard ops only:

* ``com.qti.aisw.onnx::CustomRMSNorm(hidden_states, weight; epsilon)`` -- RMSNorm. QEfficient
  swaps every Qwen RMSNorm for it because the compiler's kernel does not overflow in fp16 where
  ``Pow(x, 2)`` of a plain graph would (|x| > 256). Our exports are traced with transformers'
  own norms; :func:`rewrite_rms_norms` then replaces each traced RMSNorm subgraph
  (``Pow 2 -> ReduceMean -> Add eps -> Sqrt -> Div 1 -> Mul x -> [Cast] -> Mul weight``) with one
  function node. The body computes in fp32 whatever the input dtype (Cast up, CastLike down), which
  is also how ``qeff-evs verify --fp16`` models the kernel; in an fp32 graph the casts are no-ops
  and the result is bit-identical to the subgraph it replaces.
* ``com.qualcomm.cloud::CtxScatter(data, position_ids, updates)`` and
  ``CtxScatterCB(data, batch_index, position_ids, updates)`` -- KV-cache writes: ``updates
  (B, H, S, D)`` lands at ``(b | batch_index[b], h, position_ids[b, s])`` of ``data (F, H, ctx_len,
  D)`` (one ScatterND).
* ``com.qualcomm.cloud::CtxGather(data, ctx_indices, comp_ctx_len)`` and
  ``CtxGatherCB(data, batch_index, ctx_indices, comp_ctx_len)`` -- KV-cache reads of the slots in
  ``ctx_indices (B, 1, ctx_len)``.

Skipped slots. QEfficient marks a write or read the card must skip with the index INT32_MAX: the
language graph turns padding slots (-1) into INT32_MAX before CtxScatter, and slots beyond a row's
last position into INT32_MAX before CtxGather. Standard ScatterND/GatherND reject an index out of
range, so QEfficient's own ORT runner rewrites the INT32_MAX constants to 0 -- which, for a scatter,
writes padding into slot 0 of a live row. Our bodies instead *are* the skip, in standard ops:

* the scatter bodies cost O(updates), not O(cache): every write whose slot (or batch row) lies
  outside the cache is redirected onto the call's last real write, with that write's own update (a
  duplicate of that write, index and value, which changes nothing whatever order ScatterND applies
  them in); a call without any real write (an all-padding
  decode, vllm-qaic's ``batch_index = -1`` rows) redirects them onto slot 0 of row 0 with the value
  that slot already holds. So a skipped write touches nothing, whatever its batch row, and real
  writes land exactly once with their own values. The only full-cache pass is ScatterND's copy of
  ``data`` into its output, which ONNX Runtime skips when both are one buffer: the runtime's language
  session binds each cache as both (``qeff_evs.runtime.backends.ort``);
* the gather bodies read slot 0 (and row 0) in place of a skipped index, as one Gather of
  ``head_dim`` vectors from the cache seen as ``(rows * heads * ctx_len, head_dim)``; the language
  graph zeroes what a skipped read returns (keys and values), so the card's unspecified skipped data
  and ORT's slot-0 rows both become exact zeros, which the attention mask already hides.

So the card and ONNX Runtime compute the same thing, and ORT's logits are bit for bit those of the
graphs before these functions (pads used to write the last slot, which no query reads before it is
rewritten; a masked score's softmax weight is exactly 0 either way).

Cost on ORT (``benchmarks/kv_ops_bench.py``, tiny Qwen2.5-VL, ctx_len 8192, CPU ms per call): decode
1.33 before these functions, 3.38 with scratch-slot scatters and GatherND reads, 2.71 with these
bodies; what is left over "before" is the reads (gather + zeroing), see ``benchmarks/README.md``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np
import onnx
from onnx import AttributeProto, TensorProto, helper, numpy_helper

from qeff_evs.models.ctx_ops import CTX_GATHER, CTX_GATHER_CB, CTX_SCATTER, CTX_SCATTER_CB, KV_DOMAIN

RMS_NORM_DOMAIN = "com.qti.aisw.onnx"
CUSTOM_RMS_NORM = "CustomRMSNorm"
FUNCTION_OPSET = 17  # the default-domain opset of the bodies (our exports' opset)


def _node(op: str, inputs: list[str], outputs: list[str], **attributes) -> onnx.NodeProto:
    return helper.make_node(op, inputs, outputs, **attributes)


def _const_ints(name: str, values: list[int]) -> onnx.NodeProto:
    return _node("Constant", [], [name], value=helper.make_tensor(name, TensorProto.INT64, [len(values)], values))


def _function(name: str, domain: str, inputs: list[str], nodes: list[onnx.NodeProto],
              attributes: Iterable[str] = (), doc: str = "") -> onnx.FunctionProto:
    return helper.make_function(domain, name, inputs, ["output"], nodes,
                                [helper.make_opsetid("", FUNCTION_OPSET)], attributes=list(attributes),
                                doc_string=doc)


def custom_rms_norm_function() -> onnx.FunctionProto:
    epsilon = helper.make_node("Constant", [], ["eps"])
    epsilon.attribute.append(helper.make_attribute_ref("value_float", AttributeProto.FLOAT))
    epsilon.attribute[0].ref_attr_name = "epsilon"
    nodes = [
        _node("Cast", ["hidden_states"], ["x"], to=TensorProto.FLOAT),
        _node("Cast", ["weight"], ["w"], to=TensorProto.FLOAT),
        _node("Constant", [], ["two"], value=numpy_helper.from_array(np.float32(2.0), "two")),
        _node("Pow", ["x", "two"], ["squares"]),
        _node("ReduceMean", ["squares"], ["variance"], axes=[-1], keepdims=1),
        epsilon,
        _node("Add", ["variance", "eps"], ["shifted"]),
        _node("Sqrt", ["shifted"], ["rms"]),
        _node("Constant", [], ["one"], value=numpy_helper.from_array(np.float32(1.0), "one")),
        _node("Div", ["one", "rms"], ["inverse"]),
        _node("Mul", ["x", "inverse"], ["normed"]),
        _node("CastLike", ["normed", "hidden_states"], ["normed_cast"]),
        _node("CastLike", ["w", "hidden_states"], ["w_cast"]),
        _node("Mul", ["w_cast", "normed_cast"], ["output"]),
    ]
    return _function(CUSTOM_RMS_NORM, RMS_NORM_DOMAIN, ["hidden_states", "weight"], nodes, ["epsilon"],
                     "weight * x / sqrt(mean(x^2, -1) + epsilon), computed in fp32")


def _dims(prefix: str, shape: str, axes: dict[str, int]) -> list[onnx.NodeProto]:
    """``{name: Slice(shape, [axis], [axis + 1])}`` nodes: 1-element int64 dims of a Shape output."""
    nodes = []
    for name, axis in axes.items():
        nodes += [_const_ints(f"{prefix}{name}_start", [axis]), _const_ints(f"{prefix}{name}_end", [axis + 1]),
                  _node("Slice", [shape, f"{prefix}{name}_start", f"{prefix}{name}_end"], [name])]
    return nodes


def _in_range(value: str, upper: str, out: str) -> list[onnx.NodeProto]:
    """``out = 0 <= value < upper`` (int64)."""
    return [_const_ints(f"{out}_zero", [0]),
            _node("GreaterOrEqual", [value, f"{out}_zero"], [f"{out}_lo"]),
            _node("Less", [value, upper], [f"{out}_hi"]),
            _node("And", [f"{out}_lo", f"{out}_hi"], [out])]


def _scalar(name: str, value: int) -> onnx.NodeProto:
    return _node("Constant", [], [name], value=helper.make_tensor(name, TensorProto.INT64, [], [value]))


def _range(size: str, out: str) -> list[onnx.NodeProto]:
    """``out = arange(size)`` for a 1-element int64 ``size``."""
    return [_scalar(f"{out}_start", 0), _scalar(f"{out}_step", 1),
            _node("Squeeze", [size], [f"{out}_limit"]),
            _node("Range", [f"{out}_start", f"{out}_limit", f"{out}_step"], [out])]


def _index_tuple(rows: str, heads: str, slots: str, shape: str) -> list[onnx.NodeProto]:
    """``indices (B, H, L, 3)`` of (row, head, slot) from ``rows (B, 1, 1, 1)``, ``heads (1, H, 1, 1)`` and
    ``slots (B, 1, L, 1)``, each expanded to ``shape``."""
    return [_node("Expand", [rows, shape], ["row_idx"]), _node("Expand", [heads, shape], ["head_idx"]),
            _node("Expand", [slots, shape], ["slot_idx"]),
            _node("Concat", ["row_idx", "head_idx", "slot_idx"], ["indices"], axis=3)]


def _scatter_function(batched: bool) -> onnx.FunctionProto:
    inputs = ["data", "batch_index", "position_ids", "updates"] if batched else ["data", "position_ids", "updates"]
    nodes = [_node("Shape", ["data"], ["data_shape"]), _node("Shape", ["updates"], ["updates_shape"]),
             _node("Shape", ["position_ids"], ["positions_shape"])]
    nodes += _dims("d_", "data_shape", {"rows": 0, "ctx": 2})
    nodes += _dims("u_", "updates_shape", {"batch": 0, "heads": 1, "seq": 2})
    nodes += [_const_ints("one", [1]), _const_ints("zero", [0]), _const_ints("flat", [-1]),
              _node("Concat", ["batch", "heads", "seq", "one"], ["index_shape"], axis=0)]
    nodes += _in_range("position_ids", "ctx", "slot_ok")  # (B, S)
    if batched:
        nodes += _in_range("batch_index", "rows", "row_ok")  # (B, 1), broadcast over the chunk
        nodes += [_node("And", ["slot_ok", "row_ok"], ["write"]),
                  _node("Expand", ["batch_index", "positions_shape"], ["target_row"])]  # (B, S)
    else:
        nodes += [_node("Identity", ["slot_ok"], ["write"])]
        nodes += _range("batch", "row_range")
        nodes += [_const_ints("row_axes", [1]), _node("Unsqueeze", ["row_range", "row_axes"], ["row_column"]),
                  _node("Expand", ["row_column", "positions_shape"], ["target_row"])]  # (B, S)
    # The stand-in for skipped writes: the last real write k of the call, with its own update (a
    # duplicate of an identical write, after which nothing else lands there), or, in a call without
    # any real write, slot 0 of row 0 with the value it already holds.
    nodes += [_node("Reshape", ["write", "flat"], ["write_flat"]),
              _node("Cast", ["write_flat"], ["write_int"], to=TensorProto.INT32),
              _node("ArgMax", ["write_int"], ["k"], axis=0, keepdims=1, select_last_index=1),  # (1,)
              _node("Gather", ["write_flat", "k"], ["any_write"]),
              _node("Reshape", ["target_row", "flat"], ["row_flat"]),
              _node("Gather", ["row_flat", "k"], ["k_row"]),
              _node("Reshape", ["position_ids", "flat"], ["slot_flat"]),
              _node("Gather", ["slot_flat", "k"], ["k_slot"]),
              _node("Where", ["any_write", "k_row", "zero"], ["stand_in_row"]),
              _node("Where", ["any_write", "k_slot", "zero"], ["stand_in_slot"]),
              _node("Div", ["k", "seq"], ["k_b"]), _node("Mod", ["k", "seq"], ["k_s"]),
              _node("Gather", ["updates", "k_b"], ["k_chunk"], axis=0),  # (1, H, S, D)
              _node("Gather", ["k_chunk", "k_s"], ["k_update"], axis=2),  # (1, H, 1, D)
              _const_ints("slot0_starts", [0, 0]), _const_ints("slot0_ends", [1, 1]), _const_ints("slot0_axes", [0, 2]),
              _node("Slice", ["data", "slot0_starts", "slot0_ends", "slot0_axes"], ["kept_slot0"]),  # (1, H, 1, D)
              _node("Where", ["any_write", "k_update", "kept_slot0"], ["stand_in_update"]),
              _node("Where", ["write", "target_row", "stand_in_row"], ["row"]),  # (B, S)
              _node("Where", ["write", "position_ids", "stand_in_slot"], ["slot"]),
              _const_ints("bs_axes", [1, 3]),
              _node("Unsqueeze", ["write", "bs_axes"], ["write4"]),
              _node("Where", ["write4", "updates", "stand_in_update"], ["values"])]  # (B, H, S, D)
    nodes += _range("heads", "head_range")
    nodes += [_const_ints("head_axes", [0, 2, 3]), _node("Unsqueeze", ["head_range", "head_axes"], ["head4"]),
              _node("Unsqueeze", ["row", "bs_axes"], ["row4"]), _node("Unsqueeze", ["slot", "bs_axes"], ["slot4"])]
    nodes += _index_tuple("row4", "head4", "slot4", "index_shape")
    nodes += [_node("ScatterND", ["data", "indices", "values"], ["output"])]
    name = CTX_SCATTER_CB if batched else CTX_SCATTER
    return _function(name, KV_DOMAIN, inputs, nodes,
                     doc="ScatterND of updates at (row, head, slot); writes outside the cache are skipped")


def _gather_function(batched: bool) -> onnx.FunctionProto:
    inputs = ["data", "batch_index", "ctx_indices", "comp_ctx_len"] if batched else ["data", "ctx_indices", "comp_ctx_len"]
    nodes = [_node("Shape", ["data"], ["data_shape"])]
    nodes += _dims("d_", "data_shape", {"rows": 0, "heads": 1, "ctx": 2, "dim": 3})
    nodes += [_const_ints("zero", [0]), _const_ints("one", [1]), _const_ints("flat", [-1]),
              _node("Reshape", ["comp_ctx_len", "one"], ["length"])]
    nodes += _in_range("ctx_indices", "ctx", "slot_ok")
    nodes += [_node("Where", ["slot_ok", "ctx_indices", "zero"], ["slot"])]  # (B, 1, L): skipped reads slot 0
    if batched:
        nodes += [_node("Shape", ["batch_index"], ["bi_shape"])]
        nodes += _dims("b_", "bi_shape", {"batch": 0})
        nodes += _in_range("batch_index", "rows", "row_ok")
        nodes += [_node("Where", ["row_ok", "batch_index", "zero"], ["row"])]  # (B, 1)
    else:
        nodes += [_node("Identity", ["rows"], ["batch"])]
        nodes += _range("rows", "row_range")
        nodes += [_node("Unsqueeze", ["row_range", "one"], ["row"])]  # (B, 1)
    # One Gather of D-vectors from the cache seen as (rows * heads * ctx, D), at the flat index
    # ((row * H + head) * ctx + slot): the same elements GatherND would pick, with less work per vector.
    nodes += _range("heads", "head_range")
    nodes += [_const_ints("head_axes", [0, 2]), _node("Unsqueeze", ["head_range", "head_axes"], ["head3"]),
              _const_ints("row_axes", [2]), _node("Unsqueeze", ["row", "row_axes"], ["row3"]),
              _node("Mul", ["row3", "heads"], ["row_heads"]), _node("Add", ["row_heads", "head3"], ["plane"]),
              _node("Mul", ["plane", "ctx"], ["plane_start"]), _node("Add", ["plane_start", "slot"], ["flat_slot"]),
              _node("Concat", ["batch", "heads", "length"], ["index_shape"], axis=0),
              _node("Expand", ["flat_slot", "index_shape"], ["flat_index"]),  # (B, H, comp_ctx_len)
              _node("Concat", ["flat", "dim"], ["vectors_shape"], axis=0),
              _node("Reshape", ["data", "vectors_shape"], ["vectors"]),
              _node("Gather", ["vectors", "flat_index"], ["output"], axis=0)]
    name = CTX_GATHER_CB if batched else CTX_GATHER
    return _function(name, KV_DOMAIN, inputs, nodes,
                     doc="Gather of the slots in ctx_indices; an index outside the cache reads slot 0 (of row 0)")


def custom_functions() -> dict[tuple[str, str], onnx.FunctionProto]:
    functions = [custom_rms_norm_function(), _scatter_function(False), _scatter_function(True),
                 _gather_function(False), _gather_function(True)]
    return {(f.domain, f.name): f for f in functions}


def attach_functions(model: onnx.ModelProto) -> onnx.ModelProto:
    """Add the function bodies (and their domains' opset imports) for every custom node the graph (or a function of
    it) uses."""
    available = custom_functions()
    nodes = [*model.graph.node, *(node for function in model.functions for node in function.node)]
    used = {(node.domain, node.op_type) for node in nodes if (node.domain, node.op_type) in available}
    present = {(f.domain, f.name) for f in model.functions}
    for key in sorted(used - present):
        model.functions.append(available[key])
    imported = {opset.domain for opset in model.opset_import}
    for domain in sorted({domain for domain, _ in used} - imported):
        model.opset_import.append(helper.make_opsetid(domain, 1))
    return model


def _constant_values(model: onnx.ModelProto, base_dir: str = "") -> dict[str, np.ndarray]:
    """Scalar initializers and every Constant node's value (the matcher only asks about scalars).

    A model over 2 GB keeps its tensors (initializers, and Constant values such as the RoPE tables) in
    files beside it (``base_dir``); only scalars are read, never a weight or a table.
    """
    values = {init.name: numpy_helper.to_array(init, base_dir=base_dir) for init in model.graph.initializer
              if math.prod(init.dims) == 1}
    for node in model.graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value" \
                and math.prod(node.attribute[0].t.dims) == 1:
            values[node.output[0]] = numpy_helper.to_array(node.attribute[0].t, base_dir=base_dir)
    return values


def _is_scalar(values: dict, name: str, expected: float | None = None) -> bool:
    value = values.get(name)
    return value is not None and value.size == 1 and (expected is None or float(value.reshape(())) == expected)


def rewrite_rms_norms(model: onnx.ModelProto, base_dir: str = "") -> int:
    """Replace every traced RMSNorm subgraph with a ``CustomRMSNorm`` node; returns how many.

    Matched chain (what transformers' Qwen RMSNorms trace to, every link the only consumer of the
    previous one): ``Pow(x, 2) -> ReduceMean(axes=[-1], keepdims=1) -> Add(eps) -> Sqrt ->
    Div(1, .) -> Mul(x, .) -> [Cast] -> Mul(weight, .)``. Anything else is left as it is.
    """
    graph = model.graph
    values = _constant_values(model, base_dir)
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    graph_outputs = {value.name for value in graph.output}

    def only_consumer(node: onnx.NodeProto, op_types: tuple[str, ...]) -> onnx.NodeProto | None:
        users = consumers.get(node.output[0], [])
        if len(users) != 1 or node.output[0] in graph_outputs or users[0].op_type not in op_types:
            return None
        return users[0]

    replaced: list[tuple[list[onnx.NodeProto], onnx.NodeProto]] = []
    for pow_node in [node for node in graph.node if node.op_type == "Pow"]:
        x = pow_node.input[0]
        if not _is_scalar(values, pow_node.input[1], 2.0):
            continue
        mean = only_consumer(pow_node, ("ReduceMean",))
        if mean is None or {a.name: helper.get_attribute_value(a) for a in mean.attribute} != {"axes": [-1], "keepdims": 1}:
            continue
        add = only_consumer(mean, ("Add",))
        eps_name = None if add is None else next((i for i in add.input if i != mean.output[0]), None)
        if add is None or not _is_scalar(values, eps_name):
            continue
        sqrt = only_consumer(add, ("Sqrt",))
        inverse = sqrt and only_consumer(sqrt, ("Div",))
        if inverse is None or list(inverse.input[1:]) != [sqrt.output[0]] or not _is_scalar(values, inverse.input[0], 1.0):
            continue
        scale = only_consumer(inverse, ("Mul",))
        if scale is None or set(scale.input) != {x, inverse.output[0]}:
            continue
        chain = [pow_node, mean, add, sqrt, inverse, scale]
        last = only_consumer(scale, ("Cast", "Mul"))
        if last is not None and last.op_type == "Cast":
            chain.append(last)
            last = only_consumer(last, ("Mul",))
        if last is None:
            continue
        weight = next((i for i in last.input if i != chain[-1].output[0]), None)
        if weight is None:
            continue
        chain.append(last)
        epsilon = float(values[eps_name].reshape(()))
        fused = helper.make_node(CUSTOM_RMS_NORM, [x, weight], [last.output[0]], domain=RMS_NORM_DOMAIN,
                                 name=f"{pow_node.name or x}/CustomRMSNorm", epsilon=epsilon)
        replaced.append((chain, fused))

    if replaced:
        drop = {id(node) for chain, _ in replaced for node in chain}
        first = {id(chain[-1]): fused for chain, fused in replaced}
        kept = []
        for node in graph.node:
            if id(node) in first:
                kept.append(first[id(node)])
            elif id(node) not in drop:
                kept.append(node)
        del graph.node[:]
        graph.node.extend(kept)
        _drop_unused_constants(graph)
        attach_functions(model)
    return len(replaced)


def _drop_unused_constants(graph: onnx.GraphProto) -> None:
    used = {name for node in graph.node for name in node.input} | {value.name for value in graph.output}
    kept = [node for node in graph.node if node.op_type != "Constant" or node.output[0] in used]
    del graph.node[:]
    graph.node.extend(kept)
