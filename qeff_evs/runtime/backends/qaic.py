"""QAIC backend: run the compiled QPCs on a Cloud AI 100 card through the Apps SDK's ``qaicrt``.

``qeff-evs compile`` puts one QPC per graph into ``<export>/vision/encoder_qpc``,
``<export>/vision/pruning_<method>_qpc`` (one per pruning method) and ``<export>/language/qpc``.
A ``QaicProgram`` is one loaded QPC: its bindings (name, direction, device dtype, dims), the shapes
each compiled specialization allows, and ``run(inputs, skip)``. Every call hands the runtime one
buffer per binding; an *empty* buffer means "skip": an input keeps what the device holds, an output
is not copied back. That is how retained state works with ``-retained-state``: the output
``X_RetainedState`` aliases input ``X`` on the device, so the language session

* skips every ``*_RetainedState`` output on every call (the KV cache never crosses PCIe), and
* uploads a retained input only when it has new content: zeros at the first call after ``reset``,
  a prefill chunk's window of vision rows; decode calls re-use the device's copy.

Device dtypes follow ``custom_io.yaml`` (fp16 vision embeddings and pixels, fp16 KV): the host
converts inputs to the binding's dtype and outputs back to float32, so the engine sees the same
types as with ONNX Runtime. The SDK is imported only when a session is built.

Placement: every program a deployment runs (the encoder, the pruning graph of its method, the language graph)
is loaded and activated once, on the device ids its role is given
(``specializations.placement``: checked against each device's cores before anything is loaded), and stays
active until ``close``; the SDK calls that open and release it live in ``qaic_device``. The KV cache goes
up as zeros once, with the first call after the language program is loaded, never per request.
"""

from __future__ import annotations

import importlib
import math
import platform
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from types import ModuleType

import numpy as np

from qeff_evs.models.graph_io import BATCH_INDEX, RETAINED_SUFFIX, state_shapes
from qeff_evs.manifest import IMAGE_ENCODER, LanguageShape, graph_role, pruning_graph
from qeff_evs.runtime.backends.base import (
    MergedRows,
    RetainedStateSession,
    merged_rows,
    ranking,
)
from qeff_evs.runtime.backends.qaic_device import DATA_PATH_TIMEOUT_MS, open_program
from qeff_evs.runtime.backends.vision import VisionPipeline
from qeff_evs.specializations import QPC_DIR, compile_file_name
from qeff_evs.specializations.placement import (
    DeviceIdsSpec,
    check_device_cores,
    place_programs,
    read_placement_record,
)

DEFAULT_SDK_ROOT = Path("/opt/qti-aic")
QPC_FILE = "programqpc.bin"  # what qaic-compile writes into -aic-binary-dir

# IoDesc type names (QAicApi_pb2 enum members) -> host numpy dtype. Looked up by name, so a
# member missing from an SDK version is simply not served.
DEVICE_DTYPES: tuple[tuple[str, np.dtype], ...] = (
    ("FLOAT_TYPE", np.dtype(np.float32)),
    ("FLOAT_16_TYPE", np.dtype(np.float16)),
    ("INT64_I_TYPE", np.dtype(np.int64)),
    ("INT32_I_TYPE", np.dtype(np.int32)),
    ("INT32_Q_TYPE", np.dtype(np.int32)),
    ("INT16_Q_TYPE", np.dtype(np.int16)),
    ("INT8_Q_TYPE", np.dtype(np.int8)),
    ("UINT8_Q_TYPE", np.dtype(np.uint8)),
    ("INT8_TYPE", np.dtype(np.int8)),
)


# --------------------------------------------------------------------------------------------------
# SDK


@dataclass(frozen=True)
class QaicSdk:
    """The two Apps SDK modules: ``qaicrt`` (runtime) and ``QAicApi_pb2`` (the IoDesc protobuf)."""

    qaicrt: ModuleType
    aicapi: ModuleType

    def dtypes(self) -> dict[int, np.dtype]:
        return {getattr(self.aicapi, name): dtype for name, dtype in DEVICE_DTYPES if hasattr(self.aicapi, name)}

    def ok(self, status) -> bool:
        return status == self.qaicrt.QStatus.QS_SUCCESS

    def check(self, status, what: str) -> None:
        if not self.ok(status):
            raise RuntimeError(f"qaicrt: {what} failed with status {status}")


@contextmanager
def _search_path(folder: Path) -> Iterator[None]:
    """``folder`` on ``sys.path`` for one import only (the SDK installs outside site-packages)."""
    sys.path.insert(0, str(folder))
    try:
        yield
    finally:
        if str(folder) in sys.path:
            sys.path.remove(str(folder))


def _import_from(name: str, folder: Path) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ImportError:
        with _search_path(folder):
            return importlib.import_module(name)


def load_sdk(sdk_root: str | Path = DEFAULT_SDK_ROOT) -> QaicSdk:
    """Import ``qaicrt`` and ``QAicApi_pb2``, from the environment or from ``sdk_root``'s dev folders."""
    root = Path(sdk_root)
    lib = root / "dev" / "lib" / platform.machine()
    python = root / "dev" / "python"
    try:
        return QaicSdk(_import_from("qaicrt", lib), _import_from("QAicApi_pb2", python))
    except ImportError as error:
        raise ValueError(
            f"the qaic backend needs the Cloud AI 100 Apps SDK Python runtime (`qaicrt` from {lib}, "
            f"`QAicApi_pb2` from {python}), which is not importable here ({error}); install the Apps SDK "
            "and run `qeff-evs compile EXPORT_DIR` on that machine, or use --backend ort / --backend torch"
        ) from None


# --------------------------------------------------------------------------------------------------
# one loaded QPC


@dataclass(frozen=True)
class Binding:
    """One input or output buffer of a QPC, as its IoDesc describes it."""

    name: str
    index: int
    is_input: bool
    dtype: np.dtype | None  # None: a device type the host does not convert (never uploaded)
    itemsize: int


Shapes = dict[str, tuple[int, ...]]  # binding name -> dims, one compiled specialization


def _fmt_shapes(shapes: Mapping[str, tuple[int, ...]]) -> str:
    return ", ".join(f"{name} {tuple(dims)}" for name, dims in shapes.items())


class QaicProgram:
    """One QPC loaded and activated on its device(s); ``run`` executes it once, ``close`` releases it."""

    def __init__(self, qpc_dir: str | Path, sdk: QaicSdk, device_ids: Sequence[int] = (0,),
                 timeout_ms: int = DATA_PATH_TIMEOUT_MS):
        self.qpc_dir = Path(qpc_dir)
        self.sdk = sdk
        rt = sdk.qaicrt
        qpc = rt.Qpc(str(self.qpc_dir))
        status, raw = qpc.getIoDescriptor()
        sdk.check(status, f"reading the IO descriptor of {self.qpc_dir}")
        iodesc = sdk.aicapi.IoDesc()
        iodesc.ParseFromString(bytes(raw))
        self._read_iodesc(iodesc)
        self.device_program = open_program(sdk, qpc, device_ids, str(self.qpc_dir), timeout_ms)

    def _read_iodesc(self, iodesc) -> None:
        dtypes = self.sdk.dtypes()
        descs = list(iodesc.selected_set.bindings)
        self.bindings: list[Binding] = []
        for desc in descs:
            dtype = dtypes.get(desc.type)
            dims = tuple(int(d) for d in desc.dims)
            itemsize = dtype.itemsize if dtype is not None else max(1, int(desc.size) // max(1, math.prod(dims)))
            self.bindings.append(Binding(desc.name, int(desc.index), desc.dir == self.sdk.aicapi.BUFFER_IO_TYPE_INPUT,
                                         dtype, itemsize))
        if sorted(b.index for b in self.bindings) != list(range(len(self.bindings))):
            raise ValueError(f"{self.qpc_dir}: binding indices {[b.index for b in self.bindings]} are not 0..n-1; "
                             "the QPC's IO descriptor is not one this runtime understands")
        self.by_name = {b.name: b for b in self.bindings}
        names = [b.name for b in self.bindings]
        sets = [[tuple(int(d) for d in shape.dims) for shape in allowed.shapes] for allowed in iodesc.allowed_shapes]
        if not sets:  # a QPC without specializations: the selected set's dims are the only shapes
            sets = [[tuple(int(d) for d in desc.dims) for desc in descs]]
        self.allowed_shapes: list[Shapes] = [dict(zip(names, dims)) for dims in sets]

    @property
    def input_names(self) -> list[str]:
        return [b.name for b in self.bindings if b.is_input]

    @property
    def output_names(self) -> list[str]:
        return [b.name for b in self.bindings if not b.is_input]

    def dtype(self, name: str) -> np.dtype | None:
        return self._binding(name).dtype

    def _binding(self, name: str) -> Binding:
        if name not in self.by_name:
            raise ValueError(f"{self.qpc_dir} has no binding {name!r}; its bindings are {sorted(self.by_name)}")
        return self.by_name[name]

    def match(self, shapes: Mapping[str, tuple[int, ...]]) -> Shapes:
        """The first compiled specialization whose dims equal ``shapes`` on every named binding."""
        wanted = {name: tuple(int(d) for d in dims) for name, dims in shapes.items()}
        for name in wanted:
            self._binding(name)
        for allowed in self.allowed_shapes:
            if all(allowed[name] == dims for name, dims in wanted.items()):
                return allowed
        # Retained state (KV: many large, fixed buffers) is shown only where it is what differs.
        outputs = set(self.output_names)
        shown = [n for n, dims in wanted.items()
                 if n + RETAINED_SUFFIX not in outputs or any(a[n] != dims for a in self.allowed_shapes)]
        inputs = [n for n in self.input_names if n + RETAINED_SUFFIX not in outputs or n in shown]
        listing = "\n".join(f"  [{i}] " + _fmt_shapes({n: allowed[n] for n in inputs})
                            for i, allowed in enumerate(self.allowed_shapes))
        raise ValueError(
            f"no compiled specialization of {self.qpc_dir} takes the input shapes "
            f"{_fmt_shapes({n: wanted[n] for n in shown})}; "
            f"it allows:\n{listing}\npad the inputs to one of these shapes, or export and compile a "
            "specialization for them (qeff-evs export, then qeff-evs compile)")

    def run(self, inputs: Mapping[str, np.ndarray], skip: Iterable[str] = ()) -> dict[str, np.ndarray]:
        """Execute once. Every input is either given or named in ``skip`` (the device keeps its copy);
        outputs named in ``skip`` are not copied back. Returns the other outputs in host dtypes."""
        skip = set(skip)
        for name in skip | set(inputs):
            self._binding(name)
        missing = [n for n in self.input_names if n not in inputs and n not in skip]
        if missing:
            raise ValueError(f"inputs {missing} of {self.qpc_dir} were neither given nor skipped")
        unreadable = [b.name for b in self.bindings if b.dtype is None and b.name not in skip]
        if unreadable:
            raise ValueError(f"{unreadable} of {self.qpc_dir} have a device type the host cannot convert; "
                             "skip them (retained state stays on the device)")
        shapes = self.match({name: np.shape(value) for name, value in inputs.items()})
        rt = self.sdk.qaicrt
        buffers: list = [None] * len(self.bindings)
        dims: list = [None] * len(self.bindings)
        for b in self.bindings:
            if b.name in inputs:
                data = np.ascontiguousarray(inputs[b.name], dtype=b.dtype)
                buffers[b.index], dims[b.index] = rt.QBuffer(data.tobytes()), (b.itemsize, list(data.shape or (1,)))
            elif b.name in skip:
                buffers[b.index], dims[b.index] = rt.QBuffer(b""), (b.itemsize, [0])
            else:  # an output to copy back, sized by the chosen specialization
                size = b.itemsize * math.prod(shapes[b.name])
                buffers[b.index], dims[b.index] = rt.QBuffer(bytes(size)), (b.itemsize, list(shapes[b.name]))
        exec_obj = self.device_program.exec_obj
        if exec_obj is None:
            raise ValueError(f"{self.qpc_dir} was released (close); open the sessions again to run it")
        self.sdk.check(exec_obj.setData(buffers, rt.BufferDimensionsVecRef(dims)), "setData")
        self.sdk.check(self.device_program.queue.enqueue(exec_obj), "enqueue")
        self.sdk.check(exec_obj.waitForCompletion(), f"running {self.qpc_dir}")
        status, results = exec_obj.getData()
        self.sdk.check(status, "getData")
        outputs = {}
        for b in self.bindings:
            if b.is_input or b.name in skip:
                continue
            outputs[b.name] = np.frombuffer(bytes(results[b.index]), dtype=b.dtype).reshape(shapes[b.name]).copy()
        return outputs

    def close(self) -> None:
        """Release the program: deactivate and unload it (its cores and memory go back to the devices)."""
        self.device_program.release()


# --------------------------------------------------------------------------------------------------
# sessions


class QaicGraph:
    """A vision QPC (encoder or pruning) fed by input name; outputs come back as float32 / int64."""

    def __init__(self, program: QaicProgram, label: str):
        self.program = program
        self.label = label

    def close(self) -> None:
        self.program.close()

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        missing = [name for name in self.program.input_names if name not in feeds]
        if missing:
            raise ValueError(f"{self.label} QPC inputs {missing} were not provided")
        out = self.program.run({name: feeds[name] for name in self.program.input_names})
        return {name: value.astype(np.int64 if np.issubdtype(value.dtype, np.integer) else np.float32)
                for name, value in out.items()}


class QaicEncoderSession(QaicGraph):
    """The encoder QPC: one call of F temporal patches (the specialization of its resolution and F)."""

    def __init__(self, program: QaicProgram):
        super().__init__(program, "encoder")

    def encode(self, pixel_values: np.ndarray, host_inputs: dict[str, np.ndarray]) -> MergedRows:
        return merged_rows(self.run({"pixel_values": pixel_values, **host_inputs}))


class QaicPruningSession(QaicGraph):
    """A pruning QPC (fp32 compute, fp16 rows in; the specialization of its resolution and frame bucket):
    a video's padded merged rows -> the ranking of every row."""

    def __init__(self, program: QaicProgram):
        super().__init__(program, "pruning")

    def rank(self, feeds: dict[str, np.ndarray]) -> np.ndarray:
        return ranking(self.run(feeds))


def retained_inputs(program: QaicProgram) -> list[str]:
    """Inputs ``X`` whose output ``X_RetainedState`` aliases them on the device."""
    outputs = set(program.output_names)
    return [name for name in program.input_names if name + RETAINED_SUFFIX in outputs]


def decode_width(program: QaicProgram) -> int | None:
    """Rows of the compiled decode specialization (``input_ids`` of shape ``(B, 1)``), if there is one."""
    widths = [allowed["input_ids"][0] for allowed in program.allowed_shapes
              if "input_ids" in allowed and allowed["input_ids"][1:] == (1,)]
    return max(widths) if widths else None


class QaicLanguageSession(RetainedStateSession):
    """The language QPC with device-side retained state (KV cache, last vision window).

    Same interface as the other ``RetainedStateSession`` s (``reset``, ``run``, and with a ``batch_index`` graph
    ``prefill``/``decode``/``run_rows``), but no state lives on the host: retained outputs are
    always skipped, retained inputs are sent only when they change (see the module docstring).
    """

    skips_unread_logits = False  # the compiled specializations all compute one logits row

    def __init__(self, program: QaicProgram, shape: LanguageShape):
        self.program = program
        self.retained = retained_inputs(program)
        self._check_state_shapes(shape)
        width = decode_width(program)
        if BATCH_INDEX in program.input_names and width is not None and width != shape.decode_rows:
            shape = replace(shape, decode_batch_size=width)  # the compiled decode batch decides
        super().__init__(shape, program.input_names, program.output_names)

    def _check_state_shapes(self, shape: LanguageShape) -> None:
        expected = state_shapes(shape)
        for name in self.retained:
            if name not in expected:
                raise ValueError(f"{self.program.qpc_dir} retains {name!r}, which this language graph contract lacks")
            for allowed in self.program.allowed_shapes:
                if allowed[name] != expected[name]:
                    raise ValueError(
                        f"{self.program.qpc_dir} was compiled for {name} of shape {allowed[name]}, but the export's "
                        f"manifest says {expected[name]}; compile this export again (qeff-evs compile)")

    host_checks_call_len = False  # QaicProgram.match refuses a shape the QPC was not compiled for

    def reset(self) -> None:
        """The next call uploads zeros for every retained input (at construction: once per program load)."""
        self._stale = set(self.retained)

    def close(self) -> None:
        self.program.close()

    def _call(self, inputs: dict[str, np.ndarray]) -> np.ndarray:
        inputs = dict(inputs)
        expected = state_shapes(self.shape)
        for name in self.retained:
            dtype = self.program.dtype(name)
            if name not in inputs and name in self._stale and dtype is not None:
                # a type the host cannot write (mxint8 KV) stays as the device has it
                inputs[name] = np.zeros(expected[name], dtype=dtype)
        inputs = {name: value for name, value in inputs.items() if name in self.program.by_name}
        skip = [n for n in self.retained if n not in inputs] + [n + RETAINED_SUFFIX for n in self.retained]
        outputs = self.program.run(inputs, skip=skip)
        self._stale.clear()
        return outputs["logits"].astype(np.float32)


# --------------------------------------------------------------------------------------------------
# entry point


def qpc_dir(bundle, graph: str) -> Path:
    """The compiled program of ``graph`` (``vision/encoder_qpc``, ``vision/pruning_evs_qpc``, ``language/qpc``),
    checked."""
    folder = bundle.manifest.path(bundle.export_dir, graph).parent / compile_file_name(
        QPC_DIR, None if graph == "language" else graph)
    if not (folder / QPC_FILE).is_file():
        raise ValueError(
            f"no compiled {graph} QPC at {folder} ({QPC_FILE} missing); run `qeff-evs compile "
            f"{bundle.export_dir}` on a machine with the Apps SDK first")
    return folder


def deployment_graphs(bundle, method: str | None = None, language: bool = True) -> tuple[str, ...]:
    """The graphs a deployment loads: the encoder, ``method``'s pruning graph (default: the export's default
    method), and the language graph unless ``language`` is False. One graph per role."""
    method = bundle.manifest.video_pruning_method if method is None else method
    problem = bundle.manifest.method_refusal(method)
    if problem:
        raise ValueError(problem)
    return ("encoder", pruning_graph(method), *(("language",) if language else ()))


def load_programs(bundle, graphs: Sequence[str], device_ids: DeviceIdsSpec | None = None,
                  sdk_root: str | Path = DEFAULT_SDK_ROOT) -> dict[str, QaicProgram]:
    """The programs of ``graphs`` (graph names, at most one per role), loaded and activated on their role's
    devices, by graph name.

    Checked before anything is loaded: the SDK, every QPC folder, and the placement (each program on as many
    ids as it was compiled for, each device's cores enough for all its programs at once). A load that fails
    releases the programs loaded before it.
    """
    by_role = {graph_role(graph): graph for graph in graphs}
    if len(by_role) != len(graphs):
        raise ValueError(f"graphs {list(graphs)} share a role; a deployment loads one pruning graph (its method's)")
    sdk = load_sdk(sdk_root)
    folders = {graph: qpc_dir(bundle, graph) for graph in graphs}
    placements = place_programs(read_placement_record(bundle.export_dir), device_ids, tuple(by_role))
    check_device_cores(placements)
    programs: dict[str, QaicProgram] = {}
    try:
        for placement in placements:
            graph = by_role[placement.graph]
            programs[graph] = QaicProgram(folders[graph], sdk, placement.device_ids)
    except BaseException:
        for program in programs.values():
            program.close()
        raise
    return programs


def _vision_pipeline(bundle, programs: dict[str, QaicProgram]) -> VisionPipeline:
    pruning = {graph[len("pruning_"):]: QaicPruningSession(program) for graph, program in programs.items()
               if graph_role(graph) == "pruning"}
    # The image encoder is compiled (in the encoder's role) but not loaded: images are refused on this backend.
    return VisionPipeline(bundle.family, QaicEncoderSession(programs["encoder"]), pruning,
                          bundle.manifest.frames_per_call, bundle.manifest.temporal_patch_buckets,
                          tiled_images=IMAGE_ENCODER in bundle.manifest.files)


def qaic_vision_pipeline(bundle, device_ids: DeviceIdsSpec | None = None, sdk_root: str | Path = DEFAULT_SDK_ROOT,
                         method: str | None = None) -> VisionPipeline:
    """The encoder and ``method``'s pruning QPCs of the export (``qeff-evs compile``), at its frames per call."""
    return _vision_pipeline(bundle, load_programs(bundle, deployment_graphs(bundle, method, language=False),
                                                  device_ids, sdk_root))


def qaic_language_session(bundle, device_ids: DeviceIdsSpec | None = None,
                          sdk_root: str | Path = DEFAULT_SDK_ROOT) -> QaicLanguageSession:
    """The language QPC alone, active on its devices until the session is closed (no vision program)."""
    program = load_programs(bundle, ("language",), device_ids, sdk_root)["language"]
    try:
        return QaicLanguageSession(program, bundle.language_shape)
    except BaseException:
        program.close()
        raise


def qaic_sessions(bundle, device_ids: DeviceIdsSpec | None = None, sdk_root: str | Path = DEFAULT_SDK_ROOT,
                  method: str | None = None) -> tuple[VisionPipeline, QaicLanguageSession]:
    """The vision pipeline and language session over the export's compiled QPCs (``qeff-evs compile``): the
    encoder, ``method``'s pruning graph (default: the export's default method) and the language graph, every
    program active on its devices until the sessions are closed."""
    programs = load_programs(bundle, deployment_graphs(bundle, method), device_ids, sdk_root)
    try:
        return _vision_pipeline(bundle, programs), QaicLanguageSession(programs["language"], bundle.language_shape)
    except BaseException:  # e.g. a QPC compiled for another ctx_len: give the devices back before failing
        for program in programs.values():
            program.close()
        raise
