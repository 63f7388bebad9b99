"""Nemotron-H's prompt strings as vLLM's processor writes them, and the tiny tokenizer's special tokens and chat
template (the test checkpoints' tokenizer is trained here, not downloaded)."""

from __future__ import annotations

from qeff_evs.models.protocol import TokenStrings

# vLLM's processor strings (``transformers_utils/processors/nano_nemotron_vl.py``).
IMG_START, IMG_END, IMG_CONTEXT, VIDEO_TEXT = "<img>", "</img>", "<image>", "<video>"
SOUND_START, SOUND_END, SOUND_CONTEXT = "<so_start>", "<so_end>", "<so_embedding>"
IM_START, IM_END, END_OF_TEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
# The tiny tokenizer's special tokens. ``<video>`` is not one: the released tokenizer has no such token, and vLLM
# finds it in a prompt as the text's own tokens.
SPECIAL_TOKENS = (END_OF_TEXT, IM_START, IM_END, IMG_START, IMG_END, IMG_CONTEXT, SOUND_START, SOUND_END, SOUND_CONTEXT)
NEMOTRON_TOKENS = TokenStrings(image=IMG_CONTEXT, video=VIDEO_TEXT, image_block=IMG_CONTEXT, video_block=VIDEO_TEXT,
                               audio=SOUND_CONTEXT)

# ChatML turns; a video or image item renders as its placeholder text on its own line.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- else -%}"
    "{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'video' -%}"
    "{{- '<video>\\n' -}}"
    "{%- elif item['type'] == 'image' -%}"
    "{{- '<image>\\n' -}}"
    "{%- elif item['type'] in ('audio', 'input_audio', 'audio_url') -%}"
    "{{- '<so_embedding>\\n' -}}"
    "{%- elif item['type'] == 'text' -%}"
    "{{- item['text'] -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)

# transformers' video processor of the released folders (``video_preprocessor_config.json``)
VIDEO_PROCESSOR = "NemotronH_Omni_Reasoning_V3VideoProcessor"


def tokenizer_ids(tokenizer) -> dict[str, int]:
    """The ids of the prompt's special tokens in ``tokenizer``; ValueError naming a missing one."""
    ids = {}
    for key, token in (("image", IMG_CONTEXT), ("img_start", IMG_START), ("img_end", IMG_END), ("eos", IM_END),
                       ("pad", END_OF_TEXT), ("audio", SOUND_CONTEXT), ("audio_start", SOUND_START),
                       ("audio_end", SOUND_END)):
        token_id = tokenizer.convert_tokens_to_ids(token)
        if token_id is None or (token_id == tokenizer.unk_token_id and token != tokenizer.unk_token):
            raise ValueError(f"tokenizer has no {token!r} token; build it with tiny.build_tokenizer('nemotron_h_omni')")
        ids[key] = int(token_id)
    return ids
