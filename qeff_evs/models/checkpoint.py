"""The single loading path for Hugging Face checkpoint folders (users' and the tiny test ones alike).

Local files only: nothing is downloaded. The model comes back in eval mode and fp32, whatever dtype
the checkpoint was saved in, because export and the reference path both start from fp32. The family
(``config.json``'s ``model_type``, looked up in the registry) names the config and model classes that
read the folder, so a registered family loads without transformers' Auto mappings knowing it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer, PretrainedConfig, PreTrainedModel

from qeff_evs.models.registry import family_class, family_names

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
    model_type = json.loads(_config_path(model_dir).read_text()).get("model_type")
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
    return json.loads(path.read_text()) if path.is_file() else {}


def load_checkpoint(model_dir: str | Path, *, attn_implementation: str | None = None) -> LoadedCheckpoint:
    """Load config, model (eval, fp32) and tokenizer from a local checkpoint folder.

    `attn_implementation` is passed through to transformers (default: its own choice, sdpa).
    """
    model_dir = Path(model_dir)
    family = detect_family(model_dir)
    tokenizer = _load_tokenizer(model_dir)
    config = load_config(model_dir)
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
    )
