"""Qwen3.5-MoE family: Qwen3.5 with a sparse MLP and a gated shared expert in every decoder layer (docs/models.md).

Everything but the decoder's MLP is Qwen3.5's and is taken from ``Qwen3_5Family`` as it is: Qwen3-VL's tower without
deepstack, its preprocessing, prompt layout, positions and pruning, and the hybrid language graph whose Gated
DeltaNet layers keep their conv/recurrent state per row. Every decoder layer's MLP is transformers'
``Qwen3_5MoeSparseMoeBlock``, run by ``sparse_moe.SparseMoe`` (routed experts plus the shared expert scaled by its
sigmoid gate) in both kinds of layer (``moe_language.SparseMlpGraph``).
"""

from __future__ import annotations

from typing import Any

from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

from qeff_evs.models.moe_family import SparseMlpFamily, expert_tensors
from qeff_evs.models.moe_language import SparseMlpGraph
from qeff_evs.models.qwen3_5 import Qwen3_5Family, Qwen3_5LanguageGraph, released_layer_types
from qeff_evs.models.registry import register_family
from qeff_evs.weights.name_map import NameMap

# The tiny test models' experts: 4 of them, 2 per token, and a shared expert.
TINY_EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, shared_expert_intermediate_size=48)


# Released (and save_pretrained) checkpoints store the experts one by one (transformers fuses them on load).
WEIGHT_NAMES = NameMap(experts=expert_tensors())


class Qwen3_5MoeLanguageGraph(SparseMlpGraph, Qwen3_5LanguageGraph):
    """Qwen3.5's hybrid language step with every layer's sparse MLP run by ``SparseMoe``."""


@register_family
class Qwen3_5MoeFamily(SparseMlpFamily, Qwen3_5Family):
    """Qwen3.5-MoE (``qwen3_5_moe``): Qwen3.5's vision, layout, pruning and layer states; sparse decoder MLPs."""

    model_type = "qwen3_5_moe"
    hf_architectures = ("Qwen3_5MoeForConditionalGeneration",)
    serving_architecture = "QeffEvsQwen3_5MoeForConditionalGeneration"
    config_class = Qwen3_5MoeConfig
    model_class = Qwen3_5MoeForConditionalGeneration
    language_graph_class = Qwen3_5MoeLanguageGraph
    tiny_experts = TINY_EXPERTS
    weight_names = WEIGHT_NAMES

    @classmethod
    def realistic_widths(cls, text_layers: int, vision_layers: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """Qwen3.5-35B-A3B widths (transformers' default ``Qwen3_5MoeConfig``): 256
        experts, 8 per token, a shared expert of 512, full attention every 4th layer (``released_layer_types``)."""
        text = dict(
            vocab_size=248320, hidden_size=2048, num_hidden_layers=text_layers,
            layer_types=released_layer_types(text_layers),
            num_attention_heads=16, num_key_value_heads=2, head_dim=256, max_position_embeddings=262144,
            rms_norm_eps=1e-6, linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
            linear_num_key_heads=16, linear_num_value_heads=32, tie_word_embeddings=False,
            num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512,
            rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                             "mrope_section": [11, 11, 10], "mrope_interleaved": True},
        )
        vision = dict(
            depth=vision_layers, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=2048,
            patch_size=16, temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=2304, in_channels=3,
        )
        return text, vision
