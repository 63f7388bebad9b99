"""The export as a model folder: the config, generation config and video processor config at its top that vLLM,
``AutoConfig`` and ``AutoTokenizer`` read as they read a checkpoint, the stop ids ``qeff-evs run`` and vLLM share,
and the config and preprocessor files the runtime reads (without weights)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from qeff_evs.manifest import EXPORT_FILES
from qeff_evs.models.checkpoint import float_config
from qeff_evs.models.protocol import ModelFamily
from qeff_evs.weights.json_file import read_json


PREPROCESSOR_FILES = ("preprocessor_config.json", "video_preprocessor_config.json")


def stop_token_ids(checkpoint, config_eos: tuple[int, ...]) -> list[int]:
    """The config's eos ids, then generation_config.json's: HF generate and vLLM stop on both."""
    generation = getattr(checkpoint.model, "generation_config", None)
    extra = getattr(generation, "eos_token_id", None)
    extra = [] if extra is None else [extra] if isinstance(extra, int) else list(extra)
    ids = [int(i) for i in config_eos]
    return ids + [int(i) for i in extra if int(i) not in ids]


def save_serving_config(checkpoint, family: ModelFamily, eos: list[int], ctx_len: int, folder: Path) -> None:
    """The export as a model folder: ``config.json`` and ``generation_config.json`` at its top, beside the tokenizer.

    The config names qeff-evs's interface class for the family (its ``serving_architecture``) instead of
    Hugging Face's, and the generation config stops on the same ids as ``qeff-evs run``. Its
    ``max_position_embeddings`` is the export's ``ctx_len``, so vLLM's default ``max_model_len`` is what
    the graphs hold. ``AutoConfig``, ``AutoTokenizer``, ``GenerationConfig`` and vLLM all read the folder
    as they read a checkpoint.
    """
    from transformers import GenerationConfig

    config = float_config(checkpoint.config)  # the graphs hold float weights: vLLM must not set up its quantized kernels
    config.architectures = [family.serving_architecture]
    getattr(config, "text_config", config).max_position_embeddings = int(ctx_len)
    config.save_pretrained(folder)  # EXPORT_FILES["serving_config"]
    GenerationConfig(eos_token_id=list(eos)).save_pretrained(folder)


def save_model_config(checkpoint, folder: Path) -> None:
    """The config and preprocessor files the ORT/QAIC runtime needs, without the weights."""
    float_config(checkpoint.config).save_pretrained(folder)
    for name in PREPROCESSOR_FILES:
        source = Path(checkpoint.model_dir) / name
        if source.is_file():
            shutil.copyfile(source, folder / name)


def save_video_processor_config(checkpoint, family: ModelFamily, folder: Path) -> None:
    """``video_preprocessor_config.json`` at the export's top, naming the family's HF video processor.

    vLLM picks its video loader by the model folder's ``video_processor_type`` (else by ``model_type``
    through torchvision, else its generic OpenCV loader): with this file an export gets the loader a real
    checkpoint gets (the one named for its processor), so vLLM hands our processor the frames it would hand the
    model's. The checkpoint's own video (else image) preprocessor settings are kept.
    """
    settings: dict = {}
    for name in PREPROCESSOR_FILES:
        source = Path(checkpoint.model_dir) / name
        if source.is_file():
            settings.update(read_json(source))
    settings.pop("image_processor_type", None)
    settings.setdefault("video_processor_type", family.preprocessing.video_processor)
    (folder / EXPORT_FILES["video_processor_config"]).write_text(json.dumps(settings, indent=2) + "\n")
