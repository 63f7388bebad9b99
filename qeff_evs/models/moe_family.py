"""What a MoE family adds to the dense Qwen-VL family it extends (docs/models.md).

A MoE family is ``class Family(SparseMlpFamily, DenseFamily)``: everything but the decoder's MLP is the dense
family's, its language step is its ``language_graph_class`` (a ``moe_language.SparseMlpGraph``), its tiny test
models get ``tiny_experts``, and its released checkpoints do not tie their embeddings.
"""

from __future__ import annotations

from typing import Any, ClassVar

from qeff_evs.weights.name_map import EXPERT, FusedExperts


def expert_tensors(stored_transposed: bool = False) -> tuple[FusedExperts, ...]:
    """The sparse MLP's two expert tensors as transformers holds them, ``mlp.experts.gate_up_proj`` (experts,
    2 * moe, hidden: each expert's gate rows, then its up rows) and ``mlp.experts.down_proj`` (experts, hidden, moe),
    from per-expert linears ``mlp.experts.<e>.{gate,up,down}_proj.weight`` where a checkpoint stores them so."""
    per_expert = f"mlp.experts.{EXPERT}"
    return (FusedExperts("mlp.experts.gate_up_proj", (f"{per_expert}.gate_proj.weight", f"{per_expert}.up_proj.weight"),
                         stored_transposed),
            FusedExperts("mlp.experts.down_proj", (f"{per_expert}.down_proj.weight",), stored_transposed))


class SparseMlpFamily:
    """The MoE half of a MoE family's class; the dense family it is mixed with comes after it."""

    tiny_experts: ClassVar[dict[str, Any]]  # the tiny test models' expert widths, added to the text config

    @classmethod
    def tiny_widths(cls, text: dict[str, Any], vision: dict[str, Any], vision_layers: int) -> None:
        super().tiny_widths(text, vision, vision_layers)  # type: ignore[misc]
        text.update(cls.tiny_experts)

    @classmethod
    def realistic_config_kwargs(cls, *depths: int, **named_depths: int) -> dict[str, Any]:
        # The released MoE checkpoints (Qwen3-VL-30B-A3B, Qwen3.5-35B-A3B) do not tie their embeddings; the
        # depths' defaults are the dense family's.
        dense = super().realistic_config_kwargs(*depths, **named_depths)  # type: ignore[misc]
        return {**dense, "tie_word_embeddings": False}
