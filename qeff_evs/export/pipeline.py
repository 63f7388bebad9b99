"""``qeff-evs export``: a checkpoint folder in, ONNX graphs + specializations + compile script out.

Layout of the export folder::

    manifest.json                 what `run` and `compile` read
    vision/encoder.onnx           encoder graph: F temporal patches per call, one file for every resolution
    vision/encoder_specializations.json   one entry per (resolution, F); + .named.json
    vision/encoder_custom_io.yaml
    vision/evs.onnx               EVS graph: a whole video's merged rows -> the K retained rows + indices
    vision/evs_specializations.json       one entry per (resolution, frames, q); + .named.json
    vision/evs_custom_io.yaml
    language/language.onnx        language graph (QEfficient contract, user_vision_size windows)
    language/specializations.json prefill + decode; + specializations.named.json
    language/custom_io.yaml
    tokenizer.json, tokenizer_config.json, chat_template.jinja, ...
                                  the checkpoint's tokenizer (and chat template), at the top like a model folder
    config.json, generation_config.json   the export as a model folder (vLLM, transformers' Auto* classes)
    compile.sh                    the qaic-compile command lines
    placement.json                each graph's cores and devices, as compile.sh compiles it
"""

from __future__ import annotations

import copy
import dataclasses
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from qeff_evs import evs
from qeff_evs.positions import rope_table_length
from qeff_evs.export.language import export_language_graph
from qeff_evs.export.vision import export_encoder_graph, export_evs_graph
from qeff_evs.manifest import (
    EXPORT_FILES,
    GRAPHS,
    MODEL_CONFIG_DIR,
    EncoderEntry,
    EVSEntry,
    LanguageShape,
    Manifest,
)
from qeff_evs.models.checkpoint import load_checkpoint
from qeff_evs.models.language import language_spec
from qeff_evs.models.protocol import ModelFamily
from qeff_evs.models.registry import family_for_config
from qeff_evs.specializations import (
    DEFAULT_FRAMES_PER_CALL,
    EMBEDDING_NAMES,
    FLOAT16,
    CompileCommand,
    CompileOptions,
    EncoderTarget,
    Specialization,
    VisionTarget,
    language_specializations,
    prepare_graph_compile,
    vision_specializations,
    write_compile_script,
    write_specializations_json,
)
from qeff_evs.specializations.placement import PerGraph, write_placement_record

Progress = Callable[[str], None]
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

    config = copy.deepcopy(checkpoint.config)
    config.architectures = [family.serving_architecture]
    getattr(config, "text_config", config).max_position_embeddings = int(ctx_len)
    config.save_pretrained(folder)  # EXPORT_FILES["serving_config"]
    GenerationConfig(eos_token_id=list(eos)).save_pretrained(folder)


def save_model_config(checkpoint, folder: Path) -> None:
    """The config and preprocessor files the ORT/QAIC runtime needs, without the weights."""
    checkpoint.config.save_pretrained(folder)
    for name in PREPROCESSOR_FILES:
        source = Path(checkpoint.model_dir) / name
        if source.is_file():
            shutil.copyfile(source, folder / name)


@dataclass(frozen=True)
class ExportOptions:
    video_pruning_rate: float
    frames: tuple[int, ...]
    resolutions: tuple[tuple[int, int], ...]  # (height, width) the encoder sees
    prefill_seq_len: int
    ctx_len: int
    user_vision_size: int | None = None
    kv_precision: str = FLOAT16
    num_cores: PerGraph | None = None  # cores per graph in compile.sh; None: the one-device split (placement.py)
    mxfp6_matmul: bool = False
    rope_positions: int | None = None  # RoPE table rows; None: positions.rope_table_length(ctx_len, q)
    full_batch_size: int | None = None  # continuous batching: KV rows + batch_index input (QEfficient CB)
    frames_per_call: int = DEFAULT_FRAMES_PER_CALL  # temporal patches per encoder call (F)

    @property
    def vision_size(self) -> int:
        return self.user_vision_size if self.user_vision_size is not None else self.prefill_seq_len


def check_frame_sizes(options: ExportOptions, patch_size: int, merge_size: int, temporal_patch_size: int) -> None:
    factor = patch_size * merge_size
    for height, width in options.resolutions:
        if height % factor or width % factor or height <= 0 or width <= 0:
            raise ValueError(
                f"frame size {height}x{width} is not a positive multiple of patch_size*merge_size = {factor}; "
                f"use e.g. {max(factor, round(height / factor) * factor)}x{max(factor, round(width / factor) * factor)}")
    for frames in options.frames:
        if frames <= 0 or frames % temporal_patch_size:
            raise ValueError(
                f"--frames {frames} must be a positive multiple of temporal_patch_size {temporal_patch_size}")
    if isinstance(options.frames_per_call, bool) or int(options.frames_per_call) != options.frames_per_call \
            or options.frames_per_call < 1:
        raise ValueError(f"--frames-per-call must be a positive integer (temporal patches per encoder call), "
                         f"got {options.frames_per_call!r}")


def vision_grid(height: int, width: int, frames: int, patch_size: int, temporal_patch_size: int) -> tuple[int, int, int]:
    return frames // temporal_patch_size, height // patch_size, width // patch_size


def embedding_io_names(family: ModelFamily | type[ModelFamily]) -> tuple[str, ...]:
    """Graph I/O kept in fp16 on the card (``custom_io.yaml``): vision rows and the family's extra rows."""
    return (*EMBEDDING_NAMES, *(name for rows in family.extra_rows for name in (rows.name, rows.evs_input)))


def compile_commands(export_dir: Path, options: CompileOptions, kv_precision: str,
                     specs: Mapping[str, Sequence[Specialization]],
                     embedding_names: Sequence[str]) -> list[CompileCommand]:
    """Check each graph (``GRAPHS``) against its specializations, write its compile inputs and
    ``placement.json``, return the commands. ``embedding_names``: the I/O kept in fp16 on the card
    (``embedding_io_names``)."""
    commands = []
    cores, devices = options.cores, options.devices
    for graph in GRAPHS:
        onnx_path = export_dir / EXPORT_FILES[graph]
        graph_dir = onnx_path.parent
        # The encoder and EVS graphs share the vision folder: their files carry the graph's name.
        stem = None if graph == "language" else graph
        commands.append(prepare_graph_compile(
            onnx_path, graph_dir, specs[graph], graph=graph, kv_precision=kv_precision,
            style=options.specializations_layout, num_cores=cores[graph],
            mxfp6_matmul=options.mxfp6_matmul, extra_flags=options.flags_for(graph), relative_to=export_dir,
            aic_hw_version=options.aic_hw_version, num_devices=devices[graph], stem=stem,
            embedding_names=embedding_names))
        write_specializations_json(export_dir / EXPORT_FILES[f"{graph}_specializations_named"], specs[graph], "named")
    write_placement_record(export_dir, cores, devices)
    return commands


def export_checkpoint(model_dir: str | os.PathLike, out_dir: str | os.PathLike, options: ExportOptions,
                      progress: Progress = lambda message: None) -> Manifest:
    q = evs.validate_pruning_rate(options.video_pruning_rate)
    lang_specs = language_specializations(options.prefill_seq_len, options.ctx_len, options.user_vision_size,
                                          full_batch_size=options.full_batch_size)
    rope_positions = options.rope_positions or rope_table_length(options.ctx_len, q)
    if rope_positions < options.ctx_len:
        raise ValueError(f"--rope-positions {rope_positions} is below --ctx-len {options.ctx_len}; the RoPE tables "
                         "must cover at least every KV slot's position")
    out = Path(out_dir)
    progress(f"loading checkpoint {model_dir}")
    checkpoint = load_checkpoint(model_dir)
    family = family_for_config(checkpoint.config, checkpoint.tokenizer)
    vc = family.normalized_config
    check_frame_sizes(options, vc.patch_size, vc.merge_size, vc.temporal_patch_size)

    encoder_targets, evs_targets = [], []
    for height, width in options.resolutions:
        grid_hw = (height // vc.patch_size, width // vc.patch_size)
        encoder_targets.append((EncoderTarget(height, width, options.frames_per_call), grid_hw))
        for frames in options.frames:
            grid = vision_grid(height, width, frames, vc.patch_size, vc.temporal_patch_size)
            t, h, w = family.merged_grid(grid)
            retained = evs.retained_token_count(h * w, t, q)
            evs_targets.append((VisionTarget(height, width, frames, q), grid, retained))
    specs = {
        "encoder": vision_specializations(
            [(target, family.encoder_symbols(grid_hw, target.frames_per_call)) for target, grid_hw in encoder_targets]),
        "evs": vision_specializations(
            [(target, family.evs_symbols(grid, k)) for target, grid, k in evs_targets]),
        "language": lang_specs,
    }

    (out / "vision").mkdir(parents=True, exist_ok=True)
    (out / "language").mkdir(parents=True, exist_ok=True)
    _, example_hw = encoder_targets[0]
    # Traced with 2+ frames so the per-frame tiling is in the graph (F stays a symbol either way).
    export_encoder_graph(family.encoder(checkpoint.model), example_hw, max(2, options.frames_per_call),
                         out / EXPORT_FILES["encoder"], progress=progress)
    # Traced on 2 temporal patches keeping one frame's worth: every op of the selection runs.
    _, example_h, example_w = family.merged_grid((2, *example_hw))
    spec = language_spec(checkpoint.model)
    export_evs_graph(family.evs_selection(), (2, example_h, example_w), example_h * example_w,
                     vc.vision_hidden, family.extras, out / EXPORT_FILES["evs"], progress=progress)
    progress("exporting language graph")
    export_language_graph(checkpoint.model, out / "language" / "language.onnx",
                          media_token_ids=family.special_tokens().media_pads,
                          continuous_batching=options.full_batch_size is not None, rope_positions=rope_positions)

    progress("checking specializations against the graphs and writing compile inputs")
    commands = compile_commands(out, CompileOptions(num_cores=options.num_cores, mxfp6_matmul=options.mxfp6_matmul),
                                options.kv_precision, specs, embedding_io_names(family))
    write_compile_script(out / "compile.sh", commands)
    checkpoint.tokenizer.save_pretrained(out / EXPORT_FILES["tokenizer"])
    save_model_config(checkpoint, out / MODEL_CONFIG_DIR)
    save_serving_config(checkpoint, family, stop_token_ids(checkpoint, family.special_tokens().eos),
                        options.ctx_len, out)

    specials = family.special_tokens()
    manifest = Manifest(
        family=family.name,
        model_dir=str(Path(model_dir).resolve()),
        video_pruning_rate=q,
        prefill_seq_len=options.prefill_seq_len,
        frames=tuple(options.frames),
        resolutions=tuple(tuple(r) for r in options.resolutions),
        special_tokens=dataclasses.replace(specials, eos=tuple(stop_token_ids(checkpoint, specials.eos))),
        language_shape=LanguageShape(
            num_layers=spec.num_layers, kv_heads=spec.kv_heads, head_dim=spec.head_dim, hidden=spec.hidden_size,
            ctx_len=options.ctx_len, vision_size=options.vision_size, extras=dict(spec.extras),
            full_batch_size=options.full_batch_size or 1, vocab=spec.vocab_size,
            continuous_batching=options.full_batch_size is not None, rope_positions=rope_positions),
        files=dict(EXPORT_FILES),
        encoder_entries=tuple(
            EncoderEntry(target.height, target.width, target.frames_per_call, grid_hw,
                         family.encoder_symbols(grid_hw, target.frames_per_call))
            for target, grid_hw in encoder_targets),
        evs_entries=tuple(
            EVSEntry(target.height, target.width, target.frames, tuple(grid), k, family.evs_symbols(grid, k))
            for target, grid, k in evs_targets),
        kv_precision=options.kv_precision,
    )
    manifest.write(out)
    progress(f"export written to {out}")
    return manifest
