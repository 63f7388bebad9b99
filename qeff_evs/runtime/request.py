"""A request's prompt, before and after its videos are encoded.

Before encoding only each video's retained count K is known, so the prompt holds the family's
provisional placeholder (fixed length). After encoding, each placeholder is rewritten in place to
the real layout (same length) and the request's M-RoPE positions are computed once, in int64,
as the unpruned positions restricted to the retained tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from qeff_evs import positions as pos
from qeff_evs.models.protocol import ModelFamily, VideoInput, VideoLayout
from qeff_evs.runtime.window import Placeholder


@dataclass(frozen=True)
class PromptPiece:
    """Either literal token ids or one video (by index into the request's videos)."""

    ids: tuple[int, ...] = ()
    video: int | None = None


@dataclass
class EncodedVideo:
    rows: np.ndarray  # (K, hidden)
    retained_indices: np.ndarray  # (K,) int64, ascending flat indices on the merged grid
    deepstack: np.ndarray | None = None  # (levels, K, hidden)
    kept_per_frame: tuple[int, ...] = ()


@dataclass
class PreparedPrompt:
    """Token ids fed to the language graph, with their positions and media placeholders."""

    ids: np.ndarray  # (N,) int64
    positions: np.ndarray  # (3, N) int64
    decode_start: int  # M-RoPE position of the first generated token
    placeholders: list[Placeholder]
    encoded: list[EncodedVideo] = field(default_factory=list)


def provisional_ids(pieces: list[PromptPiece], videos: list[VideoInput], retained: list[int],
                    family: ModelFamily) -> np.ndarray:
    """The prompt as it can be built before encoding (placeholders sized by K)."""
    parts = [np.asarray(p.ids, dtype=np.int64) if p.video is None
             else family.placeholder_ids(videos[p.video], retained[p.video]) for p in pieces]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def prepare_prompt(pieces: list[PromptPiece], videos: list[VideoInput], encoded: list[EncodedVideo],
                   family: ModelFamily) -> PreparedPrompt:
    """Final ids (real per-frame layouts), int64 positions and placeholders for the language graph."""
    specials = family.special_tokens()
    pads = specials.media_pads
    final_parts, unpruned_parts, keep_parts, blocks = [], [], [], []
    placeholders = []
    offset = 0
    for piece in pieces:
        if piece.video is None:
            ids = np.asarray(piece.ids, dtype=np.int64)
            final_parts.append(ids)
            unpruned_parts.append(ids)
            keep_parts.append(np.ones(len(ids), dtype=bool))
            offset += len(ids)
            continue
        video, enc = videos[piece.video], encoded[piece.video]
        layout: VideoLayout = family.video_layout(video, enc.retained_indices)
        expected = len(family.placeholder_ids(video, len(enc.retained_indices)))
        ids = layout.ids
        if len(ids) != expected:
            raise ValueError(f"video {piece.video}: real layout has {len(ids)} tokens, the placeholder {expected}")
        final_parts.append(ids)
        unpruned_parts.append(layout.unpruned_ids)
        keep_parts.append(layout.keep)
        blocks.extend(layout.blocks)
        is_embed = np.isin(ids, pads)
        placeholders.append(Placeholder(offset, len(ids), None if is_embed.all() else is_embed))
        offset += len(ids)
    final = np.concatenate(final_parts)
    unpruned_ids = np.concatenate(unpruned_parts)
    keep = np.concatenate(keep_parts)
    unpruned = pos.unpruned_positions(unpruned_ids.tolist(), set(pads), blocks)
    restricted = pos.pruned_positions(unpruned, torch.from_numpy(keep))
    return PreparedPrompt(
        ids=final,
        positions=np.asarray(restricted, dtype=np.int64),
        decode_start=pos.decode_start(unpruned),
        placeholders=placeholders,
        encoded=list(encoded),
    )
