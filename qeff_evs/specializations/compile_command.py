"""``qaic-compile`` command lines, a ``compile.sh`` that replays them, and a runner.

Flags, as QEfficient passes them (``QEFFBaseModel._compile``)::

    qaic-compile -aic-hw -aic-hw-version=ai100 -m=<onnx> -aic-num-cores=N -convert-to-fp16
                 [-retained-state] [-mxfp6-matmul] -network-specialization-config=<json>
                 -custom-IO-list-file=<yaml> -aic-binary-dir=<qpc dir>

Choices made here:

* ``-retained-state`` only for the language graph: it makes each ``X_RetainedState``
  output alias input ``X`` (KV cache, vision embeds); the vision graphs have no such pair and
  QEfficient compiles its vision graph without the flag.
* ``-mxfp6-matmul`` is never emitted for the vision graphs, whatever the caller asks
  (QEfficient pins the vision QPC to ``mxfp6_matmul=False``).
* ``-convert-to-fp16`` for the encoder and the language graph, never for the pruning graphs: EVS's
  cosine dissimilarity overflows in fp16 and VidCom2's Gaussian kernels and budgets lose their ranking
  there (docs/design.md#numerics-on-the-card), so they compute in fp32 and only their row inputs are fp16 (custom IO;
  the compiler converts at the graph's edge).
* ``-compile-only`` is not passed: QEfficient 1.21 did, later versions dropped it as
  deprecated. ``-aic-perf-metrics`` is not passed either (QEfficient never does). Anything
  else (``-mos=1``, ``-aic-enable-depth-first``, ...) goes through ``extra_flags``.
* Cores and devices are per graph (``placement.py``): by default the split that keeps every program
  active on one 16-core device together.
* ``--num-devices N > 1`` (multi-device partitioning, QEfficient's ``mdp_ts_num_devices``): a
  ``[<graph>_]mdp_ts_<N>.json`` next to the graph (one ``Partition0`` over devices ``0..N-1``, p2p, every
  device with the graph's cores) passed as ``-mdp-load-partition-config``, and ``-allow-mxint8-mdp-io``
  for a language graph whose KV cache is mxint8 (QEfficient's compile helper does the same).
* ``-aic-hw-version``: ``ai100`` or ``ai200``; by default what ``qaic-util -q`` reports for the first
  card (``FW IMAGE_VARIANT`` containing AIC200 means ai200, as QEfficient detects it), else ai100.
* A compile first removes the graph's existing qpc folder (a stale or half-written one can make the
  compiler fail); ``compile.sh`` does the same with ``rm -rf`` before each command.
* Commands store their arguments without the executable: the compiler is resolved when the
  command runs (``qaic-compile`` on ``PATH``, then the SDK's ``/opt/qti-aic/exec``), so
  the artifacts written on a machine without the SDK still run on one with it.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TextIO

from .placement import DEFAULT_GRAPH_CORES, DEFAULT_GRAPH_DEVICES, PerGraph, per_graph

GraphKind = Literal["encoder", "pruning", "language"]  # a graph's role (manifest.GRAPHS)
GRAPH_KINDS: tuple[str, ...] = ("encoder", "pruning", "language")
FP32_GRAPHS: tuple[str, ...] = ("pruning",)  # compiled without -convert-to-fp16
COMPILER_NAME = "qaic-compile"
SDK_COMPILER_PATH = Path("/opt/qti-aic/exec/qaic-compile")
DEFAULT_HW_VERSION = "ai100"
HW_VERSIONS: tuple[str, ...] = ("ai100", "ai200")
DEFAULT_NUM_CORES = 16
QAIC_UTIL_PATH = Path("/opt/qti-aic/tools/qaic-util")
NODE_PRECISION_FLAG = "-node-precision-info="  # names nodes of one graph: passed to the language graph only
SUB_FUNCTIONS_FLAG = "-sub-functions"  # the graph's layers are ONNX functions (export --layer-functions)


def detect_aic_hw_version(qaic_util: Path = QAIC_UTIL_PATH, timeout_s: float = 10.0) -> str:
    """``ai200`` if ``qaic-util -q`` reports an AIC200 firmware variant on the first card, else ``ai100``."""
    if not (qaic_util.is_file() and os.access(qaic_util, os.X_OK)):
        return DEFAULT_HW_VERSION
    try:
        report = subprocess.run([str(qaic_util), "-q"], capture_output=True, text=True, timeout=timeout_s).stdout
    except (OSError, subprocess.SubprocessError):
        return DEFAULT_HW_VERSION
    match = re.search(r"FW IMAGE_VARIANT\s*:\s*(\S+)", report)
    return "ai200" if match and "AIC200" in match.group(1).upper() else DEFAULT_HW_VERSION


def mdp_partition_config(num_devices: int, num_cores: int) -> dict:
    """QEfficient's tensor-slicing partition config: one partition over devices ``0..num_devices-1``."""
    devices = list(range(num_devices))
    return {"connections": [{"devices": devices, "type": "p2p"}],
            "partitions": [{"name": "Partition0",
                            "devices": [{"deviceId": d, "numCores": num_cores} for d in devices]}]}


def mdp_file_name(num_devices: int) -> str:
    return f"mdp_ts_{num_devices}.json"


def write_mdp_partition_config(path: str | Path, num_devices: int, num_cores: int) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(mdp_partition_config(num_devices, num_cores), indent=4) + "\n")
    return path


@dataclass(frozen=True)
class CompileOptions:
    """What ``qeff-evs compile`` (and ``compile.sh``) choose for every graph of an export.

    ``num_cores`` / ``num_devices``: one value for every graph or values by graph role (the others keep
    their default); ``num_cores=None`` is ``placement.DEFAULT_GRAPH_CORES``.
    """

    num_cores: PerGraph | None = None
    mxfp6_matmul: bool = False
    aic_hw_version: str = DEFAULT_HW_VERSION
    num_devices: PerGraph = 1
    extra_flags: tuple[str, ...] = ()
    specializations_layout: str = "named"  # QEfficient >= 1.22; "flat" for older SDKs
    # The language program(s) to build (sets.LANGUAGE_PROGRAMS): "both" for one instance; "prefill" for a prefill
    # instance (with the vision graphs), "decode" for a decode instance (the language graph alone).
    language_programs: str = "both"

    def __post_init__(self) -> None:
        if self.aic_hw_version not in HW_VERSIONS:
            raise ValueError(f"aic_hw_version must be one of {HW_VERSIONS}, got {self.aic_hw_version!r}")
        per_graph(self.num_cores, DEFAULT_GRAPH_CORES, "num_cores")  # raise now, not at the first use
        per_graph(self.num_devices, DEFAULT_GRAPH_DEVICES, "num_devices")
        if self.language_programs not in ("both", "prefill", "decode"):
            raise ValueError(f"language programs must be both, prefill or decode, got {self.language_programs!r}")
        if self.specializations_layout not in ("named", "flat"):
            raise ValueError(f"specializations layout must be 'named' or 'flat', got {self.specializations_layout!r}")

    @property
    def cores(self) -> dict[str, int]:
        """Cores of each graph's program (``-aic-num-cores``), by graph role."""
        return per_graph(self.num_cores, DEFAULT_GRAPH_CORES, "num_cores")

    @property
    def devices(self) -> dict[str, int]:
        """Devices of each graph's program (> 1: multi-device partitioning), by graph role."""
        return per_graph(self.num_devices, DEFAULT_GRAPH_DEVICES, "num_devices")

    def flags_for(self, graph: str) -> tuple[str, ...]:
        """``extra_flags`` for one graph: a node-precision file names language-graph nodes only."""
        if graph == "language":
            return self.extra_flags
        return tuple(flag for flag in self.extra_flags if not flag.startswith(NODE_PRECISION_FLAG))


@dataclass(frozen=True)
class CompileCommand:
    """One ``qaic-compile`` invocation: which graph it builds and its arguments (no executable)."""

    graph: str
    arguments: tuple[str, ...]
    qpc_dir: str | None = None  # removed before compiling (a stale folder can fail the compile)

    def argv(self, executable: str | Path) -> list[str]:
        return [str(executable), *self.arguments]

    @property
    def label(self) -> str:
        """``pruning graph vision/pruning_evs.onnx``: the role and the file (a role can hold several graphs)."""
        model = next((arg[len("-m="):] for arg in self.arguments if arg.startswith("-m=")), "")
        return f"{self.graph} graph {model}".rstrip()

    def shell_line(self, executable: str = COMPILER_NAME) -> str:
        return " ".join([executable, *(shlex.quote(arg) for arg in self.arguments)])


def qaic_compile_command(
    onnx_path: str | Path,
    specializations_json: str | Path,
    custom_io_yaml: str | Path | None,
    qpc_dir: str | Path,
    *,
    graph: GraphKind,
    num_cores: int = DEFAULT_NUM_CORES,
    mxfp6_matmul: bool = False,
    aic_hw_version: str = DEFAULT_HW_VERSION,
    extra_flags: Sequence[str] = (),
    mdp_partition_config: str | Path | None = None,
    allow_mxint8_mdp_io: bool = False,
) -> CompileCommand:
    """The ``qaic-compile`` arguments that build ``onnx_path`` into ``qpc_dir`` for ``graph``."""
    if graph not in GRAPH_KINDS:
        raise ValueError(f"graph must be one of {GRAPH_KINDS}, got {graph!r}")
    if isinstance(num_cores, bool) or not isinstance(num_cores, int) or num_cores < 1:
        raise ValueError(f"num_cores must be a positive integer (AI 100 cards have up to 16), got {num_cores!r}")
    bad_flags = [flag for flag in extra_flags if not (isinstance(flag, str) and flag.startswith("-"))]
    if bad_flags:
        raise ValueError(f"extra compiler flags must start with '-', got {bad_flags}; e.g. '-mos=1'")

    if aic_hw_version not in HW_VERSIONS:
        raise ValueError(f"aic_hw_version must be one of {HW_VERSIONS}, got {aic_hw_version!r}")
    arguments = ["-aic-hw", f"-aic-hw-version={aic_hw_version}", f"-m={onnx_path}"]
    if mdp_partition_config is not None:
        arguments.append(f"-mdp-load-partition-config={mdp_partition_config}")
        if allow_mxint8_mdp_io:
            arguments.append("-allow-mxint8-mdp-io")
    arguments.append(f"-aic-num-cores={num_cores}")
    if graph not in FP32_GRAPHS:
        arguments.append("-convert-to-fp16")
    if graph == "language":
        arguments.append("-retained-state")
        if mxfp6_matmul:
            arguments.append("-mxfp6-matmul")
    arguments += list(extra_flags)
    arguments.append(f"-network-specialization-config={specializations_json}")
    if custom_io_yaml is not None:
        arguments.append(f"-custom-IO-list-file={custom_io_yaml}")
    arguments.append(f"-aic-binary-dir={qpc_dir}")
    return CompileCommand(graph, tuple(arguments), str(qpc_dir))


def find_qaic_compile(search_path: str | None = None, sdk_path: Path = SDK_COMPILER_PATH) -> str | None:
    """``qaic-compile`` from ``search_path`` (default ``$PATH``), else the SDK install path, else None."""
    found = shutil.which(COMPILER_NAME, path=search_path)
    if found:
        return found
    if sdk_path.is_file() and os.access(sdk_path, os.X_OK):
        return str(sdk_path)
    return None


def write_compile_script(path: str | Path, commands: Sequence[CompileCommand]) -> Path:
    """An executable ``compile.sh`` running ``commands`` from the script's own directory.

    Relative paths in the commands are therefore relative to the script's folder (the build
    directory). ``QAIC_COMPILE=/path/to/qaic-compile ./compile.sh`` overrides the compiler.
    """
    if not commands:
        raise ValueError("no compile commands to write; export at least one graph first")
    lines = [
        "#!/usr/bin/env bash",
        "# Generated by qeff-evs: compiles the exported ONNX graphs into QPCs for Cloud AI 100.",
        "set -euo pipefail",
        'cd "$(dirname "$0")"',
        f'QAIC_COMPILE="${{QAIC_COMPILE:-$(command -v {COMPILER_NAME} || echo {SDK_COMPILER_PATH})}}"',
    ]
    for command in commands:
        lines.append(f"echo {shlex.quote(f'qeff-evs: compiling the {command.label}')}")
        if command.qpc_dir:
            lines.append(f"rm -rf {shlex.quote(command.qpc_dir)}  # a stale qpc folder can fail the compile")
        lines.append(command.shell_line('"$QAIC_COMPILE"'))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def run_compile(
    commands: Sequence[CompileCommand],
    *,
    cwd: str | Path | None = None,
    compiler: str | None = None,
    out: TextIO | None = None,
) -> int:
    """Run ``commands`` with ``qaic-compile`` if the SDK is installed; else print them and return 0.

    Stops at the first failing command and returns its exit status. ``compiler`` overrides
    the lookup; ``cwd`` is where relative paths in the commands resolve (the build folder).
    """
    out = out or sys.stdout
    executable = compiler or find_qaic_compile()
    if executable is None:
        print(
            f"qeff-evs: {COMPILER_NAME} not found on PATH or at {SDK_COMPILER_PATH} (Cloud AI 100 Apps SDK "
            "not installed); nothing was compiled. Run these commands (or compile.sh) where the SDK is installed:",
            file=out,
        )
        for command in commands:
            print(command.shell_line(), file=out)
        return 0
    for command in commands:
        if command.qpc_dir:
            stale = Path(cwd or ".") / command.qpc_dir
            if stale.exists():
                print(f"qeff-evs: removing the existing {stale}", file=out)
                shutil.rmtree(stale)
        print(f"qeff-evs: compiling the {command.label}: {command.shell_line(executable)}", file=out)
        out.flush()
        result = subprocess.run(command.argv(executable), cwd=cwd, check=False)
        if result.returncode != 0:
            print(f"qeff-evs: {COMPILER_NAME} failed on the {command.label} (exit {result.returncode})",
                  file=out)
            return result.returncode
    return 0
