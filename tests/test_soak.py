"""Soak: 200 requests of random sizes stream through one serving engine.

Requests arrive whenever fewer than a handful are outstanding, a few are aborted at random
moments, and the engine runs until the stream is drained. Nothing may be lost (every request
either finishes once or was aborted by the test), the encoder cache never holds more rows than
its capacity and is empty at the end, and memory stays flat: the resident set size after the
last request is within 10% of the size after the first 20. A sample of the finished requests is
checked against the same request run alone through the single-request engine.
"""

from __future__ import annotations

import gc
import os
import warnings
from pathlib import Path

import numpy as np
import pytest

from qeff_evs.export.pipeline import ExportOptions, export_checkpoint
from qeff_evs.models.protocol import MediaInput
from qeff_evs.models.tiny import save_tiny_checkpoint
from qeff_evs.runtime.engine.single_request import Engine, EngineConfig
from qeff_evs.runtime.engine.request import PromptPiece
from qeff_evs.runtime.builders import build_serving_engine, stop_ids
from qeff_evs.runtime.export_bundle import open_export
from qeff_evs.runtime.media import image_from_array, video_from_file
from qeff_evs.runtime.sessions import sessions_for
from qeff_evs.runtime.engine.scheduler import FinishReason
from qeff_evs.runtime.engine.serving import ServeRequest
from qeff_evs.runtime.inputs.synthetic import moving_square_video

NUM_REQUESTS = 200
OUTSTANDING = 6  # requests waiting or running at once (4 run, the rest queue)
WARMUP = 20  # finished requests before the first memory reading
ABORT_RATE = 0.03  # chance per step that the test aborts a random live request
ENCODER_ROWS = 64
CHECKED_ALONE = 8
WORDS = ("what", "moves", "here", "square", "left", "12", "frame", "why")

# 112x112 -> 4x4 merged tokens per temporal patch, 112x168 -> 4x6; at most 2 temporal patches.
OPTIONS = ExportOptions(0.5, (2, 4), ((112, 112), (112, 168)), prefill_seq_len=16, ctx_len=96, full_batch_size=4)


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    folder = tmp_path_factory.mktemp("soak")
    checkpoint = save_tiny_checkpoint("qwen2_5_vl", folder / "checkpoint", seed=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        export_checkpoint(checkpoint, folder / "export", OPTIONS)
    return open_export(folder / "export")


def media_pool(bundle, folder: Path, rng: np.random.Generator) -> list[MediaInput]:
    """Videos of 2-5 source frames and images, of several sizes (both exported resolutions)."""
    pool = []
    for number in range(10):
        path = folder / f"clip{number}.npy"
        size = (int(rng.integers(90, 130)), int(rng.integers(90, 200)))
        np.save(path, moving_square_video(int(rng.integers(2, 6)), *size, seed=number))
        pool.append(video_from_file(path, bundle))
    for _ in range(5):
        size = (int(rng.integers(90, 130)), int(rng.integers(90, 200)), 3)
        pool.append(image_from_array(rng.integers(0, 256, size=size, dtype=np.uint8), bundle))
    return pool


def make_request(bundle, number: int, pool: list[MediaInput], rng: np.random.Generator) -> ServeRequest:
    media = [pool[int(i)] for i in rng.choice(len(pool), size=int(rng.integers(1, 3)), replace=False)]
    question = " ".join(rng.choice(WORDS, size=int(rng.integers(1, 8))).tolist())
    content = [{"type": m.kind} for m in media] + [{"type": "text", "text": question}]
    text = bundle.tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                add_generation_prompt=True)
    pieces = []
    for item, part in enumerate(text.replace("<|image_pad|>", "<|video_pad|>").split("<|video_pad|>")):
        if item:
            pieces.append(PromptPiece(media_item=item - 1))
        pieces.append(PromptPiece(ids=tuple(bundle.tokenizer.encode(part, add_special_tokens=False))))
    return ServeRequest(f"s{number}", pieces, media, max_new_tokens=int(rng.integers(1, 5)))


def alone(bundle, sessions, request: ServeRequest) -> list[int]:
    m = bundle.manifest
    config = EngineConfig(m.prefill_seq_len, m.ctx_len, m.user_vision_size, m.video_pruning_rate,
                          max_new_tokens=request.max_new_tokens)
    engine = Engine(bundle.family, *sessions, config)
    return engine.generate(engine.prepare(list(request.pieces), list(request.media)),
                           eos_ids=stop_ids(bundle)).generated_token_ids


def test_two_hundred_requests_finish_with_flat_memory_and_an_empty_cache(bundle, tmp_path):
    rng = np.random.default_rng(0)
    pool = media_pool(bundle, tmp_path, rng)
    engine = build_serving_engine(bundle, max_num_batched_tokens=20, encoder_cache_rows=ENCODER_ROWS)
    eos = set(stop_ids(bundle))

    requests: dict[str, ServeRequest] = {}
    tokens: dict[str, list[int]] = {}
    finished: dict[str, FinishReason] = {}
    aborted: set[str] = set()
    rss_after_warmup = None
    most_rows = 0
    while len(requests) < NUM_REQUESTS or engine.has_unfinished():
        live = len(requests) - len(finished) - len(aborted)
        while live < OUTSTANDING and len(requests) < NUM_REQUESTS:
            request = make_request(bundle, len(requests), pool, rng)
            requests[request.request_id] = request
            engine.add_request(request)
            live += 1
        if engine.live and rng.random() < ABORT_RATE:
            victim = sorted(engine.live)[int(rng.integers(len(engine.live)))]
            engine.abort(victim)
            aborted.add(victim)
        if not engine.has_unfinished():
            continue
        for event in engine.step():
            tokens.setdefault(event.request_id, []).append(event.token_id)
            if event.finish_reason is not None:
                assert event.request_id not in finished, f"{event.request_id} finished twice"
                finished[event.request_id] = event.finish_reason
        most_rows = max(most_rows, sum(len(e.kept_indices) for e in engine.encoder_outputs.values()))
        if rss_after_warmup is None and len(finished) >= WARMUP:
            gc.collect()
            rss_after_warmup = rss_bytes()

    # Nothing lost: every request finished exactly once or was aborted, never both.
    assert len(requests) == NUM_REQUESTS
    assert set(finished) | aborted == set(requests) and not set(finished) & aborted
    assert 0 < len(aborted) < NUM_REQUESTS // 10
    for rid, reason in finished.items():
        out, limit = tokens[rid], requests[rid].max_new_tokens
        if reason is FinishReason.LENGTH:
            assert len(out) == limit, rid
        else:
            assert reason is FinishReason.EOS and out[-1] in eos and len(out) <= limit, rid

    # The cache stayed within its rows and ends empty.
    assert 0 < most_rows <= ENCODER_ROWS
    assert engine.scheduler.cache.is_empty and engine.encoder_outputs == {} and engine.live == {}

    # Memory is flat.
    gc.collect()
    rss_end = rss_bytes()
    assert rss_end <= 1.10 * rss_after_warmup, f"RSS grew from {rss_after_warmup / 2**20:.1f} MiB " \
                                               f"to {rss_end / 2**20:.1f} MiB over {NUM_REQUESTS} requests"

    # A sample of the finished requests got exactly what they get alone.
    sessions = sessions_for(bundle, "ort")
    sample = rng.choice(sorted(finished), size=CHECKED_ALONE, replace=False)
    for rid in sample:
        assert tokens[rid] == alone(bundle, sessions, requests[rid]), rid
