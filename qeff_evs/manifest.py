"""``manifest.json``: everything ``qeff-evs run`` and ``compile`` need to know about an export folder."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

MANIFEST_NAME = "manifest.json"


@dataclass(frozen=True)
class VisionEntry:
    """One vision specialization and the (resolution, frames, q) it serves."""

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
    ctx_len: int
    user_vision_size: int
    frames: tuple[int, ...]
    resolutions: tuple[tuple[int, int], ...]  # (height, width) frame sizes the encoder sees
    special_tokens: dict[str, object]
    language_shape: dict[str, int]
    files: dict[str, str]  # role -> path relative to the export folder
    vision_entries: tuple[VisionEntry, ...] = field(default=())
    kv_precision: str = "float16"

    def path(self, export_dir: Path, role: str) -> Path:
        if role not in self.files:
            raise ValueError(f"manifest has no file for {role!r}; it lists {sorted(self.files)}")
        return Path(export_dir) / self.files[role]

    def vision_entry(self, grid_thw: tuple[int, int, int]) -> VisionEntry:
        for entry in self.vision_entries:
            if tuple(entry.grid_thw) == tuple(grid_thw):
                return entry
        served = sorted({tuple(e.grid_thw) for e in self.vision_entries})
        raise ValueError(
            f"no vision specialization for video grid {tuple(grid_thw)} (frames/2, H/patch, W/patch); "
            f"exported grids are {served}; re-export with matching --frames/--height/--width")

    def write(self, export_dir: Path) -> Path:
        path = Path(export_dir) / MANIFEST_NAME
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")
        return path


def read_manifest(export_dir: Path) -> Manifest:
    path = Path(export_dir) / MANIFEST_NAME
    if not path.is_file():
        raise ValueError(f"{path} not found: run `qeff-evs export MODEL_DIR -o {export_dir}` first")
    raw = json.loads(path.read_text())
    entries = tuple(
        VisionEntry(e["height"], e["width"], e["frames"], tuple(e["grid_thw"]), e["retained"], e["symbols"])
        for e in raw.pop("vision_entries", []))
    raw["frames"] = tuple(raw["frames"])
    raw["resolutions"] = tuple(tuple(r) for r in raw["resolutions"])
    return Manifest(**raw, vision_entries=entries)
