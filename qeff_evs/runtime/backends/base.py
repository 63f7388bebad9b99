"""Backends behind one interface: ONNX Runtime (default), the PyTorch reference, and QAIC.

The vision side is two sessions (docs/design.md#the-runtime): an encoder session runs one call of F temporal
patches, a pruning session ranks a video's merged rows padded to a frame bucket; ``vision.VisionPipeline``
drives both for a media item (and keeps the first K of the ranking) and is what the engines call
(``VisionSession``). Encoder sessions read graph outputs by name: ``vision_embeds`` are the rows, every
other output is one of the family's extra rows (``ExtraRows``) and travels under its name in an ``extras``
mapping.

A language session owns its retained state (KV cache, last vision window) the way a QAIC
program does with ``-retained-state``: the engine sends only the per-call inputs, and each
``*_RetainedState`` output is the next call's input. Where it lives is the backend's: on the card
(QAIC), in host buffers the graph writes in place (ONNX Runtime, ``ort.OrtLanguageSession``), or in
tensors on the PyTorch reference's device, replaced by each call's outputs there
(``torch_reference.TorchLanguageSession``).

Continuous batching: when the language graph was exported with ``batch_index``, the session keeps
``full_batch_size`` KV cache rows, one per running request. ``prefill(row, step)`` runs one
request's chunk into its row; ``decode(rows)`` runs the next token of several requests in calls of
``decode_batch_size`` rows. A call with fewer requests than that is padded with rows whose positions
are all -1: the graph skips their KV writes (QEfficient's INT32_MAX index), so they change no cache
row, whatever ``batch_index`` they carry (-1, vllm-qaic's convention, included), and their logits are
dropped. ``run(step)`` is the single-request case (cache row 0).

A call runs only at a length the export has a specialization for (``LanguageShape.prefill_lens``, or one token):
the card runs a call only in a specialization of exactly its shape, so the host sessions (ONNX Runtime, PyTorch),
whose graphs would run any length, refuse another one as the card does, in one message naming the export's lengths
and the one to pad to. Padding is the engines' (``EngineConfig.chunk_seq_len``: the shortest length holding the
chunk); a session never pads or cuts a call itself.

The KV cache is zeroed once, when a session (its program) is made, never per request: a new request in
a used row finds the earlier requests' keys and values in its slots, finite, and never reads them (a
step reads only the slots up to its own last position, all written by its own request, and zeroes the
reads past it; the mask hides them too). A family's other per-row state (``LanguageShape.layer_states``,
e.g. a linear-attention layer's recurrent state) is the graph's to restart: the chunk holding a
request's first token (KV slot 0) replaces the row's state by zeros before it runs, so the host never
writes it either. ``reset`` stays for callers that want a clean state on purpose.
With compute context lengths (``LanguageShape.comp_ctx_lengths``) every call also gets ``comp_ctx_lengths``, as
long as the smallest length holding the call's last KV slot: so every engine (single-request, serving, the vLLM
worker, the bench), which all call through here, runs each step in the shortest specialization that holds it.
With logits rows (``LanguageShape.logits_rows``) every call also gets ``logits_rows``: of length 1, or 0 on the
host backends for a step that does not want its logits (``LanguageInputs.wants_logits``: a prefill chunk before the
prompt's last), which then skips the LM head, a read of ``vocab x hidden`` weights per call; the card's
specializations all compute one row.
``close`` releases what the session holds (a QAIC program on its device); the host backends hold nothing.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from qeff_evs.manifest import LanguageShape
from qeff_evs.models.graph_io import (
    BATCH_INDEX, COMP_CTX_LENGTHS, LOGITS_ROWS, PAD_POSITION, RETAINED_SUFFIX, check_batch_index, state_shapes,
)
from qeff_evs.specializations.sets import call_len_refusal


@dataclass(frozen=True)
class LanguageInputs:
    """Per-call inputs of one language-graph call; the retained state (KV, last window) stays in the session."""

    input_ids: np.ndarray  # (1, S) int64
    position_ids: np.ndarray  # (4, 1, S) int64: KV slot, then M-RoPE t/h/w; padding -1
    vision_embeds: np.ndarray | None  # (1, U, hidden) or None (decode: keep the retained buffer)
    extras: Mapping[str, np.ndarray]  # the family's extra rows by name, (levels, 1, U, hidden); {} in decode
    image_idx: np.ndarray  # (1, 1) int64
    vision_rows: int  # how many real rows the window carries
    # False: nobody reads this call's logits (a prefill chunk before the prompt's last); a session whose graph
    # takes logits_rows may then compute none (``RetainedStateSession.skips_unread_logits``).
    wants_logits: bool = True


@dataclass(frozen=True)
class MergedRows:
    """Merger output of encoder calls (one call, or a whole item): rows in raster (t, row, col) order."""

    rows: np.ndarray  # (N, hidden)
    extras: Mapping[str, np.ndarray] = field(default_factory=dict)  # by name, (levels, N, hidden)


@dataclass(frozen=True)
class VisionResult:
    """One media item after the vision side: its K kept rows, their raster indices, its kept extra rows."""

    rows: np.ndarray  # (K, hidden)
    kept_indices: np.ndarray  # (K,) int64, ascending
    extras: Mapping[str, np.ndarray] = field(default_factory=dict)  # by name, (levels, K, hidden)


VISION_ROWS, RANKING = "vision_embeds", "ranking"


def merged_rows(outputs: Mapping[str, np.ndarray]) -> MergedRows:
    """An encoder call's outputs by name: ``vision_embeds``, and every other output an extra row tensor."""
    return MergedRows(outputs[VISION_ROWS], {k: v for k, v in outputs.items() if k != VISION_ROWS})


def ranking(outputs: Mapping[str, np.ndarray]) -> np.ndarray:
    """A pruning call's ranking (int64): every row of the bucket, most worth keeping first."""
    return np.asarray(outputs[RANKING]).astype(np.int64, copy=False)


@dataclass(frozen=True)
class DecodeRow:
    """One running request's next token in a continuous-batching decode call."""

    cache_row: int  # the request's KV cache row (its batch_index)
    token_id: int
    kv_slot: int  # position_ids[0]: the token's slot in the request's cache row
    mrope_position: int  # rows 1..3 of position_ids (text: t = h = w)


class EncoderSession(Protocol):
    def encode(self, pixel_values: np.ndarray, host_inputs: dict[str, np.ndarray]) -> MergedRows:
        """One encoder call: ``(F*H*W, patch_dim)`` pixels + one frame's index inputs -> ``F*h*w`` rows."""


class PruningSession(Protocol):
    def rank(self, feeds: Mapping[str, np.ndarray]) -> np.ndarray:
        """One pruning graph's inputs by name (a video's merged rows padded to a bucket, [``score_extras``],
        ``bucket_carrier``, ``frame_count`` [, ``retention_ratio``]) -> its ranking, int64."""


class VisionSession(Protocol):
    def encode(self, media, pruning) -> VisionResult:
        """One media item's kept rows under ``pruning`` (a ``models.pruning.VideoPruning``; all rows of an image)."""


class LanguageSession(Protocol):
    shape: LanguageShape

    def reset(self) -> None: ...

    def run(self, step: LanguageInputs) -> np.ndarray:
        """Logits ``(1, 1, vocab)`` of the step's last valid position."""


class BatchedLanguageSession(LanguageSession, Protocol):
    """A language session over ``shape.full_batch_size`` KV cache rows (continuous batching)."""

    def prefill(self, cache_row: int, step: LanguageInputs) -> np.ndarray:
        """Logits ``(1, 1, vocab)`` of one request's prefill chunk, run into its cache row."""

    def decode(self, rows: Sequence[DecodeRow], pad_token_id: int = 0) -> np.ndarray:
        """Next-token logits ``(len(rows), vocab)`` of several running requests."""


def close_session(session: object) -> None:
    """``session.close()`` where the session has one (ONNX Runtime and torch sessions hold no device)."""
    close = getattr(session, "close", None)
    if close is not None:
        close()


class RetainedStateSession(abc.ABC):
    """A language graph whose ``*_RetainedState`` outputs come back as the next call's inputs.

    The session owns the KV cache and the last vision window, as a QAIC program compiled with
    ``-retained-state`` does; the engine sends only per-call inputs (``LanguageInputs``). With a
    continuous-batching graph (input ``batch_index``) the KV state has ``shape.full_batch_size`` rows
    and ``prefill``/``decode``/``run_rows`` address them explicitly. A backend says where the state
    lives (``reset``) and how one call runs (``_call``).
    """

    # Whether a step that does not want its logits runs with no logits rows (the host backends: any length of
    # logits_rows runs); False where only the compiled one-row specializations exist (the card).
    skips_unread_logits = True

    def __init__(self, shape: LanguageShape, input_names: list[str], output_names: list[str]) -> None:
        self.shape = shape
        self.input_names = input_names
        self.output_names = output_names
        self.continuous_batching = BATCH_INDEX in input_names
        if shape.full_batch_size > 1 and not self.continuous_batching:
            raise ValueError(
                f"full_batch_size={shape.full_batch_size} needs a language graph with a batch_index input; "
                f"re-export with --full-batch-size {shape.full_batch_size} (continuous batching), or serve one "
                "sequence at a time"
            )
        self.reset()

    @property
    def cache_rows(self) -> int:
        return self.shape.full_batch_size

    # A call's length is checked against the export's (``call_len_refusal``) where the graph itself would run any:
    # on the host. A compiled program refuses it itself, listing the shapes it was compiled for.
    host_checks_call_len = True

    @abc.abstractmethod
    def reset(self) -> None:
        """Zero the KV cache and vision window (done once, at construction; never needed per request)."""

    def retained_dims(self) -> dict[str, tuple[int, ...]]:
        """The shape of each input the graph retains (returned as ``<input>_RetainedState``), from the export's
        language shape; refused where the graph retains one the shape does not describe."""
        retained = [name for name in self.input_names if name + RETAINED_SUFFIX in self.output_names]
        dims = state_shapes(self.shape)
        missing = [name for name in retained if name not in dims]
        if missing:
            raise ValueError(f"the language graph retains {missing}, which the export's language shape does not "
                             "describe; re-export this folder with this qeff-evs")
        return {name: dims[name] for name in retained}

    def close(self) -> None:
        """Release the session's device resources (nothing on the host backends)."""

    @abc.abstractmethod
    def _call(self, inputs: dict[str, np.ndarray]) -> np.ndarray:
        """Run the graph once with these per-call inputs (the retained ones only when they changed); logits."""

    def run(self, step: LanguageInputs) -> np.ndarray:
        """Logits ``(B, 1, vocab)`` of a single-request step (cache rows ``0..B-1`` under CB)."""
        if self.continuous_batching:
            return self.run_rows(step, range(step.input_ids.shape[0]))
        return self._run(step, None)

    def prefill(self, cache_row: int, step: LanguageInputs) -> np.ndarray:
        """One request's prefill chunk (batch 1) into its KV cache row; logits ``(1, 1, vocab)``."""
        if step.input_ids.shape[0] != 1:
            raise ValueError(f"a prefill call carries one request, got a step of {step.input_ids.shape[0]} rows")
        return self.run_rows(step, [cache_row])

    def decode(self, rows: Sequence[DecodeRow], pad_token_id: int = 0) -> np.ndarray:
        """Next-token logits ``(len(rows), vocab)`` of several requests, in calls of ``decode_rows`` rows."""
        rows = list(rows)
        if not rows:
            raise ValueError("decode needs at least one DecodeRow")
        cache_rows = [r.cache_row for r in rows]
        if len(set(cache_rows)) != len(cache_rows):
            raise ValueError(f"decode rows share KV cache rows {cache_rows}; each running request has its own row")
        width = self.shape.decode_rows
        logits = []
        for start in range(0, len(rows), width):
            group = rows[start:start + width]
            step, batch_index = decode_batch(group, width, self.cache_rows, pad_token_id)
            logits.append(self.run_rows(step, batch_index)[: len(group), 0])
        return np.concatenate(logits, axis=0)

    def run_rows(self, step: LanguageInputs, batch_index: Sequence[int]) -> np.ndarray:
        """One call whose batch row ``b`` reads and writes KV cache row ``batch_index[b]``."""
        if not self.continuous_batching:
            raise ValueError(
                "this language graph has no batch_index input and serves one sequence at a time; re-export "
                "with --full-batch-size N (continuous batching) to serve N sequences together"
            )
        index = np.asarray(list(batch_index), dtype=np.int64).reshape(-1, 1)
        check_batch_index(index, step.position_ids, self.cache_rows)
        return self._run(step, index)

    def _run(self, step: LanguageInputs, batch_index: np.ndarray | None) -> np.ndarray:
        rows = step.input_ids.shape[0]
        if batch_index is None and rows != self.cache_rows:
            raise ValueError(
                f"a call of {rows} sequences on a language graph exported for {self.cache_rows} (no "
                "--full-batch-size); re-export with --full-batch-size N to serve N sequences together")
        refusal = self.host_checks_call_len and call_len_refusal(step.input_ids.shape[1], self.shape.prefill_lens)
        if refusal:
            raise ValueError(refusal)
        inputs = {"input_ids": step.input_ids, "position_ids": step.position_ids, "image_idx": step.image_idx}
        if batch_index is not None:
            inputs[BATCH_INDEX] = batch_index
        length = self.shape.comp_ctx_len(int(step.position_ids[0].max()))
        if length is not None:  # only its length counts: the call reads that many slots of each KV row
            inputs[COMP_CTX_LENGTHS] = np.arange(length, dtype=np.int64)
        if self.shape.logits_rows:  # only its length counts: logits per batch row
            inputs[LOGITS_ROWS] = np.zeros(int(step.wants_logits or not self.skips_unread_logits), dtype=np.int64)
        if step.vision_embeds is not None:
            inputs["vision_embeds"] = step.vision_embeds
        inputs.update(step.extras)
        return self._call(inputs)


def decode_batch(rows: Sequence[DecodeRow], width: int, cache_rows: int,
                 pad_token_id: int = 0) -> tuple[LanguageInputs, list[int]]:
    """A decode call of exactly ``width`` rows: the requests, then padding rows (positions -1).

    Padding rows point at the lowest cache row no request of this call uses (one exists: the call has
    fewer requests than ``width <= cache_rows``); their writes are skipped, so they change nothing.
    (vllm-qaic pads with ``batch_index = -1``, ids and positions -1 instead; the graph accepts both.)
    """
    if not 1 <= len(rows) <= width:
        raise ValueError(f"a decode call of width {width} takes 1..{width} rows, got {len(rows)}")
    if width > cache_rows:
        raise ValueError(f"decode width {width} exceeds full_batch_size {cache_rows}; use decode_batch_size <= it")
    used = {r.cache_row for r in rows}
    spare = next((row for row in range(cache_rows) if row not in used), None)
    input_ids = np.full((width, 1), pad_token_id, dtype=np.int64)
    position_ids = np.full((4, width, 1), PAD_POSITION, dtype=np.int64)
    batch_index = [spare] * width
    for b, r in enumerate(rows):
        input_ids[b, 0] = r.token_id
        position_ids[0, b, 0] = r.kv_slot
        position_ids[1:, b, 0] = r.mrope_position
        batch_index[b] = r.cache_row
    step = LanguageInputs(input_ids, position_ids, None, {}, np.zeros((1, 1), dtype=np.int64), 0)
    return step, batch_index
