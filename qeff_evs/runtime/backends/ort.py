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
    """The language graph in ONNX Runtime; ``graph`` is its path or an opened ``InferenceSession``.

    ``decode_graph``: the export's decode-only twin (``manifest.LANGUAGE_DECODE``, same I/O), run for one-token
    calls instead of a graph that computes its prefill path there too.
    """

    def __init__(self, graph, shape: LanguageShape, decode_graph=None):
        self.session = _session(graph)
        self.decode_session = None if decode_graph is None else _session(decode_graph)
        super().__init__(shape, [i.name for i in self.session.get_inputs()],
                         [o.name for o in self.session.get_outputs()])
        if self.decode_session is not None:
            names = ([i.name for i in self.decode_session.get_inputs()],
                     [o.name for o in self.decode_session.get_outputs()])
            if names != (self.input_names, self.output_names):
                raise ValueError(f"the decode-only language graph's I/O {names} differs from the language graph's; "
                                 "re-export this folder")

    def _execute(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        one_token = self.decode_session is not None and feeds["input_ids"].shape[1] == 1
        session = self.decode_session if one_token else self.session
        return session.run(None, {name: feeds[name] for name in self.input_names})


