"""Which family serves a checkpoint, by its transformers ``model_type``."""

from __future__ import annotations

from qeff_evs.models.protocol import ModelFamily

SUPPORTED_MODEL_TYPES = ("qwen2_5_vl", "qwen3_vl")


def family_for_config(config, tokenizer=None) -> ModelFamily:
    """The family adapter; Qwen3-VL needs the tokenizer for its timestamp text."""
    model_type = getattr(config, "model_type", None)
    if model_type == "qwen2_5_vl":
        from qeff_evs.models.qwen2_5_vl import Qwen2_5_VLFamily

        return Qwen2_5_VLFamily(config)
    if model_type == "qwen3_vl":
        from qeff_evs.models.qwen3_vl import Qwen3_VLFamily

        return Qwen3_VLFamily(config, tokenizer)
    raise ValueError(
        f"model_type {model_type!r} is not supported; qeff-evs exports {', '.join(SUPPORTED_MODEL_TYPES)} checkpoints")
