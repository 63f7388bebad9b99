"""The model families qeff-evs serves: each family module registers its class here, by ``model_type``.

A family is one module (``ModelFamily``, ``protocol.py``) whose class is decorated with
``@register_family``. The modules qeff-evs ships are named in ``SHIPPED_MODULES`` (a table of module
paths, as vLLM's model registry names its models) and imported on the first lookup: they pull in
transformers' vision code, which most importers of this module (the manifest readers, the vLLM
plugin's entry points) do not need at import time, and they import this module to register, so this
one never imports them by name (no import circle).
"""

from __future__ import annotations

import importlib
import inspect
from types import ModuleType
from typing import TypeVar

from qeff_evs.models.protocol import ModelFamily, VideoPreprocessing

# The family a bare ``qeff-evs bench``, the demo and ``tiny.build_tokenizer()`` use.
DEFAULT_FAMILY = "qwen2_5_vl"

# The family modules qeff-evs ships, in listing order; importing one registers its family.
SHIPPED_MODULES = tuple(f"qeff_evs.models.{name}" for name in
                        ("qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_vl_moe", "qwen3_5_moe",
                                                    "nemotron_h_omni"))

_REGISTERED: dict[str, type[ModelFamily]] = {}

# What every family class must declare (``ModelFamily``'s class attributes).
_DECLARATIONS = ("model_type", "hf_architectures", "serving_architecture", "hf_processor", "config_class",
                 "model_class", "preprocessing", "token_strings", "config_paths", "extra_rows", "pruning_methods",
                 "modalities", "rope", "weight_names")
# ... and every method it must implement (``ModelFamily``'s methods and class methods).
_METHODS = tuple(name for name, value in vars(ModelFamily).items()
                 if not name.startswith("_") and (inspect.isfunction(value) or isinstance(value, classmethod)))

F = TypeVar("F", bound=type)


def shipped_family_names() -> tuple[str, ...]:
    """The ``model_type`` of every family qeff-evs ships, in listing order, without importing their modules (each is
    named after its family's ``model_type``; tests/test_family_registry.py holds them to the registered names): for
    text that must not pay for the imports, such as the command line's help."""
    return tuple(name.rsplit(".", 1)[1] for name in SHIPPED_MODULES)


def _shipped_modules() -> tuple[ModuleType, ...]:
    """The family modules qeff-evs ships, in listing order: importing a family's module registers it."""
    return tuple(importlib.import_module(name) for name in SHIPPED_MODULES)


def _registered() -> list[type[ModelFamily]]:
    """Every registered family: the shipped ones in listing order (whatever order they were imported in),
    then the others in registration order."""
    order = {module.__name__: rank for rank, module in enumerate(_shipped_modules())}
    return sorted(_REGISTERED.values(), key=lambda family: order.get(family.__module__, len(order)))


def register_family(family: F) -> F:
    """Class decorator: make ``family`` the adapter of checkpoints whose ``model_type`` it declares.

    Raises if a declaration of ``ModelFamily`` is missing, or if another class already holds the
    ``model_type`` or the serving architecture name (re-registering the same class is a no-op).
    """
    missing = [name for name in _DECLARATIONS if getattr(family, name, None) in (None, "")]
    missing += [name for name in _METHODS if not callable(getattr(family, name, None))]
    if missing:
        raise TypeError(f"{family.__name__} does not declare {', '.join(missing)}; every model family must "
                        "(see qeff_evs.models.protocol.ModelFamily)")
    for other in _REGISTERED.values():
        if other is not family and (other.model_type == family.model_type
                                    or other.serving_architecture == family.serving_architecture):
            raise ValueError(f"{family.__name__} declares model_type {family.model_type!r} / serving architecture "
                             f"{family.serving_architecture!r}, already registered by {other.__name__}; "
                             "give the family its own names or unregister the other first")
    _REGISTERED[family.model_type] = family
    return family


def unregister_family(model_type: str) -> None:
    """Forget a registered family (tests that register one of their own undo it with this)."""
    _REGISTERED.pop(model_type, None)


def family_names() -> tuple[str, ...]:
    """Every registered ``model_type``: the shipped families first, in listing order."""
    return tuple(family.model_type for family in _registered())


def family_classes() -> tuple[type[ModelFamily], ...]:
    return tuple(_registered())


def family_class(model_type: str) -> type[ModelFamily]:
    """The registered family of ``model_type``; ValueError naming the families qeff-evs serves."""
    names = family_names()
    if model_type not in names:
        raise ValueError(f"unknown model family {model_type!r}; expected one of {', '.join(names)}")
    return _REGISTERED[model_type]


def family_for_config(config, tokenizer=None) -> ModelFamily:
    """The family adapter of one checkpoint config (a family may need the tokenizer for its prompt text)."""
    model_type = getattr(config, "model_type", None)
    names = family_names()
    if model_type not in names:
        raise ValueError(f"model_type {model_type!r} is not supported; qeff-evs exports {', '.join(names)} checkpoints")
    return _REGISTERED[model_type](config, tokenizer)


def preprocess_defaults(model_type: str) -> VideoPreprocessing:
    return family_class(model_type).preprocessing
