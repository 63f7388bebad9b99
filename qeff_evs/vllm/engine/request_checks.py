"""What one request may ask of an export, checked in vLLM's frontend before the request reaches the worker.

An exception inside the worker would stop vLLM's engine for every user, so everything a request can get
wrong is checked on what the frontend knows before any graph runs: the prompt's token ids, its media
placeholders, the M-RoPE positions its *unpruned* layout reaches (known from the media grids alone, before
the encoder), and ``max_tokens``. Each check returns the one line the client gets back with HTTP 400, or
None; our multimodal processor (``processing/processor.py``) and the platform's ``validate_request`` raise it. The
worker keeps the same checks as assertions of what the frontend guaranteed. Pure: no vLLM import.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class RequestLimits:
    """What every request must respect, from the export and vLLM's resolved settings."""

    media_pads: Mapping[int, str]  # media pad token id -> its text, e.g. {151656: "<|video_pad|>"}
    rope_positions: int | None  # the language graph's RoPE tables cover positions [0, rope_positions)
    max_model_len: int


def stray_media_pads(prompt_ids: Sequence[int], placeholders: Sequence[tuple[int, int]],
                     limits: RequestLimits) -> str | None:
    """Media pad tokens outside every media placeholder ``(offset, length)``.

    The language graph merges a vision row at every media pad it sees, so a pad the text carries (a chat
    message quoting ``<|image_pad|>``) would take a row no media gave. vLLM embeds such a pad as text;
    the graphs cannot, so the request is refused. Markers (``<|vision_start|>``) are plain text to both.
    """
    ids = np.asarray(prompt_ids, dtype=np.int64)
    outside = np.ones(len(ids), dtype=bool)
    for offset, length in placeholders:
        outside[offset:offset + length] = False
    stray = np.flatnonzero(outside & np.isin(ids, list(limits.media_pads)))
    if not len(stray):
        return None
    names = sorted({limits.media_pads[int(ids[i])] for i in stray})
    where = ", ".join(str(int(i)) for i in stray[:5]) + (", ..." if len(stray) > 5 else "")
    return (f"the prompt holds {len(stray)} media pad token(s) {' '.join(names)} that no attached image or video "
            f"fills (at token {where}); a pad token stands for one attached media item: attach the media, or "
            "remove the pad tokens from the text")


def media_count(prompt_ids: Sequence[int], items: Mapping[str, int],
                pads: Mapping[str, tuple[int | Sequence[int], str]]) -> str | None:
    """More or fewer media items than the prompt has pad tokens (or pad texts) for them.

    ``items``: modality -> number of items attached; ``pads``: modality -> (the pad id, or the ids of the text a
    prompt writes for one item, e.g. ``<video>`` spelled in four tokens; its text).
    """
    ids = [int(i) for i in prompt_ids]
    problems = []
    for modality, (target, text) in pads.items():
        given, found = int(items.get(modality, 0)), occurrences(ids, target)
        if given != found:
            problems.append(f"{given} {modality}(s) attached but the prompt has {found} {text}")
    if not problems:
        return None
    return ("; ".join(problems) + ": give exactly one pad token per attached item (a chat template writes them; "
            "with prompt token ids, write one per item yourself)")


def occurrences(ids: Sequence[int], target: int | Sequence[int]) -> int:
    """How many times ``target`` (an id, or a run of ids) occurs in ``ids``, without overlaps (as vLLM finds them)."""
    target = [int(target)] if isinstance(target, (int, np.integer)) else [int(t) for t in target]
    count = at = 0
    while at + len(target) <= len(ids):
        if ids[at:at + len(target)] == target:
            count, at = count + 1, at + len(target)
        else:
            at += 1
    return count


def positions_end(prompt_len: int, placeholders: Sequence[tuple[int, int]], spans: Sequence[int]) -> int:
    """The first M-RoPE position after the prompt (where decoding starts), from its layout alone.

    Text advances positions by one per token; each media item's unpruned segment spans ``spans[i]``
    positions wherever it sits (a pure shift), however many of its tokens EVS keeps. ``placeholders``:
    each item's ``(offset, length)`` in the prompt, in the order of ``spans``.
    """
    return prompt_len - sum(length for _, length in placeholders) + sum(spans)


def new_tokens(prompt_len: int, max_tokens: int | None, limits: RequestLimits) -> int:
    """Tokens the request may generate: ``max_tokens``, and never past ``max_model_len`` (vLLM's cap)."""
    room = limits.max_model_len - prompt_len
    return room if max_tokens is None else min(int(max_tokens), room)


def positions_problem(end: int, prompt_len: int, max_tokens: int | None, limits: RequestLimits) -> str | None:
    """Positions past the RoPE tables: the prompt reaches ``end``, generated token j sits at ``end + j``."""
    table = limits.rope_positions
    generated = new_tokens(prompt_len, max_tokens, limits)
    if table is None or generated < 1 or end + generated - 1 < table:
        return None  # (no room at all: vLLM's own prompt-length check refuses it next)
    last = end + generated - 1
    room = table - end
    fix = f"ask for at most max_tokens={room}, " if room > 0 else "its prompt alone passes them: "
    return (f"this request needs M-RoPE positions up to {last} (its prompt's unpruned layout reaches {end - 1}, "
            f"plus {generated} new tokens) but the export's RoPE tables cover [0, {table}); {fix}send fewer or denser "
            f"video frames (a video's positions follow its timestamps), or re-export with --rope-positions >= "
            f"{last + 1}")
