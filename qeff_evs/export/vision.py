"""Export a family's vision(+EVS) wrapper to ONE ONNX file that serves every grid, frame count and K.

The wrapper declares its graph interface (input/output names in ``forward`` order and the named
symbol of each dynamic axis) as a ``VisionGraphSpec``, and builds example inputs for a grid.
Every dynamic dimension gets a named symbol so a specialization can bind it; the exported
file is checked for that and for the absence of data-dependent ops (NonZero).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Protocol

import onnx
import torch

from qeff_evs.export.onnx_graph import check_named_axes, check_static_ops, legacy_export
from qeff_evs.models.graph_io import VisionGraphSpec

_LOG = logging.getLogger(__name__)

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
    legacy_export(wrapper, list(inputs.values()), path, input_names=spec.input_names,
                  output_names=spec.output_names, dynamic_axes=spec.dynamic_axes)
    check_vision_graph(onnx.load(str(path), load_external_data=False), spec)
    say(f"vision graph written: {path} ({path.stat().st_size / 1e6:.2f} MB)")
    return path


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
    check_named_axes(model, declared, "vision graph", "add it to the wrapper's graph_spec")
    check_static_ops(model, "vision graph")
