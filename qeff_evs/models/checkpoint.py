"""The single loading path for Hugging Face checkpoint folders (users' and the tiny test ones alike).

Local files only: nothing is downloaded. The model comes back in eval mode and fp32, whatever dtype
the checkpoint was saved in, because export and the reference path both start from fp32. The family
(``config.json``'s ``model_type``, looked up in the registry) names the config and model classes that
read the folder, so a registered family loads without transformers' Auto mappings knowing it.

``open_weights`` reads the folder's tensors one at a time under the module's state-dict names
(``qeff_evs.weights.ModuleWeights``: the family's ``weight_names`` map from released names, quantized formats
dequantized in fp32): the streamed export reads it, and ``load_checkpoint`` builds the in-memory model from it where
transformers cannot read the folder (a quantized release: transformers would need a quantization package, or round
to bf16).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer, GenerationConfig, PretrainedConfig, PreTrainedModel

from qeff_evs.models.protocol import ModelFamily
from qeff_evs.models.registry import family_class, family_names
from qeff_evs.weights.json_file import read_json
from qeff_evs.weights.module_weights import ModuleWeights
from qeff_evs.weights.name_map import NameMap
from qeff_evs.weights.quantization import QuantizationRecord, read_record
from qeff_evs.weights.stored import StoredWeights

# The config keys that hold a quantization record (vLLM reads both): an in-memory model built from dequantized weights
# is a float model, and its config must not say otherwise.
QUANTIZATION_KEYS = ("quantization_config", "compression_config")

# Any one of these means the folder carries a tokenizer AutoTokenizer can read.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json")


@dataclass
class LoadedCheckpoint:
    family: str
    config: PretrainedConfig
    model: PreTrainedModel
    tokenizer: Any
    model_dir: Path
    # preprocessor_config.json contents (patch/merge sizes, pixel mean/std); empty when the file is absent.
    preprocessor_config: dict[str, Any] = field(default_factory=dict)
    # The checkpoint's quantization (its weights were dequantized to fp32 on load); None for a float checkpoint.
    quantization: QuantizationRecord | None = None


def _config_path(model_dir: Path) -> Path:
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise ValueError(
            f"{model_dir} is not a checkpoint folder: no config.json there; pass the folder that "
            "save_pretrained wrote (config.json, *.safetensors, tokenizer files)"
        )
    return config_path


def detect_family(model_dir: str | Path) -> str:
    """The family of the checkpoint in `model_dir`, from config.json's model_type."""
    model_dir = Path(model_dir)
    model_type = read_json(_config_path(model_dir)).get("model_type")
    names = family_names()
    if model_type not in names:
        raise ValueError(
            f"{model_dir} holds a model_type={model_type!r} checkpoint; qeff-evs supports {', '.join(names)}")
    return model_type


def load_config(model_dir: str | Path) -> PretrainedConfig:
    """The checkpoint's config, read by its family's config class."""
    model_dir = Path(model_dir)
    return family_class(detect_family(model_dir)).config_class.from_pretrained(model_dir, local_files_only=True)


def _load_tokenizer(model_dir: Path):
    if not any((model_dir / name).is_file() for name in _TOKENIZER_FILES):
        raise ValueError(
            f"{model_dir} has no tokenizer (none of {', '.join(_TOKENIZER_FILES)}); save the tokenizer "
            "into the checkpoint folder with tokenizer.save_pretrained(folder)"
        )
    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


def _load_preprocessor_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "preprocessor_config.json"
    return read_json(path) if path.is_file() else {}


def module_layout(family: type[ModelFamily], config: PretrainedConfig
                  ) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[str, ...]]]:
    """``(shapes, tied)`` of the family's module for ``config``: its state-dict names -> shapes (built on the meta
    device: no memory, no init), and each tied name -> the other names of its tensor (tied embeddings)."""
    with torch.device("meta"):
        model = family.model_class(config)
    state = model.state_dict(keep_vars=True)
    groups: dict[int, list[str]] = {}
    for name, tensor in state.items():
        groups.setdefault(id(tensor), []).append(name)
    tied = {name: tuple(other for other in group if other != name)
            for group in groups.values() if len(group) > 1 for name in group}
    return {name: tuple(tensor.shape) for name, tensor in state.items()}, tied


def open_weights(model_dir: str | Path) -> ModuleWeights:
    """The checkpoint's tensors under its family's module names, one at a time (``ModuleWeights``; close it).

    Every shape is checked against the module's from the headers before anything is read; a quantized method we do
    not read is refused here, in one line naming it.
    """
    model_dir = Path(model_dir)
    family = family_class(detect_family(model_dir))
    shapes, tied = module_layout(family, load_config(model_dir))
    stored = StoredWeights.open(model_dir)
    try:
        return ModuleWeights(stored, shapes, tied, getattr(family, "weight_names", NameMap()))
    except Exception:
        stored.close()
        raise


def float_config(config: PretrainedConfig) -> PretrainedConfig:
    """``config`` without its quantization record (the model it describes now holds fp32 weights)."""
    config = copy.deepcopy(config)
    for holder in (config, getattr(config, "text_config", None)):
        for key in QUANTIZATION_KEYS:
            if holder is not None and hasattr(holder, key):
                delattr(holder, key)
    return config


def model_from_weights(model_dir: Path, config: PretrainedConfig, attn_implementation: str | None = None):
    """The family's model (eval, fp32) with every tensor from ``open_weights``: the in-memory load of a checkpoint
    transformers cannot read (a quantized release). Returns ``(model, quantization record)``."""
    family = family_class(detect_family(model_dir))
    config = float_config(config)
    extra = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    with open_weights(model_dir) as weights:
        model = family.model_class._from_config(config, dtype=torch.float32, **extra)
        targets = model.state_dict(keep_vars=True)
        done: set[int] = set()
        with torch.no_grad():
            for name in weights.names():
                target = targets[name]
                if id(target) not in done:  # a tied tensor is filled once
                    target.copy_(weights.tensor(name))
                    done.add(id(target))
        quantization = weights.quantization
    generation = model_dir / "generation_config.json"
    if generation.is_file():
        model.generation_config = GenerationConfig.from_pretrained(model_dir, local_files_only=True)
    return model.eval(), quantization


def load_checkpoint(model_dir: str | Path, *, attn_implementation: str | None = None) -> LoadedCheckpoint:
    """Load config, model (eval, fp32) and tokenizer from a local checkpoint folder.

    `attn_implementation` is passed through to transformers (default: its own choice, sdpa). A float checkpoint loads
    through transformers' ``from_pretrained``; a quantized one through ``open_weights`` (dequantized to fp32 by us,
    no quantization package), its config without the quantization record and ``quantization`` set.
    """
    model_dir = Path(model_dir)
    family = detect_family(model_dir)
    tokenizer = _load_tokenizer(model_dir)
    config = load_config(model_dir)
    quantization = read_record(model_dir)
    if quantization is not None:
        model, quantization = model_from_weights(model_dir, config, attn_implementation)
    else:
        extra = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
        model = family_class(family).model_class.from_pretrained(
            model_dir, config=config, dtype=torch.float32, local_files_only=True, **extra
        )
    return LoadedCheckpoint(
        family=family,
        config=model.config,
        model=model.eval(),
        tokenizer=tokenizer,
        model_dir=model_dir,
        preprocessor_config=_load_preprocessor_config(model_dir),
        quantization=quantization,
    )
