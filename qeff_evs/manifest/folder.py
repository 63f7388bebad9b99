"""The export folder on disk: which names mark one (its manifest, its lock, its first files), why a folder without a
manifest cannot be read, and the check that every file and graph tensor it names lies inside it."""

from __future__ import annotations

from pathlib import Path

MANIFEST_NAME = "manifest.json"
# The lock an export holds on its folder while it writes (``export.folder``); it stays, empty, marking an export folder.
EXPORT_LOCK = ".qeff-evs-export.lock"
# What an export writes first: a folder holding any of these but no manifest is an unfinished export.
EXPORT_MARKS = (EXPORT_LOCK, "vision/weights", "language/weights", "vision/encoder.onnx", "language/language.onnx")


def is_export_folder(folder: Path) -> bool:
    """Whether ``folder`` holds an export, finished or not: its manifest or its lock (what an export may rewrite)."""
    return any((Path(folder) / name).exists() for name in (MANIFEST_NAME, EXPORT_LOCK))


def unfinished_refusal(export_dir: Path) -> str | None:
    """Why ``export_dir`` cannot be read as an export when it has no manifest (one line), or None when it has one."""
    if (Path(export_dir) / MANIFEST_NAME).is_file():
        return None
    if any((Path(export_dir) / name).exists() for name in EXPORT_MARKS):
        return (f"the export into {export_dir} did not finish (it has no {MANIFEST_NAME}, which an export writes "
                f"last): run it again, it resumes")
    return f"{Path(export_dir) / MANIFEST_NAME} not found: run `qeff-evs export MODEL_DIR -o {export_dir}` first"


def check_inside(export_dir: Path, location: str | Path, what: str) -> Path:
    """``location`` (relative to ``export_dir``, or absolute) resolved, symlinks followed; ValueError in one line
    naming ``what`` and the location unless it lies inside ``export_dir``."""
    root = Path(export_dir).resolve()
    resolved = (root / location).resolve()
    if resolved != root and root not in resolved.parents:
        raise ValueError(f"{what} names {str(location)!r}, which resolves to {resolved}, outside the export folder "
                         f"{root}; an export reads only its own files: export again into this folder")
    return resolved


def check_graph_data(export_dir: Path, graph: Path) -> None:
    """Refuse ``graph`` (a graph file of the export at ``export_dir``) if any of its tensors' external data lies
    outside the folder (``check_inside``): read from the graph's proto alone, before any runtime opens it."""
    import onnx

    graph = Path(graph)
    check_inside(export_dir, graph, "the export")
    model = onnx.load(str(graph), load_external_data=False)
    tensors = list(model.graph.initializer)
    tensors += [attr.t for node in model.graph.node for attr in node.attribute if attr.HasField("t")]
    for tensor in tensors:
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        location = next((entry.value for entry in tensor.external_data if entry.key == "location"), "")
        if Path(location).is_absolute():
            raise ValueError(f"graph {graph} reads tensor {tensor.name}'s data from the absolute path {location!r}; "
                             "an export reads only its own files: export again into this folder")
        resolved = (graph.parent / location).resolve()
        root = Path(export_dir).resolve()
        if root not in resolved.parents:
            raise ValueError(f"graph {graph} reads tensor {tensor.name}'s data from {location!r}, which resolves to "
                             f"{resolved}, outside the export folder {root}; an export reads only its own files: "
                             "export again into this folder")


def check_export_graphs(export_dir: Path, manifest: "Manifest") -> None:
    """``check_graph_data`` for every graph the manifest lists (what compile and verify read)."""
    for file in manifest.files.values():
        if file.endswith(".onnx"):
            check_graph_data(export_dir, Path(export_dir) / file)


def export_root(graph: Path) -> Path:
    """The export folder a graph file belongs to: its nearest parent holding an export, else its own folder."""
    graph = Path(graph).absolute()
    return next((parent for parent in graph.parents if is_export_folder(parent)), graph.parent)
