"""The benchmark's inputs: the synthetic moving-square clip, a fixed-length question, the prepared prompt.

The language side is timed on the published video size, where the vision graph is too heavy to run
(see ``BenchConfig.vision_frame_size``). Its kept tokens are chosen by the reference EVS rule
applied to the clip's pixels, merged per token as the encoder's merger groups them; the embedding
rows are random. Which tokens are kept changes positions, not the work per chunk, so prefill
timings do not depend on that choice; the kept *count* is exactly the production rule.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from qeff_evs import evs
from qeff_evs.models.protocol import SAMPLING_FPS, ModelFamily, MediaInput, audio_rows
from qeff_evs.runtime.inputs.preprocess_spec import VisionPreprocessSpec
from qeff_evs.runtime.inputs.processor import preprocess_video
from qeff_evs.runtime.engine.request import EncodedMedia, PreparedPrompt, PromptPiece, prepare_prompt
from qeff_evs.runtime.inputs.audio_features import audio_input
from qeff_evs.runtime.inputs.synthetic import moving_square_video


@dataclass(frozen=True)
class Clip:
    """A synthetic clip: RGB frames and the encoder input made from them."""

    frames: np.ndarray  # (T, H, W, 3) uint8
    video: MediaInput

    @property
    def grid_thw(self) -> tuple[int, int, int]:
        return self.video.grid_thw


def synthetic_clip(spec: VisionPreprocessSpec, num_frames: int, size: int, seed: int) -> Clip:
    """The moving-square clip at ``size`` x ``size``, preprocessed for the family's encoder."""
    frames = moving_square_video(num_frames, size, size, seed=seed)
    processed = preprocess_video(frames, (size, size), spec)
    times = tuple(i / SAMPLING_FPS for i in range(num_frames))  # the clip is taken as already sampled
    return Clip(frames, MediaInput(processed.pixel_values, tuple(processed.grid_thw), SAMPLING_FPS, times,
                                   frame_indices=tuple(range(num_frames)), source_fps=SAMPLING_FPS))


def merged_pixel_tokens(pixel_values: torch.Tensor, merge_size: int) -> torch.Tensor:
    """``(T*H*W, patch_dim)`` patches -> ``(T*h*w, merge^2 * patch_dim)``: one row per merged token.

    Patches come in merge-block order, so each token's ``merge^2`` patches are consecutive rows.
    """
    group = merge_size * merge_size
    if pixel_values.shape[0] % group:
        raise ValueError(f"{pixel_values.shape[0]} patch rows do not group into merge blocks of {group}")
    return pixel_values.reshape(pixel_values.shape[0] // group, group * pixel_values.shape[1])


def pixel_kept_indices(video: MediaInput, merge_size: int, q: float) -> np.ndarray:
    """Ascending flat indices EVS keeps when its dissimilarity is taken on the pixels themselves."""
    tokens = merged_pixel_tokens(video.pixel_values.to(torch.float32), merge_size)
    mask = evs.retention_mask(tokens, video.grid_thw, merge_size, q)
    return torch.nonzero(mask).reshape(-1).numpy().astype(np.int64)


def question_ids(num_tokens: int, first_special_id: int, seed: int) -> tuple[int, ...]:
    """A fixed-length question of ordinary (non-special) token ids, reproducible from ``seed``."""
    rng = np.random.default_rng(seed)
    return tuple(int(i) for i in rng.integers(0, first_special_id, size=num_tokens))


def prompt_pieces(family: ModelFamily, question: tuple[int, ...]) -> list[PromptPiece]:
    """The family's plain video block (markers around the video), then the question (``runtime.prompt``'s
    plain layout)."""
    before, after = family.video_block_ids()
    return [PromptPiece(ids=before), PromptPiece(media_item=0), PromptPiece(ids=(*after, *question))]


def random_rows(num_rows: int, hidden: int, seed: int,
                extras: Mapping[str, int] | None = None) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Stand-in vision embeddings ``(K, hidden)`` and extra rows ``(levels, K, hidden)`` by name, float32."""
    rng = np.random.default_rng(seed)
    rows = rng.standard_normal((num_rows, hidden), dtype=np.float32)
    extra = {name: rng.standard_normal((levels, num_rows, hidden), dtype=np.float32)
             for name, levels in (extras or {}).items() if levels}
    return rows, extra


def language_prompt(family: ModelFamily, clip: Clip, q: float, question: tuple[int, ...], hidden: int,
                    extras: Mapping[str, int], merge_size: int, seed: int,
                    sound: MediaInput | None = None) -> PreparedPrompt:
    """Final ids and int64 positions of the clip pruned at ``q`` followed by the question; ``sound``: the clip's
    sound right after it, as vLLM's ``use_audio_in_video`` lays it (every row kept)."""
    indices = pixel_kept_indices(clip.video, merge_size, q)
    rows, extra = random_rows(len(indices), hidden, seed, extras)
    t, h, w = family.merged_grid(clip.grid_thw)
    encoded = EncodedMedia(rows, indices, extra, tuple(evs.tokens_per_frame_kept(indices, t, h * w)))
    pieces = prompt_pieces(family, question)
    if sound is None:
        return prepare_prompt(pieces, [clip.video], [encoded], family)
    count = audio_rows(family.audio_features(), sound.clip_frames)
    sound_rows, sound_extra = random_rows(count, hidden, seed + 1, extras)
    heard = EncodedMedia(sound_rows, np.arange(count, dtype=np.int64), sound_extra, (count,))
    return prepare_prompt([*pieces[:2], PromptPiece(media_item=1), *pieces[2:]], [clip.video, sound],
                          [encoded, heard], family)


def synthetic_sound(family: ModelFamily, seconds: float, seed: int) -> MediaInput:
    """``seconds`` of seeded noise at the checkpoint's rate as its audio encoder's input (the encoder's work depends
    on the length only)."""
    features = family.audio_features()
    if features is None:
        raise ValueError(f"--sound-seconds: {family.name} has no audio encoder; benchmark a sound track on "
                         "--family nemotron_h_omni")
    samples = int(round(seconds * features.sampling_rate))
    wave = 0.1 * np.random.default_rng(seed).standard_normal(samples).astype(np.float32)
    return audio_input(wave, features)


def first_special_id(family: ModelFamily) -> int:
    return min(family.special_tokens().ids)
