"""Turns a question about a video into prompt pieces: text ids around one video placeholder.

With a chat template the user turn is rendered the way the checkpoint expects, then split at the
video pad the template emits (the family's ``TokenStrings``); the family later expands that placeholder into
its own layout. Without a template the family's plain video block, then the question, is used.
"""

from __future__ import annotations

from dataclasses import dataclass

from qeff_evs.models.protocol import TokenStrings
from qeff_evs.models.registry import DEFAULT_FAMILY, family_class


def _tokens(tokens: TokenStrings | None) -> TokenStrings:
    """The family's token strings; None: the default family's (what a bare ``qeff-evs`` run assumes)."""
    return family_class(DEFAULT_FAMILY).token_strings if tokens is None else tokens


@dataclass(frozen=True)
class PromptPiece:
    """Either literal token ids or one media item (by index into the request's media list: videos and images)."""

    ids: tuple[int, ...] = ()
    media_item: int | None = None


def render_video_question(tokenizer, question: str, tokens: TokenStrings | None = None) -> str:
    tokens = _tokens(tokens)
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": question}]}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokens.video_block + question


def video_question_pieces(tokenizer, question: str, tokens: TokenStrings | None = None) -> list[PromptPiece]:
    """``[text before the video pad, the video, text after]`` as token-id pieces (``tokens``: the family's)."""
    tokens = _tokens(tokens)
    rendered = render_video_question(tokenizer, question, tokens)
    pad = tokens.video
    if rendered.count(pad) != 1:
        raise ValueError(f"the rendered prompt must hold exactly one {pad}, found {rendered.count(pad)}: {rendered!r}")
    before, _, after = rendered.partition(pad)

    def encode(text: str) -> tuple[int, ...]:
        return tuple(tokenizer.encode(text, add_special_tokens=False)) if text else ()

    return [PromptPiece(ids=encode(before)), PromptPiece(media_item=0), PromptPiece(ids=encode(after))]


def chat_pieces(tokenizer, content: list[dict], tokens: TokenStrings | None = None,
                sound_in_video: bool = False) -> list[PromptPiece]:
    """One user turn (OpenAI-style ``content``: text, ``{"type": "video"}``, ``{"type": "image"}``,
    ``{"type": "audio"}``) as pieces.

    The chat template renders the turn, which is then split at every media pad it emits (the family's ``tokens``);
    media placeholders are numbered in prompt order (the order of the request's media list).
    """
    return conversation_pieces(tokenizer, [{"role": "user", "content": content}], tokens, sound_in_video)


def conversation_pieces(tokenizer, messages: list[dict], tokens: TokenStrings | None = None,
                        sound_in_video: bool = False) -> list[PromptPiece]:
    """A chat (OpenAI-style ``messages``: user turns with text and media parts, assistant turns as text) as pieces,
    rendered whole by the chat template as vLLM's chat endpoint renders it, then split at its media pads (numbered
    in prompt order). ``sound_in_video`` (vLLM's ``use_audio_in_video``): an audio pad right after each video pad,
    as vLLM's Nemotron-H processor puts the video's sound; each video's next media item is then its sound."""
    tokens = _tokens(tokens)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("a conversation needs the checkpoint's chat template, and this tokenizer has none; "
                         "ask each question in a request of its own")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if sound_in_video:
        if not tokens.audio:
            raise ValueError("use_audio_in_video: this model serves no audio")
        text = text.replace(tokens.video, tokens.video + tokens.audio)
    pieces = []
    for pad in tokens.pads:  # every pad is one item: split at each, numbered in prompt order
        text = text.replace(pad, tokens.video)
    for item, part in enumerate(text.split(tokens.video)):
        if item:
            pieces.append(PromptPiece(media_item=item - 1))
        if part:
            pieces.append(PromptPiece(ids=tuple(tokenizer.encode(part, add_special_tokens=False))))
    return pieces
