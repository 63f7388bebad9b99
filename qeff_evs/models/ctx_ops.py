"""KV-cache reads and writes as QEfficient's compiler-known ops (``com.qualcomm.cloud::Ctx*``).

Eager PyTorch runs :func:`ctx_scatter` / :func:`ctx_gather` (and their ``batch_index`` variants)
as plain tensor code; under ``torch.onnx.export`` each becomes one node of the custom domain, whose
body (standard ops, so ONNX Runtime runs it) the exporter attaches afterwards
(``qeff_evs.export.onnx_functions``). The eager code and those bodies compute the same thing:

* a write whose slot lies outside ``[0, ctx_len)`` -- the graph sends ``SKIP_INDEX`` (INT32_MAX)
  for padding, as QEfficient does, and the card skips it -- or whose ``batch_index`` row lies
  outside the cache (vllm-qaic pads unused decode rows with -1) is skipped;
* a read of such a slot or row returns slot 0 of row 0 (the card returns unspecified data there);
  callers zero skipped reads (``qeff_evs.models.kv_cache``).
"""

from __future__ import annotations

import torch

KV_DOMAIN = "com.qualcomm.cloud"
CTX_SCATTER, CTX_SCATTER_CB = "CtxScatter", "CtxScatterCB"
CTX_GATHER, CTX_GATHER_CB = "CtxGather", "CtxGatherCB"
SKIP_INDEX = torch.iinfo(torch.int32).max  # QEfficient's "skip this slot" index


def _inside(index: torch.Tensor, size: int) -> torch.Tensor:
    return (index >= 0) & (index < size)


def _scatter(data: torch.Tensor, rows: torch.Tensor, position_ids: torch.Tensor, updates: torch.Tensor,
             row_ok: torch.Tensor) -> torch.Tensor:
    """``data (F, H, C, D)`` with ``updates (B, H, S, D)`` written at ``(rows[b, s], h, position_ids[b, s])``.

    Only the real writes land; skipped ones touch nothing (the ONNX body gets there without a
    data-dependent shape, by repeating a real write; see ``qeff_evs.export.onnx_functions``).
    """
    write = _inside(position_ids, data.shape[2]) & row_ok
    batch, seq = torch.nonzero(write, as_tuple=True)
    heads = torch.arange(data.shape[1], device=data.device)
    out = data.clone()
    out[rows[batch, seq][:, None], heads[None, :], position_ids[batch, seq][:, None]] = \
        updates[batch, :, seq].to(data.dtype)
    return out


class _CtxScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, data, position_ids, updates):
        rows = torch.arange(data.shape[0], device=data.device)[:, None].expand_as(position_ids)
        return _scatter(data, rows, position_ids, updates, torch.ones_like(position_ids, dtype=torch.bool))

    @staticmethod
    def symbolic(g, data, position_ids, updates):
        return g.op(f"{KV_DOMAIN}::{CTX_SCATTER}", data, position_ids, updates).setType(data.type())


class _CtxScatterCB(torch.autograd.Function):
    @staticmethod
    def forward(ctx, data, batch_index, position_ids, updates):
        rows = batch_index.expand_as(position_ids)
        return _scatter(data, rows, position_ids, updates, _inside(rows, data.shape[0]))

    @staticmethod
    def symbolic(g, data, batch_index, position_ids, updates):
        return g.op(f"{KV_DOMAIN}::{CTX_SCATTER_CB}", data, batch_index, position_ids, updates).setType(data.type())


def _read_type(data):
    """A read's ONNX type: the cache's dtype, heads and head_dim; its rows (the call's batch) and length
    (``comp_ctx_len``) left unknown. Typed as the whole cache, ONNX Runtime may plan to reuse its buffer
    for a cache-sized tensor, which fails when a continuous-batching call has fewer rows than the cache."""
    sizes = data.type().varyingSizes()  # per axis, None where the trace left it dynamic
    if sizes is None or len(sizes) != 4:
        return data.type()
    return data.type().with_sizes([None, sizes[1], None, sizes[3]])


def _gather(data: torch.Tensor, rows: torch.Tensor, ctx_indices: torch.Tensor) -> torch.Tensor:
    """``(B, H, L, D)``: slot ``ctx_indices[b, 0, l]`` of row ``rows[b]``; skipped indices read slot/row 0."""
    slots = torch.where(_inside(ctx_indices, data.shape[2]), ctx_indices, 0)  # (B, 1, L)
    rows = torch.where(_inside(rows, data.shape[0]), rows, 0)  # (B,)
    heads = torch.arange(data.shape[1], device=data.device)
    return data[rows[:, None, None], heads[None, :, None], slots]


class _CtxGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, data, ctx_indices, comp_ctx_len):
        return _gather(data, torch.arange(data.shape[0], device=data.device), ctx_indices)

    @staticmethod
    def symbolic(g, data, ctx_indices, comp_ctx_len):
        return g.op(f"{KV_DOMAIN}::{CTX_GATHER}", data, ctx_indices, comp_ctx_len).setType(_read_type(data))


class _CtxGatherCB(torch.autograd.Function):
    @staticmethod
    def forward(ctx, data, batch_index, ctx_indices, comp_ctx_len):
        return _gather(data, batch_index.reshape(-1), ctx_indices)

    @staticmethod
    def symbolic(g, data, batch_index, ctx_indices, comp_ctx_len):
        return g.op(f"{KV_DOMAIN}::{CTX_GATHER_CB}", data, batch_index, ctx_indices, comp_ctx_len).setType(
            _read_type(data))


def ctx_scatter(data: torch.Tensor, position_ids: torch.Tensor, updates: torch.Tensor) -> torch.Tensor:
    """Write ``updates (B, H, S, D)`` into ``data (B, H, ctx_len, D)`` at slots ``position_ids (B, S)``."""
    return _CtxScatter.apply(data, position_ids, updates)


def ctx_scatter_cb(data: torch.Tensor, batch_index: torch.Tensor, position_ids: torch.Tensor,
                   updates: torch.Tensor) -> torch.Tensor:
    """As :func:`ctx_scatter`, into cache row ``batch_index[b, 0]`` of ``data (full_batch_size, ...)``."""
    return _CtxScatterCB.apply(data, batch_index, position_ids, updates)


def ctx_gather(data: torch.Tensor, ctx_indices: torch.Tensor, comp_ctx_len: torch.Tensor) -> torch.Tensor:
    """Read slots ``ctx_indices (B, 1, L)`` of ``data (B, H, ctx_len, D)`` -> ``(B, H, L, D)``."""
    return _CtxGather.apply(data, ctx_indices, comp_ctx_len)


def ctx_gather_cb(data: torch.Tensor, batch_index: torch.Tensor, ctx_indices: torch.Tensor,
                  comp_ctx_len: torch.Tensor) -> torch.Tensor:
    """As :func:`ctx_gather`, from cache row ``batch_index[b, 0]`` of ``data (full_batch_size, ...)``."""
    return _CtxGatherCB.apply(data, batch_index, ctx_indices, comp_ctx_len)
