"""What both exporters share: the legacy torch.onnx export call and the checks every graph must pass.

Every graph is exported with the TorchScript exporter at opset 17 (QEfficient's path), must name
every dynamic dimension (QAIC binds each one in every specialization), and must not contain ops
whose output shape depends on data.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path

import onnx
import torch

from qeff_evs.export.onnx_functions import attach_functions, rewrite_rms_norms

ONNX_OPSET = 17  # what QEfficient's legacy export path uses
DATA_DEPENDENT_OPS = frozenset({"NonZero", "Unique", "Compress"})


def legacy_export(module: torch.nn.Module, inputs: Sequence[torch.Tensor], path: Path, *,
                  input_names: Sequence[str], output_names: Sequence[str],
                  dynamic_axes: Mapping[str, Mapping[int, str]], ignore_messages: Sequence[str] = ()) -> None:
    """``torch.onnx.export`` (TorchScript, opset 17) in eval mode; only known-harmless warnings silenced."""
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad(), warnings.catch_warnings():
            # The legacy exporter is deprecated upstream but is QEfficient's path; silence only that notice.
            warnings.filterwarnings("ignore", category=DeprecationWarning)
            for message in ignore_messages:
                warnings.filterwarnings("ignore", message=message)
            torch.onnx.export(module, tuple(inputs), str(path), input_names=list(input_names),
                              output_names=list(output_names), dynamic_axes={k: dict(v) for k, v in dynamic_axes.items()},
                              opset_version=ONNX_OPSET, dynamo=False)
    finally:
        module.train(was_training)
    add_compiler_functions(path)


def trace_without_weights(module: torch.nn.Module, inputs: Sequence[torch.Tensor], *, input_names: Sequence[str],
                          output_names: Sequence[str], dynamic_axes: Mapping[str, Mapping[int, str]],
                          ignore_messages: Sequence[str] = ()) -> onnx.ModelProto:
    """``torch.onnx.export`` as ``legacy_export`` does it, but with ``module``'s parameters left as graph inputs named
    by their ``state_dict`` names: no weight is serialized, none folded, none merged with an equal one. The streamed
    export traces hollow modules (``qeff_evs.models.hollow``) this way and writes the weights itself
    (``qeff_evs.export.weights``). No compiler functions are attached yet."""
    was_training = module.training
    module.eval()
    buffer = io.BytesIO()
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=DeprecationWarning)
            for message in ignore_messages:
                warnings.filterwarnings("ignore", message=message)
            torch.onnx.export(module, tuple(inputs), buffer, input_names=list(input_names),
                              output_names=list(output_names),
                              dynamic_axes={k: dict(v) for k, v in dynamic_axes.items()}, opset_version=ONNX_OPSET,
                              dynamo=False, export_params=False, keep_initializers_as_inputs=True,
                              do_constant_folding=False)
    finally:
        module.train(was_training)
    return onnx.load_from_string(buffer.getvalue())


def add_compiler_functions(path: Path) -> None:
    """Rewrite RMSNorms to ``CustomRMSNorm`` and attach every compiler-known function body, in place.

    Only nodes and functions change, so weights stored as external data stay where they are.
    """
    model = onnx.load(str(path), load_external_data=False)
    rewrite_rms_norms(model, base_dir=str(Path(path).parent))
    attach_functions(model)
    onnx.save(model, str(path))


def check_named_axes(model: onnx.ModelProto, dynamic_axes: Mapping[str, Mapping[int, str]], label: str,
                     fix: str) -> None:
    """Every declared axis carries its symbol; no other axis of any graph I/O is dynamic."""
    graph = model.graph
    for value in [*graph.input, *graph.output]:
        declared = dynamic_axes.get(value.name, {})
        for index, dim in enumerate(value.type.tensor_type.shape.dim):
            want = declared.get(index)
            if want is not None and dim.dim_param != want:
                got = dim.dim_param or dim.dim_value
                raise ValueError(f"{label}: {value.name} axis {index} is {got!r}, expected symbol {want!r}")
            if want is None and not dim.HasField("dim_value"):
                raise ValueError(
                    f"{label}: {value.name} axis {index} is dynamic ({dim.dim_param!r}) with no declared symbol; {fix}")


def check_static_ops(model: onnx.ModelProto, label: str) -> None:
    bad_ops = sorted({node.op_type for node in model.graph.node} & DATA_DEPENDENT_OPS)
    if bad_ops:
        raise ValueError(f"{label} contains data-dependent ops {bad_ops}; rewrite them as TopK/Gather/Where")
