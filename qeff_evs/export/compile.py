"""``qeff-evs compile``: rebuild the qaic-compile commands for chosen cores/precision and run them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from qeff_evs.export.compile_inputs import compile_commands, embedding_io_names
from qeff_evs.manifest import check_export_graphs, read_manifest
from qeff_evs.models.registry import family_class
from qeff_evs.specializations import CompileOptions, read_specializations_json, run_compile, write_compile_script


def compile_export(export_dir: Path, options: CompileOptions = CompileOptions(),
                   progress: Callable[[str], None] = lambda message: None) -> int:
    """Re-check and rewrite the compile inputs, refresh compile.sh, run it where the SDK is installed.

    Each compile first removes the graph's existing qpc folder. Without ``qaic-compile`` the commands
    are printed (nothing is removed) and 0 is returned: the folder can be copied to a
    machine with the Apps SDK and compiled there with ``./compile.sh``.
    """
    manifest = read_manifest(export_dir)
    check_export_graphs(export_dir, manifest)  # qaic-compile reads the external data: refused before it runs
    specs = {graph: read_specializations_json(manifest.path(export_dir, f"{graph}_specializations"))
             for graph in manifest.graphs}
    node_precision = (manifest.path(export_dir, "language_node_precision")
                      if "language_node_precision" in manifest.files else None)
    commands = compile_commands(export_dir, options, manifest.kv_precision, specs,
                                embedding_io_names(family_class(manifest.family)),
                                manifest.language_shape.layer_states, node_precision)
    script = manifest.path(export_dir, "compile_script")
    if options.language_programs != "both":  # one side of prefill/decode disaggregation: its own script
        script = script.with_name(f"{script.stem}_{options.language_programs}{script.suffix}")
    script = write_compile_script(script, commands)
    progress(f"compile script written: {script}")
    return run_compile(commands, cwd=export_dir)
