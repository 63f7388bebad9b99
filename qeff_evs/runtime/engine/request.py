"""A request's prompt, before and after its videos are encoded.

Before encoding only each video's kept count K is known, so the prompt holds the family's
provisional placeholder (fixed length). After encoding, each placeholder is rewritten in place to
the real layout (same length) and the request's M-RoPE positions are computed once, in int64,
as the unpruned positions restricted to the kept tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from qeff_evs import positions as pos
from qeff_evs.models.protocol import ModelFamily, MediaInput, MediaLayout
from qeff_evs.runtime.engine.window import Placeholder
from qeff_evs.runtime.inputs.prompt import PromptPiece


@dataclass
class EncodedMedia:
    rows: np.ndarray  # (K, hidden)
    kept_indices: np.ndarray  # (K,) int64, ascending flat indices on the merged grid
    extras: Mapping[str, np.ndarray] = field(default_factory=dict)  # the family's extra rows, (levels, K, hidden)
    kept_per_frame: tuple[int, ...] = ()


@dataclass
class PreparedPrompt:
    """Token ids fed to the language graph, with their positions and media placeholders."""

    ids: np.ndarray  # (N,) int64
    positions: np.ndarray  # (3, N) int64
    decode_start: int  # M-RoPE position of the first generated token
    placeholders: list[Placeholder]
    encoded: list[EncodedMedia] = field(default_factory=list)


def provisional_ids(pieces: list[PromptPiece], videos: list[MediaInput], kept: list[int],
                    family: ModelFamily) -> np.ndarray:
    """The prompt as it can be built before encoding (placeholders sized by K)."""
    parts = [np.asarray(p.ids, dtype=np.int64) if p.media_item is None
             else family.placeholder_ids(videos[p.media_item], kept[p.media_item]) for p in pieces]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


@dataclass
class PromptPlan:
    """A request's prompt once its media grids are known; each item is filled in when it is encoded.

    Text positions and the placeholders' offsets and lengths are final from the start (they depend
    on grids and K only); an item's real ids and positions need its kept indices, so the engine
    completes it after the vision graph ran, before any chunk reaches its placeholder.
    """

    ids: np.ndarray  # (N,) int64; provisional inside placeholders until completed
    positions: np.ndarray  # (3, N) int64; -1 inside placeholders until completed
    decode_start: int
    placeholders: list[Placeholder]  # one per media item, in media order
    encoded: list[EncodedMedia | None]
    unpruned_positions: list[np.ndarray]  # per media item to fill: (3, unpruned length) positions of its segment

    @property
    def complete(self) -> bool:
        return all(e is not None for e in self.encoded)

    def items_needing_fill(self, computed: int, scheduled: int) -> list[int]:
        """Unfilled items whose placeholder, past its leading text, overlaps ``[computed, computed+scheduled)``."""
        end = computed + scheduled
        return [i for i, ph in enumerate(self.placeholders) if self.encoded[i] is None
                and ph.offset + ph.leading_text < end and ph.offset + ph.length > computed]

    def fill(self, item: int, video: MediaInput, encoded: EncodedMedia, family: ModelFamily) -> None:
        """Rewrite item ``item``'s placeholder to its real layout and write its positions."""
        layout: MediaLayout = family.video_layout(video, encoded.kept_indices)
        ph = self.placeholders[item]
        if len(layout.ids) != ph.length:
            raise ValueError(f"media item {item}: real layout has {len(layout.ids)} tokens, "
                             f"its placeholder {ph.length}")
        self.ids[ph.offset:ph.offset + ph.length] = layout.ids
        self.positions[:, ph.offset:ph.offset + ph.length] = self.unpruned_positions[item][:, layout.keep]
        self.placeholders[item] = Placeholder.of_ids(ph.offset, layout.ids, family.special_tokens().media_pads)
        self.encoded[item] = encoded

    @classmethod
    def of_prepared(cls, prompt: PreparedPrompt) -> PromptPlan:
        """The complete plan of a prompt whose items are all encoded (nothing left to fill)."""
        return cls(prompt.ids, prompt.positions, prompt.decode_start, list(prompt.placeholders),
                   list(prompt.encoded), unpruned_positions=[])

    def prepared(self) -> PreparedPrompt:
        if not self.complete:
            missing = [i for i, e in enumerate(self.encoded) if e is None]
            raise ValueError(f"media items {missing} are not encoded yet")
        return PreparedPrompt(self.ids, self.positions, self.decode_start, self.placeholders, list(self.encoded))


def plan_prompt(pieces: list[PromptPiece], media: list[MediaInput], kept: list[int],
                family: ModelFamily) -> PromptPlan:
    """Provisional ids, final text positions and placeholders, from grids and kept counts alone."""
    pads = family.special_tokens().media_pads
    ids_parts, unpruned_parts, blocks, segments = [], [], [], []
    for piece in pieces:
        if piece.media_item is None:
            text = np.asarray(piece.ids, dtype=np.int64)
            ids_parts.append(text)
            unpruned_parts.append(text)
            segments.append(None)
            continue
        if not 0 <= piece.media_item < len(media):
            raise ValueError(f"prompt piece names media item {piece.media_item}, "
                             f"but the request has {len(media)} items")
        if piece.media_item in segments:
            raise ValueError(f"media item {piece.media_item} appears twice in the prompt; give each occurrence its own "
                             "media entry (identical pixels share one encoder run through the content hash)")
        video, k = media[piece.media_item], kept[piece.media_item]
        # The unpruned segment and its blocks do not depend on which tokens are kept.
        shape = family.video_layout(video, np.arange(k, dtype=np.int64))
        ids_parts.append(family.placeholder_ids(video, k))
        unpruned_parts.append(shape.unpruned_ids)
        blocks.extend(shape.blocks)
        segments.append(piece.media_item)
    unpruned = np.asarray(pos.unpruned_positions(np.concatenate(unpruned_parts).tolist(), set(pads), blocks))
    ids = np.concatenate(ids_parts) if ids_parts else np.zeros(0, dtype=np.int64)
    positions = np.full((3, len(ids)), -1, dtype=np.int64)
    placeholders: list[Placeholder | None] = [None] * len(media)
    unpruned_segments: list[np.ndarray | None] = [None] * len(media)
    at = unpruned_at = 0
    for part, unpruned_part, item in zip(ids_parts, unpruned_parts, segments):
        if item is None:
            positions[:, at:at + len(part)] = unpruned[:, unpruned_at:unpruned_at + len(part)]
        else:
            placeholders[item] = Placeholder.of_ids(at, part, pads)
            unpruned_segments[item] = unpruned[:, unpruned_at:unpruned_at + len(unpruned_part)]
            # Text before the first pad (Qwen3's frame-0 timestamp and marker) reads the same in the
            # provisional and the real layout, so its positions are final already.
            lead = placeholders[item].leading_text
            positions[:, at:at + lead] = unpruned[:, unpruned_at:unpruned_at + lead]
        at += len(part)
        unpruned_at += len(unpruned_part)
    if any(p is None for p in placeholders):
        raise ValueError("every media item must appear exactly once in the prompt pieces")
    return PromptPlan(ids, positions, int(unpruned.max()) + 1 if unpruned.size else 0, placeholders,
                      [None] * len(media), unpruned_segments)


def prepare_prompt(pieces: list[PromptPiece], videos: list[MediaInput], encoded: list[EncodedMedia],
                   family: ModelFamily) -> PreparedPrompt:
    """Final ids (real per-frame layouts), int64 positions and placeholders for the language graph."""
    plan = plan_prompt(pieces, videos, [len(e.kept_indices) for e in encoded], family)
    for item, (video, enc) in enumerate(zip(videos, encoded)):
        plan.fill(item, video, enc, family)
    return plan.prepared()
