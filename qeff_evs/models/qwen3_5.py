"""Qwen3.5 family: Qwen3-VL's vision and prompt layout, a hybrid language model whose linear layers keep state.

Vision: Qwen3-VL's tower without deepstack (``Qwen3_VLTower``: the merged rows only, no extra rows),
preprocessing by ``Qwen3VLVideoProcessor``'s rules, and Qwen3-VL's prompt layout (a ``<t seconds>``
timestamp and its own ``<|vision_start|> ... <|vision_end|>`` block per temporal patch, the lumped
placeholder before encoding) and positions (each temporal patch one M-RoPE block; interleaved M-RoPE
on the rotary quarter of each head): this class is ``Qwen3_VLFamily`` with those parts kept.

Language: three of every four decoder layers are Gated DeltaNet (linear attention), the fourth gated
full attention (q/k norm, an output gate, partial interleaved M-RoPE), as ``layer_types`` says. The
full-attention layers run as every family's do, over the slot KV cache (``past_key.{i}`` /
``past_value.{i}``, CtxScatter/CtxGather); the linear ones keep, per request row, a convolution state
``conv_state.{i} (rows, conv_dim, K - 1)`` and a recurrent state ``recurrent_state.{i} (rows, Hv, dk,
dv)`` with their ``_RetainedState`` outputs (``LayerState``), run by
``qeff_evs.models.linear_attention.GatedDeltaNetStep`` with the layer's own weights:

* prefill chunks use the chunked gated delta rule at the compiled prefill length (the graph is traced
  at it; a shorter chunk is right-padded and its padding changes no state), decode the per-token
  recurrence; one graph serves both;
* under continuous batching each request's states live in its KV row (CtxGatherCB/CtxScatterCB of whole
  rows); a padding row writes nothing;
* **reset**: a chunk that holds a request's first token (KV slot 0) replaces its row's states by zeros
  before running, so a row reused by a new request (or a request recomputed from its first token) never
  sees the earlier state; no host write and no extra input (vLLM's ``has_initial_state`` rule);
* precision on the card: the conv state fp16 like the KV cache; the recurrent state fp32, left out of
  ``custom_io.yaml`` and kept fp32 along its path through the graph by a ``-node-precision-info`` file
  (fp16 storage drifts with every decode step: ``benchmarks/README.md``, the Gated DeltaNet layer bench).

vLLM's block prefix cache could not serve this family even if exports shared KV blocks: a cached prefix would have
to restore the linear layers' state at the prefix's end, which no KV block holds. Row reuse (the vLLM plugin's
prefix caching) can, when the row's whole history is the prefix: its state is then the state at the prefix's end.
"""

from __future__ import annotations

from collections.abc import Sequence
import math
from typing import Any

import torch
from torch import nn
from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

from qeff_evs.manifest import LayerState
from qeff_evs.models.language import LanguageGraph, LayerStep
from qeff_evs.models.linear_attention import CONV_STATE, RECURRENT_STATE, GatedDeltaNetStep, state_names
from qeff_evs.models.qwen3_vl import Qwen3_VLFamily, Qwen3_VLTower
from qeff_evs.models.qwen_vl import MEDIA_IDS, QwenVLFamily, special_token_ids
from qeff_evs.models.registry import register_family

LINEAR, FULL = "linear_attention", "full_attention"
# The recurrent state is kept fp32 on the card (module docstring); the conv state is fp16 like KV.
CONV_PRECISION, RECURRENT_PRECISION = "float16", "float32"


# Tiny test models: the Gated DeltaNet heads' decay rates (see _remembering_decays).
TINY_DT_RANGE = (1e-3, 1e-1)
TINY_A_RANGE = (1.0, 8.0)
# Zero-centred q/k RMSNorm weight of the tiny models: scale 1 + 1 = 2 (Qwen3-VL's QK_NORM_WEIGHT, same reason).
TINY_QK_NORM_WEIGHT = 1.0


def layer_types(config) -> list[str]:
    """``linear_attention`` / ``full_attention`` of each decoder layer of a Qwen3.5 config (or its dict)."""
    text = config["text_config"] if isinstance(config, dict) else config.text_config
    types = text["layer_types"] if isinstance(text, dict) else text.layer_types
    unknown = sorted(set(types) - {LINEAR, FULL})
    if unknown:
        raise ValueError(f"layer_types holds {unknown}; a Qwen3.5 decoder layer is {LINEAR!r} or {FULL!r}")
    return list(types)


def tiny_layer_types(layers: int) -> list[str]:
    """The tiny models' layers: full attention at layers 1, 4, 7, ... (so 2 layers still hold one of each and
    4 hold two linear layers in a row and a linear layer after the last full one); one layer is full attention
    (a language graph needs one KV cache for its slots)."""
    return [FULL if i % 3 == 1 or layers == 1 else LINEAR for i in range(layers)]


def released_layer_types(layers: int) -> list[str]:
    """The released checkpoints' pattern (full attention every 4th layer), the last layer always full
    attention so a shallow bench model keeps one KV cache."""
    return [FULL if (i + 1) % 4 == 0 or i == layers - 1 else LINEAR for i in range(layers)]


def _remembering_decays(gdn: nn.Module, generator: torch.Generator) -> None:
    """Per-head decay of a random Gated DeltaNet layer as trained ones have: ``dt`` log-uniform in
    TINY_DT_RANGE, ``A`` uniform in TINY_A_RANGE (Mamba's init).

    transformers initialises every head alike (``dt_bias = 1``, ``A`` up to 16): the state is forgotten
    within a token or two, which would hide a state that is not carried from chunk to chunk.
    """
    heads = gdn.num_v_heads
    low, high = (math.log(v) for v in TINY_DT_RANGE)
    dt = torch.exp(torch.empty(heads).uniform_(low, high, generator=generator))
    a = torch.empty(heads).uniform_(*TINY_A_RANGE, generator=generator)
    gdn.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus(dt_bias) = dt
    gdn.A_log.copy_(torch.log(a))


class Qwen3_5Tower(Qwen3_VLTower):
    family_label = "Qwen3.5"


class Qwen3_5LanguageGraph(LanguageGraph):
    """Qwen3.5's language step: transformers' full-attention layers over the slot KV cache, and each Gated
    DeltaNet layer composed here around ``GatedDeltaNetStep`` over its retained conv/recurrent state.

    ``prefill_seq_len``: the compiled prefill length the chunked rule is unrolled for (a graph for export
    and the torch backend; chunks up to that length and decode). Without it each call picks its path by
    its own length (eager only). ``prefill_seq_len`` 1: a decode-only graph (the one-token recurrence
    alone, traced at seq_len 1), which ONNX Runtime runs for decode steps instead of the prefill+decode
    graph that computes both paths there (the card's compiler drops the path a specialization does not take).
    """

    def __init__(self, hf_model: nn.Module, media_token_ids: Sequence[int] | None = None,
                 rope_positions: int | None = None, prefill_seq_len: int | None = None):
        super().__init__(hf_model, media_token_ids, rope_positions)
        self.trace_seq_len = prefill_seq_len
        types = layer_types(hf_model.config)
        unrolled = None if prefill_seq_len == 1 else prefill_seq_len  # decode-only: the traced length picks
        self.linear = nn.ModuleDict({
            str(i): GatedDeltaNetStep(layer.linear_attn, prefill_seq_len=unrolled)
            for i, (layer, kind) in enumerate(zip(self.text_model.layers, types)) if kind == LINEAR})

    def decoder_layer(self, layer_idx: int, layer: nn.Module, hidden: torch.Tensor, step: LayerStep) -> torch.Tensor:
        linear = self.linear[str(layer_idx)] if str(layer_idx) in self.linear else None
        if linear is None:
            return super().decoder_layer(layer_idx, layer, hidden, step)
        if torch.jit.is_tracing() and self.trace_seq_len is None:
            raise ValueError("a Qwen3.5 language graph unrolls its prefill for one length: build it with "
                             "prefill_seq_len (the compiled prefill length) before tracing it")
        conv, recurrent = state_names(layer_idx)
        # transformers' decoder layer, with the linear attention over the retained state instead of its cache.
        out = linear(layer.input_layernorm(hidden), step.slots, step.states[conv], step.states[recurrent],
                     step.batch_index)
        step.states[conv], step.states[recurrent] = out.conv_state, out.recurrent_state
        hidden = hidden + out.hidden_states
        return hidden + self.feed_forward(layer_idx, layer, layer.post_attention_layernorm(hidden))


@register_family
class Qwen3_5Family(Qwen3_VLFamily):
    """Qwen3.5 (``qwen3_5``): Qwen3-VL's layout and tower without deepstack, a hybrid language graph."""

    model_type = "qwen3_5"
    hf_architectures = ("Qwen3_5ForConditionalGeneration",)
    serving_architecture = "QeffEvsQwen3_5ForConditionalGeneration"
    hf_processor = "Qwen3VL"  # transformers serves Qwen3.5 with Qwen3-VL's processors
    config_class = Qwen3_5Config
    model_class = Qwen3_5ForConditionalGeneration
    extra_rows = ()
    wrapper = Qwen3_5Tower
    language_graph_class = Qwen3_5LanguageGraph

    # ---- tiny test checkpoints and realistic bench configs ----------------------------------------

    @classmethod
    def tiny_widths(cls, text: dict[str, Any], vision: dict[str, Any], vision_layers: int) -> None:
        # 4 attention heads of 32 (a rotary quarter of 8 = 4 frequency pairs, interleaved t h w t), and
        # linear layers with 2 key heads of 16 and 4 value heads of 8 (Hv > Hk and dk != dv, so neither
        # the key-head sharing nor a transposed state can go unnoticed).
        text.update(head_dim=32, layer_types=tiny_layer_types(text["num_hidden_layers"]),
                    linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=8,
                    linear_num_key_heads=2, linear_num_value_heads=4,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                     "mrope_section": [1, 1, 2], "mrope_interleaved": True})
        # num_position_embeddings must be a perfect square (8 x 8 learned grid).
        vision.update(patch_size=16, num_position_embeddings=64)

    @classmethod
    def prepare_tiny_model(cls, model, tokenizer) -> None:
        """Qwen-VL's media rows zeroed; the linear layers' heads given memory (``_remembering_decays``) and
        the q/k norms sharpened as for Qwen3-VL, so greedy decoding varies and state matters."""
        QwenVLFamily.prepare_tiny_model(model, tokenizer)  # not Qwen3-VL's: its sharpening expects attention everywhere
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for layer in model.model.language_model.layers:
                if hasattr(layer, "linear_attn"):
                    _remembering_decays(layer.linear_attn, generator)
                else:
                    layer.self_attn.q_norm.weight.fill_(TINY_QK_NORM_WEIGHT)
                    layer.self_attn.k_norm.weight.fill_(TINY_QK_NORM_WEIGHT)

    @classmethod
    def realistic_config_kwargs(cls, text_layers: int = 24, vision_layers: int = 12) -> dict[str, Any]:
        text, vision = cls.realistic_widths(text_layers, vision_layers)
        ids = special_token_ids(cls.tiny_tokenizer())  # the bench tokenizer's, as QwenVLFamily's
        return dict(text_config={**text, "eos_token_id": ids["eos_token_id"]}, vision_config=vision,
                    tie_word_embeddings=True, **{k: ids[k] for k in MEDIA_IDS})

    @classmethod
    def realistic_widths(cls, text_layers: int, vision_layers: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """Qwen3.5-0.8B widths (the smallest released; its config.json as quoted by third parties): full attention
        every 4th layer and in the last (``released_layer_types``; docs/models.md, Qwen3.5)."""
        text = dict(
            vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_hidden_layers=text_layers,
            layer_types=released_layer_types(text_layers),
            num_attention_heads=8, num_key_value_heads=2, head_dim=256, max_position_embeddings=262144,
            rms_norm_eps=1e-6, linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
            linear_num_key_heads=16, linear_num_value_heads=16, tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                             "mrope_section": [11, 11, 10], "mrope_interleaved": True},
        )
        vision = dict(
            depth=vision_layers, hidden_size=768, intermediate_size=3072, num_heads=12, out_hidden_size=1024,
            patch_size=16, temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=2304, in_channels=3,
        )
        return text, vision

    # ---- one checkpoint ----------------------------------------------------------------------------

    def language_graph(self, model: nn.Module, media_token_ids: Sequence[int] | None = None,
                       rope_positions: int | None = None, prefill_seq_len: int | None = None) -> Qwen3_5LanguageGraph:
        return self.language_graph_class(model, media_token_ids, rope_positions, prefill_seq_len)

    def kv_layers(self) -> tuple[int, ...]:
        layers = tuple(i for i, kind in enumerate(layer_types(self.config)) if kind == FULL)
        if not layers:
            raise ValueError("this Qwen3.5 config has no full_attention layer; the language graph keeps its KV "
                             "slots in the full-attention layers' caches, so give layer_types at least one")
        return layers

    def layer_kinds(self) -> tuple[str, ...]:
        return tuple(layer_types(self.config))

    def layer_states(self) -> tuple[LayerState, ...]:
        text = self.config.text_config
        linear = tuple(i for i, kind in enumerate(layer_types(self.config)) if kind == LINEAR)
        k_heads, v_heads = int(text.linear_num_key_heads), int(text.linear_num_value_heads)
        k_dim, v_dim = int(text.linear_key_head_dim), int(text.linear_value_head_dim)
        conv_dim = 2 * k_heads * k_dim + v_heads * v_dim  # the q|k|v channels the causal conv runs over
        return (LayerState(CONV_STATE, linear, (conv_dim, int(text.linear_conv_kernel_dim) - 1), CONV_PRECISION),
                LayerState(RECURRENT_STATE, linear, (v_heads, k_dim, v_dim), RECURRENT_PRECISION))
