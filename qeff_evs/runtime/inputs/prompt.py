"""Turns a question about a video into prompt pieces: text ids around one video slot.

With a chat template the user turn is rendered the way the checkpoint expects, then split at the
video pad the template emits; the family later expands that slot into its own layout. Without a
template the plain layout ``<|vision_start|><|video_pad|><|vision_end|>question`` is used.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PromptPiece:
    """Either literal token ids or one video (by index into the request's videos)."""

    ids: tuple[int, ...] = ()
    video: int | None = None


VIDEO_PAD = "<|video_pad|>"
PLAIN_VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"


def render_video_question(tokenizer, question: str) -> str:
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": question}]}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return PLAIN_VIDEO + question


def video_question_pieces(tokenizer, question: str) -> list[PromptPiece]:
    """``[text before the video pad, the video, text after]`` as token-id pieces."""
    rendered = render_video_question(tokenizer, question)
    if rendered.count(VIDEO_PAD) != 1:
        raise ValueError(
            f"the rendered prompt must hold exactly one {VIDEO_PAD}, found {rendered.count(VIDEO_PAD)}: {rendered!r}")
    before, _, after = rendered.partition(VIDEO_PAD)

    def encode(text: str) -> tuple[int, ...]:
        return tuple(tokenizer.encode(text, add_special_tokens=False)) if text else ()

    return [PromptPiece(ids=encode(before)), PromptPiece(video=0), PromptPiece(ids=encode(after))]


def chat_pieces(tokenizer, content: list[dict]) -> list[PromptPiece]:
    """One user turn (OpenAI-style ``content``: text, ``{"type": "video"}``, ``{"type": "image"}``) as pieces.

    The chat template renders the turn, which is then split at every image or video pad it emits;
    media slots are numbered in prompt order (the order of the request's media list).
    """
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)
    pieces = []
    for item, part in enumerate(text.replace("<|image_pad|>", VIDEO_PAD).split(VIDEO_PAD)):
        if item:
            pieces.append(PromptPiece(video=item - 1))
        if part:
            pieces.append(PromptPiece(ids=tuple(tokenizer.encode(part, add_special_tokens=False))))
    return pieces
