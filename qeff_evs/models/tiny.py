"""Tiny real checkpoints: a small byte-level BPE tokenizer and randomly initialised Qwen VL models.

Everything is built in code (no downloads) with the real `transformers` classes, written with
`save_pretrained`, and meant to be read back with `qeff_evs.models.checkpoint.load_checkpoint`, the
same path a user's checkpoint takes. Sizes follow the known-good tiny configs for transformers 5.x.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast

from qeff_evs.models.registry import FAMILIES, family_module, preprocess_defaults

# Qwen's added special tokens, in Qwen's relative order; they take the ids after the BPE vocabulary.
ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END, VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)

# BPE merges stop here; with the 7 special tokens the vocabulary has at most 512 entries.
BPE_VOCAB_SIZE = 505

# Weight std for the random init. The HF default (0.02) gives nearly flat logits, so greedy decoding
# repeats one token and top-2 gaps sit near float noise; 0.3 spreads logits (std ~2) so greedy tokens
# vary and ORT-vs-PyTorch argmax parity is not decided by rounding.
INITIALIZER_RANGE = 0.3

# Qwen3 text attention normalises q and k per head; see _sharpen_qk_norm.
QK_NORM_WEIGHT = 2.0

# A small English corpus written for this project: video-QA phrasing, numbers, Qwen3-VL timestamps.
TRAINING_CORPUS = """\
Describe the video in detail. What happens in this video? Summarize the clip in one sentence.
The video shows a person walking into a kitchen. She opens the fridge, takes out a bottle of milk,
and pours it into a glass on the table. Then she sits down and reads a newspaper.
In the first frames a red car is parked on a quiet street. A few seconds later the car starts to
move to the left, and a cyclist passes behind it. The camera stays still the whole time.
A dog runs across a green park and catches a yellow ball. The owner claps and throws the ball again.
Two children are playing with building blocks on the floor. One of them builds a tall tower,
and the other one knocks it over. Both of them laugh.
The weather is cloudy at the start of the video, but the sun comes out near the end.
How many people are in the picture? There are three people standing near the window.
What color is the shirt of the man on the right? The man on the right wears a blue shirt.
Where does the scene take place? The scene takes place in a small office with two desks.
What is the woman holding? The woman is holding a cup of coffee in her left hand.
Is anything moving in the background? Yes, a bus drives past the building in the background.
When does the door open? The door opens at 3.5 seconds and closes again at 7.0 seconds.
<0.5 seconds> <1.5 seconds> <2.5 seconds> <3.5 seconds> <4.5 seconds> <5.5 seconds>
<6.5 seconds> <7.5 seconds> <8.5 seconds> <9.5 seconds> <10.5 seconds> <12.0 seconds>
The clip is 16 seconds long and was recorded at 30 frames per second in 2026.
The image is 448 pixels wide and 336 pixels high. The patch size is 14 and the merge size is 2.
A cat is sleeping on a chair near the door while the light slowly changes in the room.
The teacher writes a list of numbers on the board: 1, 2, 3, 4, 5, 6, 7, 8, 9 and 10.
The people in the video are talking about the news. Then they stand up and leave the room.
First the camera looks at the river, then it turns to the bridge, and finally to the city.
You are a helpful assistant. Answer the question about the video as briefly as you can.
The answer is yes. The answer is no. I can see a tree, a house, a road and a small boat.
What is the man doing? He is cooking dinner. What is the girl doing? She is drawing a picture.
The ball rolls off the table and falls to the floor. Nothing else changes in the last frames.
"""

# Qwen-style chat template: <|im_start|>role\n...<|im_end|>\n per message; content lists render
# video and image items as one vision block each (the runtime expands the pad token later).
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- else -%}"
    "{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'video' -%}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- elif item['type'] == 'image' -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
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

def _check_family(family: str) -> None:
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; use one of {', '.join(FAMILIES)}")


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on `TRAINING_CORPUS` and wrap it with Qwen's special tokens and chat template.

    Deterministic: the same corpus and settings give the same vocabulary and merges on every run.
    """
    bpe = Tokenizer(models.BPE())
    # Digits one per token (as Qwen does), then GPT-2 style byte-level splitting of the rest.
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(TRAINING_CORPUS.splitlines(keepends=True), trainer=trainer)
    # Added here, before the wrapper names eos/pad, so the ids follow Qwen's order.
    bpe.add_special_tokens(list(SPECIAL_TOKENS))

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        clean_up_tokenization_spaces=False,
        model_max_length=32768,
    )
    tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS)})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _token_id(tokenizer: PreTrainedTokenizerFast, token: str) -> int:
    token_id = tokenizer.convert_tokens_to_ids(token)
    if token_id is None or token_id == tokenizer.unk_token_id:
        raise ValueError(f"tokenizer has no {token!r} token; build it with build_tokenizer()")
    return int(token_id)


def special_token_ids(tokenizer: PreTrainedTokenizerFast) -> dict[str, int]:
    """The ids the model configs need, read from the tokenizer (never hard-coded)."""
    return {
        "image_token_id": _token_id(tokenizer, IMAGE_PAD),
        "video_token_id": _token_id(tokenizer, VIDEO_PAD),
        "vision_start_token_id": _token_id(tokenizer, VISION_START),
        "vision_end_token_id": _token_id(tokenizer, VISION_END),
        "bos_token_id": _token_id(tokenizer, ENDOFTEXT),
        "eos_token_id": _token_id(tokenizer, IM_END),
        "pad_token_id": _token_id(tokenizer, ENDOFTEXT),
    }


def _merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """`base` updated by `overrides`; nested `text_config` / `vision_config` dicts are merged key by key."""
    merged = copy.deepcopy(base)
    for key, value in overrides.items():
        if key in ("text_config", "vision_config") and isinstance(value, dict):
            merged[key] = {**merged.get(key, {}), **value}
        else:
            merged[key] = value
    return merged


def _tiny_config_kwargs(family: str, ids: dict[str, int], vocab_size: int) -> dict[str, Any]:
    text_ids = {k: ids[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    media_ids = {k: ids[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")}
    text = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        initializer_range=INITIALIZER_RANGE,
        **text_ids,
    )
    vision = dict(
        depth=2,
        hidden_size=64,
        intermediate_size=128,
        num_heads=4,
        out_hidden_size=64,
        spatial_merge_size=2,
        temporal_patch_size=2,
        in_channels=3,
        initializer_range=INITIALIZER_RANGE,
    )
    if family == "qwen2_5_vl":
        # mrope_section sums to head_dim // 2 = (64 // 4) // 2.
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
        # window 56 px = 2 merged tokens; tokens_per_second as in the released checkpoints.
        vision.update(patch_size=14, window_size=56, fullatt_block_indexes=[1], tokens_per_second=2)
    else:
        text["head_dim"] = 16
        text["rope_parameters"] = {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [2, 3, 3],
            "mrope_interleaved": True,
        }
        # num_position_embeddings must be a perfect square (8 x 8 learned grid).
        vision.update(patch_size=16, num_position_embeddings=64, deepstack_visual_indexes=[0])
    return dict(text_config=text, vision_config=vision, **media_ids)


def tiny_config(family: str, tokenizer: PreTrainedTokenizerFast, **overrides: Any):
    """A real `Qwen2_5_VLConfig` / `Qwen3VLConfig` with hidden 64, 2 layers, vision depth 2.

    vocab_size is len(tokenizer) and every special id comes from the tokenizer. `overrides` are config
    kwargs; `text_config=` / `vision_config=` dicts are merged into the tiny defaults key by key.
    """
    _check_family(family)
    kwargs = _merge(_tiny_config_kwargs(family, special_token_ids(tokenizer), len(tokenizer)), overrides)
    return family_module(family).CONFIG_CLASS(**kwargs)


def build_tiny_model(family: str, tokenizer: PreTrainedTokenizerFast, *, seed: int = 0, **overrides: Any):
    """Seeded random init of the real HF model class for `family`, in eval mode, fp32."""
    config = tiny_config(family, tokenizer, **overrides)
    # Fork the RNG so building a model does not disturb the caller's random stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = family_module(family).MODEL_CLASS(config)
    _never_emit_media_tokens(model, tokenizer)
    if family == "qwen3_vl":
        _sharpen_qk_norm(model)
    return model.to(torch.float32).eval()


def _sharpen_qk_norm(model) -> None:
    """Set Qwen3's per-head q/k RMSNorm weights to QK_NORM_WEIGHT instead of 1.

    Unit-RMS q and k bound every attention logit by sqrt(head_dim) = 4, so random attention stays
    near uniform, the current token dominates the residual stream and greedy decoding falls into
    short loops. Weight 2 bounds logits by 16, which gives varied greedy tokens.
    """
    with torch.no_grad():
        for layer in model.model.language_model.layers:
            layer.self_attn.q_norm.weight.fill_(QK_NORM_WEIGHT)
            layer.self_attn.k_norm.weight.fill_(QK_NORM_WEIGHT)


def _never_emit_media_tokens(model, tokenizer: PreTrainedTokenizerFast) -> None:
    """Zero the output rows of the vision placeholder/marker tokens.

    A trained model never generates them; a random one does, and a generated <|video_pad|> fed back
    would be taken for a media slot. With the other logits spread (std ~2), a logit of exactly 0
    never wins greedy decoding. (With tied embeddings this also zeros their input rows, harmless:
    pad rows are replaced by vision embeddings.)
    """
    ids = special_token_ids(tokenizer)
    media = [ids[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")]
    with torch.no_grad():
        model.get_output_embeddings().weight[media] = 0.0


def preprocessor_config(family: str, config) -> dict[str, Any]:
    """`preprocessor_config.json` contents shaped like the released checkpoints' files."""
    _check_family(family)
    vision = config.vision_config
    defaults = preprocess_defaults(family)
    common = {
        "patch_size": vision.patch_size,
        "temporal_patch_size": vision.temporal_patch_size,
        "merge_size": vision.spatial_merge_size,
        "do_resize": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "do_convert_rgb": True,
        "image_mean": list(defaults.image_mean),
        "image_std": list(defaults.image_std),
    }
    if family == "qwen2_5_vl":
        return {
            **common,
            "min_pixels": 3136,
            "max_pixels": 12845056,
            "image_processor_type": "Qwen2VLImageProcessor",
        }
    return {
        **common,
        "size": {"shortest_edge": 65536, "longest_edge": 16777216},
        "image_processor_type": "Qwen2VLImageProcessor",
    }


def generation_config(tokenizer: PreTrainedTokenizerFast) -> GenerationConfig:
    """Greedy decoding that stops at <|im_end|> or <|endoftext|>, as the released instruct checkpoints do."""
    ids = special_token_ids(tokenizer)
    return GenerationConfig(
        bos_token_id=ids["bos_token_id"],
        eos_token_id=[ids["eos_token_id"], ids["bos_token_id"]],
        pad_token_id=ids["pad_token_id"],
        do_sample=False,
    )


def save_tiny_checkpoint(family: str, out_dir: str | Path, *, seed: int = 0, **overrides: Any) -> Path:
    """Write a complete tiny checkpoint folder (config, safetensors, tokenizer, preprocessor, generation config)."""
    _check_family(family)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    model = build_tiny_model(family, tokenizer, seed=seed, **overrides)
    model.generation_config = generation_config(tokenizer)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / "preprocessor_config.json").write_text(json.dumps(preprocessor_config(family, model.config), indent=2) + "\n")
    return out
