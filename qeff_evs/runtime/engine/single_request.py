"""Runs one request through the vision and language sessions: encode, windowed chunked prefill, greedy decode."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from qeff_evs import evs
from qeff_evs.models.protocol import ModelFamily, MediaInput
from qeff_evs.runtime.engine.steps import decode_step, prefill_step
from qeff_evs.runtime.engine.request import EncodedMedia, PreparedPrompt, PromptPiece, plan_prompt
from qeff_evs.runtime.backends.base import LanguageSession, VisionSession
from qeff_evs.runtime.engine.window import prefill_chunks

TOP_LOGITS = 10


@dataclass(frozen=True)
class EngineConfig:
    prefill_seq_len: int
    ctx_len: int
    user_vision_size: int
    video_pruning_rate: float
    max_new_tokens: int = 16
    pad_token_id: int = 0

    def __post_init__(self) -> None:
        evs.validate_pruning_rate(self.video_pruning_rate)
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.user_vision_size < self.prefill_seq_len:
            raise ValueError(
                f"user_vision_size {self.user_vision_size} is below prefill_seq_len {self.prefill_seq_len}: a "
                "chunk can hold that many media tokens; use --user-vision-size >= --prefill-seq-len")


@dataclass
class GenerationResult:
    prompt_token_ids: list[int]
    generated_token_ids: list[int]
    prefill_top_logits: list[list[float]]
    retained_tokens_per_frame: list[list[int]]
    num_prefill_chunks: int
    vision_rows_per_chunk: list[int] = field(default_factory=list)

    def to_json(self) -> dict:
        return dict(self.__dict__)


def top_logits(logits: np.ndarray, k: int = TOP_LOGITS) -> list[list[float]]:
    flat = np.asarray(logits, dtype=np.float64).reshape(-1)
    order = np.argsort(-flat, kind="stable")[:k]
    return [[int(i), float(flat[i])] for i in order]


def retained_count(family: ModelFamily, media: MediaInput, q: float) -> int:
    """K for one media item (an image, T = 1, keeps all its tokens by the same rule)."""
    t, h, w = family.merged_grid(media.grid_thw)
    return evs.retained_token_count(h * w, t, q)


def encode_media(family: ModelFamily, vision: VisionSession, media: MediaInput, q: float) -> EncodedMedia:
    """Run the vision graph once for one item: its K retained rows, their indices and per-frame counts."""
    k = retained_count(family, media, q)
    result = vision.run(media.pixel_values.numpy(), family.vision_host_inputs(media.grid_thw, k))
    t, h, w = family.merged_grid(media.grid_thw)
    retained = result.retained_indices.astype(np.int64)
    kept = evs.tokens_per_frame_kept(retained, t, h * w)
    return EncodedMedia(result.rows, retained, result.deepstack, tuple(kept))


class Engine:
    def __init__(self, family: ModelFamily, vision: VisionSession, language: LanguageSession,
                 config: EngineConfig, progress: Callable[[str], None] | None = None):
        self.family = family
        self.vision = vision
        self.language = language
        self.config = config
        self.progress = progress or (lambda message: None)

    def encode(self, video: MediaInput) -> EncodedMedia:
        return encode_media(self.family, self.vision, video, self.config.video_pruning_rate)

    def prepare(self, pieces: list[PromptPiece], videos: list[MediaInput]) -> PreparedPrompt:
        """Encode every media item of one request and return its final ids and positions."""
        retained = [retained_count(self.family, v, self.config.video_pruning_rate) for v in videos]
        plan = plan_prompt(pieces, videos, retained, self.family)
        self._check_fits(len(plan.ids))
        for i, video in enumerate(videos):
            self.progress(f"vision graph: {video.kind} {i} grid {tuple(video.grid_thw)}, keeping {retained[i]} tokens")
            plan.fill(i, video, self.encode(video), self.family)
        return plan.prepared()

    def _check_fits(self, num_prompt_tokens: int) -> None:
        # Pad writes of a partial chunk land in KV slot ctx_len-1, so that slot must stay free during prefill.
        need = num_prompt_tokens + self.config.max_new_tokens
        if need > self.config.ctx_len:
            raise ValueError(
                f"the prompt ({num_prompt_tokens} tokens) plus max_new_tokens ({self.config.max_new_tokens}) "
                f"needs {need} KV slots but ctx_len is {self.config.ctx_len}; use fewer frames, a higher "
                "--video-pruning-rate, fewer new tokens, or export with a larger --ctx-len")

    def generate(self, prompt: PreparedPrompt, eos_ids: tuple[int, ...] = (),
                 chunks: list[tuple[int, int]] | None = None) -> GenerationResult:
        """Prefill in ``chunks`` (``(computed, scheduled)``; default: cut every prefill_seq_len), then decode."""
        cfg = self.config
        shape = self.language.shape
        self._check_fits(len(prompt.ids))
        self.language.reset()
        chunks = chunks or prefill_chunks(len(prompt.ids), cfg.prefill_seq_len)
        covered = [c for c, _ in chunks] + [len(prompt.ids)]
        if covered[0] != 0 or any(c + n != nxt for (c, n), nxt in zip(chunks, covered[1:])):
            raise ValueError(f"prefill chunks {chunks} do not cover the prompt's {len(prompt.ids)} tokens in order")
        rows_per_chunk = []
        logits = None
        for number, (computed, scheduled) in enumerate(chunks, 1):
            step = prefill_step(prompt, computed, scheduled, cfg.prefill_seq_len, cfg.user_vision_size,
                                shape.hidden, shape.deepstack_levels, cfg.pad_token_id)
            rows_per_chunk.append(step.vision_rows)
            self.progress(f"prefill chunk {number}/{len(chunks)}: {scheduled} tokens, {step.vision_rows} vision rows")
            logits = self.language.run(step)
        generated = [int(np.argmax(logits.reshape(-1)))]
        prefill_top = top_logits(logits)
        for j in range(1, cfg.max_new_tokens):
            if generated[-1] in eos_ids:
                break
            step = decode_step(generated[-1], len(prompt.ids) + j - 1, prompt.decode_start + j - 1)
            logits = self.language.run(step)
            generated.append(int(np.argmax(logits.reshape(-1))))
        self.progress(f"decoded {len(generated)} tokens")
        return GenerationResult(
            prompt_token_ids=prompt.ids.tolist(),
            generated_token_ids=generated,
            prefill_top_logits=prefill_top,
            retained_tokens_per_frame=[list(e.kept_per_frame) for e in prompt.encoded],
            num_prefill_chunks=len(chunks),
            vision_rows_per_chunk=rows_per_chunk,
        )
