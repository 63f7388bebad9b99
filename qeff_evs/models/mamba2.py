"""One Mamba2 layer step over retained state: what a hybrid language graph runs for a state-space layer.

A Mamba2 mixer (transformers' ``NemotronHMamba2Mixer``, run here with its own weights) keeps two tensors per
request instead of a KV cache:

* ``conv_state.{i}`` ``(rows, conv_dim, K - 1)``: the conv inputs (the ``x | B | C`` channels) of the last
  ``K - 1`` tokens, the causal conv's left context (vLLM keeps ``K - 1`` columns, transformers ``K``);
* ``ssm_state.{i}`` ``(rows, heads, head_dim, state_size)``: the state-space state (transformers' and vLLM's
  layout), fp32 as both keep it (``mamba_ssm_cache_dtype``).

Per head ``h`` with ``A_h = -exp(A_log_h)``, token ``t`` with step ``dt_t = softplus(dt_raw + dt_bias)``, input
``x_t (head_dim)`` and the group's ``B_t``, ``C_t (state_size)``::

    S <- exp(dt_t A_h) S + dt_t x_t B_t^T        y_t = S C_t + D_h x_t

then the gated RMSNorm (``y * silu(z)`` normalised per group) and the output projection. Two exact forms:

* :func:`recurrent_scan`: the loop above, one token at a time (decode);
* :func:`chunked_scan`: Mamba2's state-space duality in chunks of ``L`` tokens, matmuls only (no solve): inside a
  chunk ``y_l = sum_{s<=l} exp(G_l - G_s) (C_l . B_s) dt_s x_s + exp(G_l) C_l S_0`` with ``G`` the chunk's
  cumulative ``dt A``, then one state update per chunk. The chunks are a Python loop, unrolled when traced.

The step itself follows ``linear_attention.GatedDeltaNetStep``: padding (slot -1, after the valid tokens) gets
``dt = 0`` and ``x = 0`` (no decay, no write) and the conv state comes from the last valid tokens; a chunk that holds
a request's slot 0 starts from zero states (vLLM's ``has_initial_state``); under continuous batching whole state rows
are gathered and scattered by ``batch_index``; with ``prefill_seq_len`` one graph computes both the chunked form
over the chunk padded to that length and the one-token recurrence, and ``seq_len == 1`` selects.

``dt`` is not clamped: vLLM runs both forms with ``dt_limit = (0, inf)``. transformers clamps ``dt`` below at
``time_step_min`` in its chunked (prefill) form only, not in its one-token form; where a step falls below it the two
differ, and this step follows vLLM, which serves the checkpoints.

For ``-convert-to-fp16`` nothing here exponentiates a positive number (cumulative decay differences are clamped to
0 before ``exp`` and masked after), ``softplus`` is the overflow-free form, and a slow head's per-token decay is
applied as ``S + S * expm1(dt A)`` (``gated_delta.decay``) so it survives where ``exp`` would round to 1. The state
stays fp32 on the card (node precision), as the Gated DeltaNet recurrent state does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from qeff_evs.models.gated_delta import causal_conv, decay, softplus
from qeff_evs.models.linear_attention import (
    CONV_STATE, check_state_rows, check_step_slots, gather_state_rows, scatter_state_rows,
)

SSM_STATE = "ssm_state"
MAX_CHUNK = 128  # the released checkpoints' Mamba2 chunk_size


def state_names(layer_idx: int) -> tuple[str, str]:
    """``(conv_state.{i}, ssm_state.{i})``: a Mamba2 layer's state inputs (outputs add ``_RetainedState``)."""
    return f"{CONV_STATE}.{layer_idx}", f"{SSM_STATE}.{layer_idx}"


@dataclass(frozen=True)
class Mamba2StateSpec:
    """Shapes of one Mamba2 layer's state, read from the mixer (``mamba2_state_spec``)."""

    conv_dim: int  # x | B | C channels: heads * head_dim + 2 * groups * state_size
    conv_history: int  # K - 1 tokens of conv input
    heads: int
    head_dim: int
    state_size: int

    def conv_shape(self, rows: int) -> tuple[int, int, int]:
        return (rows, self.conv_dim, self.conv_history)

    def ssm_shape(self, rows: int) -> tuple[int, int, int, int]:
        return (rows, self.heads, self.head_dim, self.state_size)


def mamba2_state_spec(mixer: nn.Module) -> Mamba2StateSpec:
    """The state shapes of a transformers Mamba2 mixer (any module with its attribute names)."""
    return Mamba2StateSpec(conv_dim=int(mixer.conv_dim), conv_history=int(mixer.conv_kernel_size) - 1,
                           heads=int(mixer.num_heads), head_dim=int(mixer.head_dim),
                           state_size=int(mixer.ssm_state_size))


def recurrent_scan(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                   state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The scan token by token; returns ``(y (B, H, S, P), final state (B, H, P, N))`` (without ``D x``).

    ``x (B, H, S, P)``, ``dt (B, H, S)``, ``a (H,)`` (negative), ``b``/``c (B, H, S, N)``, ``state (B, H, P, N)``;
    all fp32. Unrolled over ``S`` when traced (``S = 1`` in a decode graph).
    """
    outputs = []
    for t in range(int(x.shape[2])):
        step = dt[:, :, t, None, None]  # (B, H, 1, 1)
        state = decay(state, step * a[None, :, None, None])
        state = state + (x[:, :, t, :, None] * step) * b[:, :, t, None, :]
        outputs.append((state @ c[:, :, t, :, None]).transpose(-1, -2))  # (B, H, 1, P)
    return torch.cat(outputs, dim=2), state


def chunked_scan(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                 state: torch.Tensor, chunk_size: int = MAX_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """The scan in chunks of ``chunk_size`` tokens; same I/O as :func:`recurrent_scan`.

    ``S`` is padded to a multiple of the chunk with ``dt = 0``, ``x = 0`` (tokens that leave the state as it is).
    Every exponent is ``<= 0``: ``G`` is non-increasing since ``dt A <= 0``.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    batch, heads = x.shape[:2]  # symbols under tracing
    seq_len = int(x.shape[2])  # a constant of the traced graph: the chunk loop is unrolled for it
    size = min(chunk_size, seq_len)
    pad = (-seq_len) % size
    if pad:
        x, b, c = (F.pad(v, (0, 0, 0, pad)) for v in (x, b, c))
        dt = F.pad(dt, (0, pad))
    chunks = (seq_len + pad) // size

    def split(v: torch.Tensor) -> torch.Tensor:  # (B, H, S, D) -> (B, H, N, L, D)
        return v.reshape(batch, heads, chunks, size, v.shape[-1])

    x, b, c = split(x), split(b), split(c)
    dt = split(dt[..., None])  # (B, H, N, L, 1)
    rows = torch.arange(size, device=x.device)[:, None]
    cols = torch.arange(size, device=x.device)[None, :]
    inclusive = (cols <= rows).to(x.dtype)
    log_decay = inclusive @ (dt * a[None, :, None, None, None])  # cumulative dt A in each chunk: (B, H, N, L, 1)
    # exp(G_l - G_s) for s <= l; the other half is clamped to exp(0) and masked off, never exp(+x).
    pairwise = torch.exp(torch.clamp(log_decay - log_decay.transpose(-1, -2), max=0.0)) * inclusive
    inputs = x * dt  # dt_s x_s: (B, H, N, L, P)
    intra = ((c @ b.transpose(-1, -2)) * pairwise) @ inputs  # (B, H, N, L, P)
    last = log_decay[:, :, :, -1:]  # (B, H, N, 1, 1)
    c_decayed = c * torch.exp(log_decay)  # how the chunk's start state reaches each output
    b_decayed = b * torch.exp(last - log_decay)  # how each input reaches the chunk's end state

    outputs = []
    for i in range(chunks):
        outputs.append(intra[:, :, i] + c_decayed[:, :, i] @ state.transpose(-1, -2))
        state = decay(state, last[:, :, i]) + inputs[:, :, i].transpose(-1, -2) @ b_decayed[:, :, i]
    out = torch.cat(outputs, dim=2)  # (B, H, N * L, P)
    return out[:, :, :seq_len], state


def _zero(like: torch.Tensor) -> torch.Tensor:
    return torch.zeros((), dtype=like.dtype, device=like.device)


def per_head(v: torch.Tensor, heads: int) -> torch.Tensor:
    """``(B, S, G, N) -> (B, heads, S, N)``: head ``h`` reads group ``h // (heads / G)`` (repeat_interleave)."""
    batch, seq_len, groups, size = v.shape
    repeats = heads // groups
    v = v[:, :, :, None, :].expand(batch, seq_len, groups, repeats, size).reshape(batch, seq_len, heads, size)
    return v.transpose(1, 2)


class Mamba2Output(NamedTuple):
    hidden_states: torch.Tensor  # (B, S, hidden): the mixer's output (before the decoder's residual)
    conv_state: torch.Tensor  # (rows, conv_dim, K - 1)
    ssm_state: torch.Tensor  # (rows, heads, head_dim, state_size) fp32


class Mamba2Step(nn.Module):
    """A step of one transformers Mamba2 mixer over retained conv/SSM state (module docstring).

    It shares (does not copy) the mixer's parameters and never calls its ``forward``. ``chunk_size`` caps the
    prefill chunk (default: the mixer's own); ``prefill_seq_len`` makes one graph serve prefill chunks of up to
    that many tokens and decode.
    """

    def __init__(self, mixer: nn.Module, chunk_size: int | None = None, prefill_seq_len: int | None = None):
        super().__init__()
        self.mixer = mixer
        self.spec = mamba2_state_spec(mixer)
        self.groups = int(mixer.n_groups)
        if self.spec.heads % self.groups:
            raise ValueError(f"{self.spec.heads} Mamba2 heads are not a multiple of {self.groups} groups")
        self.chunk_size = int(chunk_size or mixer.chunk_size)
        if prefill_seq_len is not None and prefill_seq_len < 2:
            raise ValueError(f"prefill_seq_len must be >= 2 for a prefill+decode graph, got {prefill_seq_len}")
        self.prefill_seq_len = prefill_seq_len
        self.activation = ACT2FN[mixer.activation]

    def forward(self, hidden_states: torch.Tensor, slots: torch.Tensor, conv_state: torch.Tensor,
                ssm_state: torch.Tensor, batch_index: torch.Tensor | None = None) -> Mamba2Output:
        """``hidden_states (B, S, hidden)`` (after the block's norm), ``slots (B, S)`` int64 (``position_ids[0]``)."""
        self._check_inputs(hidden_states, slots, conv_state, ssm_state, batch_index)
        conv_rows, ssm_rows = gather_state_rows(conv_state, batch_index), gather_state_rows(ssm_state, batch_index)
        # A request starts in this row: drop whatever the row held (vLLM's has_initial_state).
        starts = (slots == 0).any(dim=1)
        conv_rows = torch.where(starts[:, None, None], _zero(conv_rows), conv_rows)
        ssm_rows = torch.where(starts[:, None, None, None], _zero(ssm_rows), ssm_rows)

        mixer, spec = self.mixer, self.spec
        batch, seq_len, _ = hidden_states.shape
        inner = spec.heads * spec.head_dim
        valid = slots >= 0
        gate, mixed, dt = torch.split(mixer.in_proj(hidden_states), [inner, spec.conv_dim, spec.heads], dim=-1)
        conv_out, new_conv = causal_conv(mixed.transpose(1, 2), conv_rows, mixer.conv1d.weight, valid.sum(dim=1))
        if mixer.conv1d.bias is not None:
            conv_out = conv_out + mixer.conv1d.bias[None, :, None].to(conv_out.dtype)
        conv_out = self.activation(conv_out).transpose(1, 2)  # (B, S, conv_dim)
        groups_width = self.groups * spec.state_size
        x, b, c = torch.split(conv_out, [inner, groups_width, groups_width], dim=-1)
        x = x.float().reshape(batch, seq_len, spec.heads, spec.head_dim).transpose(1, 2)  # (B, H, S, P)
        b = per_head(b.float().reshape(batch, seq_len, self.groups, spec.state_size), spec.heads)
        c = per_head(c.float().reshape(batch, seq_len, self.groups, spec.state_size), spec.heads)
        dt = softplus(dt.float() + mixer.dt_bias.float()).transpose(1, 2)  # (B, H, S)
        # Padding tokens leave the state as it is: no decay (dt = 0), no write (x = 0).
        token = valid[:, None, :]
        dt = torch.where(token, dt, _zero(dt))
        x = torch.where(token[..., None], x, _zero(x))
        a = -torch.exp(mixer.A_log.float())
        y, new_ssm = self._scan(x, dt, a, b, c, ssm_rows.float())
        y = y + mixer.D.float()[None, :, None, None] * x
        y = y.transpose(1, 2).reshape(batch, seq_len, inner)
        output = mixer.out_proj(mixer.norm(y, gate).to(hidden_states.dtype))
        real = valid.any(dim=1)
        return Mamba2Output(output, scatter_state_rows(conv_state, new_conv, real, batch_index),
                            scatter_state_rows(ssm_state, new_ssm, real, batch_index))

    def _scan(self, x, dt, a, b, c, state) -> tuple[torch.Tensor, torch.Tensor]:
        if self.prefill_seq_len is None:
            if int(x.shape[2]) == 1:  # the traced length picks the path: a graph per length
                return recurrent_scan(x, dt, a, b, c, state)
            return chunked_scan(x, dt, a, b, c, state, self.chunk_size)
        if not torch.jit.is_tracing() and x.shape[2] == 1:
            # Eager (the torch backend): the path the graph's Where below would pick, without the other one.
            return recurrent_scan(x, dt, a, b, c, state)
        # One graph, both paths: the chunk padded to prefill_seq_len (padding = tokens that change nothing), and
        # the recurrence over the first token; seq_len (a symbol) chooses.
        pad = self.prefill_seq_len - x.shape[2]
        chunk_out, chunk_state = chunked_scan(F.pad(x, (0, 0, 0, pad)), F.pad(dt, (0, pad)), a,
                                              F.pad(b, (0, 0, 0, pad)), F.pad(c, (0, 0, 0, pad)), state,
                                              self.chunk_size)
        step_out, step_state = recurrent_scan(x[:, :, :1], dt[:, :, :1], a, b[:, :, :1], c[:, :, :1], state)
        is_prefill = torch.arange(x.shape[2], device=x.device).max() > 0
        return (torch.where(is_prefill, chunk_out[:, :, :x.shape[2]], step_out),
                torch.where(is_prefill, chunk_state, step_state))

    def _check_inputs(self, hidden_states, slots, conv_state, ssm_state, batch_index) -> None:
        if torch.jit.is_tracing():
            return
        check_step_slots(hidden_states, slots, self.prefill_seq_len)
        rows, spec = conv_state.shape[0], self.spec
        if tuple(conv_state.shape) != spec.conv_shape(rows) or tuple(ssm_state.shape) != spec.ssm_shape(rows):
            raise ValueError(f"states must be conv {spec.conv_shape(rows)} and ssm {spec.ssm_shape(rows)}, got "
                             f"{tuple(conv_state.shape)} and {tuple(ssm_state.shape)}")
        check_state_rows(rows, slots, batch_index)
