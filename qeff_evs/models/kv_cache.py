"""A KV cache addressed by slot: each token's key/value lives at slot ``position_ids[0]``.

The language graph receives the whole cache ``(batch, kv_heads, ctx_len, head_dim)`` per layer,
scatters the chunk's new keys/values into it and attends over all ``ctx_len`` slots, with a mask
built from the slots alone: a query at slot ``p`` sees key slot ``j`` iff ``j <= p``. Nothing here
has a data-dependent shape, so the graph exports with ``ctx_len`` as a plain symbol.

Padding tokens carry slot ``-1``. They are redirected to the last slot, ``ctx_len - 1``, and their
queries see no key at all. This is safe under one host invariant:

    prompt_len + max_new_tokens <= ctx_len

so while a padded prefill chunk runs, slot ``ctx_len - 1`` never holds a real token; a real decode
token written there later simply overwrites the padding's leftovers (it is written before it is read).

Continuous batching (QEfficient's ``full_batch_size`` mode, :class:`BatchedSlotKVCache`): the cache
holds ``full_batch_size`` request rows and a call of ``batch_size`` rows names the cache row of each of
its rows in ``batch_index``. The chunk's keys/values are scattered only at ``(batch_index[b], head,
slot)`` (one ScatterND), attention reads the gathered rows ``cache[batch_index]``, and every cache row
the call does not name is returned bit for bit unchanged. A padding row of a decode call (all
positions -1) writes only slot ``ctx_len - 1`` of the row it names, which by the same invariant no
request reads before writing it itself; it must not name a row another row of the same call writes,
or two writes to one slot would race (the host picks a row the call does not use).
"""

from __future__ import annotations

import torch

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


def write_slots(position_slots: torch.Tensor, key_slots: torch.Tensor) -> torch.Tensor:
    """Cache slot each token writes to: its own slot, or the last slot for padding (slot < 0)."""
    # max() rather than [-1]: a negative Gather index is legal ONNX but not every backend takes it.
    return torch.where(position_slots < 0, key_slots.max(), position_slots)


def scatter_at_slots(cache: torch.Tensor, new: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Write ``new (B, H, S, D)`` into ``cache (B, H, ctx_len, D)`` at ``slots (B, S)``; returns a new tensor."""
    index = slots[:, None, :, None].expand(-1, new.shape[1], -1, new.shape[3])
    return cache.scatter(2, index, new.to(cache.dtype))


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


class SlotKVCache:
    """The ``past_key_values`` handed to a transformers text model for one graph step.

    Decoder attention calls ``update(key, value, layer_idx)``; this scatters the chunk's keys and
    values at their slots and returns the full ``ctx_len`` cache, which attention then reads whole.
    The updated per-layer caches are what the graph returns as ``*_RetainedState``.
    """

    def __init__(self, past_keys, past_values, slots: torch.Tensor):
        if len(past_keys) != len(past_values):
            raise ValueError(
                f"got {len(past_keys)} past keys but {len(past_values)} past values; "
                "pass one key and one value cache per decoder layer"
            )
        self.keys = list(past_keys)
        self.values = list(past_values)
        self.slots = slots

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.keys[layer_idx] = scatter_at_slots(self.keys[layer_idx], key_states, self.slots)
        self.values[layer_idx] = scatter_at_slots(self.values[layer_idx], value_states, self.slots)
        return self.keys[layer_idx], self.values[layer_idx]

    def __len__(self) -> int:
        return len(self.keys)


def scatter_at_rows_and_slots(
    cache: torch.Tensor, new: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """Write ``new (B, H, S, D)`` into ``cache (F, H, ctx_len, D)`` at ``(rows[b], h, slots[b, s])``.

    ``rows (B,)`` picks the cache row of each batch row. Exports as one ScatterND whose indices are
    ``(B, H, S, 3)``: only the ``B*H*S`` new vectors move, never a whole ``ctx_len`` row, and rows
    not named in ``rows`` keep their values exactly.
    """
    heads = torch.arange(new.shape[1], device=new.device)
    index = (rows[:, None, None], heads[None, :, None], slots[:, None, :])  # broadcast to (B, H, S)
    return cache.index_put(index, new.to(cache.dtype))


class BatchedSlotKVCache(SlotKVCache):
    """``past_key_values`` of a continuous-batching step: full_batch_size cache rows, batch_index per call.

    ``update`` scatters the call's keys/values into the full caches (kept as the retained state) and
    returns only the call's rows, ``cache[batch_index]`` ``(B, H, ctx_len, D)``, for attention.
    """

    def __init__(self, past_keys, past_values, slots: torch.Tensor, batch_rows: torch.Tensor):
        super().__init__(past_keys, past_values, slots)
        self.batch_rows = batch_rows  # (B,) int64 cache row of each batch row

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        rows, slots = self.batch_rows, self.slots
        self.keys[layer_idx] = scatter_at_rows_and_slots(self.keys[layer_idx], key_states, rows, slots)
        self.values[layer_idx] = scatter_at_rows_and_slots(self.values[layer_idx], value_states, rows, slots)
        return self.keys[layer_idx].index_select(0, rows), self.values[layer_idx].index_select(0, rows)
