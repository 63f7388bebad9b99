"""What one benchmark run measures: model size, workloads, repetitions (``BenchConfig``) and its presets.

Three presets share every code path: ``full`` (the published workloads on Qwen2.5-VL-3B widths),
``quick`` (the same widths on smaller videos, under two minutes on 2 cores) and ``smoke`` (tiny
widths; the test suite's run). Any field can be overridden from the command line.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from qeff_evs import evs
from qeff_evs.models.registry import DEFAULT_FAMILY, family_names, preprocess_defaults
from qeff_evs.specializations import DEFAULT_FRAMES_PER_CALL, TARGETS

# How a run reports what it is doing (one line at a time; the command prints them).
Progress = Callable[[str], None]

WIDTHS = ("realistic", "tiny")  # realistic: released-checkpoint widths; tiny: the test checkpoints' widths

# Prompt ids around the video besides the question: the plain layout's marker before and after it.
VISION_MARKERS = 2


@dataclass(frozen=True)
class BenchConfig:
    family: str = DEFAULT_FAMILY
    widths: str = "realistic"
    text_layers: int = 2
    vision_layers: int = 2
    # Pruning sweep: one video, several q.
    frames: int = 16
    frame_size: int = 448
    question_tokens: int = 32
    pruning_rates: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 0.9)
    # Language graph specialization.
    prefill_seq_len: int = 128
    ctx_len: int = 8192
    user_vision_size: int | None = None  # None: prefill_seq_len (the default export)
    target: str = "card"  # export --target's defaults: its compute context ladder (and, unless given, prefill length)
    # Window sweep: several frame counts at one q.
    window_frames: tuple[int, ...] = (4, 8, 16, 32, 64)
    window_rate: float = 0.5
    # The vision side of the pruning sweep: the same clip as the language side in the full preset
    # (the encoder's cost is linear in the frames), smaller in the quick and smoke presets.
    vision_frames: int = 16
    vision_frame_size: int = 448
    frames_per_call: int = DEFAULT_FRAMES_PER_CALL  # temporal patches per encoder call
    # EVS overhead: the EVS graph's time against the encoder's on a clip of this many frames (frame_size).
    overhead_frames: int = 64
    # Vision sweep (frame_size): the vision side per temporal patch.
    vision_sweep_frames: tuple[int, ...] = (4, 8, 16, 32, 64, 128)
    repeats: int = 3
    overhead_repeats: int = 5
    seed: int = 0
    preset: str = "full"
    # Settings the phases declare (phase.Option), by name; phases.with_option_defaults fills the rest.
    options: Mapping[str, Any] = field(default_factory=dict)

    @property
    def effective_user_vision_size(self) -> int:
        return self.user_vision_size if self.user_vision_size is not None else self.prefill_seq_len

    @property
    def text_tokens(self) -> int:
        return self.question_tokens + VISION_MARKERS

    def replace(self, **changes) -> BenchConfig:
        return dataclasses.replace(self, **changes)

    def option(self, name: str) -> Any:
        """A phase's setting (``phase.Option``); KeyError naming the ones this config has."""
        if name not in self.options:
            raise KeyError(f"bench option {name!r} is not set; this config has {sorted(self.options) or 'none'}")
        return self.options[name]

    def to_json(self) -> dict:
        """results.json's ``config``: every field; ``options`` only when a phase declares some."""
        data = dataclasses.asdict(self)
        data["options"] = dict(self.options)
        if not data["options"]:
            del data["options"]
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> BenchConfig:
        """The config of a saved run; keys of settings the bench no longer has (whole_video_max_frames) are dropped."""
        known = {f.name for f in dataclasses.fields(cls)}
        data = {key: value for key, value in data.items() if key in known}
        return cls(**{**data, "pruning_rates": tuple(data["pruning_rates"]),
                      "window_frames": tuple(data["window_frames"]),
                      "vision_sweep_frames": tuple(data["vision_sweep_frames"])})


def prefill_chunk_lengths(config: BenchConfig) -> tuple[int, ...]:
    """The chunk lengths the prefill-lengths phase times (its ``prefill_lengths`` option), ascending: those a prefill
    specialization can have, 2 (1 is decode's) to ``prefill_seq_len``; none where the config has no phase options
    (a script's own config). Here, not in the phase, because the export (``graphs.export_options``) has them too."""
    return tuple(sorted({n for n in config.options.get("prefill_lengths", ()) if 2 <= n <= config.prefill_seq_len}))


PRESETS = {
    "full": BenchConfig(),
    "quick": BenchConfig(
        text_layers=1, frames=8, frame_size=224, window_frames=(4, 8, 16), ctx_len=1024,
        vision_frames=8, vision_frame_size=112, overhead_frames=16, vision_sweep_frames=(4, 8, 16),
        repeats=2, overhead_repeats=3, preset="quick",
    ),
    "smoke": BenchConfig(
        widths="tiny", text_layers=1, frames=8, frame_size=112, question_tokens=8, prefill_seq_len=16,
        ctx_len=128, window_frames=(2, 4, 8), vision_frames=4, vision_frame_size=112, overhead_frames=6,
        vision_sweep_frames=(2, 4, 6), repeats=1, overhead_repeats=1, preset="smoke",
    ),
}


# Frame sides above are for Qwen2.5-VL (28 px per merged token). Qwen3-VL merges 32 px, so its
# presets scale every side by 32/28: the same merged-token grids, hence the same token counts.
_PRESET_TOKEN_PIXELS = 28


def preset(name: str, family: str = DEFAULT_FAMILY) -> BenchConfig:
    """A preset for ``family``: the same merged-token grids whatever the family's patch size."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    if family not in family_names():
        raise ValueError(f"--family {family!r} is not one of {', '.join(family_names())}")
    base = PRESETS[name]
    defaults = preprocess_defaults(family)
    pixels = defaults.patch_size * defaults.merge_size
    return base.replace(family=family, frame_size=base.frame_size // _PRESET_TOKEN_PIXELS * pixels,
                        vision_frame_size=base.vision_frame_size // _PRESET_TOKEN_PIXELS * pixels)


def _positive(name: str, value: int) -> None:
    if int(value) != value or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def tokens_per_temporal_patch(size: int, patch_size: int, merge_size: int) -> int:
    """Merged tokens of one square ``size`` x ``size`` temporal patch."""
    side = size // (patch_size * merge_size)
    return side * side


def validate(config: BenchConfig, patch_size: int, merge_size: int, temporal_patch_size: int) -> BenchConfig:
    """Raise ``ValueError`` naming the flag to change when the config cannot run; returns it."""
    if config.family not in family_names():
        raise ValueError(f"--family {config.family!r} is not one of {', '.join(family_names())}")
    if config.target not in TARGETS:
        raise ValueError(f"--target {config.target!r} is not one of {', '.join(TARGETS)}")
    if config.widths not in WIDTHS:
        raise ValueError(f"widths {config.widths!r} is not one of {', '.join(WIDTHS)}")
    for name in ("text_layers", "vision_layers", "frames", "frame_size", "prefill_seq_len", "ctx_len",
                 "vision_frames", "vision_frame_size", "frames_per_call", "overhead_frames", "repeats", "overhead_repeats"):
        _positive(name, getattr(config, name))
    if config.question_tokens < 0:
        raise ValueError(f"--question-tokens must be >= 0, got {config.question_tokens}")
    if config.vision_layers < 2:
        # With one block it is the full-attention block; the window inputs go unused and the
        # exporter drops them, so the graph would not have the contract's inputs.
        raise ValueError(f"--vision-layers must be >= 2 (one windowed and one full-attention block), "
                         f"got {config.vision_layers}")
    if not config.pruning_rates or not config.window_frames or not config.vision_sweep_frames:
        raise ValueError("--pruning-rates, --window-frames and --vision-sweep-frames need at least one value each")
    for q in (*config.pruning_rates, config.window_rate):
        evs.validate_pruning_rate(q)
    if config.effective_user_vision_size < config.prefill_seq_len:
        raise ValueError(f"--user-vision-size {config.user_vision_size} is below --prefill-seq-len "
                         f"{config.prefill_seq_len}; a chunk can hold that many video tokens")
    factor = patch_size * merge_size
    for name in ("frame_size", "vision_frame_size"):
        if getattr(config, name) % factor:
            raise ValueError(f"{name.replace('_', '-')} {getattr(config, name)} is not a multiple of "
                             f"patch_size*merge_size = {factor}")
    for name, counts in (("frames", (config.frames,)), ("window-frames", config.window_frames),
                         ("vision-frames", (config.vision_frames,)), ("overhead-frames", (config.overhead_frames,)),
                         ("vision-sweep-frames", config.vision_sweep_frames)):
        for count in counts:
            _positive(name, count)
            if count % temporal_patch_size:
                raise ValueError(f"--{name} {count} is not a multiple of temporal_patch_size {temporal_patch_size}")
    # The unpruned prompt of the pruning sweep and the largest window prompt must fit the KV cache
    # (plus one slot: a padded chunk writes its padding to the last slot).
    per_patch = tokens_per_temporal_patch(config.frame_size, patch_size, merge_size)
    longest = max(
        per_patch * (config.frames // temporal_patch_size),
        max(evs.kept_token_count(per_patch, f // temporal_patch_size, config.window_rate)
            for f in config.window_frames),
    ) + config.text_tokens + 1
    if longest > config.ctx_len:
        raise ValueError(f"the longest benchmark prompt needs {longest} KV slots but --ctx-len is "
                         f"{config.ctx_len}; raise --ctx-len or use fewer frames")
    return config
