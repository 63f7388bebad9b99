"""One request through the serving engine: encode, windowed chunked prefill at chosen boundaries, greedy decode.

``prepare`` encodes every media item up front and returns the final prompt; ``generate`` queues it
as the serving engine's only request, with the prefill cut at ``chunks`` (default: every
``prefill_seq_len`` tokens), and reports what the chunks saw. Works on exports with and without
continuous batching.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from qeff_evs.models.protocol import ModelFamily, MediaInput
from qeff_evs.positions import check_rope_range
from qeff_evs.runtime.backends.base import LanguageSession, VisionSession, close_session
from qeff_evs.runtime.engine.executor import EngineConfig, encode_media, kept_count, media_pruning
from qeff_evs.runtime.engine.request import EncodedMedia, PreparedPrompt, PromptPiece, PromptPlan, plan_prompt
from qeff_evs.runtime.engine.scheduler import SchedulerConfig, check_fits_context
from qeff_evs.runtime.engine.serving import ServingEngine
from qeff_evs.runtime.engine.window import prefill_chunks

TOP_LOGITS = 10
REQUEST_ID = "request"


@dataclass
class GenerationResult:
    prompt_token_ids: list[int]
    generated_token_ids: list[int]
    prefill_top_logits: list[list[float]]
    kept_tokens_per_frame: list[list[int]]
    num_prefill_chunks: int
    vision_rows_per_chunk: list[int] = field(default_factory=list)
    # wall seconds by phase: "prefill" (the first chunk to the first token) and "decode" (the first token to the last)
    # from generate(); "vision" (every item's encoder and pruning) where the caller timed prepare() (builders.answer)
    seconds: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict:
        data = dict(self.__dict__)
        del data["seconds"]
        seconds = dict(self.seconds)
        if "vision" in seconds and "prefill" in seconds:
            seconds["ttft"] = seconds["vision"] + seconds["prefill"]  # from the patches to the first token
        data["seconds"] = seconds
        data["num_prompt_tokens"] = len(self.prompt_token_ids)
        data["num_kept_vision_tokens"] = sum(sum(frame) for frame in self.kept_tokens_per_frame)
        return data


def top_logits(logits: np.ndarray, k: int = TOP_LOGITS) -> list[list[float]]:
    flat = np.asarray(logits, dtype=np.float64).reshape(-1)
    order = np.argsort(-flat, kind="stable")[:k]
    return [[int(i), float(flat[i])] for i in order]


@dataclass(eq=False)
class Engine:
    family: ModelFamily
    vision: VisionSession
    language: LanguageSession
    config: EngineConfig
    progress: Callable[[str], None] | None = None

    def __post_init__(self) -> None:
        self.progress = self.progress or (lambda message: None)

    def close(self) -> None:
        """Release the sessions' programs (QAIC); the engine serves no request after this."""
        try:
            close_session(self.vision)
        finally:
            close_session(self.language)

    def encode(self, video: MediaInput) -> EncodedMedia:
        return encode_media(self.family, self.vision, video, media_pruning(video, self.config.pruning))

    def prepare(self, pieces: list[PromptPiece], videos: list[MediaInput]) -> PreparedPrompt:
        """Encode every media item of one request and return its final ids and positions."""
        kept = [kept_count(self.family, v, media_pruning(v, self.config.pruning)) for v in videos]
        plan = plan_prompt(pieces, videos, kept, self.family)
        self._check_fits(len(plan.ids))
        # Before the encoder runs; generate() admits the request through Executor.add, which checks it for every engine.
        check_rope_range(plan.decode_start, self.config.max_new_tokens, self.language.shape.rope_positions)
        for i, video in enumerate(videos):
            self.progress(f"vision graph: {video.kind} {i} grid {tuple(video.grid_thw)}, keeping {kept[i]} tokens")
            plan.fill(i, video, self.encode(video), self.family)
        return plan.prepared()

    def _check_fits(self, num_prompt_tokens: int) -> None:
        check_fits_context(num_prompt_tokens, self.config.max_new_tokens, self.config.ctx_len)

    def _check_chunks(self, chunks: list[tuple[int, int]], num_prompt_tokens: int) -> None:
        covered = [c for c, _ in chunks] + [num_prompt_tokens]
        if covered[0] != 0 or any(c + n != nxt for (c, n), nxt in zip(chunks, covered[1:])):
            raise ValueError(f"prefill chunks {chunks} do not cover the prompt's {num_prompt_tokens} tokens in order")
        for computed, scheduled in chunks:
            if scheduled < 1:
                raise ValueError(f"prefill chunk at {computed} is empty; give every chunk >= 1 token")
            if scheduled > self.config.prefill_seq_len:
                raise ValueError(
                    f"chunk of {scheduled} tokens exceeds the prefill length {self.config.prefill_seq_len}")

    def _scheduler(self, prompt: PreparedPrompt) -> SchedulerConfig:
        # One request, one chunk per step; the encoder cache holds every item (they arrive encoded).
        rows = max(1, sum(ph.num_embeds for ph in prompt.placeholders))
        cfg = self.config
        return SchedulerConfig(max_num_batched_tokens=cfg.prefill_seq_len, max_num_seqs=1,
                               prefill_seq_len=cfg.prefill_seq_len, ctx_len=cfg.ctx_len,
                               encoder_compute_budget=rows, encoder_cache_size=rows)

    def generate(self, prompt: PreparedPrompt, eos_ids: tuple[int, ...] = (),
                 chunks: list[tuple[int, int]] | None = None) -> GenerationResult:
        """Prefill in ``chunks`` (``(computed, scheduled)``; default: ``prefill_chunks`` over the export's prefill
        lengths), then decode."""
        cfg = self.config
        self._check_fits(len(prompt.ids))
        chunks = chunks or prefill_chunks(len(prompt.ids), cfg.prefill_seq_len, cfg.short_prefill_lens)
        self._check_chunks(chunks, len(prompt.ids))
        serving = ServingEngine(self.family, self.vision, self.language, cfg, self._scheduler(prompt), eos_ids,
                                self.progress)
        # Items arrive encoded: their keys only name them for the scheduler's encoder cache.
        keys = [f"{REQUEST_ID}/item-{i}" for i in range(len(prompt.placeholders))]
        request = serving.add_planned(REQUEST_ID, PromptPlan.of_prepared(prompt), (), keys, cfg.max_new_tokens,
                                      chunk_ends=tuple(c + n for c, n in chunks))
        started = time.perf_counter()
        first_token = None
        while serving.has_unfinished():
            if serving.step() and first_token is None:
                first_token = time.perf_counter()
        finished = time.perf_counter()
        first_token = finished if first_token is None else first_token
        self.progress(f"decoded {len(request.tokens)} tokens")
        return GenerationResult(
            prompt_token_ids=prompt.ids.tolist(),
            generated_token_ids=list(request.tokens),
            prefill_top_logits=top_logits(request.prompt_logits),
            kept_tokens_per_frame=[list(e.kept_per_frame) for e in prompt.encoded],
            num_prefill_chunks=len(request.vision_rows_per_chunk),
            vision_rows_per_chunk=list(request.vision_rows_per_chunk),
            seconds={"prefill": first_token - started, "decode": finished - first_token},
        )
