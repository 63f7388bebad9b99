"""Export the language-model step (``qeff_evs.models.language``) to one ONNX file, QEfficient's contract.

Inputs, in order: ``input_ids (batch_size, seq_len)``, ``vision_embeds (1, vision_size, hidden)``,
[``deepstack_features (levels, 1, vision_size, hidden)``], ``position_ids (4, batch_size, seq_len)``,
``image_idx (1, 1)``, then ``past_key.{i}``, ``past_value.{i}`` per layer ``(batch_size, kv_heads,
ctx_len, head_dim)``. Outputs: ``logits (batch_size, 1, vocab)``, ``vision_embeds_RetainedState``,
[``deepstack_features_RetainedState``], ``image_idx_output (1, 1)``, ``past_key.{i}_RetainedState``,
``past_value.{i}_RetainedState``. The dynamic symbols are ``batch_size``, ``seq_len``,
``vision_size`` and ``ctx_len``; one file serves the prefill and the decode specializations.

Continuous batching (``continuous_batching=True``, QEfficient's CB export): one more input,
``batch_index (batch_size, 1)`` int64, after the caches, and the caches become ``(full_batch_size,
kv_heads, ctx_len, head_dim)`` under their own symbol. Row ``b`` of a call reads and writes cache row
``batch_index[b, 0]``; the other cache rows pass through unchanged. Prefill runs ``batch_size = 1``
(one request into its row), decode runs every running request in one call.

``ExportableLanguageGraph`` is the traced module; its ``run`` takes and returns tensors keyed by
these names, so the PyTorch reference backend calls it exactly like an ONNX Runtime session.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import onnx
import torch
from torch import nn

from qeff_evs.export.onnx_graph import check_named_axes, check_static_ops, legacy_export
from qeff_evs.models.language import LanguageGraph, LanguageSpec

_LOG = logging.getLogger(__name__)

BATCH, SEQ, VISION, CTX = "batch_size", "seq_len", "vision_size", "ctx_len"
FULL_BATCH = "full_batch_size"  # KV cache rows under continuous batching (QEfficient's symbol)
BATCH_INDEX = "batch_index"


@dataclass(frozen=True)
class LanguageGraphIO:
    """Names (in graph order) and dynamic axes of the language graph's inputs and outputs."""

    num_layers: int
    deepstack: bool
    continuous_batching: bool = False

    def _kv(self, suffix: str = "") -> list[str]:
        return [f"past_{kind}.{i}{suffix}" for i in range(self.num_layers) for kind in ("key", "value")]

    @property
    def input_names(self) -> list[str]:
        vision = ["vision_embeds"] + (["deepstack_features"] if self.deepstack else [])
        # batch_index follows the caches, as in QEfficient's forward signature.
        cb = [BATCH_INDEX] if self.continuous_batching else []
        return ["input_ids", *vision, "position_ids", "image_idx", *self._kv(), *cb]

    @property
    def output_names(self) -> list[str]:
        retained = ["vision_embeds_RetainedState"]
        if self.deepstack:
            retained.append("deepstack_features_RetainedState")
        return ["logits", *retained, "image_idx_output", *self._kv("_RetainedState")]

    @property
    def dynamic_axes(self) -> dict[str, dict[int, str]]:
        kv_axes = {0: FULL_BATCH if self.continuous_batching else BATCH, 2: CTX}
        axes = {
            "input_ids": {0: BATCH, 1: SEQ},
            "vision_embeds": {1: VISION},
            "position_ids": {1: BATCH, 2: SEQ},
            "logits": {0: BATCH},
            "vision_embeds_RetainedState": {1: VISION},
        }
        if self.deepstack:
            axes["deepstack_features"] = {2: VISION}
            axes["deepstack_features_RetainedState"] = {2: VISION}
        if self.continuous_batching:
            axes[BATCH_INDEX] = {0: BATCH}
        for name in self._kv() + self._kv("_RetainedState"):
            axes[name] = dict(kv_axes)
        return axes


def language_io_names(
    num_layers: int, deepstack: bool, continuous_batching: bool = False
) -> tuple[list[str], list[str]]:
    """``(input_names, output_names)`` of the language graph, in graph order."""
    io = LanguageGraphIO(num_layers, deepstack, continuous_batching)
    return io.input_names, io.output_names


class ExportableLanguageGraph(nn.Module):
    """``LanguageGraph`` with flat tensor inputs/outputs in graph order (what the exporter traces)."""

    def __init__(self, graph: LanguageGraph, continuous_batching: bool = False):
        super().__init__()
        self.graph = graph
        self.io = LanguageGraphIO(graph.spec.num_layers, graph.spec.has_deepstack, continuous_batching)

    @property
    def spec(self) -> LanguageSpec:
        return self.graph.spec

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        names = self.io.input_names
        if len(inputs) != len(names):
            raise ValueError(f"expected {len(names)} inputs ({names}), got {len(inputs)}")
        named = dict(zip(names, inputs))
        layers = range(self.spec.num_layers)
        step = self.graph(
            named["input_ids"],
            named["vision_embeds"],
            named["position_ids"],
            named["image_idx"],
            [named[f"past_key.{i}"] for i in layers],
            [named[f"past_value.{i}"] for i in layers],
            deepstack_features=named.get("deepstack_features"),
            batch_index=named.get(BATCH_INDEX),
        )
        retained = [named["vision_embeds"]]
        if self.io.deepstack:
            retained.append(named["deepstack_features"])
        kv = [cache for i in layers for cache in (step.past_keys[i], step.past_values[i])]
        return (step.logits, *retained, step.image_idx_output, *kv)

    @torch.no_grad()
    def run(self, feeds: Mapping[str, torch.Tensor | np.ndarray]) -> dict[str, torch.Tensor]:
        """Eager step with ONNX names in and out (the PyTorch reference backend's session call)."""
        missing = [name for name in self.io.input_names if name not in feeds]
        if missing:
            raise ValueError(f"language step is missing inputs {missing}; feed every name in {self.io.input_names}")
        device = next(self.parameters()).device
        inputs = [torch.as_tensor(feeds[name]).to(device) for name in self.io.input_names]
        return dict(zip(self.io.output_names, self(*inputs)))


def language_dummy_inputs(
    spec: LanguageSpec,
    *,
    batch_size: int = 1,
    seq_len: int = 8,
    vision_size: int = 6,
    ctx_len: int = 32,
    dtype: torch.dtype = torch.float32,
    full_batch_size: int | None = None,
) -> dict[str, torch.Tensor]:
    """Example inputs keyed and ordered like the graph: a prefill chunk with a few media tokens.

    With ``full_batch_size`` (continuous batching) the caches have that many rows and
    ``batch_index`` sends batch row ``b`` to cache row ``full_batch_size - 1 - b``.
    """
    if seq_len > ctx_len:
        raise ValueError(f"example seq_len {seq_len} exceeds ctx_len {ctx_len}; choose ctx_len >= seq_len")
    if full_batch_size is not None and full_batch_size < batch_size:
        raise ValueError(
            f"example full_batch_size {full_batch_size} is below batch_size {batch_size}; a call's rows need "
            "distinct cache rows, so choose full_batch_size >= batch_size"
        )
    io = LanguageGraphIO(spec.num_layers, spec.has_deepstack, full_batch_size is not None)
    media = min(seq_len // 2, vision_size)
    input_ids = torch.zeros(batch_size, seq_len, dtype=torch.int64)
    input_ids[:, 1 : 1 + media] = spec.media_token_ids[-1]
    positions = torch.arange(seq_len, dtype=torch.int64).expand(4, batch_size, seq_len).contiguous()
    kv_shape = (full_batch_size or batch_size, spec.kv_heads, ctx_len, spec.head_dim)
    values = {
        "input_ids": input_ids,
        "vision_embeds": torch.zeros(1, vision_size, spec.hidden_size, dtype=dtype),
        "deepstack_features": torch.zeros(spec.deepstack_levels, 1, vision_size, spec.hidden_size, dtype=dtype),
        "position_ids": positions,
        "image_idx": torch.zeros(1, 1, dtype=torch.int64),
    }
    if full_batch_size is not None:
        values[BATCH_INDEX] = (full_batch_size - 1 - torch.arange(batch_size, dtype=torch.int64)).reshape(-1, 1)
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
) -> Path:
    """Trace the language step of ``hf_model`` (legacy exporter, opset 17) and write it to ``path``.

    The example sizes only have to be valid: every one of them is a named symbol in the graph.
    ``continuous_batching`` adds ``batch_index`` and the ``full_batch_size`` cache rows (the example
    value is only traced with; the specializations choose the real one).
    """
    module = ExportableLanguageGraph(LanguageGraph(hf_model, media_token_ids), continuous_batching)
    io = module.io
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    dtype = next(hf_model.parameters()).dtype
    inputs = language_dummy_inputs(
        module.spec,
        batch_size=batch_size_example,
        seq_len=seq_len_example,
        vision_size=vision_size_example,
        ctx_len=ctx_len_example,
        dtype=dtype,
        full_batch_size=full_batch_size_example if continuous_batching else None,
    )
    _LOG.info(
        "exporting language graph (%d layers, deepstack=%s, continuous_batching=%s) with example "
        "seq_len=%d ctx_len=%d -> %s",
        module.spec.num_layers, io.deepstack, continuous_batching, seq_len_example, ctx_len_example, path,
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
