"""ONNX Runtime backend (the embedded default): the export's graphs on the CPU."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from qeff_evs.manifest import LanguageShape
from qeff_evs.runtime.backends.base import HostStateSession, MergedRows, merged_rows, ranking


def open_ort_session(path: Path):
    import onnxruntime as ort

    if not Path(path).is_file():
        raise ValueError(f"graph {path} not found; re-run `qeff-evs export` for this folder")

    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _session(graph):
    """An ``InferenceSession`` as given, or one opened on the graph file at ``graph``."""
    return open_ort_session(graph) if isinstance(graph, (str, Path)) else graph


class OrtGraph:
    """One graph in ONNX Runtime, fed by input name; ``graph`` is its path or an opened ``InferenceSession``."""

    def __init__(self, graph, label: str):
        self.session = _session(graph)
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

    def __init__(self, graph):
        super().__init__(graph, "encoder graph")

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


class OrtLanguageSession(HostStateSession):
    """The language graph in ONNX Runtime; ``graph`` is its path or an opened ``InferenceSession``."""

    def __init__(self, graph, shape: LanguageShape):
        self.session = _session(graph)
        super().__init__(shape, [i.name for i in self.session.get_inputs()],
                         [o.name for o in self.session.get_outputs()])

    def _execute(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        return self.session.run(None, {name: feeds[name] for name in self.input_names})


