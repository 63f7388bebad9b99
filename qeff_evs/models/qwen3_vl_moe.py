"""Qwen3-VL-MoE family: Qwen3-VL with sparse decoder MLPs (docs/models.md).

Everything but the decoder's MLP is Qwen3-VL's and is taken from ``Qwen3_VLFamily`` as it is: the vision tower
with deepstack, preprocessing, the timestamped prompt layout, positions, EVS and VidCom2 over
``[merger | deepstack]``. The decoder layers the config makes sparse (every ``decoder_sparse_step``-th, except
``mlp_only_layers``) run ``sparse_moe.SparseMoe``; the others keep transformers' dense MLP
(``moe_language.SparseMlpGraph``).
"""

from __future__ import annotations

from typing import Any

from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

from qeff_evs.models.language import LanguageGraph
from qeff_evs.models.moe_family import SparseMlpFamily, expert_tensors
from qeff_evs.models.moe_language import SparseMlpGraph
from qeff_evs.models.qwen3_vl import Qwen3_VLFamily
from qeff_evs.models.registry import register_family
from qeff_evs.weights.name_map import NameMap

# The tiny test models' experts: 4 of them, 2 per token (the least that still routes), the last decoder layer
# kept dense (mlp_only_layers) so both kinds of layer run.
TINY_EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, decoder_sparse_step=1)


# The bf16 release stores each layer's experts fused as (experts, hidden, 2 * moe) and (experts, moe, hidden), the
# transpose of transformers' module (its conversion mapping swaps them); the FP8 release stores them per expert.
WEIGHT_NAMES = NameMap(experts=expert_tensors(stored_transposed=True))


class Qwen3_VLMoeLanguageGraph(SparseMlpGraph, LanguageGraph):
    """Qwen3-VL's language step with its sparse MLPs run by ``SparseMoe``."""


@register_family
class Qwen3_VLMoeFamily(SparseMlpFamily, Qwen3_VLFamily):
    """Qwen3-VL-MoE (``qwen3_vl_moe``): Qwen3-VL's vision, layout and pruning; sparse decoder MLPs."""

    model_type = "qwen3_vl_moe"
    hf_architectures = ("Qwen3VLMoeForConditionalGeneration",)
    serving_architecture = "QeffEvsQwen3_VLMoeForConditionalGeneration"
    config_class = Qwen3VLMoeConfig
    model_class = Qwen3VLMoeForConditionalGeneration
    language_graph_class = Qwen3_VLMoeLanguageGraph
    tiny_experts = TINY_EXPERTS
    weight_names = WEIGHT_NAMES

    @classmethod
    def tiny_widths(cls, text: dict[str, Any], vision: dict[str, Any], vision_layers: int) -> None:
        super().tiny_widths(text, vision, vision_layers)
        layers = text["num_hidden_layers"]
        text["mlp_only_layers"] = [layers - 1] if layers > 1 else []

    @classmethod
    def realistic_widths(cls, text_layers: int, vision_layers: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """Qwen3-VL-30B-A3B widths (its config.json): 128 experts, 8 per token, every
        layer sparse."""
        text = dict(
            vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=text_layers,
            num_attention_heads=32, num_key_value_heads=4, head_dim=128, max_position_embeddings=262144,
            rms_norm_eps=1e-6, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
            decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [24, 20, 20],
                             "mrope_interleaved": True},
        )
        levels = [i for i in (8, 16, 24) if i < vision_layers]  # the released tower taps blocks 8, 16, 24 of 27
        vision = dict(
            depth=vision_layers, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=2048,
            patch_size=16, temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=2304,
            deepstack_visual_indexes=levels or [vision_layers - 1], in_channels=3,
        )
        return text, vision
