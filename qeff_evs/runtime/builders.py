"""Engines over an opened export: the pruning a run serves, the engine settings, the single-request and serving
engines, one question answered about one video, and many requests served to the end."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

from qeff_evs.manifest import IMAGE_ENCODER
from qeff_evs.models.protocol import MediaInput
from qeff_evs.models.pruning import VideoPruning
from qeff_evs.runtime.backends.base import close_session
from qeff_evs.runtime.backends.vision import Progress
from qeff_evs.runtime.engine.executor import EngineConfig
from qeff_evs.runtime.engine.single_request import Engine, GenerationResult
from qeff_evs.runtime.export_bundle import ExportBundle
from qeff_evs.runtime.inputs.prompt import chat_pieces, video_question_pieces
from qeff_evs.runtime.sessions import sessions_for


def video_pruning(bundle: ExportBundle, method: str | None = None, rate: float | None = None) -> VideoPruning:
    """The pruning a run serves: ``method`` and ``rate`` (defaults: the export's), checked against what the export
    carries (its pruning graphs, the rates its RoPE tables cover)."""
    m = bundle.manifest
    chosen = VideoPruning(m.video_pruning_method if method is None else method,
                          m.video_pruning_rate if rate is None else rate)
    m.check_pruning(chosen.method, chosen.rate)
    return chosen


def engine_config(bundle: ExportBundle, pruning: VideoPruning | None = None, **overrides) -> EngineConfig:
    """The engine settings of the export (``overrides``: e.g. ``max_new_tokens``), pruning with ``pruning``
    (default: the export's method and rate)."""
    m = bundle.manifest
    pruning = video_pruning(bundle) if pruning is None else pruning
    m.check_pruning(pruning.method, pruning.rate)
    return EngineConfig(m.prefill_seq_len, m.ctx_len, m.user_vision_size, pruning.rate,
                        video_pruning_method=pruning.method, short_prefill_lens=m.short_prefill_lens, **overrides)


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
    return _answer(bundle, engine, pieces, [video])


def answer_media(bundle: ExportBundle, engine: Engine, media: Sequence[MediaInput], question: str,
                 use_audio_in_video: bool = False) -> GenerationResult:
    """A question about several items (images, audio clips and videos, in ``media``'s order, before the question),
    rendered by the chat template as vLLM's chat endpoint renders a user turn of those parts. With
    ``use_audio_in_video`` a video's sound (an audio item) follows it in ``media`` and in the prompt, as vLLM's
    Nemotron-H processor lays it out: the video block, then the sound's."""
    for item in media:
        if item.kind == "video":
            bundle.manifest.check_video(item.grid_thw)
    sounds = {i + 1 for i, item in enumerate(media) if use_audio_in_video and item.kind == "video"}
    if any(i >= len(media) or media[i].kind != "audio" for i in sounds):
        raise ValueError("use_audio_in_video: each video needs its sound (an audio item) right after it")
    content = [{"type": item.kind} for i, item in enumerate(media) if i not in sounds]
    pieces = chat_pieces(bundle.tokenizer, content + [{"type": "text", "text": question}],
                         bundle.family.token_strings, sound_in_video=bool(sounds))
    return _answer(bundle, engine, pieces, list(media))


def _answer(bundle: ExportBundle, engine: Engine, pieces, media: list[MediaInput]) -> GenerationResult:
    started = time.perf_counter()
    prompt = engine.prepare(pieces, media)
    vision = time.perf_counter() - started
    result = engine.generate(prompt, eos_ids=stop_ids(bundle))
    result.seconds = {"vision": vision, **result.seconds}
    return result


def build_serving_engine(bundle: ExportBundle, backend: str = "ort", max_num_seqs: int | None = None,
                         max_num_batched_tokens: int | None = None, encoder_cache_rows: int | None = None,
                         progress: Progress | None = None, device: str | None = None, device_ids=None,
                         pruning: VideoPruning | None = None, row_reuse: bool = True):
    """A continuous-batching serving engine over an export made with ``--full-batch-size`` (``row_reuse``: a
    request reuses what a free KV row holds of its prompt, ``engine/row_history.py``)."""
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
    # As vLLM's compute_encoder_budget: the encoder budget and cache hold at least the largest item (a request may
    # choose rate 0: the longest video unpruned).
    largest_item = largest_item_rows(bundle, VideoPruning(config.pruning.method, 0.0))
    rows = max(budget, largest_item) if encoder_cache_rows is None else encoder_cache_rows
    scheduler = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=seqs,
                                prefill_seq_len=m.prefill_seq_len, ctx_len=m.ctx_len,
                                encoder_compute_budget=rows, encoder_cache_size=rows, row_reuse=row_reuse)
    vision, language = sessions_for(bundle, backend, device, device_ids, method=config.video_pruning_method)
    try:
        return ServingEngine(bundle.family, vision, language, config, scheduler, stop_ids(bundle), progress)
    except ValueError:  # e.g. max_num_seqs above the export's rows: give the devices back before failing
        close_session(vision)
        close_session(language)
        raise


def generate_all(engine, requests: Iterable,
                 on_finished: Callable[[str, list[int], object], Iterable | None] | None = None,
                 on_token: Callable[[object], None] | None = None) -> dict[str, list[int]]:
    """Every request (``ServeRequest``) through a serving engine until all have finished: each one's generated token
    ids by request id. ``on_token(event)`` sees every ``TokenEvent``; ``on_finished(request_id, token_ids, event)``
    runs as each request finishes (``event``: its last, with ``finish_reason`` and ``num_cached_tokens``), and the
    requests it returns (a conversation's follow-ups) are queued then."""
    for request in requests:
        engine.add_request(request)
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for event in engine.step():
            tokens.setdefault(event.request_id, []).append(event.token_id)
            if on_token is not None:
                on_token(event)
            if event.finish_reason is not None and on_finished is not None:
                for request in on_finished(event.request_id, tokens[event.request_id], event) or ():
                    engine.add_request(request)
    return tokens


def largest_item_rows(bundle: ExportBundle, pruning: VideoPruning) -> int:
    """Encoder rows of the largest item the export serves under ``pruning``: the longest video (its largest
    bucket) at the resolution with the most tokens, or the largest image."""
    m, factor = bundle.manifest, bundle.preprocess.factor
    tokens = max((h // factor) * (w // factor) for h, w in m.resolutions)
    return max(largest_image_rows(bundle), pruning.kept_token_count(tokens, max(m.temporal_patch_buckets)))


def largest_image_rows(bundle: ExportBundle) -> int:
    """Rows of the largest image: a tiled family's at its default most tiles and the thumbnail (vLLM sizes its
    encoder cache with the processor's ``max_num_tiles`` alike), else one at the resolution with the most tokens."""
    m, factor = bundle.manifest, bundle.preprocess.factor
    if IMAGE_ENCODER in m.files:
        tiling = bundle.family.image_tiling()
        side = tiling.tile_size // factor
        return (tiling.max_tiles + int(tiling.thumbnail)) * side * side
    return max((h // factor) * (w // factor) for h, w in m.resolutions)
