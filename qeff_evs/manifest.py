"""The export folder: its layout and typed contents (what ``qeff-evs export`` writes, the runtime reads).

``manifest.json`` records everything ``run``, ``compile`` and a server need about the graphs; the
layout of the folder (which file plays which role) is ``EXPORT_FILES``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

MANIFEST_NAME = "manifest.json"
MODEL_CONFIG_DIR = "model_config"  # the checkpoint's config and preprocessor files, without weights

# The three graphs, in compile order. The encoder and the EVS graph share the vision folder, so their
# compile inputs carry the graph's name (``vision/encoder_specializations.json``, ``vision/evs_qpc``).
GRAPHS = ("encoder", "evs", "language")
# role -> path relative to the export folder
EXPORT_FILES = dict(
    encoder="vision/encoder.onnx", evs="vision/evs.onnx", language="language/language.onnx",
    tokenizer=".",  # the checkpoint's tokenizer files sit at the top (exports before issue 15: "tokenizer")
    encoder_specializations="vision/encoder_specializations.json",
    evs_specializations="vision/evs_specializations.json",
    language_specializations="language/specializations.json",
    encoder_specializations_named="vision/encoder_specializations.named.json",
    evs_specializations_named="vision/evs_specializations.named.json",
    language_specializations_named="language/specializations.named.json",
    model_config=MODEL_CONFIG_DIR,
    encoder_custom_io="vision/encoder_custom_io.yaml", evs_custom_io="vision/evs_custom_io.yaml",
    language_custom_io="language/custom_io.yaml",
    compile_script="compile.sh",
    placement="placement.json",  # each graph's cores and devices, as compile.sh compiles it
    serving_config="config.json", generation_config="generation_config.json",
)


@dataclass(frozen=True)
class SpecialTokens:
    """The ids the host and the language graph look for; ``eos`` also holds generation_config.json's.

    The field names are manifest.json's keys; code outside the family reads ``media_pads``,
    ``media_pad(modality)`` and ``ids``.
    """

    image_pad: int
    video_pad: int
    vision_start: int
    vision_end: int
    eos: tuple[int, ...] = field(default=())

    @property
    def media_pads(self) -> tuple[int, int]:
        return (self.image_pad, self.video_pad)

    def media_pad(self, modality: str) -> int:
        """The pad id the language graph merges an item of ``modality`` ("image" or "video") at."""
        if modality not in ("image", "video"):
            raise ValueError(f"qeff-evs exports take images and videos, not {modality!r}")
        return self.image_pad if modality == "image" else self.video_pad

    @property
    def ids(self) -> tuple[int, ...]:
        """Every special id: the pads, the markers around media, the stop ids."""
        return (self.image_pad, self.video_pad, self.vision_start, self.vision_end, *self.eos)


@dataclass(frozen=True)
class LanguageShape:
    """Static facts of a compiled/exported language graph the host must honour."""

    num_layers: int
    kv_heads: int
    head_dim: int
    hidden: int
    ctx_len: int
    vision_size: int  # user_vision_size
    # The family's extra rows beside vision_embeds (qeff_evs.models.protocol.ExtraRows): name -> levels.
    extras: dict[str, int] = field(default_factory=dict)
    full_batch_size: int = 1  # KV cache rows; > 1 needs a graph exported with continuous batching
    decode_batch_size: int | None = None  # rows per decode call (the Decode specialization); None: full_batch_size
    vocab: int | None = None
    continuous_batching: bool = False  # the graph has a batch_index input (export --full-batch-size)
    rope_positions: int | None = None  # rows of the RoPE cos/sin tables: positions [0, rope_positions)

    def __post_init__(self) -> None:
        if self.full_batch_size < 1:
            raise ValueError(f"full_batch_size must be >= 1, got {self.full_batch_size}")
        decode = self.decode_rows
        if not 1 <= decode <= self.full_batch_size:
            raise ValueError(
                f"decode_batch_size={decode} must lie in [1, full_batch_size={self.full_batch_size}]: "
                "a decode call's rows need distinct KV cache rows"
            )

    @property
    def decode_rows(self) -> int:
        return self.full_batch_size if self.decode_batch_size is None else self.decode_batch_size


# manifest.json keeps ctx_len and user_vision_size at its top level; the rest of the shape under "language_shape".
_TOP_LEVEL_SHAPE = {"ctx_len": "ctx_len", "vision_size": "user_vision_size"}


@dataclass(frozen=True)
class EncoderEntry:
    """One encoder specialization: F temporal patches of one resolution per call, any video length."""

    height: int
    width: int
    frames_per_call: int
    grid_hw: tuple[int, int]  # patch grid of one frame
    symbols: dict[str, int]


@dataclass(frozen=True)
class EVSEntry:
    """One EVS specialization and the (resolution, frames, q) it serves: T temporal patches, K kept."""

    height: int
    width: int
    frames: int
    grid_thw: tuple[int, int, int]
    retained: int
    symbols: dict[str, int]


@dataclass(frozen=True)
class Manifest:
    family: str
    model_dir: str  # the checkpoint the graphs came from (the PyTorch backend loads it)
    video_pruning_rate: float
    prefill_seq_len: int
    frames: tuple[int, ...]
    resolutions: tuple[tuple[int, int], ...]  # (height, width) frame sizes the encoder sees
    special_tokens: SpecialTokens
    language_shape: LanguageShape
    files: dict[str, str]  # role -> path relative to the export folder
    encoder_entries: tuple[EncoderEntry, ...] = field(default=())
    evs_entries: tuple[EVSEntry, ...] = field(default=())
    kv_precision: str = "float16"

    @property
    def ctx_len(self) -> int:
        return self.language_shape.ctx_len

    @property
    def user_vision_size(self) -> int:
        return self.language_shape.vision_size

    def path(self, export_dir: Path, role: str) -> Path:
        if role not in self.files:
            raise ValueError(f"manifest has no file for {role!r}; it lists {sorted(self.files)}")
        return Path(export_dir) / self.files[role]

    def encoder_entry(self, grid_hw: tuple[int, int]) -> EncoderEntry:
        """The encoder specialization of a frame's patch grid ``(H, W)``; ValueError naming what was exported."""
        for entry in self.encoder_entries:
            if tuple(entry.grid_hw) == tuple(grid_hw):
                return entry
        served = [(e.height, e.width) for e in self.encoder_entries]
        raise ValueError(
            f"no encoder specialization for frames of {tuple(grid_hw)} patches (H/patch, W/patch); exported "
            f"resolutions (height, width) are {served}; re-export with matching --height/--width")

    def evs_entry(self, grid_thw: tuple[int, int, int]) -> EVSEntry:
        """The EVS specialization of a video grid ``(T, H, W)`` (its resolution must have an encoder one too).

        ValueError naming what was exported otherwise.
        """
        grid = tuple(int(v) for v in grid_thw)
        try:
            self.encoder_entry(grid[1:])
        except ValueError as error:
            raise ValueError(f"no vision specialization for video grid {grid}: {error}") from None
        for entry in self.evs_entries:
            if tuple(entry.grid_thw) == grid:
                return entry
        served = sorted({tuple(e.grid_thw) for e in self.evs_entries})
        raise ValueError(
            f"no vision specialization for video grid {grid} (frames/2, H/patch, W/patch): no EVS specialization "
            f"for {grid[0]} temporal patches; exported grids are {served} (frames {list(self.frames)}); "
            "re-export with matching --frames")

    @property
    def frames_per_call(self) -> int:
        """F of the encoder: every resolution is exported with the same frames per call."""
        counts = {e.frames_per_call for e in self.encoder_entries}
        if len(counts) != 1:
            raise ValueError(f"manifest lists encoder frames per call {sorted(counts)}; expected exactly one value")
        return counts.pop()

    def to_json(self) -> dict:
        raw = asdict(self)
        shape = raw.pop("language_shape")
        for field_name, key in _TOP_LEVEL_SHAPE.items():
            raw[key] = shape.pop(field_name)
        shape.pop("decode_batch_size")  # a property of a compiled program, not of the export
        raw["language_shape"] = shape
        return raw

    def write(self, export_dir: Path) -> Path:
        path = Path(export_dir) / MANIFEST_NAME
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        return path


def read_manifest(export_dir: Path) -> Manifest:
    path = Path(export_dir) / MANIFEST_NAME
    if not path.is_file():
        raise ValueError(f"{path} not found: run `qeff-evs export MODEL_DIR -o {export_dir}` first")
    raw = json.loads(path.read_text())
    if "vision_entries" in raw:
        raise ValueError(f"{path} is an export from before the encoder/EVS split (one vision graph); "
                         "re-run `qeff-evs export` with this version")
    encoder = tuple(EncoderEntry(e["height"], e["width"], e["frames_per_call"], tuple(e["grid_hw"]), e["symbols"])
                    for e in raw.pop("encoder_entries", []))
    evs = tuple(EVSEntry(e["height"], e["width"], e["frames"], tuple(e["grid_thw"]), e["retained"], e["symbols"])
                for e in raw.pop("evs_entries", []))
    shape = dict(raw.pop("language_shape"))
    for field_name, key in _TOP_LEVEL_SHAPE.items():
        shape[field_name] = raw.pop(key)
    if "deepstack_levels" in shape:  # exports written before the family extras were one mapping
        levels = shape.pop("deepstack_levels")
        shape["extras"] = {"deepstack_features": levels} if levels else {}
    tokens = dict(raw.pop("special_tokens"))
    tokens["eos"] = tuple(tokens.get("eos", ()))
    raw["frames"] = tuple(raw["frames"])
    raw["resolutions"] = tuple(tuple(r) for r in raw["resolutions"])
    return Manifest(**raw, special_tokens=SpecialTokens(**tokens), language_shape=LanguageShape(**shape),
                    encoder_entries=encoder, evs_entries=evs)
