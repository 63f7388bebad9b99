"""``qeff-evs export``: a checkpoint folder in, ONNX graphs + specializations + compile script out.

Layout of the export folder::

    manifest.json                 what `run` and `compile` read; written last (the folder is servable once it is there:
                                  ``export.folder``)
    .qeff-evs-export.lock         the lock an export holds while it writes (empty)
    vision/encoder.onnx           encoder graph: F temporal patches per call, one file for every resolution
    vision/encoder_specializations.json   one entry per (resolution, F); + .named.json
    vision/encoder_custom_io.yaml
    vision/pruning_<method>.onnx  one pruning graph per method (evs, vidcom2): a video's merged rows padded to a
                                  frame bucket -> a ranking; the host keeps its first K(method, q, T)
    vision/pruning_<method>_specializations.json  one entry per (resolution, frame bucket); + .named.json
    vision/pruning_<method>_custom_io.yaml
    language/language.onnx        language graph (QEfficient contract, user_vision_size windows)
    language/specializations.json prefill + decode; + specializations.named.json
    language/custom_io.yaml
    language/node_precision.yaml  the ops kept fp32 on the card (-node-precision-info): an fp32 layer state's path,
                                  each MoE router's, if any
    vision/weights/, language/weights/   a streamed export's weight units (``export.weights``)
    vision/<graph>.graph.json, language/<graph>.graph.json   what a streamed export's graph was made from: a later
                                  export takes the graph instead of tracing it where that is unchanged
                                  (``export.reuse``)
    tokenizer.json, tokenizer_config.json, chat_template.jinja, ...
                                  the checkpoint's tokenizer (and chat template), at the top like a model folder
    config.json, generation_config.json   the export as a model folder (vLLM, transformers' Auto* classes)
    video_preprocessor_config.json        names the family's HF video processor (vLLM's video loader)
    compile.sh                    the qaic-compile command lines
    placement.json                each graph's cores and devices, as compile.sh compiles it
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from qeff_evs import evs
from qeff_evs.export.budget import check_budget, estimate_budget
from qeff_evs.export.compile_inputs import NODE_PRECISION_FILE, compile_commands, embedding_io_names, write_node_precision
from qeff_evs.export.folder import claim_folder, disk_full
from qeff_evs.export.language import export_language_graph, export_language_graph_stamped
from qeff_evs.export.model_folder import save_model_config, save_serving_config, save_video_processor_config, stop_token_ids
from qeff_evs.export.reuse import GraphReuse, checkpoint_digest, code_digest
from qeff_evs.export.vision import export_encoder_graph, export_encoder_graph_streamed, export_pruning_graph
from qeff_evs.export.weights import WEIGHT_DTYPES, WEIGHTS_DIR, WeightStore, settings_stamp
from qeff_evs.manifest import (
    AUDIO_ENCODER,
    AUDIO_ENCODER_FILES,
    IMAGE_ENCODER,
    IMAGE_ENCODER_FILES,
    LANGUAGE_DECODE,
    LANGUAGE_DECODE_FILE,
    MODEL_CONFIG_DIR,
    PRUNING_ROLE,
    EncoderEntry,
    LanguageShape,
    Manifest,
    PruningEntry,
    export_files,
    graph_role,
    pruning_graph,
)
from qeff_evs.models.checkpoint import (
    LoadedCheckpoint, _load_preprocessor_config, _load_tokenizer, detect_family, float_config, load_checkpoint,
    load_config, open_weights,
)
from qeff_evs.models.hollow import hollow_model, parameter_names
from qeff_evs.models.language import language_spec
from qeff_evs.models.pruning import PRUNING_METHODS, pruning_method
from qeff_evs.models.registry import family_class, family_for_config
from qeff_evs.positions import rope_table_length
from qeff_evs.specializations import (
    DEFAULT_FRAMES_PER_CALL,
    DEFAULT_MAX_FRAMES,
    FLOAT16,
    CompileOptions,
    EncoderTarget,
    PruningTarget,
    Specialization,
    comp_ctx_lengths,
    default_sampled_frame_buckets,
    language_specializations,
    short_prefill_lens,
    vision_specializations,
    write_compile_script,
)
from qeff_evs.specializations.placement import PerGraph
from qeff_evs.specializations.sets import COMP_CTX_STEP, check_frame_size, check_frames_per_call

FLOAT32 = "float32"
Progress = Callable[[str], None]
DEFAULT_MAX_PRUNING_RATE = 0.9  # --max-video-pruning-rate: the RoPE tables cover ctx_len / (1 - 0.9)


@dataclass(frozen=True)
class ExportOptions:
    video_pruning_rate: float  # the default rate q (run/encode/vllm serve may choose another)
    frames: tuple[int, ...]  # frame buckets in sampled frames; () for powers of two up to max_frames
    resolutions: tuple[tuple[int, int], ...]  # (height, width) the encoder sees
    prefill_seq_len: int
    ctx_len: int
    user_vision_size: int | None = None
    kv_precision: str = FLOAT16
    num_cores: PerGraph | None = None  # cores per graph in compile.sh; None: the one-device split (placement.py)
    mxfp6_matmul: bool = False
    rope_positions: int | None = None  # RoPE table rows; None: ctx_len / (1 - max_video_pruning_rate)
    full_batch_size: int | None = None  # continuous batching: KV rows + batch_index input (QEfficient CB)
    frames_per_call: int = DEFAULT_FRAMES_PER_CALL  # temporal patches per encoder call (F)
    max_frames: int | None = None  # the largest bucket when frames is (); None: DEFAULT_MAX_FRAMES
    max_video_pruning_rate: float = DEFAULT_MAX_PRUNING_RATE  # the largest rate the RoPE tables cover
    # Pruning graphs exported, the first the default; None: the methods vLLM runs for the family (its pruning_methods).
    video_pruning_methods: tuple[str, ...] | None = None
    # Compute context lengths (--ctx-lengths, docs/design.md#specializations); None: specializations.sets' default
    # ladder up to ctx_len.
    ctx_lengths: tuple[int, ...] | None = None
    # Shorter prefill lengths (--short-prefill-lens); None: specializations.sets' default where the family's graph
    # takes any chunk length (a graph unrolled for its prefill length, Qwen3.5's, gets none).
    short_prefill_lens: tuple[int, ...] | None = None
    # The default ladder's step (ctx_len / step**k) where ctx_lengths is None: 4 for the card, 2 for a CPU export
    # (specializations.sets.TARGETS).
    comp_ctx_step: int = COMP_CTX_STEP
    # The dtype the graphs store their weights in (--weight-dtype): float32 (ONNX Runtime on a CPU computes in it), or
    # float16 (what the card compiles; half the disk; the graph casts each weight to fp32 where it reads it).
    weight_dtype: str = FLOAT32
    # Load the whole checkpoint and trace the language step at once (--in-memory): the export before streaming, the
    # tests' reference; it holds the model in fp32 (about 1.7x its fp32 bytes at its peak) and stores fp32 weights.
    in_memory: bool = False
    # Each kind of decoder layer as an ONNX local function, each layer a call of it (--layer-functions).
    layer_functions: bool = False

    @property
    def effective_user_vision_size(self) -> int:
        return self.user_vision_size if self.user_vision_size is not None else self.prefill_seq_len

    def sampled_frame_buckets(self, temporal_patch_size: int) -> tuple[int, ...]:
        """The buckets in sampled frames, ascending: ``frames``, else powers of two up to ``max_frames``."""
        if not self.frames:
            return default_sampled_frame_buckets(self.max_frames or DEFAULT_MAX_FRAMES, temporal_patch_size)
        buckets = tuple(sorted(set(int(f) for f in self.frames)))
        if self.max_frames is not None and self.max_frames != buckets[-1]:
            raise ValueError(f"--max-frames {self.max_frames} is not the largest of --frames {list(buckets)} (the "
                             "largest bucket is the export's maximum); drop one of the two")
        return buckets


def check_pruning_options(options: ExportOptions, family_methods: Sequence[str] = PRUNING_METHODS,
                          family: str = "this family") -> tuple[float, float, tuple[str, ...]]:
    """``(q, max rate, methods)``: the default rate within [0, max rate], max rate in [0, 1), known methods the
    family is pruned with in vLLM (``family_methods``; the default when the options name none)."""
    q = evs.validate_pruning_rate(options.video_pruning_rate)
    top = evs.validate_pruning_rate(options.max_video_pruning_rate)
    if q > top:
        raise ValueError(f"--video-pruning-rate {q} is above --max-video-pruning-rate {top}; the RoPE tables are "
                         "sized for the largest rate: raise --max-video-pruning-rate")
    methods = tuple(family_methods if options.video_pruning_methods is None else options.video_pruning_methods)
    if not methods or len(set(methods)) != len(methods):
        raise ValueError(f"--video-pruning-methods must list distinct methods (of {', '.join(PRUNING_METHODS)}), "
                         f"got {list(methods)}")
    for method in methods:
        pruning_method(method)
        if method not in family_methods:
            raise ValueError(f"--video-pruning-methods {method}: vLLM prunes {family} videos with "
                             f"{', '.join(family_methods)} only; export --video-pruning-methods "
                             f"{','.join(family_methods)}")
    return q, top, methods


def check_frame_sizes(options: ExportOptions, patch_size: int, merge_size: int, temporal_patch_size: int) -> None:
    for height, width in options.resolutions:
        check_frame_size(height, width, patch_size * merge_size)
    for frames in options.frames:
        if frames <= 0 or frames % temporal_patch_size:
            raise ValueError(
                f"--frames {frames} must be a positive multiple of temporal_patch_size {temporal_patch_size}")
    check_frames_per_call(options.frames_per_call, "--frames-per-call")


def export_checkpoint(model_dir: str | os.PathLike, out_dir: str | os.PathLike, options: ExportOptions,
                      progress: Progress = lambda message: None, weights=None) -> Manifest:
    """Export the checkpoint in ``model_dir`` to ``out_dir``. Streamed (the default): the model is built without its
    weights, each graph traced from it (the language graph a decoder layer per kind, stamped per layer) and the weights
    written from the checkpoint one tensor at a time; ``weights``: where to read them (the checkpoint's
    ``ModuleWeights``, by default ``open_weights(model_dir)``). ``options.in_memory``: load the model and trace it."""
    _, max_rate, _ = check_pruning_options(options)  # bad rates and unknown methods, before the checkpoint loads
    ctx_lengths = comp_ctx_lengths(options.ctx_lengths, options.ctx_len, options.prefill_seq_len, options.comp_ctx_step)
    short_lens = short_prefill_lens(options.short_prefill_lens, options.prefill_seq_len)
    language_specializations(options.prefill_seq_len, options.ctx_len, options.user_vision_size,
                             full_batch_size=options.full_batch_size)  # refuses bad sizes before the checkpoint loads
    rope_positions = options.rope_positions or rope_table_length(options.ctx_len, max_rate)
    if rope_positions < options.ctx_len:
        raise ValueError(f"--rope-positions {rope_positions} is below --ctx-len {options.ctx_len}; the RoPE tables "
                         "must cover at least every KV slot's position")
    out = Path(out_dir)
    check_weight_options(options)
    reader = None
    if options.in_memory:
        progress(f"loading checkpoint {model_dir}")
        checkpoint = load_checkpoint(model_dir)
    else:
        checkpoint = hollow_checkpoint(model_dir)
        reader = weights if weights is not None else open_weights(model_dir)
    try:
        with ExitStack() as held:
            return _export(checkpoint, reader, out, options, progress, ctx_lengths, short_lens, rope_positions, held)
    finally:
        if reader is not None and weights is None:
            reader.close()


def check_weight_options(options: ExportOptions) -> None:
    if options.weight_dtype not in WEIGHT_DTYPES:
        raise ValueError(f"--weight-dtype {options.weight_dtype!r}: choose one of {', '.join(WEIGHT_DTYPES)}")
    if options.in_memory and (options.weight_dtype != FLOAT32 or options.layer_functions):
        raise ValueError("--in-memory traces the loaded model as it is (fp32 weights, no layer functions); drop "
                         "--weight-dtype/--layer-functions or --in-memory")
    if options.layer_functions and options.mxfp6_matmul:
        raise ValueError("--layer-functions with --mxfp6: a layer function takes its weights as inputs, which "
                         "-mxfp6-matmul cannot compress (it needs them as the graph's constants); drop one of them")


def hollow_checkpoint(model_dir: str | os.PathLike) -> LoadedCheckpoint:
    """The checkpoint's config, tokenizer and generation config around a hollow model (``models.hollow``): what a
    streamed export traces; its weights are read later, one tensor at a time."""
    from transformers import GenerationConfig

    model_dir = Path(model_dir)
    family = detect_family(model_dir)
    config = float_config(load_config(model_dir))
    model = hollow_model(family_class(family).model_class, config)
    if (model_dir / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(model_dir, local_files_only=True)
    return LoadedCheckpoint(family=family, config=model.config, model=model, tokenizer=_load_tokenizer(model_dir),
                            model_dir=model_dir, preprocessor_config=_load_preprocessor_config(model_dir))


def _graph_order(specs) -> list[str]:
    """The graphs of ``specs`` in compile order (``Manifest.graphs``): the encoders, the pruning graphs, the language."""
    encoders = [graph for graph in ("encoder", IMAGE_ENCODER, AUDIO_ENCODER) if graph in specs]
    return [*encoders, *(g for g in specs if graph_role(g) == PRUNING_ROLE), "language"]


def _audio_features(family, progress: Progress):
    """The family's audio features where this checkpoint has an audio encoder; None otherwise (said)."""
    try:
        features = family.audio_features()
    except ValueError as error:
        progress(f"no audio encoder graph: {error}")
        return None
    if features is None and "audio" in family.modalities:
        progress("no audio encoder graph: this checkpoint's config has no sound_config (it serves no audio)")
    return features


def _image_tiling(family, progress: Progress):
    """The family's image tiling where its images have a graph of their own; None where they go through the video
    encoder, or where this checkpoint's images cannot be served (said, and refused per request at run time)."""
    try:
        return family.image_tiling()
    except ValueError as error:
        progress(f"no image encoder graph: {error}")
        return None


def _weights_written(out: Path) -> int:
    """Bytes of weight files an earlier run of the export already wrote to ``out`` (a resumed export's)."""
    return sum(path.stat().st_size for path in out.glob(f"*/{WEIGHTS_DIR}/*.data"))


def _export(checkpoint: LoadedCheckpoint, reader, out: Path, options: ExportOptions, progress: Progress, ctx_lengths,
            short_lens, rope_positions: int, held: ExitStack) -> Manifest:
    """The export proper. It claims ``out`` (``folder.claim_folder``: held until ``held`` closes) only once every
    option and the budget are checked, so a refused export leaves an earlier one servable; a full disk from there on
    is one line (``folder.disk_full``)."""
    family = family_for_config(checkpoint.config, checkpoint.tokenizer)
    q, max_rate, methods = check_pruning_options(options, family.pruning_methods, family.name)
    shipped = getattr(checkpoint.config, "video_pruning_rate", None)
    if shipped and float(shipped) != q:  # vLLM 0.34 reads the rate from its flag and the request, never the config
        progress(f"the checkpoint's config ships video_pruning_rate {float(shipped):g}; as in vLLM, the export's "
                 f"default is --video-pruning-rate ({q:g}) and a request may ask its own: pass "
                 f"--video-pruning-rate {float(shipped):g} to serve the checkpoint's")
    if not family.rope:  # positions reach its graph only as KV slots: no RoPE table, no bound on them
        rope_positions = None
    vc = family.normalized_config
    check_frame_sizes(options, vc.patch_size, vc.merge_size, vc.temporal_patch_size)
    buckets = options.sampled_frame_buckets(vc.temporal_patch_size)
    spec = language_spec(checkpoint.model)
    if spec.layer_states:  # the family's graph unrolls its prefill for one length
        if options.short_prefill_lens:
            raise ValueError(f"--short-prefill-lens {list(options.short_prefill_lens)}: {family.name}'s language graph "
                             "is unrolled for one prefill length (its linear-attention layers); drop the flag")
        short_lens = ()
    lang_specs = language_specializations(options.prefill_seq_len, options.ctx_len, options.user_vision_size,
                                          full_batch_size=options.full_batch_size, comp_ctx_lengths=ctx_lengths,
                                          short_prefill_lens=short_lens, logits_rows=True)

    encoder_targets, pruning_targets = [], []
    for height, width in options.resolutions:
        grid_hw = (height // vc.patch_size, width // vc.patch_size)
        encoder_targets.append((EncoderTarget(height, width, options.frames_per_call), grid_hw))
        for frames in buckets:
            pruning_targets.append((PruningTarget(height, width, frames), grid_hw, frames // vc.temporal_patch_size))
    pruning_specs = vision_specializations(
        [(target, family.pruning_symbols(grid_hw, bucket)) for target, grid_hw, bucket in pruning_targets])
    tiling = _image_tiling(family, progress)
    image_targets = [] if tiling is None else [
        (EncoderTarget(tiling.tile_size, tiling.tile_size, options.frames_per_call), tiling.grid_hw)]
    specs = {
        "encoder": vision_specializations(
            [(target, family.encoder_symbols(grid_hw, target.frames_per_call)) for target, grid_hw in encoder_targets]),
        **({IMAGE_ENCODER: vision_specializations(
            [(target, family.image_encoder_symbols(grid_hw, target.frames_per_call))
             for target, grid_hw in image_targets])} if image_targets else {}),
        **{pruning_graph(method): pruning_specs for method in methods},
        "language": lang_specs,
    }
    audio = _audio_features(family, progress)
    if audio is not None:
        specs[AUDIO_ENCODER] = [Specialization(f"Audio_{i}", family.audio_encoder_symbols(frames))
                                for i, frames in enumerate(audio.bucket_frames)]
        specs = {graph: specs[graph] for graph in _graph_order(specs)}
    files = export_files(methods)
    if image_targets:
        files.update(IMAGE_ENCODER_FILES)
    if audio is not None:
        files.update(AUDIO_ENCODER_FILES)

    _, example_hw = encoder_targets[0]
    streamed = reader is not None
    rope_bytes = 0 if rope_positions is None else 2 * rope_positions * spec.head_dim * 4 * (2 if spec.layer_states else 1)
    budget = estimate_budget(checkpoint.model, options.weight_dtype, rope_bytes,
                             by_rows=(lambda name: reader.row_range(name) is not None) if streamed else lambda name: False)
    if streamed:
        progress(f"the export needs {budget.describe()}")
        check_budget(budget, out, _weights_written(out))
    claim = held.enter_context(claim_folder(out))
    held.enter_context(disk_full(out, budget.disk))
    (out / "vision").mkdir(parents=True, exist_ok=True)
    (out / "language").mkdir(parents=True, exist_ok=True)
    reuse = None
    if streamed:
        names = parameter_names(checkpoint.model)
        stamp = settings_stamp(options.weight_dtype)
        stores = {folder: WeightStore(out / folder / WEIGHTS_DIR, options.weight_dtype, stamp)
                  for folder in ("vision", "language")}
        # the graphs' external-data files, unit by unit (weights.WeightStore)
        files.update(encoder_weights=f"vision/{WEIGHTS_DIR}", language_weights=f"language/{WEIGHTS_DIR}")
        # an earlier export's graphs, taken where their inputs are unchanged (export.reuse)
        traced_from = checkpoint_digest(checkpoint.model_dir, reader)
        reuse = None if traced_from is None else GraphReuse(out, f"{code_digest()}|{traced_from}")
    # Traced with 2+ frames so the per-frame tiling is in the graph (F stays a symbol either way).
    if streamed:
        export_encoder_graph_streamed(family.encoder(checkpoint.model), example_hw, max(2, options.frames_per_call),
                                      out / files["encoder"], names, stores["vision"], reader, progress=progress,
                                      reuse=reuse)
    else:
        export_encoder_graph(family.encoder(checkpoint.model), example_hw, max(2, options.frames_per_call),
                             out / files["encoder"], progress=progress)
    if tiling is not None:  # the tower's blocks are the encoder's; only the tower file (its first layer) is its own
        tile_frames = max(2, options.frames_per_call)
        if streamed:
            export_encoder_graph_streamed(family.image_encoder(checkpoint.model), tiling.grid_hw, tile_frames,
                                          out / files[IMAGE_ENCODER], names, stores["vision"], reader,
                                          progress=progress, reuse=reuse, tower_unit="image_tower",
                                          label="image encoder")
        else:
            export_encoder_graph(family.image_encoder(checkpoint.model), tiling.grid_hw, tile_frames,
                                 out / files[IMAGE_ENCODER], progress=progress, name="image encoder")
    if audio is not None:  # the Parakeet tower and projector: weights of their own
        example = (audio.bucket_frames[0], audio.mels)
        if streamed:
            export_encoder_graph_streamed(family.audio_encoder(checkpoint.model), example, 1,
                                          out / files[AUDIO_ENCODER], names, stores["vision"], reader,
                                          progress=progress, reuse=reuse, tower_unit="audio_tower",
                                          label="audio encoder")
        else:
            export_encoder_graph(family.audio_encoder(checkpoint.model), example, 1, out / files[AUDIO_ENCODER],
                                 progress=progress, name="audio encoder")
    for method in methods:
        export_pruning_graph(family.pruning_ranking(method), vc.vision_hidden, out / files[pruning_graph(method)],
                             progress=progress, reuse=reuse)
    progress("exporting language graph")
    graphs = [(files["language"], options.prefill_seq_len)]
    if spec.layer_states:  # an unrolled prefill graph: a decode-only twin for ONNX Runtime (manifest.LANGUAGE_DECODE)
        files[LANGUAGE_DECODE] = LANGUAGE_DECODE_FILE
        graphs.append((LANGUAGE_DECODE_FILE, 1))
    for file, prefill_len in graphs:
        if prefill_len == 1:
            progress("exporting the decode-only language graph")
        settings = dict(media_token_ids=family.special_tokens().media_pads,
                        continuous_batching=options.full_batch_size is not None, rope_positions=rope_positions,
                        prefill_seq_len=prefill_len, comp_ctx_lengths=bool(ctx_lengths), logits_rows=True)
        if streamed:
            export_language_graph_stamped(checkpoint.model, out / file, names, stores["language"], reader,
                                          functions=options.layer_functions, progress=progress, reuse=reuse,
                                          **settings)
        else:
            export_language_graph(checkpoint.model, out / file, **settings)

    if reuse is not None:
        files.update(reuse.record_files(files))
    progress("checking specializations against the graphs and writing compile inputs")
    node_precision = write_node_precision(out, spec.layer_states)
    if node_precision is not None:
        files["language_node_precision"] = NODE_PRECISION_FILE
    commands = compile_commands(out, CompileOptions(num_cores=options.num_cores, mxfp6_matmul=options.mxfp6_matmul),
                                options.kv_precision, specs, embedding_io_names(family), spec.layer_states,
                                node_precision)
    write_compile_script(out / files["compile_script"], commands)
    checkpoint.tokenizer.save_pretrained(out / files["tokenizer"])
    save_model_config(checkpoint, out / MODEL_CONFIG_DIR)
    save_serving_config(checkpoint, family, stop_token_ids(checkpoint, family.special_tokens().eos),
                        options.ctx_len, out)
    save_video_processor_config(checkpoint, family, out)

    specials = family.special_tokens()
    # A quantized release's record, from the reader that dequantized it (streamed) or the in-memory load's.
    source_quantization = reader.quantization if streamed else checkpoint.quantization
    manifest = Manifest(
        family=family.name,
        model_dir=str(Path(checkpoint.model_dir).resolve()),
        video_pruning_rate=q,
        prefill_seq_len=options.prefill_seq_len,
        sampled_frame_buckets=buckets,
        resolutions=tuple(tuple(r) for r in options.resolutions),
        special_tokens=dataclasses.replace(specials, eos=tuple(stop_token_ids(checkpoint, specials.eos))),
        language_shape=LanguageShape(
            num_layers=spec.num_layers, kv_heads=spec.kv_heads, head_dim=spec.head_dim, hidden=spec.hidden_size,
            ctx_len=options.ctx_len, vision_size=options.effective_user_vision_size, extras=dict(spec.extras),
            full_batch_size=options.full_batch_size or 1, vocab=spec.vocab_size,
            continuous_batching=options.full_batch_size is not None, rope_positions=rope_positions,
            kv_layers=spec.io_kv_layers, layer_states=spec.layer_states, comp_ctx_lengths=ctx_lengths,
            logits_rows=True),
        files=files,
        encoder_entries=tuple(
            EncoderEntry(target.height, target.width, target.frames_per_call, grid_hw,
                         family.encoder_symbols(grid_hw, target.frames_per_call))
            for target, grid_hw in encoder_targets),
        audio_buckets=() if audio is None else audio.bucket_frames,
        image_encoder_entries=tuple(
            EncoderEntry(target.height, target.width, target.frames_per_call, grid_hw,
                         family.image_encoder_symbols(grid_hw, target.frames_per_call))
            for target, grid_hw in image_targets),
        pruning_entries=tuple(
            PruningEntry(method, target.height, target.width, target.frames, bucket,
                         family.pruning_symbols(grid_hw, bucket))
            for method in methods for target, grid_hw, bucket in pruning_targets),
        video_pruning_methods=methods,
        video_pruning_method=methods[0],
        max_video_pruning_rate=max_rate,
        kv_precision=options.kv_precision,
        short_prefill_lens=short_lens,
        source_quantization=None if source_quantization is None else source_quantization.to_json(),
        weight_dtype=options.weight_dtype,
    )
    kept = [path for store in stores.values() for path in store.reused] if streamed else []
    kept += reuse.kept if reuse is not None else []
    for path in claim.finish(kept):
        progress(f"deleted {path.relative_to(out)}, which this export does not hold")
    manifest.write(out)  # last: the folder is servable from here on
    progress(f"export written to {out}")
    return manifest
