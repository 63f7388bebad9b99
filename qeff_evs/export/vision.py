"""Export a family's vision(+EVS) wrapper to ONE ONNX file that serves every grid, frame count and K.

The wrapper declares its graph interface (input/output names in ``forward`` order and the named
symbol of each dynamic axis) as a ``VisionGraphSpec``, and builds example inputs for a grid.
Every dynamic dimension gets a named symbol so a specialization can bind it; the exported
file is checked for that and for the absence of data-dependent ops (NonZero).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import onnx
import torch

ONNX_OPSET = 17  # what QEfficient's legacy export path uses
# Ops whose output shape depends on tensor values; a QAIC specialization cannot hold them.
DATA_DEPENDENT_OPS = frozenset({"NonZero", "Unique", "Compress"})

_LOG = logging.getLogger(__name__)

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


class ExportableVision(Protocol):
    """What ``export_vision_graph`` needs from a family's vision(+EVS) wrapper."""

    graph_spec: VisionGraphSpec

    def dummy_inputs(self, grid_thw: Sequence[int], retained: int) -> dict[str, torch.Tensor]:
        """Example inputs for one grid and K, keyed (and ordered) like ``graph_spec.inputs``."""

    def __call__(self, *args: torch.Tensor): ...


def export_vision_graph(
    wrapper: ExportableVision,
    example_grid: Sequence[int],
    example_retained: int,
    path: str | Path,
    progress: Callable[[str], None] | None = None,
) -> Path:
    """Trace ``wrapper`` on one example grid and write the ONNX graph to ``path``; returns the path.

    The example only has to be valid (the graph keeps every grid-dependent size symbolic); pick
    one with T > 1 and K < T*h*w so every op of the EVS selection is traced.
    ``progress`` receives human-readable status lines (default: this module's logger).
    """
    say = progress or _LOG.info
    spec = wrapper.graph_spec
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    inputs = wrapper.dummy_inputs(example_grid, example_retained)
    if list(inputs) != spec.input_names:
        raise ValueError(
            f"dummy_inputs returned {list(inputs)} but graph_spec declares {spec.input_names}; "
            "make the wrapper build its example inputs in forward order"
        )
    say(f"exporting vision graph for example grid {tuple(example_grid)}, K={example_retained} -> {path}")
    was_training = wrapper.training
    wrapper.eval()
    try:
        with torch.no_grad(), warnings.catch_warnings():
            # The legacy exporter is deprecated upstream but is QEfficient's path; silence only that notice.
            warnings.filterwarnings("ignore", category=DeprecationWarning)
            torch.onnx.export(
                wrapper,
                tuple(inputs.values()),
                str(path),
                input_names=spec.input_names,
                output_names=spec.output_names,
                dynamic_axes=spec.dynamic_axes,
                opset_version=ONNX_OPSET,
                dynamo=False,
            )
    finally:
        wrapper.train(was_training)
    check_vision_graph(onnx.load(str(path), load_external_data=False), spec)
    say(f"vision graph written: {path} ({path.stat().st_size / 1e6:.2f} MB)")
    return path


def _dims(value_info: onnx.ValueInfoProto) -> list[onnx.TensorShapeProto.Dimension]:
    return list(value_info.type.tensor_type.shape.dim)


def check_vision_graph(model: onnx.ModelProto, spec: VisionGraphSpec) -> None:
    """Raise ``ValueError`` unless the graph has the spec's I/O, only named dynamic dims, and no NonZero."""
    graph = model.graph
    declared = {**spec.inputs, **spec.outputs}
    found = {vi.name: vi for vi in [*graph.input, *graph.output]}
    missing = [name for name in declared if name not in found]
    if missing:
        raise ValueError(
            f"exported vision graph lacks {missing}; every declared input must be used by forward "
            "(the exporter drops unused inputs)"
        )
    for name, axes in declared.items():
        for index, dim in enumerate(_dims(found[name])):
            want = axes.get(index)
            if want is not None and dim.dim_param != want:
                got = dim.dim_param or dim.dim_value
                raise ValueError(f"{name} axis {index} is {got!r}, expected symbol {want!r}; re-export with it named")
            if want is None and not dim.HasField("dim_value"):
                raise ValueError(
                    f"{name} axis {index} is dynamic ({dim.dim_param!r}) but has no declared symbol; "
                    "add it to the wrapper's graph_spec"
                )
    bad_ops = sorted({node.op_type for node in graph.node} & DATA_DEPENDENT_OPS)
    if bad_ops:
        raise ValueError(f"vision graph contains data-dependent ops {bad_ops}; rewrite them as TopK/Gather/Where")
