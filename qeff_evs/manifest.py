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
import math
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from qeff_evs import evs
from qeff_evs.positions import rope_table_length

MANIFEST_NAME = "manifest.json"
# The lock an export holds on its folder while it writes (``export.folder``); it stays, empty, marking an export folder.
EXPORT_LOCK = ".qeff-evs-export.lock"
# What an export writes first: a folder holding any of these but no manifest is an unfinished export.
EXPORT_MARKS = (EXPORT_LOCK, "vision/weights", "language/weights", "vision/encoder.onnx", "language/language.onnx")
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
    audio_pad: int | None = None  # a family with audio (Nemotron-H Omni's <so_embedding>); absent before audio

    @property
    def media_pads(self) -> tuple[int, ...]:
        return (self.image_pad, self.video_pad) + (() if self.audio_pad is None else (self.audio_pad,))

    def media_pad(self, modality: str) -> int:
        """The pad id the language graph merges an item of ``modality`` ("image", "video", "audio") at."""
        if modality == "audio" and self.audio_pad is not None:
            return self.audio_pad
        if modality not in ("image", "video"):
            raise ValueError(f"this export takes images and videos, not {modality!r}")
        return self.image_pad if modality == "image" else self.video_pad

    @property
    def ids(self) -> tuple[int, ...]:
        """Every special id: the pads, the markers around media, the stop ids."""
        audio = () if self.audio_pad is None else (self.audio_pad,)
        return (self.image_pad, self.video_pad, *audio, self.vision_start, self.vision_end, *self.eos)


# Device precisions a retained state can declare (``LayerState.precision``): fp16 as the rest of the graph
# on the card, or fp32 (the state and the ops it flows through kept in fp32 by a node-precision file).
STATE_PRECISIONS = ("float16", "float32")


@dataclass(frozen=True)
class LayerState:
    """Retained state some decoder layers keep per request row in place of a KV cache (a linear-attention
    layer's convolution or recurrent state), as the language graph declares it.

    Layer ``i`` of ``layers`` has graph input ``{name}.{i}`` of shape ``(rows, *row_shape)`` and the
    output ``{name}.{i}_RetainedState``; ``rows`` is the KV rows (``full_batch_size``, or the batch).
    ``precision`` is its device type on an fp16 card (``STATE_PRECISIONS``).
    """

    name: str
    layers: tuple[int, ...]
    row_shape: tuple[int, ...]
    precision: str = "float16"

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(int(i) for i in self.layers))
        object.__setattr__(self, "row_shape", tuple(int(d) for d in self.row_shape))
        if self.precision not in STATE_PRECISIONS:
            raise ValueError(f"state {self.name!r} declares precision {self.precision!r}; expected one of "
                             f"{STATE_PRECISIONS}")

    def input_name(self, layer: int) -> str:
        return f"{self.name}.{layer}"

    @property
    def input_names(self) -> list[str]:
        return [self.input_name(i) for i in self.layers]

    def row_bytes(self, itemsize: int | None = None) -> int:
        """Bytes of one request row over all its layers, at ``itemsize`` (default: its device precision)."""
        size = itemsize if itemsize is not None else (2 if self.precision == "float16" else 4)
        return len(self.layers) * math.prod(self.row_shape) * size

    @classmethod
    def from_json(cls, raw: dict) -> "LayerState":
        return cls(raw["name"], tuple(raw["layers"]), tuple(raw["row_shape"]), raw.get("precision", "float16"))


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
    # Decoder layers with a KV cache (``past_key.{i}``/``past_value.{i}``); None: every layer.
    kv_layers: tuple[int, ...] | None = None
    layer_states: tuple[LayerState, ...] = ()  # per-row state of the other layers (e.g. linear attention)
    # The lengths of a prefill call the export has specializations for (``Prefill<n>``, ``Prefill``), ascending, the
    # last prefill_seq_len; a call of one token is decode's. Filled by the Manifest from its prefill_seq_len and
    # short_prefill_lens (never written under language_shape). Empty: a shape made by hand, not read from an
    # export; its sessions run any length the graph file takes.
    prefill_lens: tuple[int, ...] = ()
    # Compute context lengths (docs/design.md#specializations), ascending, the last ctx_len: a call reads only the first
    # comp_ctx_len slots of its KV row. Empty: the graph has no comp_ctx_lengths input and every call reads
    # ctx_len (exports without a ladder, and every export written before it; their manifests lack the key).
    comp_ctx_lengths: tuple[int, ...] = ()
    # The graph takes logits_rows: a call whose logits nobody reads (a prefill chunk before the prompt's last) may
    # compute none. False: exports written before it (their manifests lack the key); every call computes one row.
    logits_rows: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "comp_ctx_lengths", tuple(int(n) for n in self.comp_ctx_lengths))
        if self.comp_ctx_lengths and self.comp_ctx_lengths[-1] != self.ctx_len:
            raise ValueError(f"compute context lengths {list(self.comp_ctx_lengths)} must end at ctx_len "
                             f"{self.ctx_len}; re-export this folder")
        if self.kv_layers is not None:
            object.__setattr__(self, "kv_layers", tuple(int(i) for i in self.kv_layers))
        object.__setattr__(self, "prefill_lens", tuple(sorted(int(n) for n in self.prefill_lens)))
        object.__setattr__(self, "layer_states", tuple(
            s if isinstance(s, LayerState) else LayerState.from_json(s) for s in self.layer_states))
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

    @property
    def kv_layer_indices(self) -> tuple[int, ...]:
        return tuple(range(self.num_layers)) if self.kv_layers is None else self.kv_layers

    def comp_ctx_len(self, last_slot: int) -> int | None:
        """The compute context length a call whose largest KV slot is ``last_slot`` runs in: the smallest of
        ``comp_ctx_lengths`` holding it (None: the graph has no such input and reads all of ``ctx_len``)."""
        if not self.comp_ctx_lengths:
            return None
        if not 0 <= last_slot < self.ctx_len:
            raise ValueError(f"KV slot {last_slot} lies outside [0, ctx_len={self.ctx_len}); a request must fit "
                             "the export's context")
        return next(n for n in self.comp_ctx_lengths if n > last_slot)

    def kv_row_bytes(self, itemsize: int = 2) -> int:
        """Bytes of one request row's KV cache (keys and values of every KV layer over ``ctx_len``)."""
        return 2 * len(self.kv_layer_indices) * self.kv_heads * self.ctx_len * self.head_dim * itemsize

    def state_row_bytes(self) -> int:
        """Bytes of one request row's other retained state, each at its device precision."""
        return sum(state.row_bytes() for state in self.layer_states)


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


def is_export_folder(folder: Path) -> bool:
    """Whether ``folder`` holds an export, finished or not: its manifest or its lock (what an export may rewrite)."""
    return any((Path(folder) / name).exists() for name in (MANIFEST_NAME, EXPORT_LOCK))


def unfinished_refusal(export_dir: Path) -> str | None:
    """Why ``export_dir`` cannot be read as an export when it has no manifest (one line), or None when it has one."""
    if (Path(export_dir) / MANIFEST_NAME).is_file():
        return None
    if any((Path(export_dir) / name).exists() for name in EXPORT_MARKS):
        return (f"the export into {export_dir} did not finish (it has no {MANIFEST_NAME}, which an export writes "
                f"last): run it again, it resumes")
    return f"{Path(export_dir) / MANIFEST_NAME} not found: run `qeff-evs export MODEL_DIR -o {export_dir}` first"


def check_inside(export_dir: Path, location: str | Path, what: str) -> Path:
    """``location`` (relative to ``export_dir``, or absolute) resolved, symlinks followed; ValueError in one line
    naming ``what`` and the location unless it lies inside ``export_dir``."""
    root = Path(export_dir).resolve()
    resolved = (root / location).resolve()
    if resolved != root and root not in resolved.parents:
        raise ValueError(f"{what} names {str(location)!r}, which resolves to {resolved}, outside the export folder "
                         f"{root}; an export reads only its own files: export again into this folder")
    return resolved


def check_graph_data(export_dir: Path, graph: Path) -> None:
    """Refuse ``graph`` (a graph file of the export at ``export_dir``) if any of its tensors' external data lies
    outside the folder (``check_inside``): read from the graph's proto alone, before any runtime opens it."""
    import onnx

    graph = Path(graph)
    check_inside(export_dir, graph, "the export")
    model = onnx.load(str(graph), load_external_data=False)
    tensors = list(model.graph.initializer)
    tensors += [attr.t for node in model.graph.node for attr in node.attribute if attr.HasField("t")]
    for tensor in tensors:
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        location = next((entry.value for entry in tensor.external_data if entry.key == "location"), "")
        if Path(location).is_absolute():
            raise ValueError(f"graph {graph} reads tensor {tensor.name}'s data from the absolute path {location!r}; "
                             "an export reads only its own files: export again into this folder")
        resolved = (graph.parent / location).resolve()
        root = Path(export_dir).resolve()
        if root not in resolved.parents:
            raise ValueError(f"graph {graph} reads tensor {tensor.name}'s data from {location!r}, which resolves to "
                             f"{resolved}, outside the export folder {root}; an export reads only its own files: "
                             "export again into this folder")


def check_export_graphs(export_dir: Path, manifest: "Manifest") -> None:
    """``check_graph_data`` for every graph the manifest lists (what compile and verify read)."""
    for file in manifest.files.values():
        if file.endswith(".onnx"):
            check_graph_data(export_dir, Path(export_dir) / file)


def export_root(graph: Path) -> Path:
    """The export folder a graph file belongs to: its nearest parent holding an export, else its own folder."""
    graph = Path(graph).absolute()
    return next((parent for parent in graph.parents if is_export_folder(parent)), graph.parent)


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
