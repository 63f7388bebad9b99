"""The one list of model families qeff-evs serves, and the way from a name to its module.

A family's name is the transformers ``model_type`` of its checkpoints. Its module (imported on
first use: it pulls in transformers' vision code) owns everything family-specific: the adapter
class ``Family``, its transformers classes, the vision wrapper and ``PREPROCESS_DEFAULTS``.
"""

from __future__ import annotations

from types import ModuleType

from qeff_evs.models.protocol import ModelFamily, VideoPreprocessing

FAMILIES = ("qwen2_5_vl", "qwen3_vl")


def family_module(name: str) -> ModuleType:
    if name == "qwen2_5_vl":
        from qeff_evs.models import qwen2_5_vl

        return qwen2_5_vl
    if name == "qwen3_vl":
        from qeff_evs.models import qwen3_vl

        return qwen3_vl
    raise ValueError(f"unknown model family {name!r}; expected one of {', '.join(FAMILIES)}")


def family_for_config(config, tokenizer=None) -> ModelFamily:
    """The family adapter; Qwen3-VL needs the tokenizer for its timestamp text."""
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        raise ValueError(
            f"model_type {model_type!r} is not supported; qeff-evs exports {', '.join(FAMILIES)} checkpoints")
    return family_module(model_type).Family(config, tokenizer)


def preprocess_defaults(name: str) -> VideoPreprocessing:
    return family_module(name).PREPROCESS_DEFAULTS
