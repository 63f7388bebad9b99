"""Tiny real checkpoints: a small byte-level BPE tokenizer and randomly initialised models of any family.

Everything is built in code (no downloads) with the real `transformers` classes, written with
`save_pretrained`, and meant to be read back with `qeff_evs.models.checkpoint.load_checkpoint`, the
same path a user's checkpoint takes. What is family-specific (special tokens, chat template, config
sizes, preprocessor file) each family declares (``ModelFamily.tiny_*``); sizes follow the known-good
tiny configs for transformers 5.x.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from qeff_evs.models.registry import DEFAULT_FAMILY, family_class

# Vocabulary size the BPE trains to, before the special tokens are added.
BPE_VOCAB_SIZE = 505

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

def train_tokenizer(special_tokens: Sequence[str], *, eos_token: str, pad_token: str,
                    chat_template: str) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on `TRAINING_CORPUS` and add ``special_tokens`` (in order, right after the
    BPE vocabulary), the eos/pad tokens and the chat template a family declares.

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
    # Added here, before the wrapper names eos/pad, so the ids follow the family's order.
    bpe.add_special_tokens(list(special_tokens))

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token=eos_token,
        pad_token=pad_token,
        clean_up_tokenization_spaces=False,
        model_max_length=32768,
    )
    tokenizer.add_special_tokens({"additional_special_tokens": list(special_tokens)})
    tokenizer.chat_template = chat_template
    return tokenizer


def build_tokenizer(family: str = DEFAULT_FAMILY) -> PreTrainedTokenizerFast:
    """The tiny tokenizer of ``family`` (its special tokens and chat template on the shared BPE)."""
    return family_class(family).tiny_tokenizer()


def _merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """`base` updated by `overrides`; nested `text_config` / `vision_config` dicts are merged key by key."""
    merged = copy.deepcopy(base)
    for key, value in overrides.items():
        if key in ("text_config", "vision_config") and isinstance(value, dict):
            merged[key] = {**merged.get(key, {}), **value}
        else:
            merged[key] = value
    return merged


def tiny_config(family: str, tokenizer: PreTrainedTokenizerFast, *, text_layers: int = 2, vision_layers: int = 2,
                **overrides: Any):
    """A real config of ``family`` with hidden 64 and ``text_layers`` / ``vision_layers`` layers (default 2).

    vocab_size is len(tokenizer) and every special id comes from the tokenizer. `overrides` are config
    kwargs; `text_config=` / `vision_config=` dicts are merged into the tiny defaults key by key.
    """
    spec = family_class(family)
    kwargs = _merge(spec.tiny_config_kwargs(tokenizer, text_layers, vision_layers), overrides)
    return spec.config_class(**kwargs)


def build_tiny_model(family: str, tokenizer: PreTrainedTokenizerFast, *, seed: int = 0, **overrides: Any):
    """Seeded random init of the real HF model class for `family`, in eval mode, fp32."""
    spec = family_class(family)
    config = tiny_config(family, tokenizer, **overrides)
    # Fork the RNG so building a model does not disturb the caller's random stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = spec.model_class(config)
    spec.prepare_tiny_model(model, tokenizer)
    return model.to(torch.float32).eval()


def preprocessor_config(family: str, config) -> dict[str, Any]:
    """`preprocessor_config.json` contents shaped like the released checkpoints' files."""
    return family_class(family).tiny_preprocessor_config(config)


def save_tiny_checkpoint(family: str, out_dir: str | Path, *, seed: int = 0, **overrides: Any) -> Path:
    """Write a complete tiny checkpoint folder (config, safetensors, tokenizer, preprocessor, generation config)."""
    spec = family_class(family)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(family)
    model = build_tiny_model(family, tokenizer, seed=seed, **overrides)
    model.generation_config = spec.tiny_generation_config(tokenizer)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / "preprocessor_config.json").write_text(json.dumps(preprocessor_config(family, model.config), indent=2) + "\n")
    return out
