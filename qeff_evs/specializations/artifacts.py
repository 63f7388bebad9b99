"""One exported graph -> its compile folder: checked specializations.json, custom_io.yaml, command.

The order matters: the symbol check runs before anything is written, so a specialization
set that cannot compile never lands on disk next to a graph it does not fit.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from .compile_command import (
    DEFAULT_HW_VERSION,
    DEFAULT_NUM_CORES,
    CompileCommand,
    GraphKind,
    mdp_file_name,
    qaic_compile_command,
    write_mdp_partition_config,
)
from .custom_io import (
    EMBEDDING_NAMES,
    FLOAT16,
    MXINT8,
    check_retained_pairs,
    custom_io_precisions,
    write_custom_io_yaml,
)
from .files import DEFAULT_STYLE, SpecializationStyle, write_specializations_json
from .sets import Specialization
from .symbols import check_specializations, graph_symbols, load_graph

SPECIALIZATIONS_FILE = "specializations.json"
CUSTOM_IO_FILE = "custom_io.yaml"
QPC_DIR = "qpc"


def compile_file_name(name: str, stem: str | None = None) -> str:
    """``name`` (one of the three above) for the graph ``stem`` when a folder holds several graphs."""
    return name if stem is None else f"{stem}_{name}"


def prepare_graph_compile(
    onnx_path: str | Path,
    graph_dir: str | Path,
    specs: Sequence[Specialization],
    *,
    graph: GraphKind,
    kv_precision: str = FLOAT16,
    pixel_values_fp16: bool = True,
    style: SpecializationStyle = DEFAULT_STYLE,
    num_cores: int = DEFAULT_NUM_CORES,
    mxfp6_matmul: bool = False,
    extra_flags: Sequence[str] = (),
    relative_to: str | Path | None = None,
    aic_hw_version: str = DEFAULT_HW_VERSION,
    num_devices: int = 1,
    stem: str | None = None,
    embedding_names: Sequence[str] = EMBEDDING_NAMES,
    state_precisions: Mapping[str, str] | None = None,
) -> CompileCommand:
    """Check ``specs`` against the graph, write its compile inputs into ``graph_dir``, return the command.

    Files: ``graph_dir/specializations.json``, ``graph_dir/custom_io.yaml``; the QPC goes to
    ``graph_dir/qpc``; each name prefixed ``<stem>_`` when ``stem`` is given (the encoder and EVS
    graphs share the ``vision`` folder). With ``relative_to`` (the folder ``compile.sh`` lives in) the command's
    paths are relative to it, so the build folder can be copied to a machine with the SDK.
    ``num_devices > 1`` also writes ``graph_dir/[<stem>_]mdp_ts_<N>.json`` (multi-device partitioning: the
    encoder and EVS graphs may differ in cores, so each has its own).
    ``embedding_names``: the I/O kept in fp16 with their retained twins (vision rows, a family's extra rows);
    ``state_precisions``: a family's layer states by input name and their declared precision.
    """
    proto, label = load_graph(onnx_path)
    check_specializations(proto, specs, label=label)  # before writing anything
    io_names = list(graph_symbols(proto))
    precisions = custom_io_precisions(io_names, kv_precision=kv_precision, pixel_values_fp16=pixel_values_fp16,
                                      embedding_names=embedding_names, state_precisions=state_precisions)
    check_retained_pairs(precisions, io_names)

    graph_dir = Path(graph_dir)
    json_path = write_specializations_json(graph_dir / compile_file_name(SPECIALIZATIONS_FILE, stem), specs, style)
    yaml_path = (write_custom_io_yaml(graph_dir / compile_file_name(CUSTOM_IO_FILE, stem), precisions)
                 if precisions else None)
    mdp_path = (write_mdp_partition_config(graph_dir / compile_file_name(mdp_file_name(num_devices), stem),
                                           num_devices, num_cores) if num_devices > 1 else None)

    def shown(path: Path | str | None) -> str | None:
        if path is None or relative_to is None:
            return None if path is None else str(path)
        return os.path.relpath(Path(path).resolve(), Path(relative_to).resolve())

    return qaic_compile_command(
        shown(onnx_path),
        shown(json_path),
        shown(yaml_path),
        shown(graph_dir / compile_file_name(QPC_DIR, stem)),
        graph=graph,
        num_cores=num_cores,
        mxfp6_matmul=mxfp6_matmul,
        extra_flags=extra_flags,
        aic_hw_version=aic_hw_version,
        mdp_partition_config=shown(mdp_path),
        allow_mxint8_mdp_io=graph == "language" and kv_precision == MXINT8,
    )
