"""Opening an export folder for running: its manifest, model family, tokenizer and preprocessing."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from transformers import AutoTokenizer

from qeff_evs.manifest import MODEL_CONFIG_DIR, LanguageShape, Manifest, read_manifest
from qeff_evs.models.protocol import ModelFamily
from qeff_evs.models.registry import family_for_config
from qeff_evs.runtime.inputs.preprocess_spec import VisionPreprocessSpec


@dataclass
class ExportBundle:
    """An export folder opened for running: manifest, family, tokenizer, preprocessing."""

    export_dir: Path
    manifest: Manifest
    family: ModelFamily
    tokenizer: object
    preprocess: VisionPreprocessSpec

    @property
    def language_shape(self) -> LanguageShape:
        return self.manifest.language_shape


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json")


def _require_any_file(folder: Path, names: tuple[str, ...], what: str) -> None:
    # transformers would take a missing local folder for a hub repo id and fail with an OSError.
    if not any((folder / name).is_file() for name in names):
        raise ValueError(
            f"{folder} holds no {what} (none of {', '.join(names)}); the export folder is incomplete: "
            "run `qeff-evs export` again")


def open_export(export_dir: str | Path) -> ExportBundle:
    export_dir = Path(export_dir)
    manifest = read_manifest(export_dir)
    config_dir = export_dir / MODEL_CONFIG_DIR
    tokenizer_dir = manifest.path(export_dir, "tokenizer")
    _require_any_file(config_dir, ("config.json",), "model config")
    _require_any_file(tokenizer_dir, TOKENIZER_FILES, "tokenizer")
    from qeff_evs.models.checkpoint import load_config  # transformers' model code, needed from here on

    config = load_config(config_dir)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    preprocess = VisionPreprocessSpec.from_pretrained_dir(config_dir, config)
    return ExportBundle(export_dir, manifest, family_for_config(config, tokenizer), tokenizer, preprocess)
