"""The verifier's runs: plain ONNX Runtime sessions of the exported graphs (the export side never imports the runtime),
the language graph with its retained state fed back as a ``-retained-state`` program keeps it, the feeds of a
sample chunk and of video-like rows, and what one comparison of fp32 with the fp16 twin records."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from qeff_evs.manifest import LanguageShape, read_manifest
from qeff_evs.models.graph_io import (
    BATCH_INDEX, COMP_CTX_LENGTHS, LOGITS_ROWS, RETAINED_SUFFIX, LanguageGraphIO, state_shapes,
)

EVS_NORMS = (20.0, 100.0)  # realistic merged-row norms of a video (the EVS and router workloads)


def nonfinite(values: np.ndarray) -> int:
    return int(np.size(values) - np.isfinite(values).sum())


def agreement(a, b) -> float:
    """Share of positions where two equally long sequences agree."""
    a, b = list(a), list(b)
    return 1.0 if not a else sum(x == y for x, y in zip(a, b)) / len(a)


def kept_agreement(fp32_indices, fp16_indices) -> float:
    """Share of fp32's kept tokens that the fp16 run keeps too."""
    fp32_indices = set(np.asarray(fp32_indices).tolist())
    return 1.0 if not fp32_indices else len(fp32_indices & set(np.asarray(fp16_indices).tolist())) / len(fp32_indices)


@dataclass
class Comparison:
    name: str
    max_abs_error: float = 0.0
    greedy_agreement: float = 1.0
    kept_token_agreement: float | None = None
    nonfinite_fp32: int = 0
    nonfinite_fp16: int = 0
    detail: dict = field(default_factory=dict)


EXTERNAL_DATA_FOLDER = "session.model_external_initializers_file_folder_path"  # ORT's key for a graph from bytes


def graph_session(graph: Path | bytes, weights: Path | None = None):
    """An ORT session of a graph file, or of a serialized graph whose external data lies in ``weights``."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    if weights is not None:
        options.add_session_config_entry(EXTERNAL_DATA_FOLDER, str(weights))
    return ort.InferenceSession(graph if isinstance(graph, bytes) else str(graph), options,
                                providers=["CPUExecutionProvider"])


class LanguageRun:
    """One language graph with its retained state fed back, as a ``-retained-state`` program keeps it.

    ``graph``: what to run (default the export's language graph file), e.g. a serialized probe of it with
    ``extra_outputs`` whose weights lie in ``weights``."""

    def __init__(self, export_dir: Path, graph: Path | bytes | None = None, extra_outputs: tuple[str, ...] = (),
                 weights: Path | None = None):
        manifest = read_manifest(export_dir)
        self.shape = manifest.language_shape
        self.tokens = manifest.special_tokens
        self.session = graph_session(manifest.path(export_dir, "language") if graph is None else graph, weights)
        self.prefill_seq_len = manifest.prefill_seq_len
        self.io = LanguageGraphIO.of_shape(self.shape)
        self.output_names = [*self.io.output_names, *extra_outputs]
        self.reset()

    def reset(self) -> None:
        self.state = {name: np.zeros(dims, np.float32) for name, dims in state_shapes(self.shape).items()}

    def chunk_len(self, wanted: int) -> int:
        """A chunk length the graph takes: a graph with layer states is unrolled for its prefill length."""
        return min(wanted, self.prefill_seq_len) if self.shape.layer_states else wanted

    def call(self, input_ids: np.ndarray, positions: np.ndarray, **vision: np.ndarray) -> dict[str, np.ndarray]:
        """Every output of one call, by name; the retained state kept for the next."""
        feeds = {**self.state, **vision, "input_ids": input_ids, "position_ids": positions,
                 "image_idx": np.zeros((1, 1), np.int64)}
        if BATCH_INDEX in self.io.input_names:
            feeds[BATCH_INDEX] = np.zeros((input_ids.shape[0], 1), np.int64)
        feeds.update(shape_feeds(self.shape, positions))
        outputs = dict(zip(self.output_names, self.session.run(self.output_names, feeds)))
        for name, value in outputs.items():
            if name.endswith(RETAINED_SUFFIX):
                self.state[name[: -len(RETAINED_SUFFIX)]] = value
        return outputs

    def run(self, input_ids: np.ndarray, positions: np.ndarray, **vision: np.ndarray) -> np.ndarray:
        return self.call(input_ids, positions, **vision)["logits"][0, 0]


def chunk_feeds(shape, tokens, seq_len: int, offset: int, seed: int, media_rows: np.ndarray | None = None):
    rng = np.random.default_rng(seed)
    special = set(tokens.ids)
    vocab = [i for i in range(min(shape.vocab or 256, 4096)) if i not in special]
    ids = rng.choice(vocab, size=(1, seq_len)).astype(np.int64)
    window = np.zeros((1, shape.vision_size, shape.hidden), np.float32)
    if media_rows is not None:
        ids[0, 1:1 + len(media_rows)] = tokens.media_pad("video")
        window[0, : len(media_rows)] = media_rows
    positions = np.empty((4, 1, seq_len), np.int64)
    positions[0, 0] = np.arange(seq_len)
    positions[1:, 0] = offset + np.arange(seq_len)
    vision = {"vision_embeds": window}
    for name, levels in shape.extras.items():  # every level of an extra: the chunk's vision rows
        extra = np.zeros((levels, 1, shape.vision_size, shape.hidden), np.float32)
        extra[:, 0] = window[0]
        vision[name] = extra
    return ids, positions, vision


def shape_feeds(shape: LanguageShape, positions: np.ndarray) -> dict[str, np.ndarray]:
    """The inputs a call takes by the export's shape: ``comp_ctx_lengths`` as long as the smallest compute context
    length holding the call's last slot (the specialization a card picks), one ``logits_rows`` row."""
    feeds = {}
    length = shape.comp_ctx_len(int(positions[0].max()))
    if length is not None:
        feeds[COMP_CTX_LENGTHS] = np.arange(length, dtype=np.int64)
    if shape.logits_rows:
        feeds[LOGITS_ROWS] = np.zeros(1, dtype=np.int64)
    return feeds


def video_like_rows(frames: int, tokens: int, width: int, norms: tuple[float, float], seed: int) -> np.ndarray:
    """``(frames*tokens, width)`` rows with norms in ``norms`` whose tokens drift a little frame to frame."""
    rng = np.random.default_rng(seed)
    base = rng.standard_normal((tokens, width))
    rows = []
    for _ in range(frames):
        base = base + rng.standard_normal((tokens, width)) * rng.uniform(0.05, 0.5, size=(tokens, 1))
        scale = rng.uniform(*norms, size=(tokens, 1)) / np.linalg.norm(base, axis=1, keepdims=True)
        rows.append(base * scale)
    return np.concatenate(rows).astype(np.float32)
