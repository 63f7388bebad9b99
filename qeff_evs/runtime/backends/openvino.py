"""OpenVINO backend (``--backend openvino``, the ``openvino`` extra): the export's ONNX graphs, the same files ONNX
Runtime runs, compiled by OpenVINO's CPU plugin.

OpenVINO reads ONNX itself, through its ONNX frontend, which has no rule for the export's model-local functions
(``CustomRMSNorm``, ``CtxGather``, ``CtxScatter``: the card's custom ops, whose bodies ONNX Runtime inlines): the graph
is handed over with them inlined by ``onnx.inliner`` (its structure only; the weights stay in their files). OpenVINO
resolves external data only under the graph's own folder, so the inlined graph is written there, under a hidden
scratch name, and removed as soon as OpenVINO has read it.
Compute is fp32 (``INFERENCE_PRECISION_HINT f32``) under ``--backend openvino``: on a CPU with bf16 instructions
OpenVINO would otherwise compute in bf16, which changes logits past the embedded path's fp32 tolerance. ``--backend
openvino-bf16`` asks for that bf16 compute (OpenVINO's own default on such a CPU) in the encoder and language graphs,
for speed, with its own tolerance (docs/performance.md); the pruning graph ranks in fp32 on both, and the weights,
the retained state and every graph output stay fp32. A CPU without bf16 instructions is refused in one line rather
than silently computing fp32. The language graph's retained state
lives in host buffers the session owns, as on ONNX Runtime: each call feeds them and the graph's
``*_RetainedState`` outputs are written into the other buffer of a pair (``set_output_tensor``), which becomes the
next call's input, so no state is copied on the host. Once a graph is compiled, the pages of the export's weight
files OpenVINO read are released from the process (``file_pages``): the plugin computes from its own copies.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

import numpy as np

from qeff_evs.manifest import LanguageShape, check_graph_data, export_root
from qeff_evs.models.graph_io import RETAINED_SUFFIX
from qeff_evs.runtime.backends import file_pages
from qeff_evs.runtime.backends.base import MergedRows, RetainedStateSession, merged_rows, ranking

OPENVINO_EXTRA = "pip install 'qeff-evs[openvino]'"
THREADS_ENV = "QEFF_EVS_OPENVINO_THREADS"  # the CPU plugin's threads (default: OpenVINO's, every core)
F32, BF16 = "f32", "bf16"
PRECISIONS = {"openvino": F32, "openvino-bf16": BF16}  # backend name: the compute precision of its heavy graphs


def compile_graph(path: Path, precision: str = F32):
    """A compiled model of the ONNX graph at ``path`` on OpenVINO's CPU plugin, computing in ``precision``."""
    try:
        import openvino as ov
    except ImportError:
        raise ValueError(f"--backend openvino needs OpenVINO, which is not installed; {OPENVINO_EXTRA}") from None
    if not Path(path).is_file():
        raise ValueError(f"graph {path} not found; re-run `qeff-evs export` for this folder")
    check_graph_data(export_root(path), path)
    core = ov.Core()
    capabilities = core.get_property("CPU", "OPTIMIZATION_CAPABILITIES")
    if precision == BF16 and "BF16" not in capabilities:
        raise ValueError("--backend openvino-bf16: this CPU has no bf16 instructions (OpenVINO reports "
                         f"{', '.join(capabilities)}); use --backend openvino")
    config = {"INFERENCE_PRECISION_HINT": precision, "PERFORMANCE_HINT": "LATENCY"}
    if os.environ.get(THREADS_ENV):
        config["INFERENCE_NUM_THREADS"] = int(os.environ[THREADS_ENV])
    with inlined_graph(Path(path)) as readable:
        model = core.read_model(str(readable))
    compiled = core.compile_model(model, "CPU", config)
    file_pages.release(export_root(path))  # the plugin computes from its own copies (file_pages)
    return compiled


def onnx_io_names(path: Path) -> set[str]:
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    return {value.name for value in (*graph.input, *graph.output)}


@contextlib.contextmanager
def inlined_graph(path: Path):
    """``path`` itself where the graph has no model-local functions, else the graph with them inlined, written beside
    it (where its external data's relative paths resolve) for as long as the context lasts."""
    import onnx
    import onnx.inliner

    model = onnx.load(str(path), load_external_data=False)
    if not model.functions:
        yield path
        return
    inlined = onnx.inliner.inline_local_functions(model)
    try:
        handle, name = tempfile.mkstemp(prefix=".openvino-", suffix=".onnx", dir=path.parent)
    except OSError as error:
        raise ValueError(f"--backend openvino writes the graph with its functions inlined beside {path} while it "
                         f"loads, and cannot ({error.strerror}); make {path.parent} writable, or use --backend "
                         "ort") from None
    try:
        with os.fdopen(handle, "wb") as out:
            out.write(inlined.SerializeToString())
        yield Path(name)
    finally:
        os.unlink(name)


class OpenVinoGraph:
    """One graph compiled by OpenVINO, fed by input name."""

    def __init__(self, path: Path, label: str, precision: str = F32):
        self.compiled = compile_graph(path, precision)
        self.request = self.compiled.create_infer_request()
        self.label = label
        # A port may carry several tensor names (OpenVINO merges the names of what it folds); the graph's are these.
        graph = onnx_io_names(path)
        self.input_names = [_graph_name(port, graph) for port in self.compiled.inputs]
        self.output_names = [_graph_name(port, graph) for port in self.compiled.outputs]

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        missing = [name for name in self.input_names if name not in feeds]
        if missing:
            raise ValueError(f"{self.label} inputs {missing} were not provided")
        self.request.infer({name: np.ascontiguousarray(feeds[name]) for name in self.input_names})
        return {name: self.request.get_tensor(name).data.copy() for name in self.output_names}


def _graph_name(port, graph_names: set[str]) -> str:
    """The ONNX graph's name of a compiled model's port (among the names OpenVINO gives it)."""
    names = set(port.get_names()) & graph_names
    if len(names) != 1:
        raise ValueError(f"OpenVINO's port names {sorted(port.get_names())} match no single name of the graph's "
                         "inputs and outputs; use --backend ort")
    return names.pop()


class OpenVinoEncoderSession(OpenVinoGraph):
    def __init__(self, path: Path, precision: str = F32):
        super().__init__(path, "encoder graph", precision)

    def encode(self, pixel_values: np.ndarray, host_inputs: dict[str, np.ndarray]) -> MergedRows:
        return merged_rows(self.run({"pixel_values": np.asarray(pixel_values, dtype=np.float32), **host_inputs}))


class OpenVinoPruningSession(OpenVinoGraph):
    def __init__(self, path: Path):
        super().__init__(path, "pruning graph")

    def rank(self, feeds: dict[str, np.ndarray]) -> np.ndarray:
        return ranking(self.run({name: np.asarray(value, dtype=np.float32) if value.dtype.kind == "f" else value
                                 for name, value in feeds.items()}))


_NUMPY_DTYPES = {"f32": np.float32, "f16": np.float16, "i64": np.int64, "i32": np.int32}


class OpenVinoLanguageSession(RetainedStateSession):
    """The language graph on OpenVINO (module docstring); ``state`` as ``OrtLanguageSession``'s: the array each
    retained input's next call reads. ``decode_path``: the export's decode-only twin, run for one-token calls."""

    def __init__(self, path: Path, shape: LanguageShape, decode_path: Path | None = None, precision: str = F32):
        self.graphs = [OpenVinoGraph(path, "language graph", precision)]
        if decode_path is not None:
            self.graphs.append(OpenVinoGraph(decode_path, "decode-only language graph", precision))
        graph = self.graphs[0]
        self._dtypes = {name: _NUMPY_DTYPES[port.get_element_type().get_type_name()]
                        for name, port in zip(graph.input_names, graph.compiled.inputs)}
        super().__init__(shape, graph.input_names, graph.output_names)

    def reset(self) -> None:
        self.state = {name: np.zeros(dims, dtype=self._dtypes[name]) for name, dims in self.retained_dims().items()}
        self._spare = {name: np.zeros_like(buffer) for name, buffer in self.state.items()}

    def _call(self, inputs: dict[str, np.ndarray]) -> np.ndarray:
        import openvino as ov

        missing = [name for name in self.input_names if name not in inputs and name not in self.state]
        if missing:
            raise ValueError(f"language graph inputs {missing} were not provided")
        one_token = len(self.graphs) > 1 and inputs["input_ids"].shape[1] == 1
        request = (self.graphs[1] if one_token else self.graphs[0]).request
        for name, value in inputs.items():
            if name in self.state:  # a prefill chunk's window: it becomes the retained one
                self.state[name] = np.ascontiguousarray(value, dtype=self._dtypes[name])
                self._spare[name] = np.zeros_like(self.state[name])
        for name in self.input_names:
            value = self.state[name] if name in self.state else np.ascontiguousarray(inputs[name],
                                                                                      dtype=self._dtypes[name])
            request.set_tensor(name, ov.Tensor(value, shared_memory=True))
        for name in self.state:
            request.set_tensor(name + RETAINED_SUFFIX, ov.Tensor(self._spare[name], shared_memory=True))
        request.infer()
        logits = request.get_tensor("logits").data.copy()
        for name in self.state:  # what the graph wrote is what the next call reads
            self.state[name], self._spare[name] = self._spare[name], self.state[name]
        return logits
