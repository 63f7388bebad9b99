"""The language graph of an MoE family: its dense sibling's graph, with each sparse MLP run by ``sparse_moe``.

transformers' sparse block loops over the experts the data hit, which no static graph can hold; everything else
in an MoE decoder layer (norms, attention or Gated DeltaNet, residuals) is the dense sibling's. So an MoE family's
graph is its sibling's graph class with ``SparseMlpGraph`` mixed in before it: a layer with a sparse MLP runs
transformers' attention over the slot KV cache (``LanguageGraph.attention``) and then ``SparseMoe``; a layer the
config keeps dense (``mlp_only_layers``, ``decoder_sparse_step``) runs as the sibling runs it; a hybrid sibling's
own layers (Qwen3.5's Gated DeltaNet) call ``feed_forward``, which this mixin answers with the sparse block.
"""

from __future__ import annotations

import torch
from torch import nn

from qeff_evs.models.language import LanguageGraph, LayerStep
from qeff_evs.models.sparse_moe import DEFAULT_EXPERT_FORM, SparseMoe, is_sparse_block


class SparseMlpGraph(LanguageGraph):
    """Mix in before a family's language graph class; ``expert_form`` (keyword): ``sparse_moe.EXPERT_FORMS``."""

    def __init__(self, hf_model: nn.Module, *args, expert_form: str = DEFAULT_EXPERT_FORM, **kwargs) -> None:
        super().__init__(hf_model, *args, **kwargs)
        self.sparse = nn.ModuleDict({str(i): SparseMoe(layer.mlp, expert_form)
                                     for i, layer in enumerate(self.text_model.layers) if is_sparse_block(layer.mlp)})
        self.expert_form = expert_form

    def feed_forward(self, layer_idx: int, layer: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        sparse = self.sparse[str(layer_idx)] if str(layer_idx) in self.sparse else None
        return layer.mlp(hidden) if sparse is None else sparse(hidden)

    def decoder_layer(self, layer_idx: int, layer: nn.Module, hidden: torch.Tensor, step: LayerStep) -> torch.Tensor:
        if str(layer_idx) not in self.sparse or not hasattr(layer, "self_attn"):
            return super().decoder_layer(layer_idx, layer, hidden, step)
        # transformers' decoder layer, with the sparse MLP computed by SparseMoe.
        hidden = hidden + self.attention(layer, layer.input_layernorm(hidden), step)
        return hidden + self.feed_forward(layer_idx, layer, layer.post_attention_layernorm(hidden))
