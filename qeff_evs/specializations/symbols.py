"""Which dimension symbols a graph uses, and whether a specialization set binds them all.

``qaic-compile`` needs a static shape for every input/output of every specialization; a
dynamic dimension whose symbol a specialization leaves unbound fails the compile (on a
machine that may be far from the one that exported). This check runs before any file is
written so the mistake surfaces at export time, with the symbol, graph and entry named.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import onnx

from .sets import Specialization

Dimension = str | int | None  # symbol name, fixed size, or None for an unnamed dynamic dim
ModelSource = str | Path | onnx.ModelProto

# The legacy exporter names undeclared dynamic output axes "<OpType><output>_dim_<i>"
# (e.g. "MatMuly_dim_1"), even for axes whose size is in fact fixed.
_EXPORTER_INVENTED = re.compile(r"_dim_\d+$")


def load_graph(model: ModelSource) -> tuple[onnx.ModelProto, str]:
    """The model proto (weights stay on disk) and a label naming the graph in messages."""
    if isinstance(model, onnx.ModelProto):
        return model, model.graph.name or "<in-memory graph>"
    path = Path(model)
    if not path.is_file():
        raise ValueError(f"ONNX file {path} does not exist; export the graph first")
    return onnx.load(str(path), load_external_data=False), str(path)


def _dimensions(value_info: onnx.ValueInfoProto) -> list[Dimension]:
    tensor_type = value_info.type.tensor_type
    if not tensor_type.HasField("shape"):
        return []
    dims: list[Dimension] = []
    for dim in tensor_type.shape.dim:
        if dim.HasField("dim_param") and dim.dim_param:
            dims.append(dim.dim_param)
        elif dim.HasField("dim_value"):
            dims.append(int(dim.dim_value))
        else:
            dims.append(None)
    return dims


def graph_symbols(model: ModelSource) -> dict[str, list[Dimension]]:
    """``{input/output name: [symbol | size | None, ...]}`` for the graph's inputs then outputs.

    Initializers listed as graph inputs (weights) are skipped; ``None`` marks a dynamic
    dimension the exporter left without a name.
    """
    proto, _ = load_graph(model)
    weights = {init.name for init in proto.graph.initializer}
    shapes = {vi.name: _dimensions(vi) for vi in proto.graph.input if vi.name not in weights}
    shapes.update({vi.name: _dimensions(vi) for vi in proto.graph.output})
    return shapes


def required_symbols(shapes: Mapping[str, Sequence[Dimension]]) -> dict[str, list[str]]:
    """``{symbol: [io names using it]}`` in first-use order."""
    users: dict[str, list[str]] = {}
    for io_name, dims in shapes.items():
        for dim in dims:
            if isinstance(dim, str) and io_name not in users.setdefault(dim, []):
                users[dim].append(io_name)
    return users


def check_specializations(
    model: ModelSource, specs: Sequence[Specialization | Mapping[str, int]], label: str | None = None
) -> None:
    """Raise ValueError unless every specialization binds every dynamic symbol of the graph.

    Also rejects a dynamic dimension with no name (no specialization can bind it) and an
    empty specialization list. Extra symbols in a specialization are allowed. ``label`` names
    the graph in messages (default: its path, or the graph name for an in-memory model).
    """
    proto, default_label = load_graph(model)
    label = label or default_label
    shapes = graph_symbols(proto)
    unnamed = [(io, axis) for io, dims in shapes.items() for axis, dim in enumerate(dims) if dim is None]
    if unnamed:
        io, axis = unnamed[0]
        raise ValueError(
            f"graph {label}: {io!r} axis {axis} is dynamic but has no symbol name (all unnamed: {unnamed}); "
            "export it with a named dynamic axis so a specialization can bind it"
        )
    if not specs:
        raise ValueError(f"graph {label}: no specializations given; every compiled graph needs at least one")

    users = required_symbols(shapes)
    for index, spec in enumerate(specs):
        name, symbols = (spec.name, spec.symbols) if isinstance(spec, Specialization) else (f"#{index}", spec)
        missing = [symbol for symbol in users if symbol not in symbols]
        if missing:
            symbol = missing[0]
            hint = (
                " The name looks invented by the TorchScript exporter for an axis not listed in dynamic_axes: "
                "name that output axis in dynamic_axes (or make it static)."
                if _EXPORTER_INVENTED.search(symbol)
                else ""
            )
            raise ValueError(
                f"graph {label}: symbol {symbol!r} (used by {users[symbol]}) is not bound in specialization "
                f"{name!r} {dict(symbols)}; all unbound: {missing}. Add it to the specialization, or export "
                f"that axis under a symbol the specializations bind.{hint}"
            )
