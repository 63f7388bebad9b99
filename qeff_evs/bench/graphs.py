"""The benchmarked graphs: the random checkpoint exported by ``qeff-evs export``'s pipeline, opened in ORT.

``build_graphs`` saves the checkpoint (``checkpoint.save_checkpoint``), exports it with
``export_checkpoint`` (encoder, EVS pruning and language graphs, a frame bucket for every frame count and
frame size the phases use, so no clip is padded) and opens the export as ``qeff-evs run`` does (``open_export``: manifest, family,
tokenizer, preprocessing), each graph in its own timing session (``sessions``). The language graph's
``vision_size`` is a symbol, so one file serves both the ``user_vision_size`` way and the QEfficient way.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from qeff_evs.bench.checkpoint import model_config, save_checkpoint
from qeff_evs.bench.config import BenchConfig, Progress, prefill_chunk_lengths
from qeff_evs.bench.sessions import open_inference_session
from qeff_evs.export.pipeline import ExportOptions, export_checkpoint
from qeff_evs.manifest import AUDIO_ENCODER, LanguageShape
from qeff_evs.models.protocol import ModelFamily
from qeff_evs.models.registry import family_for_config
from qeff_evs.manifest import pruning_graph
from qeff_evs.runtime.backends.ort import OrtEncoderSession, OrtPruningSession
from qeff_evs.runtime.backends.vision import VisionPipeline
from qeff_evs.runtime.inputs.preprocess_spec import VisionPreprocessSpec
from qeff_evs.runtime.export_bundle import open_export
from qeff_evs.specializations import TARGETS, short_prefill_lens

CHECKPOINT_DIR = "checkpoint"
EXPORT_DIR = "export"


@dataclass
class BenchGraphs:
    """Exported graphs, open in ORT, with what the host needs to feed them."""

    family: ModelFamily
    hf_config: object
    preprocess: VisionPreprocessSpec
    language_shape: LanguageShape  # the export's; vision_size is per way, see with_vision_size
    encoder: object  # ort.InferenceSession of the encoder graph
    evs: object  # ... of the EVS pruning graph
    language: object | None  # None when the run measures no language phase
    files: dict[str, str]  # encoder, evs (the EVS pruning graph), language -> path
    frames_per_call: int
    buckets: tuple[int, ...]  # the export's frame buckets in temporal patches
    checkpoint_dir: Path  # the saved random checkpoint
    export_dir: Path  # qeff-evs export's folder: what `qeff-evs run` and `vllm serve` take
    short_prefill_lens: tuple[int, ...] = ()  # the export's shorter prefill lengths (Manifest.short_prefill_lens)
    audio_encoder: object | None = None  # ... of the audio encoder graph, where the export has one
    audio_buckets: tuple[int, ...] = ()  # its clip buckets in feature frames

    @property
    def merge_size(self) -> int:
        return self.family.normalized_config.merge_size

    def with_vision_size(self, vision_size: int) -> LanguageShape:
        return dataclasses.replace(self.language_shape, vision_size=vision_size)

    def vision_pipeline(self) -> VisionPipeline:
        """The runtime's vision side over the opened sessions: encoder calls of F patches, then EVS's ranking."""
        audio = None if self.audio_encoder is None else OrtEncoderSession(self.audio_encoder)
        return VisionPipeline(self.family, OrtEncoderSession(self.encoder), {"evs": OrtPruningSession(self.evs)},
                              self.frames_per_call, self.buckets, audio_encoder=audio, audio_buckets=self.audio_buckets)


def export_options(config: BenchConfig) -> ExportOptions:
    """The export of every clip the phases run: each frame count at each frame size, the config's prefill
    chunks and window, default rate ``window_rate``; every frame count is a bucket (no clip is padded) and the
    EVS pruning graph the one method (the phases prune with EVS). The short prefill lengths are the default ones and
    every chunk length the prefill-lengths phase times (the language session runs only the export's lengths), except
    for a family whose language graph is unrolled for one prefill length (Qwen3.5: its export has none)."""
    frames = {config.frames, config.vision_frames, config.overhead_frames, *config.window_frames,
              *config.vision_sweep_frames}
    sides = {config.frame_size, config.vision_frame_size}
    short = None
    if not family_for_config(model_config(config)).layer_states():
        short = tuple(sorted({*short_prefill_lens(None, config.prefill_seq_len),
                              *(n for n in prefill_chunk_lengths(config) if n < config.prefill_seq_len)}))
    return ExportOptions(video_pruning_rate=config.window_rate, frames=tuple(sorted(frames)),
                         resolutions=tuple((side, side) for side in sorted(sides)),
                         prefill_seq_len=config.prefill_seq_len, ctx_len=config.ctx_len,
                         user_vision_size=config.user_vision_size, frames_per_call=config.frames_per_call,
                         video_pruning_methods=("evs",), short_prefill_lens=short,
                         comp_ctx_step=TARGETS[config.target].comp_ctx_step)


def export_graphs(config: BenchConfig, workdir: Path, progress: Progress, hf_config=None) -> Path:
    """Save the random checkpoint (``hf_config``, default the config's ``model_config``) and export it under
    ``workdir``; the export's folder. The checkpoint's weights are freed before the export loads them again."""
    workdir = Path(workdir)
    checkpoint_dir, export_dir = workdir / CHECKPOINT_DIR, workdir / EXPORT_DIR
    progress(f"saving a random {config.family} checkpoint ({config.widths} widths, {config.text_layers} text / "
             f"{config.vision_layers} vision layers)")
    save_checkpoint(config, checkpoint_dir, hf_config)
    export_checkpoint(checkpoint_dir, export_dir, export_options(config), progress=progress)
    return export_dir


def open_graphs(workdir: Path, progress: Progress, language: bool = True) -> BenchGraphs:
    """``export_graphs``' export under ``workdir`` opened in ORT (the language graph only with ``language``: the
    vision phases do not run it); a separate process may open it, so the export's memory is gone."""
    workdir = Path(workdir)
    checkpoint_dir, export_dir = workdir / CHECKPOINT_DIR, workdir / EXPORT_DIR
    progress("opening the graphs in ONNX Runtime")
    bundle = open_export(export_dir)
    manifest = bundle.manifest
    files = {role: str(manifest.path(export_dir, graph))
             for role, graph in (("encoder", "encoder"), ("evs", pruning_graph("evs")), ("language", "language"))}
    return BenchGraphs(
        family=bundle.family,
        hf_config=bundle.family.config,
        preprocess=bundle.preprocess,
        language_shape=manifest.language_shape,
        encoder=open_inference_session(files["encoder"]),
        evs=open_inference_session(files["evs"]),
        language=open_inference_session(files["language"]) if language else None,
        files=files,
        frames_per_call=manifest.frames_per_call,
        buckets=manifest.temporal_patch_buckets,
        checkpoint_dir=checkpoint_dir,
        export_dir=export_dir,
        short_prefill_lens=manifest.short_prefill_lens,
        audio_encoder=(open_inference_session(str(manifest.path(export_dir, AUDIO_ENCODER)))
                       if AUDIO_ENCODER in manifest.files else None),
        audio_buckets=manifest.audio_buckets,
    )


def build_graphs(config: BenchConfig, workdir: Path, progress: Progress, language: bool = True) -> BenchGraphs:
    """Save the random checkpoint and export it under ``workdir`` (``export_graphs``), open the graphs in ORT
    (``open_graphs``)."""
    export_graphs(config, workdir, progress)
    return open_graphs(workdir, progress, language)
