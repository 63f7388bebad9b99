"""The export folder: its layout and typed contents (what ``qeff-evs export`` writes, the runtime reads).

``manifest.json`` records everything ``run``, ``compile`` and a server need about the graphs; the
layout of the folder (which file plays which role) is ``EXPORT_FILES``.

A folder is one export, whole: ``manifest.json`` is its completion record. An export deletes it before it writes
anything into the folder (holding ``EXPORT_LOCK`` while it writes: ``export.folder``) and writes it last, atomically
(``Manifest.write``); ``read_manifest``, which every command that reads an export goes through, refuses a folder
without it in one line. A folder never reads outside itself: every file the manifest names and every graph's
external data must resolve inside the folder, symlinks followed (``check_inside``, ``check_graph_data``).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from qeff_evs import evs
# The folder on disk (folder.py) and the language graph's shape (shapes.py) have modules of their own; their names
# are the manifest's too, as every part of the package reads them here.
from qeff_evs.manifest.folder import (
    EXPORT_LOCK,
    EXPORT_MARKS,
    MANIFEST_NAME,
    check_export_graphs,
    check_graph_data,
    check_inside,
    export_root,
    is_export_folder,
    unfinished_refusal,
)
from qeff_evs.manifest.shapes import STATE_PRECISIONS, LanguageShape, LayerState, SpecialTokens
from qeff_evs.positions import rope_table_length

# 2: frame-bucketed pruning graphs, one per method (the rate and method chosen at serve time). Exports
# without a version carried one EVS graph with a specialization per (frame count, rate).
MANIFEST_VERSION = 2
MODEL_CONFIG_DIR = "model_config"  # the checkpoint's config and preprocessor files, without weights

# The graph roles, in compile order: a program's cores and devices are chosen per role. The pruning role has
# one graph per method the export carries (``pruning_graph``); a deployment loads the encoder, the pruning
# graph of the method it serves and the language graph, all active together.
GRAPHS = ("encoder", "pruning", "language")
PRUNING_ROLE = "pruning"
# A family whose images have a graph of their own (``ModelFamily.image_tiling``) exports it beside the encoder, in
# the encoder's role (its cores and devices); one with audio (``ModelFamily.audio_features``) its audio encoder alike.
IMAGE_ENCODER = "encoder_image"
AUDIO_ENCODER = "encoder_audio"
# role -> path relative to the export folder (the pruning graphs' files: ``pruning_files``)
EXPORT_FILES = dict(
    encoder="vision/encoder.onnx", language="language/language.onnx",
    tokenizer=".",  # the checkpoint's tokenizer files sit at the top (older exports: "tokenizer")
    encoder_specializations="vision/encoder_specializations.json",
    language_specializations="language/specializations.json",
    encoder_specializations_named="vision/encoder_specializations.named.json",
    language_specializations_named="language/specializations.named.json",
    model_config=MODEL_CONFIG_DIR,
    encoder_custom_io="vision/encoder_custom_io.yaml",
    language_custom_io="language/custom_io.yaml",
    compile_script="compile.sh",
    placement="placement.json",  # each graph's cores and devices, as compile.sh compiles it
    serving_config="config.json", generation_config="generation_config.json",
    # names the family's HF video processor at the top, so vLLM picks the video loader a checkpoint gets
    video_processor_config="video_preprocessor_config.json",
    export_lock=EXPORT_LOCK,  # stays, empty, after the export: the folder is an export folder
)


# A graph unrolled for its prefill length (Qwen3.5's linear-attention layers) computes the chunked rule *and* the
# one-token recurrence and selects by seq_len; the card's compiler drops the untaken path per specialization,
# ONNX Runtime does not. Such an export also carries this decode-only twin (the same I/O), which the ORT session
# runs for seq_len-1 calls; the card compiles only the language graph.
LANGUAGE_DECODE = "language_decode"
LANGUAGE_DECODE_FILE = "language/language_decode.onnx"


def pruning_graph(method: str) -> str:
    """The graph (and file key) of one pruning method: ``pruning_evs`` at ``vision/pruning_evs.onnx``."""
    return f"{PRUNING_ROLE}_{method}"


def graph_role(graph: str) -> str:
    """The role a graph is placed under: ``pruning`` for every method's pruning graph, ``encoder`` for the image
    encoder, else the graph itself."""
    if graph in (IMAGE_ENCODER, AUDIO_ENCODER):
        return "encoder"
    return PRUNING_ROLE if graph.startswith(f"{PRUNING_ROLE}_") else graph


def encoder_files(graph: str) -> dict[str, str]:
    """The files of the image or audio encoder, by file key (beside the encoder's in the vision folder)."""
    return {graph: f"vision/{graph}.onnx", f"{graph}_specializations": f"vision/{graph}_specializations.json",
            f"{graph}_specializations_named": f"vision/{graph}_specializations.named.json",
            f"{graph}_custom_io": f"vision/{graph}_custom_io.yaml"}


IMAGE_ENCODER_FILES, AUDIO_ENCODER_FILES = encoder_files(IMAGE_ENCODER), encoder_files(AUDIO_ENCODER)


def pruning_files(method: str) -> dict[str, str]:
    """The files of one method's pruning graph, by file key (they share the vision folder with the encoder)."""
    graph = pruning_graph(method)
    return {graph: f"vision/{graph}.onnx", f"{graph}_specializations": f"vision/{graph}_specializations.json",
            f"{graph}_specializations_named": f"vision/{graph}_specializations.named.json",
            f"{graph}_custom_io": f"vision/{graph}_custom_io.yaml"}


def export_files(methods: tuple[str, ...]) -> dict[str, str]:
    """Every file of an export carrying the pruning graphs of ``methods``, by file key."""
    files = dict(EXPORT_FILES)
    for method in methods:
        files.update(pruning_files(method))
    return files


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
class PruningEntry:
    """One specialization of a method's pruning graph: videos of one resolution up to a frame bucket.

    ``frames``: the bucket in sampled frames (``--frames``); ``temporal_patches``: the same bucket in temporal
    patches (the graph's ``frame_bucket``). It serves every video of that resolution with at most that many
    temporal patches (padded to it), at every rate.
    """

    method: str
    height: int
    width: int
    frames: int
    temporal_patches: int
    symbols: dict[str, int]


@dataclass(frozen=True)
class Manifest:
    family: str
    model_dir: str  # the checkpoint the graphs came from (the PyTorch backend loads it)
    video_pruning_rate: float  # the default rate q (run, encode and vllm serve take another)
    prefill_seq_len: int
    # The frame buckets counted in sampled frames (``--frames``; the largest is the most a video may have). The pruning
    # graph counts the same buckets in temporal patches (``temporal_patch_buckets``, its ``frame_bucket`` symbol).
    sampled_frame_buckets: tuple[int, ...]
    resolutions: tuple[tuple[int, int], ...]  # (height, width) frame sizes the encoder sees
    special_tokens: SpecialTokens
    language_shape: LanguageShape
    files: dict[str, str]  # file key -> path relative to the export folder
    encoder_entries: tuple[EncoderEntry, ...] = field(default=())
    pruning_entries: tuple[PruningEntry, ...] = field(default=())
    # The image encoder's specializations (one tile size; ``IMAGE_ENCODER``), where the family has one.
    image_encoder_entries: tuple[EncoderEntry, ...] = field(default=())
    # The audio encoder's clip buckets in feature frames (``AUDIO_ENCODER``, a specialization each), where it has one.
    audio_buckets: tuple[int, ...] = ()
    video_pruning_methods: tuple[str, ...] = ("evs",)  # the methods whose pruning graphs the export carries
    video_pruning_method: str = "evs"  # the default method
    max_video_pruning_rate: float = 0.9  # the largest rate the RoPE tables were sized for
    kv_precision: str = "float16"
    # Shorter prefill lengths a chunk that holds fewer tokens runs in (``Prefill<n>`` specializations); absent in
    # manifests written before them: every chunk runs at prefill_seq_len.
    short_prefill_lens: tuple[int, ...] = ()
    # The checkpoint's quantization record, ``{"method", "source", "config"}`` as its folder wrote it, when the export
    # read a quantized release (its weights dequantized to fp32 on export); None for a float checkpoint.
    source_quantization: dict[str, Any] | None = None
    # The dtype the graphs store their weights in: float32, or float16 (each weight cast to fp32 where the graph reads
    # it; ONNX Runtime must then not fold those casts into fp32 copies, ``runtime.backends.ort``). Absent: float32.
    weight_dtype: str = "float32"
    version: int = MANIFEST_VERSION

    def __post_init__(self) -> None:
        # The language sessions refuse a call of a length the export has no specialization for, as the card does.
        lengths = (*self.short_prefill_lens, self.prefill_seq_len)
        object.__setattr__(self, "language_shape", replace(self.language_shape, prefill_lens=lengths))

    @property
    def ctx_len(self) -> int:
        return self.language_shape.ctx_len

    @property
    def user_vision_size(self) -> int:
        return self.language_shape.vision_size

    @property
    def max_frames(self) -> int:
        """The most sampled frames a video may have: the largest frame bucket (vLLM's ``max_frames``)."""
        return max(self.sampled_frame_buckets)

    @property
    def graphs(self) -> tuple[str, ...]:
        """The export's graphs, in compile order: the encoder, one pruning graph per method, the language graph."""
        others = tuple(graph for graph in (IMAGE_ENCODER, AUDIO_ENCODER) if graph in self.files)
        return ("encoder", *others, *(pruning_graph(m) for m in self.video_pruning_methods), "language")

    @property
    def temporal_patch_buckets(self) -> tuple[int, ...]:
        """The frame buckets in temporal patches, ascending: what the host pads a video's rows to, and the values of
        the pruning graph's ``frame_bucket`` symbol its specializations bind."""
        return tuple(sorted({e.temporal_patches for e in self.pruning_entries}))

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

    def image_encoder_entry(self) -> EncoderEntry:
        """The image encoder's specialization (its tiles' grid); ValueError naming the fix for an export without it."""
        if IMAGE_ENCODER not in self.files or not self.image_encoder_entries:
            raise ValueError("this export has no image encoder graph (it was written before qeff-evs served this "
                             "family's images); re-export the checkpoint to serve images")
        return self.image_encoder_entries[0]

    def check_video(self, grid_thw: tuple[int, int, int]) -> None:
        """Raise ValueError naming the limit unless a video of patch grid ``(T, H, W)`` can be encoded and pruned:
        its resolution exported, ``T`` within the largest frame bucket."""
        grid = tuple(int(v) for v in grid_thw)
        try:
            self.encoder_entry(grid[1:])
        except ValueError as error:
            raise ValueError(f"no vision specialization for video grid {grid}: {error}") from None
        largest = max(self.temporal_patch_buckets)
        if grid[0] > largest:
            raise ValueError(
                f"video grid {grid} has {grid[0]} temporal patches but the export's largest frame bucket holds "
                f"{largest} ({self.max_frames} frames); sample at most {self.max_frames} frames, or re-export with "
                "a larger --frames / --max-frames")

    def check_pruning(self, method: str, q: float) -> None:
        """Raise ValueError naming the limit unless the export carries ``method`` and ``q`` is a rate in [0, 1).

        A run checks each request's own positions against the RoPE tables (``positions.check_rope_range``); a
        server, which cannot, refuses rates past them up front (``rate_refusal``)."""
        problem = self.method_refusal(method) or self.rate_refusal(q, None)
        if problem:
            raise ValueError(problem)

    def method_refusal(self, method: str) -> str | None:
        """Why ``method`` cannot be served (one line), or None."""
        if method in self.video_pruning_methods:
            return None
        return (f"video pruning method {method!r} is not one this export carries "
                f"({', '.join(self.video_pruning_methods)}); pass --video-pruning-method "
                f"{self.video_pruning_method}, or re-export with --video-pruning-methods including {method}")

    def rate_refusal(self, q: float, max_model_len: int | None) -> str | None:
        """Why rate ``q`` cannot be served with contexts of ``max_model_len`` tokens (one line), or None.

        Positions stay unpruned, so a context of ``n`` kept tokens may reach position ``n / (1 - q)``; the RoPE
        tables must cover that (the export sized them for ``max_video_pruning_rate`` at its ``ctx_len``).
        ``max_model_len`` None: only that ``q`` is a rate.
        """
        try:
            rate = evs.validate_pruning_rate(q)
        except ValueError as error:
            return str(error)
        if max_model_len is None:
            return None
        table = self.language_shape.rope_positions
        needed = rope_table_length(max_model_len, rate, multiple=1)
        if table is not None and needed > table:
            return (f"video pruning rate {q} reaches M-RoPE positions up to {needed} in a context of {max_model_len} "
                    f"tokens (positions stay unpruned) but the export's RoPE tables cover {table} (sized for "
                    f"--max-video-pruning-rate {self.max_video_pruning_rate}); pass a rate of at most "
                    f"{self.max_video_pruning_rate} or a smaller --max-model-len, or re-export with a larger "
                    "--max-video-pruning-rate")
        return None

    def pruning_entry(self, method: str, grid_thw: tuple[int, int, int], patch_size: int) -> PruningEntry:
        """The specialization of ``method``'s graph a video of patch grid ``(T, H, W)`` runs in: its resolution's
        smallest bucket of at least ``T`` temporal patches."""
        self.check_video(grid_thw)
        problem = self.method_refusal(method)
        if problem:
            raise ValueError(problem)
        t, big_h, big_w = (int(v) for v in grid_thw)
        fitting = [e for e in self.pruning_entries
                   if e.method == method and (e.height, e.width) == (big_h * patch_size, big_w * patch_size)
                   and e.temporal_patches >= t]
        if not fitting:
            raise ValueError(f"the manifest lists no {method} pruning specialization for video grid "
                             f"{tuple(grid_thw)}; re-export this folder")
        return min(fitting, key=lambda e: e.temporal_patches)

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
        shape.pop("prefill_lens")  # the manifest's prefill_seq_len and short_prefill_lens
        raw["language_shape"] = shape
        raw["temporal_patch_buckets"] = list(self.temporal_patch_buckets)  # what a client pads rows to
        return {"version": raw.pop("version"), **raw}

    def write(self, export_dir: Path) -> Path:
        """``manifest.json``, whole or not at all: written beside it and renamed into place (the last step of an
        export: the folder is servable from this rename on)."""
        path = Path(export_dir) / MANIFEST_NAME
        temporary = path.with_name(path.name + ".tmp")
        with open(temporary, "w") as f:
            f.write(json.dumps(self.to_json(), indent=2) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
        return path


def read_manifest(export_dir: Path) -> Manifest:
    path = Path(export_dir) / MANIFEST_NAME
    problem = unfinished_refusal(export_dir)
    if problem:
        raise ValueError(problem)
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path} is not valid JSON ({error}); re-run `qeff-evs export` into {export_dir}") from None
    for key, location in raw.get("files", {}).items():
        check_inside(export_dir, location, f"{path} (file {key!r})")
    version = raw.pop("version", None)
    if version is None:
        raise ValueError(f"{path} is an export from before frame-bucketed pruning (one EVS graph per frame count "
                         "and rate, no manifest version); re-run `qeff-evs export` with this version")
    if version != MANIFEST_VERSION:
        raise ValueError(f"{path} has manifest version {version}, this qeff-evs reads version {MANIFEST_VERSION}; "
                         "re-run `qeff-evs export` with this version")
    encoder, images = (tuple(EncoderEntry(e["height"], e["width"], e["frames_per_call"], tuple(e["grid_hw"]),
                                          e["symbols"]) for e in raw.pop(key, []))
                       for key in ("encoder_entries", "image_encoder_entries"))
    pruning = tuple(PruningEntry(**e) for e in raw.pop("pruning_entries", []))
    shape = dict(raw.pop("language_shape"))
    for field_name, key in _TOP_LEVEL_SHAPE.items():
        shape[field_name] = raw.pop(key)
    tokens = dict(raw.pop("special_tokens"))
    tokens["eos"] = tuple(tokens.get("eos", ()))
    raw["sampled_frame_buckets"] = tuple(_sampled_frame_buckets(raw, path))
    written = raw.pop("temporal_patch_buckets", None)
    raw["video_pruning_methods"] = tuple(raw["video_pruning_methods"])
    raw["short_prefill_lens"] = tuple(raw.get("short_prefill_lens", ()))
    raw["resolutions"] = tuple(tuple(r) for r in raw["resolutions"])
    raw["audio_buckets"] = tuple(raw.get("audio_buckets", ()))
    manifest = Manifest(**raw, special_tokens=SpecialTokens(**tokens), language_shape=LanguageShape(**shape),
                        encoder_entries=encoder, pruning_entries=pruning, image_encoder_entries=images)
    if written is not None and tuple(written) != manifest.temporal_patch_buckets:
        raise ValueError(f"{path} lists temporal_patch_buckets {list(written)} but its pruning entries serve "
                         f"{list(manifest.temporal_patch_buckets)}; the file was edited: re-run `qeff-evs export`")
    return manifest


def _sampled_frame_buckets(raw: dict, path: Path) -> list[int]:
    """The buckets in sampled frames; manifests written before the buckets were named by their unit call them
    ``frame_buckets`` (the same values)."""
    old = raw.pop("frame_buckets", None)
    buckets = raw.pop("sampled_frame_buckets", old)
    if buckets is None:
        raise ValueError(f"{path} lists no sampled_frame_buckets; re-run `qeff-evs export`")
    return buckets
