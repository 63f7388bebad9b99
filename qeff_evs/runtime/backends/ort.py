"""ONNX Runtime backend (the embedded default): the export's graphs on the CPU.

The language session keeps its retained state where a ``-retained-state`` program keeps it: in buffers the graph
writes itself (docs/design.md#the-runtime). Each retained input ``X`` (KV caches, layer states, the vision window) is
one host buffer wrapped as an ``OrtValue`` and bound with ``IOBinding`` both as ``X`` and as ``X_RetainedState``; the
graph's KV write (the ``ScatterND`` of ``CtxScatter``) then sees its output buffer is its input and skips the copy
ONNX Runtime's kernel otherwise makes of the whole cache, so a call moves no cache bytes in or out. Zeroed once, when
the session is made (or on ``reset``), as on the card. Per-call inputs (ids, positions, ``batch_index``, a prefill
chunk's window) are ordinary feeds.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from qeff_evs.manifest import LanguageShape, check_graph_data, export_root
from qeff_evs.models.graph_io import RETAINED_SUFFIX
from qeff_evs.runtime.backends.base import MergedRows, RetainedStateSession, merged_rows, ranking


FLOAT16_WEIGHTS = "float16"


def open_ort_session(path: Path, weight_dtype: str = "float32"):
    """An ONNX Runtime session of the graph at ``path``. A graph storing its weights in fp16 (``weight_dtype``, the
    manifest's) casts each to fp32 where it reads it: left to itself ONNX Runtime would fold every such cast into an
    fp32 copy at load (twice the weights' bytes, in anonymous memory), so its session runs without constant folding
    (at the extended level, which also leaves the weights memory-mapped from their files): the casts run on every call
    instead (docs/export-compile.md, "Weights in fp16"). A graph whose external data lies outside its export folder is
    refused before ONNX Runtime reads it (``manifest.check_graph_data``)."""
    import onnxruntime as ort

    if not Path(path).is_file():
        raise ValueError(f"graph {path} not found; re-run `qeff-evs export` for this folder")
    check_graph_data(export_root(path), path)

    options = ort.SessionOptions()
    options.log_severity_level = 3
    extra = {}
    if weight_dtype == FLOAT16_WEIGHTS:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
        extra["disabled_optimizers"] = ["ConstantFolding"]
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"], **extra)


def _session(graph, weight_dtype: str = "float32"):
    """An ``InferenceSession`` as given, or one opened on the graph file at ``graph``."""
    return open_ort_session(graph, weight_dtype) if isinstance(graph, (str, Path)) else graph


class OrtGraph:
    """One graph in ONNX Runtime, fed by input name; ``graph`` is its path or an opened ``InferenceSession``
    (``weight_dtype``: the export's, ``open_ort_session``)."""

    def __init__(self, graph, label: str, weight_dtype: str = "float32"):
        self.session = _session(graph, weight_dtype)
        self.label = label
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.output_names = [o.name for o in self.session.get_outputs()]

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        missing = [name for name in self.input_names if name not in feeds]
        if missing:
            raise ValueError(f"{self.label} inputs {missing} were not provided")
        return dict(zip(self.output_names, self.session.run(None, {k: feeds[k] for k in self.input_names})))


class OrtEncoderSession(OrtGraph):
    """The encoder graph: one call of F temporal patches."""

    def __init__(self, graph, weight_dtype: str = "float32"):
        super().__init__(graph, "encoder graph", weight_dtype)

    def encode(self, pixel_values: np.ndarray, host_inputs: dict[str, np.ndarray]) -> MergedRows:
        return merged_rows(self.run({"pixel_values": np.asarray(pixel_values, dtype=np.float32), **host_inputs}))


class OrtPruningSession(OrtGraph):
    """A pruning graph: a video's merged rows padded to a frame bucket -> the ranking of every row."""

    def __init__(self, graph):
        super().__init__(graph, "pruning graph")

    def rank(self, feeds: dict[str, np.ndarray]) -> np.ndarray:
        # Floats (rows, score_extras, the ratio) as the graph's float32; the int64 carriers as they are.
        return ranking(self.run({name: np.asarray(value, dtype=np.float32) if value.dtype.kind == "f" else value
                                 for name, value in feeds.items()}))


class OrtLanguageSession(RetainedStateSession):
    """The language graph in ONNX Runtime, its retained state bound in place (module docstring).

    ``graph`` is its path or an opened ``InferenceSession``. ``state`` maps each retained input to the numpy
    array that *is* its bound buffer: what the last call wrote, read without a copy; write into it in place
    (``state[name][...] = ...``) to change what the next call reads.
    ``decode_graph``: the export's decode-only twin (``manifest.LANGUAGE_DECODE``, same I/O), run for one-token
    calls instead of a graph that computes its prefill path there too; it is bound to the same buffers.
    """

    def __init__(self, graph, shape: LanguageShape, decode_graph=None, weight_dtype: str = "float32"):
        self.session = _session(graph, weight_dtype)
        self.decode_session = None if decode_graph is None else _session(decode_graph, weight_dtype)
        self._dtypes = {i.name: _numpy_dtype(i.type) for i in self.session.get_inputs()}
        if self.decode_session is not None:
            names = ([i.name for i in self.decode_session.get_inputs()],
                     [o.name for o in self.decode_session.get_outputs()])
            if names != ([i.name for i in self.session.get_inputs()], [o.name for o in self.session.get_outputs()]):
                raise ValueError(f"the decode-only language graph's I/O {names} differs from the language graph's; "
                                 "re-export this folder")
        super().__init__(shape, [i.name for i in self.session.get_inputs()],
                         [o.name for o in self.session.get_outputs()])
        self._logits_at = self.output_names.index("logits")

    def reset(self) -> None:
        """Fresh zeroed buffers for every retained input, each bound as the graph's input and its output."""
        dims = self.retained_dims()
        self.state: dict[str, np.ndarray] = {}
        sessions = [self.session] + ([] if self.decode_session is None else [self.decode_session])
        self.bindings = [session.io_binding() for session in sessions]
        for output in self.output_names:  # in graph order, which the bindings' outputs then keep
            name = output.removesuffix(RETAINED_SUFFIX)
            if name in dims:
                self._bind_state(name, np.zeros(dims[name], dtype=self._dtypes[name]))
            else:
                for binding in self.bindings:
                    binding.bind_output(output, "cpu")

    def _bind_state(self, name: str, buffer: np.ndarray) -> None:
        import onnxruntime as ort

        self.state[name] = buffer
        value = ort.OrtValue.ortvalue_from_numpy(buffer)  # on the CPU: shares the array's memory
        for binding in self.bindings:
            binding.bind_ortvalue_input(name, value)
            binding.bind_ortvalue_output(name + RETAINED_SUFFIX, value)

    def _call(self, inputs: dict[str, np.ndarray]) -> np.ndarray:
        missing = [name for name in self.input_names if name not in inputs and name not in self.state]
        if missing:
            raise ValueError(f"language graph inputs {missing} were not provided")
        one_token = self.decode_session is not None and inputs["input_ids"].shape[1] == 1
        session, binding = (self.decode_session, self.bindings[1]) if one_token else (self.session, self.bindings[0])
        for name, value in inputs.items():
            value = np.ascontiguousarray(value, dtype=self._dtypes[name])
            if name in self.state:
                # A prefill chunk's window: a per-call input that becomes the retained one (the graph
                # returns it as it came, into the same buffer).
                self._bind_state(name, value)
            else:
                binding.bind_cpu_input(name, value)
        # Rebound each call: a bound output keeps the shape of its last call, and logits change shape
        # between prefill (one row) and decode (decode_batch_size rows).
        for name in self.output_names:
            if not name.endswith(RETAINED_SUFFIX):
                binding.bind_output(name, "cpu")
        session.run_with_iobinding(binding)
        return binding.get_outputs()[self._logits_at].numpy()


_NUMPY_DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64,
                 "tensor(int32)": np.int32}


def _numpy_dtype(onnx_type: str):
    if onnx_type not in _NUMPY_DTYPES:
        raise ValueError(f"the language graph has an input of type {onnx_type}, which this runtime does not feed; "
                         f"it feeds {', '.join(_NUMPY_DTYPES)}")
    return _NUMPY_DTYPES[onnx_type]
