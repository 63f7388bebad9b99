"""QEfficient's exported graphs run on ONNX Runtime the way QEfficient's own host runs them on the card.

The host loop is ``_QEffAutoModelForImageTextToTextDualQPC.kv_offload_generate`` (QEfficient main, read, not
copied), with ONNX Runtime in place of ``qaicrt``:

* the vision graph once per image (its specialization is one image of one size), the rows of every image
  concatenated on the token axis: the whole prompt's ``vision_embeds`` (and Qwen3-VL's ``deepstack_features``);
* the prompt padded to a multiple of the prefill length with pad id 1 and positions -1 (QEfficient's own
  ``prepare_inputs_for_generation`` computed them, in its environment); every chunk gets the whole prompt's
  vision rows, ``image_idx`` starts at 0 and is the previous chunk's ``image_idx_output`` after;
* greedy decode at ``max(position) + 1`` per position row.

On the card ``vision_embeds`` is a retained buffer (uploaded once, kept across chunks); on ONNX Runtime every
input is fed in and every ``*_RetainedState`` output read back on every call, as for our graphs
(``HostStateSession``). The bytes counted per call are those of its inputs; the vision rows' share is what
``set_buffers`` would upload per chunk if the buffer were not retained, and what vllm-qaic's windowed feeding
uploads per chunk (reference qeff.md §7.3).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from qeff_evs.bench.timing import Samples, timed

PAD_TOKEN_ID = 1  # kv_offload_generate's pad id
RETAINED = "_RetainedState"
VISION_INPUTS = ("vision_embeds", "deepstack_features")
INT32_MAX = 2**31 - 1


def open_qefficient_session(path: str | Path) -> tuple[object, dict]:
    """An ORT session on a QEfficient graph, its scalar INT32_MAX constants (the card's "skip this index") read as 0;
    and the ``OrtValue`` overrides, which must live as long as the session.

    ONNX Runtime refuses a gather at an index past the data; QEfficient's own ORT runner
    (``QEfficient/utils/run_utils.py``) overrides those constants the same way (values read there are masked).
    """
    import onnx
    import onnxruntime as ort
    from onnx import numpy_helper

    model = onnx.load(str(path), load_external_data=False)
    overrides = {}
    for node in model.graph.node:
        if node.op_type != "Constant" or not node.attribute or not node.attribute[0].HasField("t"):
            continue
        value = numpy_helper.to_array(node.attribute[0].t)
        if value.shape == () and value.item() == INT32_MAX:
            overrides[node.output[0]] = ort.OrtValue.ortvalue_from_numpy(np.array(0, dtype=value.dtype))
    options = ort.SessionOptions()
    options.log_severity_level = 3
    for name, value in overrides.items():
        options.add_initializer(name, value)
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"]), overrides


def feed_bytes(feeds: Mapping[str, np.ndarray]) -> int:
    return int(sum(np.asarray(v).nbytes for v in feeds.values()))


@dataclass
class QEfficientRun:
    """One request through QEfficient's graphs: per-chunk bytes and times, the first logits, greedy tokens."""

    prompt_tokens: int
    vision_rows: int  # rows of the whole prompt (every image)
    vision: Samples = field(default_factory=Samples)  # one sample per image
    chunks: Samples = field(default_factory=Samples)  # one sample per prefill chunk
    vision_bytes_per_chunk: list[int] = field(default_factory=list)
    all_bytes_per_chunk: list[int] = field(default_factory=list)
    first_logits: np.ndarray | None = field(default=None, repr=False)
    tokens: list[int] = field(default_factory=list)


class QEfficientGraphs:
    """QEfficient's dual-QPC graphs (vision, language) opened in ONNX Runtime."""

    def __init__(self, vision_onnx: str | Path, language_onnx: str | Path):
        self.vision, vision_overrides = open_qefficient_session(vision_onnx)
        self.language, language_overrides = open_qefficient_session(language_onnx)
        self._overrides = (vision_overrides, language_overrides)  # kept alive with the sessions
        self.language_inputs = {i.name: i for i in self.language.get_inputs()}
        self.language_outputs = [o.name for o in self.language.get_outputs()]

    def encode_images(self, images: Sequence[tuple[np.ndarray, tuple[int, int, int]]], into: Samples) -> dict:
        """Every image through the vision graph (one call each); outputs concatenated on the token axis."""
        names = [o.name for o in self.vision.get_outputs()]
        parts: dict[str, list[np.ndarray]] = {name: [] for name in names}
        for pixel_values, (t, h, w) in images:
            feeds = {"pixel_values": np.asarray(pixel_values, dtype=np.float32),
                     "image_grid_thw": np.zeros((1, t, h, w), dtype=np.int64)}
            outputs = timed(lambda: self.vision.run(None, feeds), into)
            for name, value in zip(names, outputs):
                parts[name].append(value)
        # vision_embeds (1, n, C) per image; deepstack_features (levels, 1, n, C): the token axis is the last but one.
        return {name: np.concatenate(values, axis=-2) for name, values in parts.items()}

    def zero_state(self, ctx_len: int) -> dict[str, np.ndarray]:
        state = {}
        for name, info in self.language_inputs.items():
            if name.startswith("past_"):
                _, heads, _, head_dim = info.shape
                state[name] = np.zeros((1, int(heads), ctx_len, int(head_dim)), dtype=np.float32)
        return state

    def generate(self, input_ids: np.ndarray, positions: np.ndarray, images, prefill_seq_len: int, ctx_len: int,
                 new_tokens: int) -> QEfficientRun:
        """Vision, chunked prefill and greedy decode of one prompt (``input_ids`` (N,), ``positions`` (4, 1, N_pad))."""
        n = int(input_ids.shape[0])
        chunks = -(-n // prefill_seq_len)
        padded = chunks * prefill_seq_len
        if positions.shape != (4, 1, padded):
            raise ValueError(f"QEfficient's positions have shape {positions.shape}, expected (4, 1, {padded}) for "
                             f"{n} tokens in chunks of {prefill_seq_len}")
        ids = np.full((1, padded), PAD_TOKEN_ID, dtype=np.int64)
        ids[0, :n] = input_ids
        run = QEfficientRun(prompt_tokens=n, vision_rows=0)
        vision = self.encode_images(images, run.vision)
        run.vision_rows = int(vision["vision_embeds"].shape[-2])
        state = self.zero_state(ctx_len)
        image_idx = np.zeros((1, 1), dtype=np.int64)
        outputs: dict[str, np.ndarray] = {}
        for i in range(chunks):
            span = slice(i * prefill_seq_len, (i + 1) * prefill_seq_len)
            feeds = {"input_ids": ids[:, span], "position_ids": np.ascontiguousarray(positions[..., span]),
                     "image_idx": image_idx, **vision, **state}
            outputs = self._call(feeds, run.chunks)
            run.vision_bytes_per_chunk.append(feed_bytes({k: feeds[k] for k in VISION_INPUTS if k in feeds}))
            run.all_bytes_per_chunk.append(feed_bytes(feeds))
            image_idx = outputs["image_idx_output"]
            state = {name: outputs[name + RETAINED] for name in state}
        run.first_logits = outputs["logits"].reshape(-1).copy()
        token = int(run.first_logits.argmax())
        run.tokens.append(token)
        position = positions.max(axis=-1, keepdims=True) + 1  # (4, 1, 1)
        for _ in range(1, new_tokens):
            feeds = {"input_ids": np.array([[token]], dtype=np.int64), "position_ids": position,
                     "image_idx": image_idx, **vision, **state}
            outputs = self._call(feeds, Samples())
            state = {name: outputs[name + RETAINED] for name in state}
            token = int(outputs["logits"].reshape(-1).argmax())
            run.tokens.append(token)
            position = position + 1
        return run

    def _call(self, feeds: dict[str, np.ndarray], into: Samples) -> dict[str, np.ndarray]:
        feeds = {name: feeds[name] for name in self.language_inputs}
        return dict(zip(self.language_outputs, timed(lambda: self.language.run(None, feeds), into)))
