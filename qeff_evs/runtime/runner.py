"""``qeff-evs run``: an export folder + a video + a question -> generated tokens, on a chosen backend."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoTokenizer

from qeff_evs import evs
from qeff_evs.manifest import MODEL_CONFIG_DIR, LanguageShape, Manifest, pruning_graph, read_manifest
from qeff_evs.models.protocol import SAMPLING_FPS, ModelFamily, MediaInput
from qeff_evs.models.pruning import VideoPruning
from qeff_evs.models.registry import family_for_config
from qeff_evs.runtime.engine.executor import EngineConfig
from qeff_evs.runtime.engine.single_request import Engine, GenerationResult
from qeff_evs.runtime.inputs.processor import (
    VideoFrames,
    VisionPreprocessSpec,
    choose_resolution,
    delivered_video_frames,
    preprocess_image,
    preprocess_video,
    video_file_frames,
    video_size,
)
from qeff_evs.runtime.inputs.prompt import video_question_pieces
from qeff_evs.runtime.backends.base import close_session
from qeff_evs.runtime.backends.ort import OrtEncoderSession, OrtLanguageSession, OrtPruningSession
from qeff_evs.runtime.backends.torch_reference import TorchEncoderSession, TorchLanguageSession, TorchPruningSession
from qeff_evs.runtime.backends.vision import VisionPipeline
from qeff_evs.runtime.inputs.video_io import ARRAY_SUFFIX

BACKENDS = ("ort", "torch", "qaic")

Progress = Callable[[str], None]


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


def video_from_file(path: str | Path, bundle: ExportBundle, *, media_io_kwargs: Mapping[str, Any] | None = None,
                    mm_processor_kwargs: Mapping[str, Any] | None = None, array_fps: float | None = None,
                    reader: str | None = None) -> MediaInput:
    """The video vLLM 0.32 would encode for ``video_url`` of this file: its loader (``media_io_kwargs``, vLLM's
    ``--media-io-kwargs`` video entry) then the family's HF sampling rule (``mm_processor_kwargs``), at most the
    export's ``max_frames``; resized to HF's size where exported, else the exported size closest in aspect.

    A ``.npy`` array is every frame of a clip at ``array_fps`` (default 2), as an ``LLM.generate`` caller passing
    all frames would describe it.
    """
    if array_fps is not None and Path(path).suffix.lower() != ARRAY_SUFFIX:
        raise ValueError(f"a frame rate ({array_fps:g}) describes a .npy array's frames, not the file {path}, whose "
                         "container has its own; sample it with mm_processor_kwargs {\"fps\": X} (vLLM's "
                         "--mm-processor-kwargs) or media_io_kwargs {\"fps\": X} (--media-io-kwargs)")
    frames = video_file_frames(path, bundle.preprocess, media_io_kwargs=media_io_kwargs,
                               mm_processor_kwargs=mm_processor_kwargs, max_frames=bundle.manifest.max_frames,
                               array_fps=array_fps, reader=reader)
    return _media_from_frames(frames, bundle)


def video_from_frames(frames: np.ndarray, metadata: Mapping[str, Any], bundle: ExportBundle, *,
                      mm_processor_kwargs: Mapping[str, Any] | None = None) -> MediaInput:
    """:func:`video_from_file` for frames already decoded: ``(T, H, W, 3)`` uint8 with vLLM's metadata dict
    (``total_num_frames``, ``fps``, [``frames_indices``, ``duration``, ``do_sample_frames``]): what vLLM's loader
    hands the processor, or an ``LLM.generate`` caller's ``(frames, metadata)``."""
    return _media_from_frames(delivered_video_frames(frames, metadata, bundle.preprocess,
                                                     mm_processor_kwargs=mm_processor_kwargs,
                                                     max_frames=bundle.manifest.max_frames), bundle)


def _media_from_frames(video: VideoFrames, bundle: ExportBundle) -> MediaInput:
    spec = bundle.preprocess
    size = video_size(video, spec, bundle.manifest.resolutions)
    processed = preprocess_video(video.frames, size.exported, spec)
    return MediaInput(processed.pixel_values, tuple(processed.grid_thw), float(video.clip.sampled_fps),
                      tuple(float(t) for t in video.clip.frame_times))


def image_from_array(image: np.ndarray, bundle: ExportBundle) -> MediaInput:
    """An RGB uint8 ``(H, W, 3)`` image, resized to the exported size closest in aspect (never pruned)."""
    spec = bundle.preprocess
    size = choose_resolution(image.shape[0], image.shape[1], bundle.manifest.resolutions, spec.factor)
    processed = preprocess_image(image, size, spec)
    return MediaInput(processed.pixel_values, tuple(processed.grid_thw), 1.0, (), kind="image")


def video_from_patches(pixel_values_path: str | Path, grid_thw: tuple[int, int, int], fps: float | None,
                       bundle: ExportBundle | None = None) -> MediaInput:
    """Already-patchified pixels (``pixel_values_videos`` as transformers' processor returns them).

    ``fps``: the rate the frames were sampled at; ``None`` means Qwen-VL's default rate.
    """
    path = Path(pixel_values_path)
    if not path.is_file():
        raise ValueError(f"pixel values file {path} not found")
    fps = SAMPLING_FPS if fps is None else fps
    if not fps > 0:
        raise ValueError(f"--fps must be positive for pre-patchified pixels, got {fps!r}")
    pixels = torch.from_numpy(np.load(path)).to(torch.float32)
    t, h, w = (int(v) for v in grid_thw)
    if pixels.dim() != 2 or pixels.shape[0] != t * h * w:
        raise ValueError(
            f"pixel_values of shape {tuple(pixels.shape)} do not match --video-grid-thw {t},{h},{w} "
            f"(expected {t * h * w} rows of patches)")
    temporal_patch = 2
    if bundle is not None:
        spec = bundle.preprocess
        temporal_patch = spec.temporal_patch_size
        if pixels.shape[1] != spec.patch_dim:
            raise ValueError(
                f"pixel_values rows have {pixels.shape[1]} values but this model's patches have {spec.patch_dim} "
                f"(C*temporal_patch*patch*patch); patchify with the checkpoint's processor")
    frame_times = tuple(float(i) / fps for i in range(temporal_patch * t))
    return MediaInput(pixels, (t, h, w), float(fps), frame_times)


def _check_device_ids(backend: str, device_ids) -> None:
    if device_ids is not None and backend != "qaic":
        raise ValueError(f"device ids place the programs of the qaic backend on AI 100 devices; the {backend} "
                         "backend does not use them: drop --device-ids (or QEFF_EVS_DEVICE_IDS)")


def video_pruning(bundle: ExportBundle, method: str | None = None, rate: float | None = None) -> VideoPruning:
    """The pruning a run serves: ``method`` and ``rate`` (defaults: the export's), checked against what the export
    carries (its pruning graphs, the rates its RoPE tables cover)."""
    m = bundle.manifest
    chosen = VideoPruning(m.video_pruning_method if method is None else method,
                          m.video_pruning_rate if rate is None else rate)
    m.check_pruning(chosen.method, chosen.rate)
    return chosen


def vision_pipeline(bundle: ExportBundle, backend: str, device: str | None = None,
                    checkpoint=None, device_ids=None, method: str | None = None) -> VisionPipeline:
    """The encoder and ``method``'s pruning sessions of ``backend`` over the export (default method: the
    export's), at its frames per call and frame buckets.

    ``device_ids`` (qaic only, ``placement.DeviceIdsSpec``): the devices each program opens on."""
    m, root = bundle.manifest, bundle.export_dir
    _check_device_ids(backend, device_ids)
    method = m.video_pruning_method if method is None else method
    problem = m.method_refusal(method)
    if problem:
        raise ValueError(problem)
    if backend == "ort":
        encoder = OrtEncoderSession(m.path(root, "encoder"))
        pruning = OrtPruningSession(m.path(root, pruning_graph(method)))
    elif backend == "torch":
        from qeff_evs.models.checkpoint import load_checkpoint

        checkpoint = checkpoint or load_checkpoint(m.model_dir)
        encoder = TorchEncoderSession(bundle.family.encoder(checkpoint.model), device)
        pruning = TorchPruningSession(bundle.family.pruning_ranking(method), device)
    elif backend == "qaic":
        from qeff_evs.runtime.backends.qaic import qaic_vision_pipeline

        return qaic_vision_pipeline(bundle, device_ids, method=method)
    else:
        raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    return VisionPipeline(bundle.family, encoder, {method: pruning}, m.frames_per_call, m.temporal_buckets)


def sessions_for(bundle: ExportBundle, backend: str, device: str | None = None, device_ids=None,
                 method: str | None = None):
    """``(VisionPipeline, language session)`` of ``backend`` over the export, the pipeline with ``method``'s
    pruning graph; ``device_ids`` as for :func:`vision_pipeline` (every program is loaded and activated once,
    here)."""
    _check_device_ids(backend, device_ids)
    if backend == "ort":
        return vision_pipeline(bundle, backend, method=method), language_session(bundle, backend)
    if backend == "torch":
        from qeff_evs.models.checkpoint import load_checkpoint

        checkpoint = load_checkpoint(bundle.manifest.model_dir)
        return (vision_pipeline(bundle, backend, device, checkpoint, method=method),
                _torch_language(bundle, checkpoint, device))
    if backend == "qaic":
        from qeff_evs.runtime.backends.qaic import qaic_sessions

        return qaic_sessions(bundle, device_ids, method=method)
    raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")


def _torch_language(bundle: ExportBundle, checkpoint, device: str | None) -> TorchLanguageSession:
    from qeff_evs.models.language import ExportableLanguageGraph

    shape = bundle.language_shape
    language = ExportableLanguageGraph(
        bundle.family.language_graph(checkpoint.model, bundle.family.special_tokens().media_pads,
                                     shape.rope_positions),
        continuous_batching=shape.continuous_batching)
    return TorchLanguageSession(language, shape, device)


def language_session(bundle: ExportBundle, backend: str, device: str | None = None, device_ids=None):
    """The language session of ``backend`` over the export, alone (an instance that runs no vision graph:
    a prefill/decode instance of encoder disaggregation); ``device_ids`` as for :func:`vision_pipeline`."""
    m, root = bundle.manifest, bundle.export_dir
    _check_device_ids(backend, device_ids)
    if backend == "ort":
        return OrtLanguageSession(m.path(root, "language"), bundle.language_shape)
    if backend == "torch":
        from qeff_evs.models.checkpoint import load_checkpoint

        return _torch_language(bundle, load_checkpoint(m.model_dir), device)
    if backend == "qaic":
        from qeff_evs.runtime.backends.qaic import qaic_language_session

        return qaic_language_session(bundle, device_ids)
    raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")


@dataclass(frozen=True)
class EncodeReport:
    """What ``qeff-evs encode`` prints: the vision side of one video, without the language model."""

    frames: int  # sampled frames
    resolution: tuple[int, int]  # (height, width) in pixels the encoder saw
    merged_grid: tuple[int, int, int]  # (T, h, w)
    frames_per_call: int
    retained_indices: np.ndarray  # (K,) int64, ascending raster indices
    seconds: dict[str, float]  # encoder, pruning, total
    pruning: VideoPruning = VideoPruning()

    @property
    def retained_tokens_per_frame(self) -> list[int]:
        t, h, w = self.merged_grid
        return evs.tokens_per_frame_kept(self.retained_indices, t, h * w)

    def kept_map(self) -> list[str]:
        """Per temporal patch, its h rows of w marks: ``#`` kept, ``.`` pruned."""
        t, h, w = self.merged_grid
        keep = np.zeros(t * h * w, dtype=bool)
        keep[self.retained_indices] = True
        lines = []
        for f, frame in enumerate(keep.reshape(t, h, w)):
            lines.append(f"temporal patch {f}: {int(frame.sum())}/{h * w} kept")
            lines += ["  " + "".join("#" if k else "." for k in row) for row in frame]
        return lines

    def to_json(self) -> dict:
        return {"frames": self.frames, "resolution": list(self.resolution), "merged_grid": list(self.merged_grid),
                "frames_per_call": self.frames_per_call, "video_pruning_method": self.pruning.method,
                "video_pruning_rate": self.pruning.rate, "retained_tokens": int(len(self.retained_indices)),
                "retained_tokens_per_frame": self.retained_tokens_per_frame,
                "retained_indices": self.retained_indices.tolist(), "seconds": dict(self.seconds)}


def encode_video(bundle: ExportBundle, video: MediaInput, backend: str = "ort", device: str | None = None,
                 progress: Progress | None = None, device_ids=None,
                 pruning: VideoPruning | None = None) -> EncodeReport:
    """Only the vision side of one video: encoder calls of F temporal patches, then its pruning graph once
    (``pruning``: default the export's method and rate)."""
    pruning = video_pruning(bundle) if pruning is None else pruning
    bundle.manifest.check_pruning(pruning.method, pruning.rate)
    bundle.manifest.check_video(video.grid_thw)  # fails clearly when no specialization serves this grid
    vision = vision_pipeline(bundle, backend, device, device_ids=device_ids, method=pruning.method)
    try:
        started = time.perf_counter()
        merged = vision.merged_rows(video, progress)
        encoded = time.perf_counter()
        result = vision.prune(video, merged, pruning)
        done = time.perf_counter()
    finally:
        vision.close()
    t, big_h, big_w = video.grid_thw
    patch = bundle.preprocess.patch_size
    frames = len(video.frame_times) or t * bundle.preprocess.temporal_patch_size
    return EncodeReport(frames, (big_h * patch, big_w * patch), bundle.family.merged_grid(video.grid_thw),
                        vision.frames_per_call, result.retained_indices.astype(np.int64),
                        {"encoder": encoded - started, "pruning": done - encoded, "total": done - started}, pruning)


def engine_config(bundle: ExportBundle, pruning: VideoPruning | None = None, **overrides) -> EngineConfig:
    """The engine settings of the export (``overrides``: e.g. ``max_new_tokens``), pruning with ``pruning``
    (default: the export's method and rate)."""
    m = bundle.manifest
    pruning = video_pruning(bundle) if pruning is None else pruning
    m.check_pruning(pruning.method, pruning.rate)
    return EngineConfig(m.prefill_seq_len, m.ctx_len, m.user_vision_size, pruning.rate,
                        video_pruning_method=pruning.method, **overrides)


def build_engine(bundle: ExportBundle, backend: str = "ort", max_new_tokens: int = 16,
                 progress: Progress | None = None, device: str | None = None, device_ids=None,
                 pruning: VideoPruning | None = None) -> Engine:
    config = engine_config(bundle, pruning, max_new_tokens=max_new_tokens)
    vision, language = sessions_for(bundle, backend, device, device_ids, method=config.video_pruning_method)
    return Engine(bundle.family, vision, language, config, progress)


def stop_ids(bundle: ExportBundle) -> tuple[int, ...]:
    """The export's stop tokens: the config's eos and generation_config.json's, as HF generate uses."""
    return bundle.manifest.special_tokens.eos


def answer(bundle: ExportBundle, engine: Engine, video: MediaInput, question: str) -> GenerationResult:
    bundle.manifest.check_video(video.grid_thw)  # fails clearly when no specialization serves this grid
    pieces = video_question_pieces(bundle.tokenizer, question, bundle.family.token_strings)
    prompt = engine.prepare(pieces, [video])
    return engine.generate(prompt, eos_ids=stop_ids(bundle))


def build_serving_engine(bundle: ExportBundle, backend: str = "ort", max_num_seqs: int | None = None,
                         max_num_batched_tokens: int | None = None, encoder_cache_rows: int | None = None,
                         progress: Progress | None = None, device: str | None = None, device_ids=None,
                         pruning: VideoPruning | None = None):
    """A continuous-batching serving engine over an export made with ``--full-batch-size``."""
    from qeff_evs.runtime.engine.scheduler import SchedulerConfig
    from qeff_evs.runtime.engine.serving import ServingEngine

    m = bundle.manifest
    shape = bundle.language_shape
    if not m.language_shape.continuous_batching:
        raise ValueError(
            f"{bundle.export_dir} was exported without continuous batching; re-export with "
            "--full-batch-size N to serve several requests at once")
    config = engine_config(bundle, pruning)
    seqs = shape.full_batch_size if max_num_seqs is None else max_num_seqs
    budget = m.prefill_seq_len * seqs if max_num_batched_tokens is None else max_num_batched_tokens
    # As vLLM's compute_encoder_budget: the encoder budget and cache hold at least the largest item.
    largest_item = largest_item_rows(bundle, config.pruning)
    rows = max(budget, largest_item) if encoder_cache_rows is None else encoder_cache_rows
    scheduler = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=seqs,
                                prefill_seq_len=m.prefill_seq_len, ctx_len=m.ctx_len,
                                encoder_compute_budget=rows, encoder_cache_size=rows)
    vision, language = sessions_for(bundle, backend, device, device_ids, method=config.video_pruning_method)
    try:
        return ServingEngine(bundle.family, vision, language, config, scheduler, stop_ids(bundle), progress)
    except ValueError:  # e.g. max_num_seqs above the export's rows: give the devices back before failing
        close_session(vision)
        close_session(language)
        raise


def largest_item_rows(bundle: ExportBundle, pruning: VideoPruning) -> int:
    """Encoder rows of the largest item the export serves under ``pruning``: the longest video (its largest
    bucket) at the resolution with the most tokens, or the largest image."""
    m, factor = bundle.manifest, bundle.preprocess.factor
    tokens = max((h // factor) * (w // factor) for h, w in m.resolutions)
    return max(tokens, pruning.retained_token_count(tokens, max(m.temporal_buckets)))


def requests_from_jsonl(path: str | Path, bundle: ExportBundle):
    """``{"id", "prompt", "video" | "pixel_values_videos"+"video_grid_thw", "max_new_tokens", "fps",
    "media_io_kwargs", "mm_processor_kwargs"}`` per line (``fps``: the rate of a ``.npy`` or of the pixels;
    the kwargs as vLLM takes them, for a video file)."""
    import json

    from qeff_evs.runtime.engine.serving import ServeRequest

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"requests file {path} not found")
    requests = []
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{where}: not JSON ({error})") from None
        if not isinstance(entry, dict) or "prompt" not in entry or not ({"video", "pixel_values_videos"} & entry.keys()):
            raise ValueError(f"{where}: each request needs 'prompt' and 'video' (or 'pixel_values_videos')")
        try:
            fps = None if entry.get("fps") is None else float(entry["fps"])
            max_new_tokens = int(entry.get("max_new_tokens", 16))
            if "video" in entry:
                video = video_from_file(entry["video"], bundle, media_io_kwargs=entry.get("media_io_kwargs"),
                                        mm_processor_kwargs=entry.get("mm_processor_kwargs"), array_fps=fps)
            else:
                grid = entry.get("video_grid_thw")
                if not isinstance(grid, list) or len(grid) != 3:
                    raise ValueError(f"'video_grid_thw' must be [T, H, W] with 'pixel_values_videos', got {grid!r}")
                video = video_from_patches(entry["pixel_values_videos"], tuple(int(v) for v in grid), fps, bundle)
            bundle.manifest.check_video(video.grid_thw)
        except (ValueError, TypeError) as error:
            raise ValueError(f"{where}: {error}") from None
        pieces = video_question_pieces(bundle.tokenizer, entry["prompt"], bundle.family.token_strings)
        requests.append(ServeRequest(str(entry.get("id", f"request-{number}")), pieces, [video], max_new_tokens))
    if not requests:
        raise ValueError(f"{path} holds no requests")
    return requests
