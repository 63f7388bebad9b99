"""One Gated DeltaNet layer step over retained state: what a hybrid language graph runs for a linear layer.

A linear-attention layer (transformers' Gated DeltaNet layer, run here with its own weights) keeps
two tensors per request instead of a KV cache:

* ``conv_state.{i}`` ``(rows, conv_dim, K - 1)``: the conv inputs (q|k|v channels) of the last
  ``K - 1`` tokens, the causal conv's left context (vLLM keeps ``K - 1`` columns too; transformers
  keeps ``K``, of which the first is never read);
* ``recurrent_state.{i}`` ``(rows, Hv, dk, dv)``: the gated delta rule's state (transformers' layout).

A step takes a chunk of ``seq_len`` tokens per batch row (row 0 of ``position_ids`` is each token's
KV slot, i.e. its index in the request; ``-1`` marks padding, which must follow the valid tokens) and
returns the layer output and both states after the chunk's valid tokens:

* prefill (``seq_len > 1``): the chunked rule (``qeff_evs.models.gated_delta``) with chunk size
  ``chunk_size_for(seq_len)``; decode (``seq_len == 1``): the per-token recurrence. Padding tokens get
  ``g = beta = 0`` and ``q = k = v = 0`` and the conv state comes from the last valid tokens, so padding
  leaves both states exactly as they were;
* **reset**: a row whose chunk contains slot 0 starts a request, and its states are replaced by zeros
  (a ``Where``, so even NaN garbage in a never-written buffer is dropped) before the chunk runs. This is
  vLLM's rule: ``has_initial_state = num_computed_tokens > 0`` (``vllm/v1/attention/backends/gdn_attn.py``),
  and a chunk starts at slot ``num_computed_tokens``. It needs no extra input or host write, covers a
  KV row reused by a new request and a preempted request recomputed from its first token, and never
  fires inside chunked prefill or decode (their slots are > 0). QEfficient's dense Qwen3.5 never resets;
  its MoE model uses this same position-0 rule;
* continuous batching (``batch_index (batch, 1)``): the states hold ``full_batch_size`` rows; batch row
  ``b`` reads and writes state row ``batch_index[b, 0]`` through QEfficient's ``CtxGatherCB`` /
  ``CtxScatterCB`` (``qeff_evs.models.ctx_ops``), with the ``dk`` axis (recurrent) or the channel axis
  (conv) as the "slot" axis and every index of it written: whole rows. A padding row (all slots -1;
  ``batch_index`` -1 as vllm-qaic sends, or any row) writes nothing, and rows nobody names come back
  bit for bit.

One graph for prefill and decode (``prefill_seq_len`` set): the step computes the chunked rule over the
chunk padded to ``prefill_seq_len`` *and* the one-token recurrence, and selects by ``seq_len == 1``, a
constant of each specialization (QEfficient's way; the compiler can drop the branch not taken). With
``prefill_seq_len`` None the traced ``seq_len`` picks one path: a graph per length.

On the card (``-convert-to-fp16``) the conv state can be fp16 (it holds fp16 projections anyway); the
recurrent state should stay fp32 with the ops it flows through kept in fp32
(``qeff_evs.export.node_precision``): stored in fp16 it drifts with every decode step in slow heads
(1.3 % of its norm after 1024 steps at 0.8B widths, against 0.13 % for the fp32 path; MXINT8 6-11 %;
``benchmarks/README.md``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from torch import nn
from transformers.activations import ACT2FN

from qeff_evs.models.ctx_ops import SKIP_INDEX, ctx_gather_cb, ctx_scatter_cb
from qeff_evs.models.gated_delta import (
    MAX_CHUNK, causal_conv, chunk_size_for, chunked_gated_delta_rule, gates, l2_normalize,
    recurrent_gated_delta_rule,
)
from qeff_evs.models.graph_io import BATCH, BATCH_INDEX, FULL_BATCH, SEQ, check_batch_index
from qeff_evs.specializations import RETAINED_SUFFIX

CONV_STATE, RECURRENT_STATE = "conv_state", "recurrent_state"
LAYER_OUTPUT = "layer_output"


def state_names(layer_idx: int) -> tuple[str, str]:
    """``(conv_state.{i}, recurrent_state.{i})``: a linear layer's state inputs (outputs add ``_RetainedState``)."""
    return f"{CONV_STATE}.{layer_idx}", f"{RECURRENT_STATE}.{layer_idx}"


@dataclass(frozen=True)
class LinearStateSpec:
    """Shapes of one Gated DeltaNet layer's state, read from the layer (``linear_state_spec``)."""

    conv_dim: int  # q|k|v channels: 2 * Hk * dk + Hv * dv
    conv_history: int  # K - 1 tokens of conv input
    v_heads: int  # Hv
    k_dim: int  # dk
    v_dim: int  # dv

    def conv_shape(self, rows: int) -> tuple[int, int, int]:
        return (rows, self.conv_dim, self.conv_history)

    def recurrent_shape(self, rows: int) -> tuple[int, int, int, int]:
        return (rows, self.v_heads, self.k_dim, self.v_dim)

    def row_bytes(self, conv_bytes: int, recurrent_bytes: int) -> int:
        """Bytes of one request row's two states at the given element sizes (2 fp16, 4 fp32, ~1.03 mxint8)."""
        return (self.conv_dim * self.conv_history * conv_bytes
                + self.v_heads * self.k_dim * self.v_dim * recurrent_bytes)


def linear_state_spec(gdn: nn.Module) -> LinearStateSpec:
    """The state shapes of a transformers Gated DeltaNet layer (any module with its attribute names)."""
    return LinearStateSpec(conv_dim=int(gdn.conv_dim), conv_history=int(gdn.conv_kernel_size) - 1,
                           v_heads=int(gdn.num_v_heads), k_dim=int(gdn.head_k_dim), v_dim=int(gdn.head_v_dim))


class LinearAttentionOutput(NamedTuple):
    hidden_states: torch.Tensor  # (B, S, hidden): the layer's output (before the decoder's residual)
    conv_state: torch.Tensor  # (rows, conv_dim, K - 1)
    recurrent_state: torch.Tensor  # (rows, Hv, dk, dv) fp32


def check_step_slots(hidden_states: torch.Tensor, slots: torch.Tensor, prefill_seq_len: int | None) -> None:
    """A state layer's step: ``slots`` int64 ``(batch, seq_len)`` of ``hidden_states``, a chunk no longer than the
    graph's prefill length, right padding only."""
    batch, seq_len = hidden_states.shape[:2]
    if slots.shape != (batch, seq_len) or slots.dtype != torch.int64:
        raise ValueError(f"slots must be int64 (batch, seq_len) = ({batch}, {seq_len}), got "
                         f"{slots.dtype} {tuple(slots.shape)}; pass position_ids[0]")
    if prefill_seq_len is not None and seq_len > prefill_seq_len:
        raise ValueError(f"a chunk of {seq_len} tokens exceeds this graph's prefill_seq_len "
                         f"{prefill_seq_len}; split it into chunks of at most that length")
    check_right_padding(slots)


def check_state_rows(rows: int, slots: torch.Tensor, batch_index: torch.Tensor | None) -> None:
    """A state of ``rows`` rows for the step's batch: one per batch row without ``batch_index``, else a valid index."""
    batch = slots.shape[0]
    if batch_index is None and rows != batch:
        raise ValueError(f"states have {rows} rows for a batch of {batch}; without batch_index every batch "
                         "row owns the state row of its index")
    if batch_index is not None:
        check_batch_index(batch_index, slots[None], cache_rows=rows)


def check_right_padding(slots: torch.Tensor) -> None:
    """Valid tokens must come first in each row (right padding): the conv state is read at the valid count."""
    valid = slots >= 0
    count = valid.sum(dim=1, keepdim=True)
    prefix = torch.arange(slots.shape[1], device=slots.device)[None, :] < count
    if not bool((valid == prefix).all()):
        rows = [int(r) for r in torch.nonzero((valid != prefix).any(dim=1)).reshape(-1)]
        raise ValueError(
            f"position_ids rows {rows} have padding (-1) before a valid token; a linear-attention layer "
            "needs each row's valid tokens first (pad on the right)")


class GatedDeltaNetStep(nn.Module):
    """A step of one transformers Gated DeltaNet layer over retained conv/recurrent state (module docstring).

    It shares (does not copy) the layer's parameters and never calls its ``forward``.
    ``chunk_size`` caps the prefill chunk (``chunk_size_for``); ``prefill_seq_len`` makes one graph serve
    prefill chunks of up to that many tokens and decode.
    """

    def __init__(self, gdn: nn.Module, chunk_size: int = MAX_CHUNK, prefill_seq_len: int | None = None):
        super().__init__()
        self.gdn = gdn
        self.spec = linear_state_spec(gdn)
        self.k_heads = int(gdn.num_k_heads)
        if self.spec.v_heads % self.k_heads:
            raise ValueError(f"{self.spec.v_heads} value heads are not a multiple of {self.k_heads} key heads")
        self.max_chunk = chunk_size
        chunk_size_for(1, chunk_size)  # a power of two
        if prefill_seq_len is not None and prefill_seq_len < 2:
            raise ValueError(f"prefill_seq_len must be >= 2 for a prefill+decode graph, got {prefill_seq_len}")
        self.prefill_seq_len = prefill_seq_len
        self.activation = ACT2FN[gdn.activation]

    def forward(self, hidden_states: torch.Tensor, slots: torch.Tensor, conv_state: torch.Tensor,
                recurrent_state: torch.Tensor, batch_index: torch.Tensor | None = None) -> LinearAttentionOutput:
        """``hidden_states (B, S, hidden)``, ``slots (B, S)`` int64 (``position_ids[0]``), states as above."""
        self._check_inputs(hidden_states, slots, conv_state, recurrent_state, batch_index)
        conv_rows, recurrent_rows = self._read_rows(conv_state, recurrent_state, batch_index)
        # A request starts in this row: drop whatever the row held (module docstring, "reset").
        starts = (slots == 0).any(dim=1)
        conv_rows = torch.where(starts[:, None, None], _zero(conv_rows), conv_rows)
        recurrent_rows = torch.where(starts[:, None, None, None], _zero(recurrent_rows), recurrent_rows)

        gdn, spec = self.gdn, self.spec
        batch, seq_len, _ = hidden_states.shape
        valid = slots >= 0
        mixed = gdn.in_proj_qkv(hidden_states).transpose(1, 2)  # (B, conv_dim, S)
        conv_out, new_conv = causal_conv(mixed, conv_rows, gdn.conv1d.weight, valid.sum(dim=1))
        conv_out = self.activation(conv_out).transpose(1, 2)  # (B, S, conv_dim)
        key_dim = self.k_heads * spec.k_dim
        query, key, value = torch.split(conv_out, [key_dim, key_dim, spec.v_heads * spec.v_dim], dim=-1)
        query = self._per_value_head(l2_normalize(query.float().reshape(batch, seq_len, self.k_heads, spec.k_dim)))
        key = self._per_value_head(l2_normalize(key.float().reshape(batch, seq_len, self.k_heads, spec.k_dim)))
        query = query * spec.k_dim ** -0.5
        value = value.float().reshape(batch, seq_len, spec.v_heads, spec.v_dim).transpose(1, 2)
        g, beta = gates(gdn.in_proj_a(hidden_states), gdn.in_proj_b(hidden_states), gdn.A_log, gdn.dt_bias)
        g, beta = g.transpose(1, 2), beta.transpose(1, 2)  # (B, Hv, S)

        # Padding tokens leave the state as it is: no decay (g = 0), no write (beta = 0, k = v = 0).
        token = valid[:, None, :]
        zero = _zero(query)
        query, key, value = (torch.where(token[..., None], x, zero) for x in (query, key, value))
        g, beta = torch.where(token, g, zero), torch.where(token, beta, zero)
        core, new_recurrent = self._delta_rule(query, key, value, g, beta, recurrent_rows.float())

        z = gdn.in_proj_z(hidden_states)
        core = core.transpose(1, 2).to(hidden_states.dtype)  # (B, S, Hv, dv)
        normed = gdn.norm(core.reshape(-1, spec.v_dim), z.reshape(-1, spec.v_dim))
        output = gdn.out_proj(normed.reshape(batch, seq_len, spec.v_heads * spec.v_dim))
        conv_state, recurrent_state = self._write_rows(conv_state, recurrent_state, new_conv, new_recurrent,
                                                       valid.any(dim=1), batch_index)
        return LinearAttentionOutput(output, conv_state, recurrent_state)

    def _per_value_head(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, S, Hk, D) -> (B, Hv, S, D)``: value head ``h`` uses key head ``h // (Hv / Hk)`` (repeat_interleave)."""
        batch, seq_len, heads, dim = x.shape
        repeats = self.spec.v_heads // heads
        x = x[:, :, :, None, :].expand(batch, seq_len, heads, repeats, dim).reshape(batch, seq_len, heads * repeats, dim)
        return x.transpose(1, 2)

    def _delta_rule(self, query, key, value, g, beta, state) -> tuple[torch.Tensor, torch.Tensor]:
        if self.prefill_seq_len is None:
            seq_len = int(query.shape[2])  # the traced length picks the path: a graph per length
            if seq_len == 1:
                return recurrent_gated_delta_rule(query, key, value, g, beta, state)
            return chunked_gated_delta_rule(query, key, value, g, beta, state, chunk_size_for(seq_len, self.max_chunk))
        if not torch.jit.is_tracing() and query.shape[2] == 1:
            # Eager (the torch backend): the path the graph's Where below would pick, without the other one.
            return recurrent_gated_delta_rule(query, key, value, g, beta, state)
        # One graph, both paths: the chunk padded to prefill_seq_len (padding = tokens that change
        # nothing), and the recurrence over the first token; seq_len (a symbol) chooses.
        total, seq_len = self.prefill_seq_len, query.shape[2]  # seq_len: a symbol under tracing
        pad = total - seq_len
        padded = [torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (query, key, value)]
        chunk_out, chunk_state = chunked_gated_delta_rule(
            *padded, torch.nn.functional.pad(g, (0, pad)), torch.nn.functional.pad(beta, (0, pad)), state,
            chunk_size_for(total, self.max_chunk))
        step_out, step_state = recurrent_gated_delta_rule(
            query[:, :, :1], key[:, :, :1], value[:, :, :1], g[:, :, :1], beta[:, :, :1], state)
        is_prefill = torch.arange(seq_len, device=query.device).max() > 0
        out = torch.where(is_prefill, chunk_out[:, :, :seq_len], step_out)
        return out, torch.where(is_prefill, chunk_state, step_state)

    def _read_rows(self, conv_state, recurrent_state, batch_index) -> tuple[torch.Tensor, torch.Tensor]:
        return gather_state_rows(conv_state, batch_index), gather_state_rows(recurrent_state, batch_index)

    def _write_rows(self, conv_state, recurrent_state, new_conv, new_recurrent, real, batch_index):
        return (scatter_state_rows(conv_state, new_conv, real, batch_index),
                scatter_state_rows(recurrent_state, new_recurrent, real, batch_index))

    def _check_inputs(self, hidden_states, slots, conv_state, recurrent_state, batch_index) -> None:
        if torch.jit.is_tracing():
            return
        check_step_slots(hidden_states, slots, self.prefill_seq_len)
        rows = conv_state.shape[0]
        spec = self.spec
        if tuple(conv_state.shape) != spec.conv_shape(rows) or tuple(recurrent_state.shape) != spec.recurrent_shape(rows):
            raise ValueError(
                f"states must be conv {spec.conv_shape(rows)} and recurrent {spec.recurrent_shape(rows)}, got "
                f"{tuple(conv_state.shape)} and {tuple(recurrent_state.shape)}")
        check_state_rows(rows, slots, batch_index)


def _zero(like: torch.Tensor) -> torch.Tensor:
    return torch.zeros((), dtype=like.dtype, device=like.device)


def _as_slot_rows(state: torch.Tensor) -> torch.Tensor:
    """A state as the 4-D ``(rows, heads, slots, D)`` the CB ops take, its axis 2 written whole: a 3-D
    ``(rows, channels, K - 1)`` conv state gets a unit heads axis (channels as slots), a 4-D one is as it is."""
    return state[:, None] if state.dim() == 3 else state


def _from_slot_rows(rows: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return rows[:, 0] if like.dim() == 3 else rows


def gather_state_rows(state: torch.Tensor, batch_index: torch.Tensor | None) -> torch.Tensor:
    """The state rows a call reads: all of them without ``batch_index``, else row ``batch_index[b, 0]`` per batch
    row (``CtxGatherCB`` over the whole axis 2: a 3-D state's channels, a 4-D state's third axis)."""
    if batch_index is None:
        return state
    rows = _as_slot_rows(state)
    index = torch.arange(rows.shape[2], device=state.device)  # from the shape: traced as a Range
    read = ctx_gather_cb(rows, batch_index, index[None, None, :].expand(batch_index.shape[0], 1, -1),
                         index.max() + 1)
    return _from_slot_rows(read, state)


def scatter_state_rows(state: torch.Tensor, new: torch.Tensor, real: torch.Tensor,
                       batch_index: torch.Tensor | None) -> torch.Tensor:
    """``state`` with each real batch row's ``new`` rows written (whole rows); a padding row (``real`` False)
    writes nothing and every row no batch row names comes back bit for bit."""
    new = new.to(state.dtype)
    if batch_index is None:
        # A padding row keeps its state bit for bit (its math already leaves it unchanged in fp32).
        return torch.where(real.reshape(-1, *([1] * (state.dim() - 1))), new, state)
    rows = _as_slot_rows(state)
    index = torch.arange(rows.shape[2], device=state.device)
    skip = torch.full((), SKIP_INDEX, dtype=torch.int64, device=real.device)
    writes = torch.where(real[:, None], index[None, :], skip)  # (B, slots)
    return _from_slot_rows(ctx_scatter_cb(rows, batch_index, writes, _as_slot_rows(new)), state)


class ExportableLinearAttention(nn.Module):
    """``GatedDeltaNetStep`` with flat ONNX-named I/O for layer ``layer_idx`` (a standalone layer graph).

    Inputs: ``hidden_states (batch_size, seq_len, hidden)``, ``position_ids (4, batch_size, seq_len)``
    (row 0 = slots, -1 padding; rows 1..3 unused here), ``conv_state.{i}``, ``recurrent_state.{i}``
    (``batch_size`` rows, or ``full_batch_size`` with ``batch_index (batch_size, 1)`` last).
    Outputs: ``layer_output``, ``conv_state.{i}_RetainedState``, ``recurrent_state.{i}_RetainedState``.
    """

    def __init__(self, step: GatedDeltaNetStep, layer_idx: int, continuous_batching: bool = False):
        super().__init__()
        self.step = step
        self.layer_idx = layer_idx
        self.continuous_batching = continuous_batching

    @property
    def input_names(self) -> list[str]:
        cb = [BATCH_INDEX] if self.continuous_batching else []
        return ["hidden_states", "position_ids", *state_names(self.layer_idx), *cb]

    @property
    def output_names(self) -> list[str]:
        return [LAYER_OUTPUT, *(f"{name}{RETAINED_SUFFIX}" for name in state_names(self.layer_idx))]

    @property
    def dynamic_axes(self) -> dict[str, dict[int, str]]:
        rows = {0: FULL_BATCH if self.continuous_batching else BATCH}
        axes = {"hidden_states": {0: BATCH, 1: SEQ}, "position_ids": {1: BATCH, 2: SEQ}, LAYER_OUTPUT: {0: BATCH, 1: SEQ}}
        for name in state_names(self.layer_idx):
            axes[name] = dict(rows)
            axes[f"{name}{RETAINED_SUFFIX}"] = dict(rows)
        if self.continuous_batching:
            axes[BATCH_INDEX] = {0: BATCH}
        return axes

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        named = dict(zip(self.input_names, inputs))
        conv, recurrent = state_names(self.layer_idx)
        step = self.step(named["hidden_states"], named["position_ids"][0], named[conv], named[recurrent],
                         batch_index=named.get(BATCH_INDEX))
        return tuple(step)

    @torch.no_grad()
    def run(self, feeds: Mapping[str, torch.Tensor | np.ndarray]) -> dict[str, torch.Tensor]:
        """Eager step with ONNX names in and out."""
        missing = [name for name in self.input_names if name not in feeds]
        if missing:
            raise ValueError(f"linear-attention step is missing inputs {missing}; feed every name in {self.input_names}")
        return dict(zip(self.output_names, self(*(torch.as_tensor(feeds[name]) for name in self.input_names))))
