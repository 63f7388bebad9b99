"""An emulation of ``qaic-compile -convert-to-fp16`` on ONNX Runtime (for ``qeff-evs verify --fp16``).

On the card every float tensor of a converted graph is fp16: weights and constants (values beyond the
fp16 range saturate), inputs, and the output of every op. The copy made here keeps fp32 types, so every
op has an ONNX Runtime kernel, but rounds exactly those tensors through fp16: constants and
initializers are stored fp16-rounded, and every float input and every float op output passes through
``Cast(fp16) -> Cast(fp32)``. An op therefore computes from fp16 values and its result is rounded to
fp16 (an overflow becomes inf), as on a device with fp32 accumulators. (Converting the graph's types
to fp16 instead is not faithful: ONNX Runtime runs ops without an fp16 CPU kernel as fp32 islands and
drops the casts between them, so e.g. an fp16 overflow between two such ops never happens.)

Compiler-known functions are single ops here: their outputs are rounded, their bodies are not. That
models ``CustomRMSNorm`` as the compiler's kernel, which squares in fp32 (QEfficient adds it against
exactly this overflow); the Ctx* bodies only move data.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, external_data_helper, helper, numpy_helper, shape_inference

FP16_MAX = float(np.finfo(np.float16).max)
SKELETON_ELEMENTS = 1 << 16  # initializers up to this many elements keep their values for shape inference


def round_to_fp16(values: np.ndarray) -> np.ndarray:
    """fp32 values rounded to fp16, finite values beyond the fp16 range saturated (infinities stay)."""
    values = np.asarray(values, dtype=np.float32)
    saturated = np.where(np.isfinite(values), np.clip(values, -FP16_MAX, FP16_MAX), values)
    return saturated.astype(np.float16).astype(np.float32)


def _round_tensor(tensor: onnx.TensorProto) -> onnx.TensorProto:
    if tensor.data_type != TensorProto.FLOAT:
        return tensor
    return numpy_helper.from_array(round_to_fp16(numpy_helper.to_array(tensor)), tensor.name)


def _typed_skeleton(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` without its large initializers' values: each becomes a graph input of its type and shape.

    Type inference needs no weights, and a released-width graph is past protobuf's 2 GB, which
    ``infer_shapes`` cannot take; small initializers (shapes, axes) keep their values for shape inference."""
    skeleton = onnx.ModelProto(ir_version=model.ir_version)
    skeleton.opset_import.extend(model.opset_import)
    skeleton.functions.extend(model.functions)
    graph = skeleton.graph
    graph.name = model.graph.name
    graph.node.extend(model.graph.node)
    graph.input.extend(model.graph.input)
    graph.output.extend(model.graph.output)
    inputs = {value.name for value in model.graph.input}
    for tensor in model.graph.initializer:
        if int(np.prod(tensor.dims)) <= SKELETON_ELEMENTS and tensor.data_location != TensorProto.EXTERNAL:
            graph.initializer.append(tensor)
        elif tensor.name not in inputs:
            graph.input.append(helper.make_tensor_value_info(tensor.name, tensor.data_type, list(tensor.dims)))
    return skeleton


def _float_names(model: onnx.ModelProto) -> set[str]:
    inferred = shape_inference.infer_shapes(_typed_skeleton(model))
    graph = inferred.graph
    return {value.name for value in [*graph.value_info, *graph.input, *graph.output]
            if value.type.tensor_type.elem_type == TensorProto.FLOAT}


def _stored_tensors(model: onnx.ModelProto):
    """The graph's initializers and its nodes' tensor attributes (torch stores a large Constant's value in an
    external file too)."""
    yield from model.graph.initializer
    for node in model.graph.node:
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.TENSOR:
                yield attribute.t


def round_external_weights(model: onnx.ModelProto, source: Path, target: Path, location: str) -> None:
    """Write the initializers ``model`` (loaded without its external data) keeps in files under ``source`` to
    ``target / location``, float ones rounded through fp16, one tensor at a time, and point ``model`` at them.

    A released-width graph's weights never enter the proto: a cleared protobuf field does not give its memory
    back, so loading, rounding and dropping them would hold the graph twice."""
    with open(target / location, "wb") as out:
        for tensor in _stored_tensors(model):
            if tensor.data_location != TensorProto.EXTERNAL:
                continue
            info = external_data_helper.ExternalDataInfo(tensor)
            with open(source / info.location, "rb") as f:
                f.seek(info.offset or 0)
                data = f.read(info.length) if info.length else f.read()
            if tensor.data_type == TensorProto.FLOAT:
                data = round_to_fp16(np.frombuffer(data, dtype="<f4")).astype("<f4").tobytes()
            offset = out.tell()
            out.write(data)
            del tensor.external_data[:]
            for key, value in (("location", location), ("offset", str(offset)), ("length", str(len(data)))):
                entry = tensor.external_data.add()
                entry.key, entry.value = key, value


def convert_to_fp16(model: onnx.ModelProto, in_place: bool = False) -> onnx.ModelProto:
    """A copy of ``model`` whose every float tensor is rounded through fp16 (see the module docstring);
    ``in_place``: ``model`` itself, converted (a released-width graph is gigabytes: no second copy). Initializers
    and Constant values in external data (a model loaded without it) are left to ``round_external_weights``."""
    floats = _float_names(model)
    if in_place:
        copy = model
    else:
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
    graph = copy.graph
    for tensor in graph.initializer:  # one tensor at a time, so only one extra tensor is ever held
        if tensor.data_type == TensorProto.FLOAT and tensor.data_location != TensorProto.EXTERNAL:
            tensor.CopyFrom(_round_tensor(tensor))

    def rounded(source: str, target: str) -> list[onnx.NodeProto]:
        return [helper.make_node("Cast", [source], [f"{target}__half"], to=TensorProto.FLOAT16),
                helper.make_node("Cast", [f"{target}__half"], [target], to=TensorProto.FLOAT)]

    renamed: dict[str, str] = {}
    nodes: list[onnx.NodeProto] = []
    for value in graph.input:
        if value.name in floats:
            renamed[value.name] = f"{value.name}__fp16"
            nodes += rounded(value.name, renamed[value.name])
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.TENSOR and attribute.t.data_location != TensorProto.EXTERNAL:
                attribute.t.CopyFrom(_round_tensor(attribute.t))
        for index, name in enumerate(node.input):
            node.input[index] = renamed.get(name, name)
        nodes.append(node)
        for index, name in enumerate(node.output):
            if name in floats and node.op_type != "Constant":
                node.output[index] = f"{name}__raw"
                nodes += rounded(f"{name}__raw", name)
    del graph.node[:]
    graph.node.extend(nodes)
    del graph.value_info[:]
    return copy
