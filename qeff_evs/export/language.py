"""Export the language-model step (``qeff_evs.models.language``) to one ONNX file, QEfficient's contract.

The graph's I/O names, order and dynamic axes are ``qeff_evs.models.graph_io.LanguageGraphIO``; the
traced module is ``qeff_evs.models.language.ExportableLanguageGraph``. The dynamic symbols are
``batch_size``, ``seq_len``, ``vision_size`` and ``ctx_len`` (``full_batch_size`` for the caches under
continuous batching, ``comp_ctx_len`` with compute context lengths, ``num_logits`` with logits rows); one file serves the prefill and the
decode specializations.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Sequence

import onnx
import torch
from torch import nn

from qeff_evs.export.onnx_graph import check_named_axes, check_static_ops, legacy_export
from qeff_evs.export.reuse import GraphReuse
from qeff_evs.export.stamping import stamped_language_graph
from qeff_evs.export.weights import WeightStore, attach_weights, store_tables, write_weights
from qeff_evs.models.graph_io import BATCH_INDEX, COMP_CTX_LENGTHS, LOGITS_ROWS, LanguageGraphIO
from qeff_evs.models.language import ExportableLanguageGraph, LanguageSpec
from qeff_evs.models.registry import family_for_config
from qeff_evs.models.sparse_moe import is_sparse_block

_LOG = logging.getLogger(__name__)


def language_dummy_inputs(
    spec: LanguageSpec,
    *,
    batch_size: int = 1,
    seq_len: int = 8,
    vision_size: int = 6,
    ctx_len: int = 32,
    dtype: torch.dtype = torch.float32,
    full_batch_size: int | None = None,
    comp_ctx_len: int | None = None,
    logits_rows: bool = False,
) -> dict[str, torch.Tensor]:
    """Example inputs keyed and ordered like the graph: a prefill chunk with a few media tokens.

    With ``full_batch_size`` (continuous batching) the caches have that many rows and
    ``batch_index`` sends batch row ``b`` to cache row ``full_batch_size - 1 - b``. With ``comp_ctx_len`` the
    graph takes ``comp_ctx_lengths`` of that length (in ``[seq_len, ctx_len]``); with ``logits_rows`` it takes
    ``logits_rows`` of length 1.
    """
    if comp_ctx_len is not None and not seq_len <= comp_ctx_len <= ctx_len:
        raise ValueError(f"example comp_ctx_len {comp_ctx_len} must lie in [seq_len {seq_len}, ctx_len {ctx_len}]")
    if seq_len > ctx_len:
        raise ValueError(f"example seq_len {seq_len} exceeds ctx_len {ctx_len}; choose ctx_len >= seq_len")
    if full_batch_size is not None and full_batch_size < batch_size:
        raise ValueError(
            f"example full_batch_size {full_batch_size} is below batch_size {batch_size}; a call's rows need "
            "distinct cache rows, so choose full_batch_size >= batch_size"
        )
    io = LanguageGraphIO(spec.num_layers, tuple(spec.extras), full_batch_size is not None, spec.io_kv_layers,
                         spec.layer_states, comp_ctx_len is not None, logits_rows)
    media = min(seq_len // 2, vision_size)
    input_ids = torch.zeros(batch_size, seq_len, dtype=torch.int64)
    input_ids[:, 1 : 1 + media] = spec.media_token_ids[-1]
    positions = torch.arange(seq_len, dtype=torch.int64).expand(4, batch_size, seq_len).contiguous()
    kv_shape = (full_batch_size or batch_size, spec.kv_heads, ctx_len, spec.head_dim)
    values = {
        "input_ids": input_ids,
        "vision_embeds": torch.zeros(1, vision_size, spec.hidden_size, dtype=dtype),
        **{name: torch.zeros(levels, 1, vision_size, spec.hidden_size, dtype=dtype)
           for name, levels in spec.extras.items()},
        "position_ids": positions,
        "image_idx": torch.zeros(1, 1, dtype=torch.int64),
    }
    if comp_ctx_len is not None:
        values[COMP_CTX_LENGTHS] = torch.arange(comp_ctx_len, dtype=torch.int64)
    if logits_rows:
        values[LOGITS_ROWS] = torch.zeros(1, dtype=torch.int64)
    if full_batch_size is not None:
        values[BATCH_INDEX] = (full_batch_size - 1 - torch.arange(batch_size, dtype=torch.int64)).reshape(-1, 1)
    for state in spec.layer_states:  # fp32 like the graph's float inputs
        for name in state.input_names:
            values[name] = torch.zeros(kv_shape[0], *state.row_shape, dtype=dtype)
    return {name: values[name] if name in values else torch.zeros(kv_shape, dtype=dtype) for name in io.input_names}


def export_language_graph(
    hf_model: nn.Module,
    path: str | Path,
    *,
    ctx_len_example: int = 32,
    seq_len_example: int = 8,
    vision_size_example: int = 6,
    batch_size_example: int = 1,
    media_token_ids: Sequence[int] | None = None,
    continuous_batching: bool = False,
    full_batch_size_example: int = 4,
    rope_positions: int | None = None,
    prefill_seq_len: int | None = None,
    comp_ctx_lengths: bool = False,
    logits_rows: bool = False,
) -> Path:
    """Trace the language step of ``hf_model`` (legacy exporter, opset 17) and write it to ``path``.

    The example sizes only have to be valid: every one of them is a named symbol in the graph.
    ``continuous_batching`` adds ``batch_index`` and the ``full_batch_size`` cache rows (the example
    value is only traced with; the specializations choose the real one). ``rope_positions`` is the
    length of the RoPE cos/sin tables (default: the config's ``max_position_embeddings``).
    ``prefill_seq_len``: the compiled prefill length; a family graph that unrolls its prefill per length
    (``LanguageGraph.trace_seq_len``) is built for it and traced at it. ``comp_ctx_lengths``: the graph takes
    the ``comp_ctx_lengths`` input (an export with compute context lengths, docs/design.md#specializations).
    ``logits_rows``: the graph takes the ``logits_rows`` input (a call may compute no logits).
    """
    module, inputs = _traced_step(hf_model, media_token_ids, continuous_batching, rope_positions, prefill_seq_len,
                                  comp_ctx_lengths, logits_rows, ctx_len_example, seq_len_example,
                                  vision_size_example, batch_size_example, full_batch_size_example)
    io = module.io
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _LOG.info(
        "exporting language graph (%d layers, extra rows %s, layer states %s, continuous_batching=%s) with "
        "example seq_len=%d -> %s",
        module.spec.num_layers, list(io.extras), [state.name for state in io.layer_states], continuous_batching,
        inputs["input_ids"].shape[1], path,
    )
    legacy_export(module, list(inputs.values()), path, input_names=io.input_names, output_names=io.output_names,
                  dynamic_axes=io.dynamic_axes, ignore_messages=(
                      # transformers' sdpa turns `q_len > 1` into a Python bool while tracing; the step always
                      # passes a mask, which makes is_causal False whatever that bool is, so the trace is exact.
                      "Converting a tensor to a Python boolean",
                      # Our advanced-indexing gathers only ever see non-negative indices (argmax, clamped rows).
                      "Exporting aten::index operator"))
    check_language_graph(onnx.load(str(path), load_external_data=False), io)
    _LOG.info("language graph written: %s (%.2f MB)", path, path.stat().st_size / 1e6)
    return path


def _traced_step(hf_model: nn.Module, media_token_ids, continuous_batching: bool, rope_positions, prefill_seq_len,
                 comp_ctx_lengths: bool, logits_rows: bool, ctx_len_example: int, seq_len_example: int,
                 vision_size_example: int, batch_size_example: int, full_batch_size_example: int
                 ) -> tuple[ExportableLanguageGraph, dict[str, torch.Tensor]]:
    """The module a language graph is traced from and its example inputs (``export_language_graph``'s arguments)."""
    family = family_for_config(hf_model.config)
    graph = family.language_graph(hf_model, media_token_ids, rope_positions, prefill_seq_len)
    module = ExportableLanguageGraph(graph, continuous_batching, comp_ctx_lengths, logits_rows)
    dtype = next(p.dtype for p in hf_model.parameters() if p.is_floating_point())  # not an index buffer's
    if graph.trace_seq_len is not None:
        seq_len_example = graph.trace_seq_len
        ctx_len_example = max(ctx_len_example, 2 * seq_len_example)
        vision_size_example = max(vision_size_example, seq_len_example)
    inputs = language_dummy_inputs(
        module.spec,
        batch_size=batch_size_example,
        seq_len=seq_len_example,
        vision_size=vision_size_example,
        ctx_len=ctx_len_example,
        dtype=dtype,
        full_batch_size=full_batch_size_example if continuous_batching else None,
        # Between seq_len and ctx_len, equal to neither, so the trace cannot tie its symbol to theirs.
        comp_ctx_len=(seq_len_example + ctx_len_example) // 2 if comp_ctx_lengths else None,
        logits_rows=logits_rows,
    )
    return module, inputs


def export_language_graph_stamped(
    hollow: nn.Module,
    path: str | Path,
    names: Mapping[int, str],
    store: WeightStore,
    reader,
    *,
    media_token_ids: Sequence[int] | None = None,
    continuous_batching: bool = False,
    rope_positions: int | None = None,
    prefill_seq_len: int | None = None,
    comp_ctx_lengths: bool = False,
    logits_rows: bool = False,
    functions: bool = False,
    progress: Callable[[str], None] | None = None,
    reuse: GraphReuse | None = None,
) -> Path:
    """``export_language_graph`` of a hollow model (``models.hollow``), stamped layer by layer
    (``export.stamping``), its weights written from ``reader`` (a checkpoint's ``ModuleWeights``; ``names``: each
    parameter's name there) into ``store``, one decoder layer at a time. ``functions``: each kind of decoder layer an
    ONNX local function, each layer a call of it. With ``reuse``, the graph (and its tables) an earlier export wrote
    into the folder is taken where its inputs are unchanged (``export.reuse``), else traced and recorded."""
    say = progress or _LOG.info
    path = Path(path)
    tables = f"{path.stem}.tables"
    settings = dict(media_token_ids=list(media_token_ids) if media_token_ids is not None else None,
                    continuous_batching=continuous_batching, rope_positions=rope_positions,
                    prefill_seq_len=prefill_seq_len, comp_ctx_lengths=comp_ctx_lengths, logits_rows=logits_rows,
                    functions=functions, store=store.stamp, tables=tables)
    if reuse is not None:
        if reuse.take(path, settings, store, reader, say, f"{path.name} weights"):
            return path
        reuse.forget(path)
    module, inputs = _traced_step(hollow, media_token_ids, continuous_batching, rope_positions, prefill_seq_len,
                                  comp_ctx_lengths, logits_rows, 32, 8, 6, 1, 4)
    io = module.io
    if functions and (io.layer_states or any(is_sparse_block(layer.mlp) for layer in module.graph.text_model.layers)):
        raise ValueError("--layer-functions: this model's graph keeps some ops in fp32 on the card (its layer states' "
                         "or MoE routers' paths), which its node-precision file names as nodes of the graph, not of a "
                         "function; export it without --layer-functions")
    started = time.perf_counter()
    stamped = stamped_language_graph(module.graph, inputs, io, names, functions)
    say(f"language graph {path.name}: {io.num_layers} decoder layers stamped from {stamped.kinds} traced kinds in "
        f"{time.perf_counter() - started:.1f} s")
    write_weights(stamped.weights, store, reader, say, label=f"{path.name} weights")
    attach_weights(stamped.model, stamped.weights, store)
    moved = store_tables(stamped.model, store, tables)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(stamped.model, str(path))
    check_language_graph(onnx.load(str(path), load_external_data=False), io)
    if reuse is not None:
        reuse.record(path, settings, [store.unit_paths(tables)[0]] if moved else [], stamped.weights, store)
    say(f"language graph written: {path} ({path.stat().st_size / 1e6:.2f} MB of graph, weights in {store.folder})")
    return path


def check_language_graph(model: onnx.ModelProto, io: LanguageGraphIO) -> None:
    """Raise ``ValueError`` unless the graph has exactly the contract's I/O, named dynamic dims, no NonZero."""
    graph = model.graph
    for kind, found, want in (
        ("inputs", [vi.name for vi in graph.input], io.input_names),
        ("outputs", [vi.name for vi in graph.output], io.output_names),
    ):
        if found != want:
            raise ValueError(f"language graph {kind} are {found}, the contract says {want}")
    check_named_axes(model, io.dynamic_axes, "language graph", "declare it in LanguageGraphIO.dynamic_axes")
    check_static_ops(model, "language graph")
