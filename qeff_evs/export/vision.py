"""Export the vision side: the encoder graph (F temporal patches per call) and the pruning graphs
(docs/design.md#the-three-graphs).

Each module declares its graph interface (input/output names in ``forward`` order and the named
symbol of each dynamic axis) as a ``VisionGraphSpec`` and builds example inputs. Every dynamic
dimension gets a named symbol so a specialization can bind it; each exported file is checked for
that and for the absence of data-dependent ops (NonZero).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import onnx
import torch

from qeff_evs.export.onnx_functions import attach_functions, rewrite_rms_norms
from qeff_evs.export.onnx_graph import check_named_axes, check_static_ops, legacy_export, trace_without_weights
from qeff_evs.export.reuse import GraphReuse
from qeff_evs.export.weight_exprs import cut_weights
from qeff_evs.export.weights import GraphWeight, WeightStore, attach_weights, rename_weights, write_weights
from qeff_evs.models.graph_io import VisionGraphSpec
from qeff_evs.models.pruning import PruningRanking
from qeff_evs.models.vision_common import EncoderWrapper

_LOG = logging.getLogger(__name__)


def export_encoder_graph(
    wrapper: EncoderWrapper,
    example_grid_hw: Sequence[int],
    example_frames: int,
    path: str | Path,
    progress: Callable[[str], None] | None = None,
    name: str = "encoder",
) -> Path:
    """Trace the family's encoder on ``example_frames`` temporal patches of one ``(H, W)`` patch grid.

    The example only has to be valid: every size stays a symbol, so one file serves every
    resolution and frames-per-call. Pick ``example_frames > 1`` so the per-frame tiling is traced.
    """
    inputs = wrapper.dummy_inputs(example_grid_hw, example_frames)
    label = f"{name} graph (example grid {tuple(example_grid_hw)}, {example_frames} frames per call)"
    return _export(wrapper, wrapper.graph_spec, inputs, Path(path), label, progress)


def block_unit(name: str) -> str:
    """The weights file a vision weight goes to: its block's (``blocks.3``; RADIO's ``encoder.layer.3``:
    ``layer.3``), else ``tower`` (embeddings, merger)."""
    parts = name.split(".")
    for at, part in enumerate(parts[:-1]):
        if part in ("blocks", "layers", "layer") and parts[at + 1].isdigit():
            return f"{part}.{parts[at + 1]}"
    return "tower"


def export_encoder_graph_streamed(wrapper: EncoderWrapper, example_grid_hw: Sequence[int], example_frames: int,
                                  path: str | Path, names: Mapping[int, str], store: WeightStore, reader,
                                  progress: Callable[[str], None] | None = None,
                                  reuse: GraphReuse | None = None, tower_unit: str = "tower",
                                  label: str = "encoder") -> Path:
    """``export_encoder_graph`` of a hollow tower (``models.hollow``), its weights written from ``reader`` (a
    checkpoint's ``ModuleWeights``; ``names``: each parameter's name there) into ``store``, block by block. With
    ``reuse``, the graph an earlier export wrote into the folder is taken where its inputs are unchanged
    (``export.reuse``), else traced and recorded.

    transformers' tower runs its own loop over the blocks, so the tower is traced whole, at full depth: its stand-in
    parameters cost no memory, and tracing a block costs what running it on the example costs (a few frames).

    ``tower_unit``: the file of the weights outside the blocks. A second encoder of the same tower (the image
    encoder) shares the blocks' files and keeps its own tower file, whose first layer differs."""
    say = progress or _LOG.info
    path = Path(path)
    spec = wrapper.graph_spec
    settings = dict(example_grid_hw=list(example_grid_hw), example_frames=example_frames, store=store.stamp)
    if reuse is not None:
        if reuse.take(path, settings, store, reader, say, f"{label} weights"):
            return path
        reuse.forget(path)
    inputs = wrapper.dummy_inputs(example_grid_hw, example_frames)
    blocks = {block_unit(name) for name, _ in wrapper.named_parameters()} - {"tower"}
    say(f"tracing the {label} graph ({len(blocks)} blocks, example grid "
        f"{tuple(example_grid_hw)}, {example_frames} frames per call)")
    model, parameters = trace_without_weights(wrapper, list(inputs.values()), input_names=spec.input_names,
                                              output_names=spec.output_names, dynamic_axes=spec.dynamic_axes)
    exprs = cut_weights(model, parameters)
    rewrite_rms_norms(model)
    sources = {name: names[id(p)] for name, p in wrapper.named_parameters()}
    renamed: dict[str, str] = {}
    weights: list[GraphWeight] = rename_weights(exprs, sources, "tower", renamed)
    def unit(weight: GraphWeight) -> str:
        block = block_unit(weight.sources[0])
        return tower_unit if block == "tower" else block

    weights = [GraphWeight(w.name, w.expr, w.sources, unit(w)) for w in weights]
    weights.sort(key=lambda w: _unit_order(w.unit))
    _rename_values(model, renamed)
    write_weights(weights, store, reader, say, label=f"{label} weights")
    attach_weights(model, weights, store)
    attach_functions(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    check_vision_graph(onnx.load(str(path), load_external_data=False), spec)
    if reuse is not None:
        reuse.record(path, settings, (), weights, store)
    say(f"written: {path} ({path.stat().st_size / 1e6:.2f} MB of graph, weights in {store.folder})")
    return path


def _unit_order(unit: str) -> tuple[int, int]:
    kind, _, index = unit.partition(".")
    return (0, 0) if not index else (1, int(index))


def _rename_values(model: onnx.ModelProto, renamed: Mapping[str, str]) -> None:
    """Every node input and graph output named in ``renamed`` takes its new name."""
    for node in model.graph.node:
        for index, name in enumerate(node.input):
            node.input[index] = renamed.get(name, name)
    for value in model.graph.output:
        value.name = renamed.get(value.name, value.name)


def export_pruning_graph(
    ranking: PruningRanking,
    hidden: int,
    path: str | Path,
    progress: Callable[[str], None] | None = None,
    reuse: GraphReuse | None = None,
) -> Path:
    """Trace a pruning graph (``family.pruning_ranking(method)``) on ``hidden``-wide rows.

    The example only has to be valid: ``frame_bucket`` and ``bucket_tokens`` stay symbols, so one file
    serves every resolution, bucket, frame count and rate. It is traced with a video shorter than its bucket
    (T = 2 of 3, 5 tokens per frame) so the padding branches are in the graph. With ``reuse``, the graph an earlier
    export wrote is taken where its inputs are unchanged (``export.reuse``; it reads no weights).
    """
    path = Path(path)
    settings = dict(method=ranking.method.name, score_levels=ranking.score_levels, hidden=hidden)
    if reuse is not None:
        if reuse.take(path, settings, None, None, progress or _LOG.info):
            return path
        reuse.forget(path)
    inputs = ranking.dummy_inputs(tokens_per_frame=5, bucket=3, hidden=hidden, frame_count=2)
    label = f"{ranking.method.name} pruning graph ({ranking.score_levels} scoring levels beside the rows)"
    _export(ranking, ranking.graph_spec, inputs, path, label, progress)
    if reuse is not None:
        reuse.record(path, settings, (), (), None)
    return path


def _export(module: torch.nn.Module, spec: VisionGraphSpec, inputs: Mapping[str, torch.Tensor], path: Path,
            label: str, progress: Callable[[str], None] | None) -> Path:
    say = progress or _LOG.info
    if list(inputs) != spec.input_names:
        raise ValueError(
            f"dummy_inputs returned {list(inputs)} but graph_spec declares {spec.input_names}; "
            "build the example inputs in forward order")
    path.parent.mkdir(parents=True, exist_ok=True)
    say(f"exporting {label} -> {path}")
    legacy_export(module, list(inputs.values()), path, input_names=spec.input_names,
                  output_names=spec.output_names, dynamic_axes=spec.dynamic_axes)
    check_vision_graph(onnx.load(str(path), load_external_data=False), spec)
    say(f"written: {path} ({path.stat().st_size / 1e6:.2f} MB)")
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
    check_named_axes(model, declared, "vision graph", "add it to the graph's VisionGraphSpec")
    check_static_ops(model, "vision graph")
