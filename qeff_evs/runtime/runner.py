"""``qeff-evs run``: an export folder + a video + a question -> generated tokens, on a chosen backend."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import AutoTokenizer

from qeff_evs import evs
from qeff_evs.manifest import MODEL_CONFIG_DIR, LanguageShape, Manifest, read_manifest
from qeff_evs.models.protocol import SAMPLING_FPS, ModelFamily, MediaInput
from qeff_evs.models.registry import family_for_config
from qeff_evs.runtime.engine.executor import EngineConfig, retained_count
from qeff_evs.runtime.engine.single_request import Engine, GenerationResult
from qeff_evs.runtime.inputs.processor import (
    SampledFrames,
    VisionPreprocessSpec,
    choose_resolution,
    preprocess_image,
    preprocess_video,
    sample_frame_indices,
)
from qeff_evs.runtime.inputs.prompt import video_question_pieces
from qeff_evs.runtime.backends.base import close_session
from qeff_evs.runtime.backends.ort import OrtEncoderSession, OrtEVSSession, OrtLanguageSession
from qeff_evs.runtime.backends.torch_reference import TorchEncoderSession, TorchEVSSession, TorchLanguageSession
from qeff_evs.runtime.backends.vision import VisionPipeline
from qeff_evs.runtime.inputs.video_io import load_video, probe_video, validate_frames

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


def video_from_file(path: str | Path, bundle: ExportBundle, target_fps: float | None = None,
                    source_fps: float | None = None) -> MediaInput:
    """Sample by fps to an exported frame count, resize to the exported size closest in aspect, patchify."""
    spec = bundle.preprocess
    info = probe_video(path, fps=source_fps)
    target = spec.target_fps if target_fps is None else target_fps
    sampled = sample_frame_indices(info.num_frames, info.fps, target, bundle.manifest.frames)
    frames = load_video(path, fps=source_fps, frame_indices=sampled.indices).frames
    return _sampled_video(frames, sampled, bundle)


def video_from_frames(frames: np.ndarray, fps: float, bundle: ExportBundle,
                      target_fps: float | None = None) -> MediaInput:
    """:func:`video_from_file` for frames already decoded: ``(T, H, W, 3)`` uint8 at ``fps`` (a server's input)."""
    frames = validate_frames(frames)
    spec = bundle.preprocess
    target = spec.target_fps if target_fps is None else target_fps
    sampled = sample_frame_indices(len(frames), fps, target, bundle.manifest.frames)
    return _sampled_video(frames[sampled.indices], sampled, bundle)


def _sampled_video(frames: np.ndarray, sampled: SampledFrames, bundle: ExportBundle) -> MediaInput:
    spec = bundle.preprocess
    size = choose_resolution(frames.shape[1], frames.shape[2], bundle.manifest.resolutions, spec.factor)
    processed = preprocess_video(frames, size, spec)
    return MediaInput(processed.pixel_values, tuple(processed.grid_thw), float(sampled.fps),
                      tuple(float(t) for t in sampled.timestamps))


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


def vision_pipeline(bundle: ExportBundle, backend: str, device: str | None = None,
                    checkpoint=None, device_ids=None) -> VisionPipeline:
    """The encoder and EVS sessions of ``backend`` over the export, at its frames per call.

    ``device_ids`` (qaic only, ``placement.DeviceIdsSpec``): the devices each program opens on."""
    m, root = bundle.manifest, bundle.export_dir
    _check_device_ids(backend, device_ids)
    if backend == "ort":
        encoder, selection = OrtEncoderSession(m.path(root, "encoder")), OrtEVSSession(m.path(root, "evs"))
    elif backend == "torch":
        from qeff_evs.models.checkpoint import load_checkpoint

        checkpoint = checkpoint or load_checkpoint(m.model_dir)
        encoder = TorchEncoderSession(bundle.family.encoder(checkpoint.model), device)
        selection = TorchEVSSession(bundle.family.evs_selection(), device)
    elif backend == "qaic":
        from qeff_evs.runtime.backends.qaic import qaic_vision_pipeline

        return qaic_vision_pipeline(bundle, device_ids)
    else:
        raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    return VisionPipeline(bundle.family, encoder, selection, m.frames_per_call)


def sessions_for(bundle: ExportBundle, backend: str, device: str | None = None, device_ids=None):
    """``(VisionPipeline, language session)`` of ``backend`` over the export; ``device_ids`` as for
    :func:`vision_pipeline` (every program of the export is loaded and activated once, here)."""
    _check_device_ids(backend, device_ids)
    if backend == "ort":
        return vision_pipeline(bundle, backend), language_session(bundle, backend)
    if backend == "torch":
        from qeff_evs.models.checkpoint import load_checkpoint

        checkpoint = load_checkpoint(bundle.manifest.model_dir)
        return vision_pipeline(bundle, backend, device, checkpoint), _torch_language(bundle, checkpoint, device)
    if backend == "qaic":
        from qeff_evs.runtime.backends.qaic import qaic_sessions

        return qaic_sessions(bundle, device_ids)
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
    seconds: dict[str, float]  # encoder, evs, total

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
                "frames_per_call": self.frames_per_call, "retained_tokens": int(len(self.retained_indices)),
                "retained_tokens_per_frame": self.retained_tokens_per_frame,
                "retained_indices": self.retained_indices.tolist(), "seconds": dict(self.seconds)}


def encode_video(bundle: ExportBundle, video: MediaInput, backend: str = "ort", device: str | None = None,
                 progress: Progress | None = None, device_ids=None) -> EncodeReport:
    """Only the vision side of one video: encoder calls of F temporal patches, then the EVS graph."""
    bundle.manifest.evs_entry(video.grid_thw)  # fails clearly when no specialization serves this grid
    vision = vision_pipeline(bundle, backend, device, device_ids=device_ids)
    retained = retained_count(bundle.family, video, bundle.manifest.video_pruning_rate)
    try:
        started = time.perf_counter()
        merged = vision.merged_rows(video, progress)
        encoded = time.perf_counter()
        result = vision.prune(video, merged, retained)
        done = time.perf_counter()
    finally:
        vision.close()
    t, big_h, big_w = video.grid_thw
    patch = bundle.preprocess.patch_size
    frames = len(video.frame_times) or t * bundle.preprocess.temporal_patch_size
    return EncodeReport(frames, (big_h * patch, big_w * patch), bundle.family.merged_grid(video.grid_thw),
                        vision.frames_per_call, result.retained_indices.astype(np.int64),
                        {"encoder": encoded - started, "evs": done - encoded, "total": done - started})


def build_engine(bundle: ExportBundle, backend: str = "ort", max_new_tokens: int = 16,
                 progress: Progress | None = None, device: str | None = None, device_ids=None) -> Engine:
    m = bundle.manifest
    config = EngineConfig(m.prefill_seq_len, m.ctx_len, m.user_vision_size, m.video_pruning_rate,
                          max_new_tokens=max_new_tokens)
    vision, language = sessions_for(bundle, backend, device, device_ids)
    return Engine(bundle.family, vision, language, config, progress)


def stop_ids(bundle: ExportBundle) -> tuple[int, ...]:
    """The export's stop tokens: the config's eos and generation_config.json's, as HF generate uses."""
    return bundle.manifest.special_tokens.eos


def answer(bundle: ExportBundle, engine: Engine, video: MediaInput, question: str) -> GenerationResult:
    bundle.manifest.evs_entry(video.grid_thw)  # fails clearly when no specialization serves this grid
    pieces = video_question_pieces(bundle.tokenizer, question, bundle.family.token_strings)
    prompt = engine.prepare(pieces, [video])
    return engine.generate(prompt, eos_ids=stop_ids(bundle))


def build_serving_engine(bundle: ExportBundle, backend: str = "ort", max_num_seqs: int | None = None,
                         max_num_batched_tokens: int | None = None, encoder_cache_rows: int | None = None,
                         progress: Progress | None = None, device: str | None = None, device_ids=None):
    """A continuous-batching serving engine over an export made with ``--full-batch-size``."""
    from qeff_evs.runtime.engine.scheduler import SchedulerConfig
    from qeff_evs.runtime.engine.serving import ServingEngine

    m = bundle.manifest
    shape = bundle.language_shape
    if not m.language_shape.continuous_batching:
        raise ValueError(
            f"{bundle.export_dir} was exported without continuous batching; re-export with "
            "--full-batch-size N to serve several requests at once")
    seqs = shape.full_batch_size if max_num_seqs is None else max_num_seqs
    budget = m.prefill_seq_len * seqs if max_num_batched_tokens is None else max_num_batched_tokens
    # As vLLM's compute_encoder_budget: the encoder budget and cache hold at least the largest item.
    largest_item = max((e.retained for e in m.evs_entries), default=0)
    rows = max(budget, largest_item) if encoder_cache_rows is None else encoder_cache_rows
    scheduler = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=seqs,
                                prefill_seq_len=m.prefill_seq_len, ctx_len=m.ctx_len,
                                encoder_compute_budget=rows, encoder_cache_size=rows)
    vision, language = sessions_for(bundle, backend, device, device_ids)
    config = EngineConfig(m.prefill_seq_len, m.ctx_len, m.user_vision_size, m.video_pruning_rate)
    try:
        return ServingEngine(bundle.family, vision, language, config, scheduler, stop_ids(bundle), progress)
    except ValueError:  # e.g. max_num_seqs above the export's rows: give the devices back before failing
        close_session(vision)
        close_session(language)
        raise


def requests_from_jsonl(path: str | Path, bundle: ExportBundle):
    """``{"id", "prompt", "video" | "pixel_values_videos"+"video_grid_thw", "max_new_tokens", "fps"}`` per line."""
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
                video = video_from_file(entry["video"], bundle, target_fps=fps)
            else:
                grid = entry.get("video_grid_thw")
                if not isinstance(grid, list) or len(grid) != 3:
                    raise ValueError(f"'video_grid_thw' must be [T, H, W] with 'pixel_values_videos', got {grid!r}")
                video = video_from_patches(entry["pixel_values_videos"], tuple(int(v) for v in grid), fps, bundle)
            bundle.manifest.evs_entry(video.grid_thw)
        except (ValueError, TypeError) as error:
            raise ValueError(f"{where}: {error}") from None
        pieces = video_question_pieces(bundle.tokenizer, entry["prompt"], bundle.family.token_strings)
        requests.append(ServeRequest(str(entry.get("id", f"request-{number}")), pieces, [video], max_new_tokens))
    if not requests:
        raise ValueError(f"{path} holds no requests")
    return requests
