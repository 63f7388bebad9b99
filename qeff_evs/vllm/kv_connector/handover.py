"""What a prefill instance hands a decode instance: the used part of one KV row, as named arrays (pure functions).

A request's KV row holds, per layer, keys and values at the slots its tokens took (``past_key.{i}`` /
``past_value.{i}``, ``(rows, kv_heads, ctx_len, head_dim)``) and, for a family whose layers keep other per-row
state (Qwen3.5's linear attention: ``conv_state.{i}``, ``recurrent_state.{i}``; Nemotron-H's Mamba2: its conv and
SSM states), that state whole. A hand-over carries slots ``[0, n)`` of every KV layer (the kept video tokens and the
text: nothing past the prompt, nothing pruned) and every layer state, after exactly ``n`` tokens. ``n`` is the
prompt's length less one: the decode instance computes the last prompt token itself, as vLLM's scheduler makes
every full remote hit do, so a recurrent state is never fed that token twice.

The hand-over also carries the ``n`` token ids the slots hold (vLLM's prompt ids, placeholders as vLLM holds
them): the decode instance checks them against its own request before it writes anything, which catches a
prefill instance serving another export or pruning the request's videos differently.

Example: a 530-token prompt (a video kept at 480 tokens, its markers and the question) on an export of 2 layers,
2 KV heads of 64: ``take_row`` gives 4 arrays of ``(2, 529, 64)`` float32, 1,083,392 bytes in all; at q = 0.75
the same clip's prompt has about 290 tokens and the hand-over about half the bytes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from qeff_evs.manifest import LanguageShape
from qeff_evs.models.graph_io import LanguageGraphIO

FORMAT = "qeff-evs kv row 1"


@dataclass(frozen=True)
class RowHandover:
    """The used part of one request's KV row, as it travels from the prefill to the decode instance."""

    token_ids: tuple[int, ...]
    """The ids at slots ``0..n-1`` (vLLM's prompt ids, its first ``n``)."""
    arrays: Mapping[str, np.ndarray]
    """By the language graph's input name: KV layers ``(kv_heads, n, head_dim)``, layer states their row shape."""

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def nbytes(self) -> int:
        """Bytes of the arrays (what grows with the kept tokens), without the ids and the header."""
        return sum(a.nbytes for a in self.arrays.values())


def kv_names(shape: LanguageShape) -> tuple[str, ...]:
    """The inputs that hold keys and values per slot (the rest of ``row_names`` is per-row state)."""
    io = LanguageGraphIO.of_shape(shape)
    states = set(io.state_inputs)
    return tuple(name for name in io.layer_inputs() if name not in states)


def row_names(shape: LanguageShape) -> tuple[str, ...]:
    """Every retained input a request's row spans: the KV layers and the layer states."""
    return tuple(LanguageGraphIO.of_shape(shape).layer_inputs())


def take_row(state: Mapping[str, np.ndarray], shape: LanguageShape, row: int, token_ids: Sequence[int]
             ) -> RowHandover:
    """A copy of row ``row`` of a language session's retained ``state`` after the tokens ``token_ids``.

    Args:
        state: the session's retained buffers by input name (``OrtLanguageSession.state``).
        shape: the export's language shape (which inputs are KV, which are layer states).
        row: the request's KV row.
        token_ids: the tokens the row holds, slot by slot from slot 0 (``n = len(token_ids)``).
    """
    n = len(token_ids)
    if not 0 <= n <= shape.ctx_len:
        raise ValueError(f"a hand-over of {n} tokens does not fit a KV row of ctx_len {shape.ctx_len}")
    kv = set(kv_names(shape))
    arrays = {name: np.array(state[name][row, :, :n] if name in kv else state[name][row], copy=True)
              for name in row_names(shape)}
    return RowHandover(tuple(int(t) for t in token_ids), arrays)


def put_row(state: Mapping[str, np.ndarray], shape: LanguageShape, row: int, handover: RowHandover) -> None:
    """Write a hand-over into row ``row`` of ``state`` (in place: the session's own buffers).

    Refused, before anything is written, when its arrays are not this export's (names, shapes, dtypes)."""
    problem = handover_mismatch(state, shape, handover)
    if problem:
        raise ValueError(problem)
    kv, n = set(kv_names(shape)), handover.num_tokens
    for name, array in handover.arrays.items():
        if name in kv:
            state[name][row, :, :n] = array
        else:
            state[name][row] = array


def handover_mismatch(state: Mapping[str, np.ndarray], shape: LanguageShape, handover: RowHandover) -> str | None:
    """Why ``handover`` cannot go into a row of ``state``, or None."""
    names = row_names(shape)
    if sorted(handover.arrays) != sorted(names):
        return (f"the prefill instance handed over {sorted(handover.arrays)}, this export's rows hold {sorted(names)}; "
                "serve the same export on both instances")
    if handover.num_tokens > shape.ctx_len:
        return f"the prefill instance handed over {handover.num_tokens} tokens, a KV row here holds {shape.ctx_len}"
    kv = set(kv_names(shape))
    for name in names:
        buffer, array = state[name], handover.arrays[name]
        expected = ((buffer.shape[1], handover.num_tokens, *buffer.shape[3:]) if name in kv else buffer.shape[1:])
        if array.shape != tuple(expected) or array.dtype != buffer.dtype:
            return (f"{name}: the prefill instance handed over {array.dtype}{list(array.shape)}, a row here takes "
                    f"{buffer.dtype}{list(expected)}; serve the same export (its --kv-precision, ctx_len) on both")
    return None


def to_bytes(handover: RowHandover) -> bytes:
    """The wire form: one safetensors blob, its header naming the format and the token ids."""
    from safetensors.numpy import save

    arrays = {name: np.ascontiguousarray(a) for name, a in handover.arrays.items()}
    return save(arrays, metadata={"format": FORMAT, "token_ids": json.dumps(list(handover.token_ids))})


def from_bytes(blob: bytes) -> RowHandover:
    """:func:`to_bytes` back; refused in one line when the blob is not a hand-over of this format."""
    from safetensors.numpy import load

    header = _metadata(blob)
    if header.get("format") != FORMAT:
        raise ValueError(f"the prefill instance sent {header.get('format')!r}, not {FORMAT!r}: serve qeff-evs's "
                         "QeffEvsKVConnector on both instances")
    return RowHandover(tuple(json.loads(header["token_ids"])), load(blob))


def _metadata(blob: bytes) -> dict[str, str]:
    """A safetensors blob's ``__metadata__`` (its first 8 bytes give the JSON header's length)."""
    if len(blob) < 8:
        raise ValueError(f"a hand-over of {len(blob)} bytes is truncated")
    length = int.from_bytes(blob[:8], "little")
    return json.loads(blob[8:8 + length]).get("__metadata__", {})
