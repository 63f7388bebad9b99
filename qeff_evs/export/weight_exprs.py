"""What each initializer of a streamed export's traced graph is: ``cut_weights`` takes the ops constant folding would
have folded on a hollow module's parameter inputs out of the graph, each weight the rest of the graph reads becoming a
``WeightExpr`` (those ops, and the parameters they start from), which ``weights.write_weights`` computes from the
checkpoint's tensors. Written here, not left to ONNX Runtime's or onnx's folding, because the parameters are not in
the graph (they are never in memory twice) and the bytes must equal what torch.onnx's own folding gives."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper, shape_inference

# The ops torch.onnx's constant folding folds when their inputs are all constants or parameters (its
# ``runTorchBackendForOnnx``), and only those: a weight or constant computed by anything else (an ``Exp``) is computed by
# the runtime in the in-memory export too, so it is here.
FOLDED_OPS = {"Constant", "Slice", "Concat", "Sqrt", "Div", "Mul", "Sub", "Add", "Unsqueeze", "Squeeze", "Transpose",
              "Cast", "Reshape", "Shape", "ReduceProd", "Gather", "Range", "Where", "Equal", "Greater", "Less", "Neg",
              "Not", "Size", "Softmax"}
# Ops that only move elements: a weight made by these alone may be cast to its stored dtype before them.
LAYOUT_OPS = {"Constant", "Transpose", "Reshape", "Squeeze", "Unsqueeze"}


@dataclass(frozen=True)
class WeightExpr:
    """An initializer of a traced graph as a function of module parameters.

    ``nodes`` (standard ONNX ops, in graph order, with the constants they read) applied to the parameter inputs
    ``sources`` give ``output``; with no nodes, ``output`` is the one source itself.
    """

    output: str
    sources: tuple[str, ...]
    nodes: tuple[onnx.NodeProto, ...] = ()

    def signature(self) -> str:
        """The ops, with value names replaced by positions: equal for two weights computed alike."""
        names = {name: f"s{at}" for at, name in enumerate(self.sources)}
        canonical = []
        for node in self.nodes:
            copy = onnx.NodeProto()
            copy.CopyFrom(node)
            copy.name = ""
            for index, name in enumerate(copy.input):
                copy.input[index] = names.get(name, name)
            for index, name in enumerate(copy.output):
                names.setdefault(name, f"v{len(names)}")
                copy.output[index] = names[name]
            canonical.append(copy.SerializeToString(deterministic=True))
        return hashlib.sha256(b"|".join(canonical)).hexdigest()[:16] if canonical else ""

    @property
    def ops(self) -> str:
        """``Transpose``, ``Cast+Add``...: the op chain of a computed weight (empty for a parameter itself)."""
        return "+".join(node.op_type for node in self.nodes if node.op_type != "Constant")

    def evaluate(self, sources: Sequence[np.ndarray]) -> np.ndarray:
        """The weight computed from the sources' arrays (in ``sources`` order), with PyTorch's kernels where it has
        them (``_TORCH_OPS``): the in-memory export's constant folding ran those, and ``exp`` differs by an ulp
        between libraries."""
        if not self.nodes:
            return sources[0]
        if all(node.op_type in _TORCH_OPS for node in self.nodes):
            import torch

            values = {name: torch.from_numpy(np.asarray(array)) for name, array in zip(self.sources, sources)}
            for node in self.nodes:
                args = [values[name] if name else None for name in node.input]
                attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
                values[node.output[0]] = _TORCH_OPS[node.op_type](*args, **attrs)
            return values[self.output].contiguous().numpy()
        from onnx.reference import ReferenceEvaluator

        inputs = [helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(array.dtype), list(array.shape))
                  for name, array in zip(self.sources, sources)]
        graph = helper.make_graph(list(self.nodes), "weight", inputs,
                                  [helper.make_empty_tensor_value_info(self.output)])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        return np.asarray(ReferenceEvaluator(model).run(None, dict(zip(self.sources, sources)))[0])


def _torch_ops() -> dict:
    """ONNX op -> the PyTorch computation of it (opset 17), for the ops a weight's expression holds."""
    import torch

    def ints(tensor) -> list[int]:
        return [int(v) for v in tensor.reshape(-1).tolist()]

    def reshape(data, shape, allowzero=0):
        dims = ints(shape)
        dims = [data.shape[i] if d == 0 and not allowzero else d for i, d in enumerate(dims)]
        return data.reshape(dims)

    def slice_(data, starts, ends, axes=None, steps=None):
        axes = ints(axes) if axes is not None else list(range(len(ints(starts))))
        steps = ints(steps) if steps is not None else [1] * len(axes)
        index = [slice(None)] * data.dim()
        for axis, start, end, step in zip(axes, ints(starts), ints(ends), steps):
            size = data.shape[axis]
            start, end = max(min(start, size), -size), max(min(end, size), -size - 1)
            index[axis] = slice(start, end, step)
        return data[tuple(index)]

    def gather(data, indices, axis=0):
        if indices.dim() == 0:
            return data.select(axis, int(indices))
        return data.index_select(axis, indices.reshape(-1)).reshape(
            *data.shape[:axis], *indices.shape, *data.shape[axis + 1:])

    def squeeze(data, axes=None):
        return data.squeeze() if axes is None else data.squeeze(tuple(ints(axes)))

    def unsqueeze(data, axes):
        for axis in sorted(a % (data.dim() + len(ints(axes))) for a in ints(axes)):
            data = data.unsqueeze(axis)
        return data

    def cast(data, to):
        return data.to(_TORCH_DTYPES[to])

    def div(a, b):  # as torch.onnx's folding: integer division keeps the integer type
        out = torch.div(a, b)
        return out.to(a.dtype) if a.dtype == b.dtype else out

    def reduce_prod(data, axes=None, keepdims=1):
        axes = sorted((a % data.dim() for a in axes) if axes is not None else range(data.dim()), reverse=True)
        for axis in axes:
            data = torch.prod(data, axis, keepdim=bool(keepdims))
        return data

    return {
        "Constant": lambda value: torch.from_numpy(numpy_helper.to_array(value).copy()),
        "Cast": cast, "Neg": torch.neg, "Sqrt": torch.sqrt, "Add": torch.add, "Sub": torch.sub, "Mul": torch.mul,
        "Div": div, "Transpose": lambda data, perm: data.permute(perm),
        "Reshape": reshape, "Slice": slice_, "Gather": gather, "Squeeze": squeeze, "Unsqueeze": unsqueeze,
        "Concat": lambda *parts, axis: torch.cat(parts, dim=axis), "ReduceProd": reduce_prod,
        "Range": lambda start, limit, delta: torch.arange(start.item(), limit.item(), delta.item(), dtype=start.dtype),
        "Where": torch.where, "Equal": torch.eq, "Greater": torch.greater, "Less": torch.less,
        "Not": torch.logical_not, "Softmax": lambda data, axis=-1: torch.softmax(data, axis),
        "Shape": lambda data, start=0, end=None: torch.tensor(list(data.shape)[start:end], dtype=torch.int64),
        "Size": lambda data: torch.tensor(data.numel(), dtype=torch.int64),
    }


_TORCH_DTYPES: dict = {}
_TORCH_OPS: dict = {}


def _init_torch_ops() -> None:
    import torch

    _TORCH_DTYPES.update({TensorProto.FLOAT: torch.float32, TensorProto.FLOAT16: torch.float16,
                          TensorProto.BFLOAT16: torch.bfloat16, TensorProto.DOUBLE: torch.float64,
                          TensorProto.INT64: torch.int64, TensorProto.INT32: torch.int32, TensorProto.BOOL: torch.bool})
    _TORCH_OPS.update(_torch_ops())


_init_torch_ops()


def _static_shapes(model: onnx.ModelProto) -> dict[str, list[int]]:
    inferred = shape_inference.infer_shapes(model)
    shapes = {}
    for value in [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]:
        dims = value.type.tensor_type.shape.dim
        if value.type.tensor_type.HasField("shape") and all(d.HasField("dim_value") for d in dims):
            shapes[value.name] = [d.dim_value for d in dims]
    return shapes


def _shape_constant(node: onnx.NodeProto, dims: list[int]) -> onnx.NodeProto:
    """``node`` (a ``Shape`` or ``Size`` of a weight) as the ``Constant`` it is once the weight's shape is known."""
    if node.op_type == "Size":
        value = np.asarray(int(np.prod(dims)), dtype=np.int64)
    else:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        start, end = attrs.get("start", 0), attrs.get("end", len(dims))
        value = np.asarray(dims[start:end], dtype=np.int64)
    return helper.make_node("Constant", [], [node.output[0]], name=node.name,
                            value=numpy_helper.from_array(value, node.output[0]))


def _rank(node: onnx.NodeProto | None) -> int | None:
    """The rank of a ``Constant`` node's value (None for anything else)."""
    if node is None or node.op_type != "Constant" or not node.attribute or node.attribute[0].name != "value":
        return None
    return len(node.attribute[0].t.dims)


def cut_weights(model: onnx.ModelProto, parameters: Iterable[str]) -> dict[str, WeightExpr]:
    """Take the ops on ``parameters`` (graph inputs) out of ``model``, in place; return each value they produced that
    the graph still reads, by name, as a ``WeightExpr``. Those values and the parameters are left undefined in the
    graph (``attach_weights`` defines them); a ``Shape`` of a weight becomes a constant."""
    graph = model.graph
    parameters = {name for name in parameters}
    shapes = None
    depends: dict[str, frozenset[str]] = {init.name: frozenset() for init in graph.initializer}
    depends.update({name: frozenset({name}) for name in parameters})
    producer: dict[str, onnx.NodeProto] = {}
    nodes = []
    for node in graph.node:
        inputs = [name for name in node.input if name]
        static = node.op_type == "Constant" or (
            node.domain in ("", "ai.onnx") and node.op_type in FOLDED_OPS and all(name in depends for name in inputs)
            and not (node.op_type == "Gather" and _rank(producer.get(node.input[1])) not in (0, 1))
            and not (node.op_type == "Transpose" and not any(a.name == "perm" for a in node.attribute)))
        if static:
            deps = frozenset().union(*(depends[name] for name in inputs)) if inputs else frozenset()
            if deps and node.op_type in ("Shape", "Size"):
                shapes = _static_shapes(model) if shapes is None else shapes
                if node.input[0] not in shapes:
                    raise ValueError(f"the shape of {node.input[0]!r} is not static; a weight's shape must be")
                node, deps = _shape_constant(node, shapes[node.input[0]]), frozenset()
            for name in node.output:
                depends[name] = deps
                producer[name] = node
        nodes.append(node)
    # Every op on constants alone is folded: on the parameters into the weights, the rest into Constants, as the
    # in-memory export's constant folding does (with the same PyTorch kernels, WeightExpr.evaluate).
    folded = {id(producer[name]) for name in depends if name in producer and producer[name].op_type != "Constant"}
    read = {name for node in nodes if id(node) not in folded for name in node.input}
    read |= {value.name for value in graph.output}

    def closure_of(name: str) -> tuple[onnx.NodeProto, ...]:
        closure, frontier = {}, [name]
        while frontier:
            node = producer.get(frontier.pop())
            if node is None or id(node) in closure:
                continue
            closure[id(node)] = node
            frontier += [value for value in node.input if value]
        return tuple(node for node in nodes if id(node) in closure)

    exprs, constants = {}, {}
    for name in sorted(read):
        if name not in depends or (name in producer and producer[name].op_type == "Constant"):
            continue
        if depends[name]:
            exprs[name] = WeightExpr(name, tuple(sorted(depends[name])), closure_of(name))
        elif name in producer:
            value = WeightExpr(name, (), closure_of(name)).evaluate([])
            constants[id(producer[name])] = constants.get(id(producer[name]), []) + [
                helper.make_node("Constant", [], [name], name=f"{name}/folded",
                                 value=numpy_helper.from_array(np.asarray(value), name))]
    kept = []
    for node in nodes:
        if id(node) in folded:
            kept += constants.get(id(node), [])
        else:
            kept.append(node)
    # Constants only folded ops read are read no more.
    read = {name for node in kept for name in node.input} | {value.name for value in graph.output}
    kept = [node for node in kept if node.op_type != "Constant" or node.output[0] in read]
    del graph.node[:]
    graph.node.extend(kept)
    kept = [value for value in graph.input if value.name not in parameters]
    del graph.input[:]
    graph.input.extend(kept)
    return exprs
