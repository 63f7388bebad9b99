"""A KV cache addressed by slot: each token's key/value lives at slot ``position_ids[0]``.

The language graph receives the whole cache ``(batch, kv_heads, ctx_len, head_dim)`` per layer,
scatters the chunk's new keys/values into it and attends over all ``ctx_len`` slots, with a mask
built from the slots alone: a query at slot ``p`` sees key slot ``j`` iff ``j <= p``. Nothing here
has a data-dependent shape, so the graph exports with ``ctx_len`` as a plain symbol.

Writes and reads go through QEfficient's compiler-known ops (``qeff_evs.models.ctx_ops``): each step
writes its keys/values with CtxScatter and reads the cache back with CtxGather, in QEfficient's form.

Padding tokens carry slot ``-1``; their writes get the index ``SKIP_INDEX`` (INT32_MAX), which the
card skips and our ONNX bodies and eager code skip too, so a padding write never touches the cache.
Their queries see no key at all. A row reads only the slots up to its last position; later slots are
``SKIP_INDEX`` reads (the card does not fetch them) and come back as zeros, which the mask hides.

Compute context length (docs/design.md#specializations): a call may read only the first ``comp_ctx_len`` slots of the
row (``key_slots`` of that length, from the shape of the graph's ``comp_ctx_lengths`` input, QEfficient's form): the
gather, the mask and the attention then cost that many slots while the cache stays ``ctx_len`` long. Every slot
the call's queries may see lies below its last position + 1 <= ``comp_ctx_len``, so the result is the same.

Continuous batching (QEfficient's ``full_batch_size`` mode): the cache holds ``full_batch_size``
request rows and a call of ``batch_size`` rows names the cache row of each of its rows in
``batch_index``. The chunk's keys/values are scattered only at ``(batch_index[b], head, slot)`` (one
ScatterND), attention reads rows ``cache[batch_index]``, and every cache row the call does not name is
returned bit for bit unchanged. A padding row of a decode call (all positions -1) writes nothing,
whatever row it names: vllm-qaic's ``batch_index = -1`` as well as a row another request uses.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from qeff_evs.models.ctx_ops import SKIP_INDEX, ctx_gather, ctx_gather_cb, ctx_scatter, ctx_scatter_cb

# Added to the scores of hidden key slots. Finite on purpose: a padding query sees no key at all,
# and an all -inf row would turn its softmax into NaN (which would then leak into the cache).
# Half the fp16 minimum keeps ``score + MASKED_SCORE`` finite after ``-convert-to-fp16``.
MASKED_SCORE = torch.finfo(torch.float16).min / 2


def cache_slots(cache: torch.Tensor) -> torch.Tensor:
    """``arange(ctx_len)`` of a ``(B, H, ctx_len, D)`` cache.

    Built from the cache's shape so that, under tracing, ``ctx_len`` stays a symbol instead of
    being frozen into a constant (a Python int taken from ``shape`` would be).
    """
    return torch.arange(cache.shape[2], device=cache.device)


def scatter_slots(position_slots: torch.Tensor) -> torch.Tensor:
    """Slot each token writes: its own, or ``SKIP_INDEX`` for padding (slot < 0), which no backend writes."""
    return torch.where(position_slots < 0, torch.full_like(position_slots, SKIP_INDEX), position_slots)


def read_slots(position_slots: torch.Tensor, key_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ctx_indices (B, 1, ctx_len), skipped (B, 1, ctx_len))`` of a step's cache reads.

    A row reads the slots up to its last position; later slots (every slot, for a padding row) are
    ``SKIP_INDEX``: the card does not read them, and their keys and values are zeroed after the read.
    """
    last = position_slots.max(dim=1).values[:, None, None]  # (B, 1, 1)
    slots = key_slots[None, None, :]
    skipped = slots > last
    return torch.where(skipped, torch.full_like(slots, SKIP_INDEX), slots), skipped


def slot_attention_mask(
    position_slots: torch.Tensor, key_slots: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Additive mask ``(B, 1, S, ctx_len)``: 0 where key slot ``j <= query slot p``, else MASKED_SCORE.

    A padding query (slot -1) sees nothing; its output is finite garbage that no real token reads.
    """
    visible = key_slots[None, None, None, :] <= position_slots[:, None, :, None]
    zero = torch.zeros((), dtype=dtype, device=position_slots.device)
    hidden = torch.full((), MASKED_SCORE, dtype=dtype, device=position_slots.device)
    return torch.where(visible, zero, hidden)


class CacheAddressing(NamedTuple):
    """Where one step writes and reads the KV caches: the same for every layer with a cache, so computed once
    per step (``cache_addressing``) and handed to each layer (a stamped layer's graph takes it as its inputs)."""

    write_slots: torch.Tensor  # (B, S) int64: each token's slot, SKIP_INDEX for padding (scatter_slots)
    read_indices: torch.Tensor  # (B, 1, keys) int64: the slots read, SKIP_INDEX past each row's last position
    read_length: torch.Tensor  # () int64: how many slots a read covers (QEfficient's comp_ctx_len operand)
    skipped: torch.Tensor  # (B, 1, keys, head_dim) bool: reads to zero


def cache_addressing(position_slots: torch.Tensor, key_slots: torch.Tensor, head_dim: int) -> CacheAddressing:
    """The step's writes (``position_slots (B, S)``) and reads (``key_slots``: ``arange`` of the slots read)."""
    read_indices, skipped = read_slots(position_slots, key_slots)
    # (B, 1, keys, head_dim): as wide as a read's rows, so that the Where zeroing them runs over long contiguous
    # spans (ONNX Runtime's Where is ~2.5x slower broadcasting a width-1 last axis).
    return CacheAddressing(scatter_slots(position_slots), read_indices,
                           key_slots.max() + 1,  # from the shape, so a symbol under tracing
                           skipped[..., None].expand(-1, -1, -1, head_dim))


class SlotKVCache:
    """The ``past_key_values`` handed to a transformers text model for one graph step.

    Decoder attention calls ``update(key, value, layer_idx)``; this writes the chunk's keys and values
    at their slots (CtxScatter) and returns the cache read back over ``ctx_len`` (CtxGather), with
    skipped reads zeroed. The written per-layer caches are what the graph returns as ``*_RetainedState``.
    With ``batch_index`` (continuous batching) the caches hold ``full_batch_size`` rows, batch row
    ``b`` writes and reads row ``batch_index[b, 0]`` and every other row passes through unchanged.
    ``layers`` names the decoder layer of each cache (default: cache ``i`` is layer ``i``). ``addressing``: the step's
    writes and reads (``cache_addressing``; its key slots are ``arange(comp_ctx_len)`` or every slot of the cache).
    """

    def __init__(self, past_keys, past_values, addressing: CacheAddressing, batch_index: torch.Tensor | None = None,
                 layers=None):
        if len(past_keys) != len(past_values):
            raise ValueError(
                f"got {len(past_keys)} past keys but {len(past_values)} past values; "
                "pass one key and one value cache per decoder layer"
            )
        self.keys = list(past_keys)
        self.values = list(past_values)
        # Decoder layer index -> position in keys/values: a hybrid model caches only some layers.
        layers = range(len(self.keys)) if layers is None else list(layers)
        if len(layers) != len(self.keys):
            raise ValueError(f"{len(self.keys)} KV caches for the {len(layers)} cached layers {list(layers)}")
        self.slot_of_layer = {int(layer): at for at, layer in enumerate(layers)}
        self.batch_index = batch_index
        self.write_slots = addressing.write_slots
        self.read_indices = addressing.read_indices
        self.ctx_len = addressing.read_length
        self.skipped = addressing.skipped

    def _write(self, cache: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        new = new.to(cache.dtype)
        if self.batch_index is None:
            return ctx_scatter(cache, self.write_slots, new)
        return ctx_scatter_cb(cache, self.batch_index, self.write_slots, new)

    def _read(self, cache: torch.Tensor) -> torch.Tensor:
        length = self.ctx_len
        if self.batch_index is None:
            read = ctx_gather(cache, self.read_indices, length)
        else:
            read = ctx_gather_cb(cache, self.batch_index, self.read_indices, length)
        return torch.where(self.skipped, torch.zeros((), dtype=read.dtype, device=read.device), read)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        at = self.slot_of_layer[layer_idx]
        self.keys[at] = self._write(self.keys[at], key_states)
        self.values[at] = self._write(self.values[at], value_states)
        return self._read(self.keys[at]), self._read(self.values[at])

    def __len__(self) -> int:
        return len(self.keys)
