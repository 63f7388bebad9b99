"""The compile inputs of an export: each graph checked against its specializations with its ``qaic-compile`` line,
custom I/O and placement (``compile_commands``), and the language graph's node-precision file
(``write_node_precision``); what ``qeff-evs export`` writes and ``qeff-evs compile`` writes again."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import onnx

from qeff_evs.export.node_precision import node_precision_yaml, router_paths, state_path
from qeff_evs.export.stamping import LAYER_DOMAIN
from qeff_evs.manifest import (
    AUDIO_ENCODER,
    AUDIO_ENCODER_FILES,
    EXPORT_FILES,
    IMAGE_ENCODER,
    IMAGE_ENCODER_FILES,
    PRUNING_ROLE,
    LayerState,
    export_files,
    graph_role,
)
from qeff_evs.models.protocol import ModelFamily
from qeff_evs.specializations import (
    EMBEDDING_NAMES,
    RETAINED_SUFFIX,
    CompileCommand,
    CompileOptions,
    Specialization,
    program_specializations,
    prepare_graph_compile,
    state_precisions,
    write_specializations_json,
)
from qeff_evs.specializations.compile_command import NODE_PRECISION_FLAG, SUB_FUNCTIONS_FLAG
from qeff_evs.specializations.placement import write_placement_record

FLOAT32 = "float32"

NODE_PRECISION_FILE = "language/node_precision.yaml"  # the language graph's fp32 nodes (state paths, routers), if any


def embedding_io_names(family: ModelFamily | type[ModelFamily]) -> tuple[str, ...]:
    """Graph I/O kept in fp16 on the card (``custom_io.yaml``): vision rows and the family's extra rows."""
    return (*EMBEDDING_NAMES, *(rows.name for rows in family.extra_rows))


def write_node_precision(export_dir: Path, layer_states: Sequence[LayerState]) -> Path | None:
    """The language graph's ``-node-precision-info`` file keeping in fp32 each fp32 layer state's path
    (``node_precision.state_path``: from its input to its ``_RetainedState``) and each MoE router's
    (``node_precision.router_paths``: logits to renormalised weights; in fp16 twice as many tokens change their
    top-k set, ``benchmarks/moe_router_fp16.py``); None when the graph has neither."""
    fp32 = [name for state in layer_states if state.precision == FLOAT32 for name in state.input_names]
    model = onnx.load(str(export_dir / EXPORT_FILES["language"]), load_external_data=False)
    names = [node for name in fp32 for node in state_path(model, name, name + RETAINED_SUFFIX)]
    names = list(dict.fromkeys(names + [node for path in router_paths(model) for node in path]))
    if not names:
        return None
    path = export_dir / NODE_PRECISION_FILE
    path.write_text(node_precision_yaml(names))
    return path


def _has_layer_functions(language_graph: Path) -> bool:
    """Whether the language graph calls layer functions (``--layer-functions``): its compile line then takes
    ``-sub-functions``, as QEfficient's does for its ``use_onnx_subfunctions`` graphs."""
    if not language_graph.is_file():
        return False
    model = onnx.load(str(language_graph), load_external_data=False)
    return any(function.domain == LAYER_DOMAIN for function in model.functions)


def compile_commands(export_dir: Path, options: CompileOptions, kv_precision: str,
                     specs: Mapping[str, Sequence[Specialization]],
                     embedding_names: Sequence[str], layer_states: Sequence[LayerState] = (),
                     node_precision: Path | None = None) -> list[CompileCommand]:
    """Check each graph of ``specs`` (by graph, in compile order: ``Manifest.graphs``) against its
    specializations, write its compile inputs and ``placement.json``, return the commands. Cores and devices
    are per role (``manifest.graph_role``): every method's pruning graph gets the pruning role's.
    ``embedding_names``: the I/O kept in fp16 on the card (``embedding_io_names``); ``layer_states``: a
    family's other retained state (custom IO by its declared precision); ``node_precision``: the language
    graph's node-precision file (``write_node_precision``), passed to its compile line."""
    if node_precision is not None:
        if any(flag.startswith(NODE_PRECISION_FLAG) for flag in options.extra_flags):
            raise ValueError(f"the export keeps its fp32 state's ops in fp32 with {node_precision}; add your nodes to "
                             f"that file instead of passing another {NODE_PRECISION_FLAG}...")
        flag = NODE_PRECISION_FLAG + os.path.relpath(Path(node_precision).resolve(), Path(export_dir).resolve())
        options = dataclasses.replace(options, extra_flags=(*options.extra_flags, flag))
    commands = []
    cores, devices = options.cores, options.devices
    sub_functions = _has_layer_functions(export_dir / EXPORT_FILES["language"])
    if sub_functions and options.mxfp6_matmul:
        raise ValueError("the language graph's layers are ONNX functions (exported with --layer-functions), whose "
                         "weights -mxfp6-matmul cannot compress (it needs them as the graph's constants): compile "
                         "without --mxfp6, or export again without --layer-functions")
    files = export_files(tuple(graph[len(PRUNING_ROLE) + 1:] for graph in specs if graph_role(graph) == PRUNING_ROLE))
    if IMAGE_ENCODER in specs:
        files.update(IMAGE_ENCODER_FILES)
    if AUDIO_ENCODER in specs:
        files.update(AUDIO_ENCODER_FILES)
    programs = options.language_programs  # one side of prefill/decode disaggregation: its own specializations
    for graph in specs:
        role = graph_role(graph)
        if programs == "decode" and role != "language":
            continue  # a decode instance runs no vision graph
        onnx_path = export_dir / files[graph]
        graph_dir = onnx_path.parent
        # The encoder and pruning graphs share the vision folder: their files carry the graph's name; a language
        # program of one side, the side's (language/prefill_specializations.json, language/prefill_qpc).
        stem = graph if graph != "language" else None if programs == "both" else programs
        graph_specs = program_specializations(specs[graph], programs) if graph == "language" else specs[graph]
        commands.append(prepare_graph_compile(
            onnx_path, graph_dir, graph_specs, graph=role, kv_precision=kv_precision,
            style=options.specializations_layout, num_cores=cores[role],
            mxfp6_matmul=options.mxfp6_matmul,
            extra_flags=(*options.flags_for(role), *([SUB_FUNCTIONS_FLAG] if sub_functions and role == "language"
                                                     else [])), relative_to=export_dir,
            aic_hw_version=options.aic_hw_version, num_devices=devices[role], stem=stem,
            embedding_names=embedding_names, state_precisions=state_precisions(layer_states)))
        if stem is None or graph != "language":
            write_specializations_json(export_dir / files[f"{graph}_specializations_named"], specs[graph], "named")
    write_placement_record(export_dir, cores, devices)
    return commands
