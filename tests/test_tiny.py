"""Tiny real checkpoints: tokenizer, configs, save -> load_checkpoint round trip, loader errors."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from transformers import Qwen2Config

from qeff_evs.bench.realistic import realistic_config
from qeff_evs.models.checkpoint import LoadedCheckpoint, detect_family, load_checkpoint
from qeff_evs.models.qwen_vl import QWEN_TOKENS, SPECIAL_TOKENS, special_token_ids
from qeff_evs.models.registry import family_class, family_names
from qeff_evs.models.tiny import (
    build_tiny_model,
    build_tokenizer,
    save_tiny_checkpoint,
    tiny_config,
)

ROUND_TRIP_TEXTS = [
    "Describe the video in detail.",
    "In 2026 the clip was 16 seconds long, recorded at 30 frames per second.",
    "  leading spaces, tabs\tand\nnew lines\n\n",
    "Unicode: naïve café, 日本語, emoji 🎬, math ∑ x² ≤ 3.14",
    "<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>What happens?<|im_end|>\n",
]

# The families with Qwen's tokenizer, layouts and config names, which these tests build prompts and ids for (another
# family's tiny checkpoint is checked in its own test module: Nemotron-H's in test_e2e_nemotron_h_omni.py).
QWEN_FAMILIES = tuple(name for name in family_names() if family_class(name).token_strings is QWEN_TOKENS)

# Video grid in patch units: 2 temporal patches of 8 x 8 patches -> 2 frames of 4 x 4 merged tokens.
GRID_THW = (2, 8, 8)
MERGED_PER_FRAME = (GRID_THW[1] // 2) * (GRID_THW[2] // 2)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_ckpts")
    return {family: save_tiny_checkpoint(family, root / family) for family in QWEN_FAMILIES}


def _ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# ---------------------------------------------------------------- tokenizer


def test_tokenizer_size_and_special_tokens(tokenizer):
    assert 400 <= len(tokenizer) <= 600
    ids = [tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS]
    # Qwen's order, right after the BPE vocabulary, all distinct.
    assert ids == list(range(len(tokenizer) - len(SPECIAL_TOKENS), len(tokenizer)))
    for token, token_id in zip(SPECIAL_TOKENS, ids):
        assert _ids(tokenizer, token) == [token_id]
        # Never split, even glued to ordinary text.
        assert _ids(tokenizer, f"abc{token}def").count(token_id) == 1
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|endoftext|>"


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_tokenizer_round_trips_text(tokenizer, text):
    assert tokenizer.decode(_ids(tokenizer, text)) == text


def test_digits_are_one_token_each(tokenizer):
    assert tokenizer.tokenize("2026") == ["2", "0", "2", "6"]
    assert len(_ids(tokenizer, "year 2026")) == len(_ids(tokenizer, "year ")) + 4
    # "10" is frequent in the corpus: BPE would merge it if digits were not pre-split.
    assert tokenizer.tokenize("10 1010") == ["1", "0", "Ġ", "1", "0", "1", "0"]
    assert not [t for t in tokenizer.get_vocab() if sum(c.isdigit() for c in t) > 1]


def test_bpe_learned_merges(tokenizer):
    # Frequent corpus words are single tokens (the BPE really trained), rare ones are split.
    assert len(_ids(tokenizer, " video")) == 1
    assert len(_ids(tokenizer, " xylophone")) > 3


def test_tokenizer_is_deterministic_across_processes(tokenizer):
    # A fresh interpreter with another hash seed must learn the same vocabulary and merges.
    code = "from qeff_evs.models.tiny import build_tokenizer; print(build_tokenizer().backend_tokenizer.to_str())"
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, env=env, check=True)
    assert json.loads(out.stdout) == json.loads(tokenizer.backend_tokenizer.to_str())
    assert build_tokenizer().get_vocab() == tokenizer.get_vocab()


def test_chat_template_renders_video_message(tokenizer):
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "Describe the video."}]},
    ]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>Describe the video.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_chat_template_image_and_no_generation_prompt(tokenizer):
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Look: "}, {"type": "image"}]},
        {"role": "assistant", "content": "A cat."},
    ]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert rendered == (
        "<|im_start|>user\nLook: <|vision_start|><|image_pad|><|vision_end|><|im_end|>\n"
        "<|im_start|>assistant\nA cat.<|im_end|>\n"
    )


# ---------------------------------------------------------------- configs


@pytest.mark.parametrize("family", QWEN_FAMILIES)
def test_tiny_config_takes_ids_from_tokenizer(tokenizer, family):
    config = tiny_config(family, tokenizer)
    assert config.model_type == family
    assert config.text_config.vocab_size == len(tokenizer)
    assert config.image_token_id == tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert config.video_token_id == tokenizer.convert_tokens_to_ids("<|video_pad|>")
    assert config.vision_start_token_id == tokenizer.convert_tokens_to_ids("<|vision_start|>")
    assert config.vision_end_token_id == tokenizer.convert_tokens_to_ids("<|vision_end|>")
    assert config.text_config.eos_token_id == tokenizer.eos_token_id
    assert config.text_config.pad_token_id == tokenizer.pad_token_id
    assert config.vision_config.out_hidden_size == config.text_config.hidden_size == 64
    assert config.text_config.num_hidden_layers == 2 and config.vision_config.depth == 2
    if family == "qwen2_5_vl":
        assert config.vision_config.tokens_per_second == 2


def test_tiny_config_overrides_merge_into_sub_configs(tokenizer):
    config = tiny_config("qwen2_5_vl", tokenizer, text_config={"num_hidden_layers": 3}, vision_config={"depth": 4})
    assert config.text_config.num_hidden_layers == 3
    assert config.text_config.hidden_size == 64  # untouched default survives the merge
    assert config.vision_config.depth == 4 and config.vision_config.tokens_per_second == 2


def test_unknown_family_is_rejected(tokenizer, tmp_path):
    with pytest.raises(ValueError, match="llava.*qwen2_5_vl"):
        tiny_config("llava", tokenizer)
    with pytest.raises(ValueError, match="llava"):
        save_tiny_checkpoint("llava", tmp_path / "x")


# The released widths each family's bench config copies: (vocab, hidden).
RELEASED = {"qwen2_5_vl": (151936, 2048), "qwen3_vl": (151936, 2048), "qwen3_5": (248320, 1024),
            "qwen3_vl_moe": (151936, 2048), "qwen3_5_moe": (248320, 2048)}


@pytest.mark.parametrize("family", QWEN_FAMILIES)
def test_realistic_config_is_consistent(family):
    config = realistic_config(family, text_layers=4, vision_layers=3)
    text, vision = config.text_config, config.vision_config
    vocab, hidden = RELEASED[family]
    assert text.vocab_size == vocab and text.hidden_size == vision.out_hidden_size == hidden
    # The special ids are those of the tokenizer the bench saves beside the config (a runtime that tokenizes the
    # media tags, as OpenVINO GenAI does, finds them there), read back by their text.
    tokenizer = build_tokenizer(family)
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in (
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"))}
    assert {name: getattr(config, name) for name in ids} == ids
    assert text.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>") < len(tokenizer) < text.vocab_size
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    rotary = int(head_dim * text.rope_parameters.get("partial_rotary_factor", 1.0))
    assert sum(text.rope_parameters["mrope_section"]) == rotary // 2
    if family == "qwen2_5_vl":
        assert (text.num_attention_heads, text.num_key_value_heads, text.intermediate_size) == (16, 2, 11008)
        assert (vision.hidden_size, vision.intermediate_size, vision.window_size) == (1280, 3420, 112)
        assert vision.fullatt_block_indexes == [2]
    elif family == "qwen3_vl":
        assert max(vision.deepstack_visual_indexes) < vision.depth
    elif family == "qwen3_5":  # Qwen3.5-0.8B: full attention every 4th layer, 16 + 16 linear heads of 128
        assert text.layer_types == ["linear_attention"] * 3 + ["full_attention"]
        assert (text.num_attention_heads, text.num_key_value_heads, text.head_dim, rotary) == (8, 2, 256, 64)
        assert (text.linear_num_key_heads, text.linear_num_value_heads, text.linear_key_head_dim) == (16, 16, 128)
        assert (vision.hidden_size, vision.intermediate_size, vision.num_heads) == (768, 3072, 12)
    elif family == "qwen3_vl_moe":  # Qwen3-VL-30B-A3B: 128 experts of 768, 8 per token, every layer sparse
        assert max(vision.deepstack_visual_indexes) < vision.depth
        assert (text.num_attention_heads, text.num_key_value_heads, text.head_dim) == (32, 4, 128)
        assert (text.num_experts, text.num_experts_per_tok, text.moe_intermediate_size) == (128, 8, 768)
        assert (text.decoder_sparse_step, text.mlp_only_layers, config.tie_word_embeddings) == (1, [], False)
    else:  # Qwen3.5-35B-A3B: 256 experts of 512, 8 per token, a shared expert of 512, 16 + 32 linear heads
        assert text.layer_types == ["linear_attention"] * 3 + ["full_attention"]
        assert (text.num_attention_heads, text.num_key_value_heads, text.head_dim, rotary) == (16, 2, 256, 64)
        assert (text.linear_num_key_heads, text.linear_num_value_heads, text.linear_key_head_dim) == (16, 32, 128)
        assert (text.num_experts, text.num_experts_per_tok, text.moe_intermediate_size,
                text.shared_expert_intermediate_size) == (256, 8, 512, 512)
        assert config.tie_word_embeddings is False
    # Shapes are consistent: the real class builds on the meta device (no memory).
    with torch.device("meta"):
        model = family_class(family).model_class(config)
    assert model.lm_head.weight.shape == (vocab, hidden)


# ---------------------------------------------------------------- checkpoint round trip


def _video_inputs(family, tokenizer, seed=1):
    """Chat-templated video prompt with the placeholder expanded to the model's layout, plus pixels."""
    frames = GRID_THW[0]
    if family == "qwen2_5_vl":
        block = "<|vision_start|>" + "<|video_pad|>" * (frames * MERGED_PER_FRAME) + "<|vision_end|>"
        patch = 14
    else:  # one block per temporal patch, each after its timestamp
        block = "".join(
            f"<{t + 0.5:.1f} seconds><|vision_start|>" + "<|video_pad|>" * MERGED_PER_FRAME + "<|vision_end|>"
            for t in range(frames)
        )
        patch = 16
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What happens?"}]}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    text = text.replace("<|vision_start|><|video_pad|><|vision_end|>", block)
    input_ids = torch.tensor([_ids(tokenizer, text)])
    video_token_id = tokenizer.convert_tokens_to_ids("<|video_pad|>")
    assert int((input_ids == video_token_id).sum()) == frames * MERGED_PER_FRAME
    generator = torch.Generator().manual_seed(seed)
    num_patches = frames * GRID_THW[1] * GRID_THW[2]
    return {
        "input_ids": input_ids,
        "mm_token_type_ids": (input_ids == video_token_id).long() * 2,  # 2 = video, as transformers 5 requires
        "pixel_values_videos": torch.randn(num_patches, 3 * 2 * patch * patch, generator=generator),
        "video_grid_thw": torch.tensor([GRID_THW]),
    }


@pytest.mark.parametrize("family", QWEN_FAMILIES)
def test_saved_checkpoint_folder_is_complete(checkpoints, family):
    folder = checkpoints[family]
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "preprocessor_config.json", "generation_config.json"):
        assert (folder / name).is_file(), name
    config = json.loads((folder / "config.json").read_text())
    preprocessor = json.loads((folder / "preprocessor_config.json").read_text())
    assert preprocessor["patch_size"] == config["vision_config"]["patch_size"]
    assert preprocessor["merge_size"] == config["vision_config"]["spatial_merge_size"] == 2
    assert preprocessor["temporal_patch_size"] == 2
    assert len(preprocessor["image_mean"]) == len(preprocessor["image_std"]) == 3
    generation = json.loads((folder / "generation_config.json").read_text())
    tokenizer = build_tokenizer()
    assert sorted(generation["eos_token_id"]) == sorted(
        tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    )


@pytest.mark.parametrize("family", QWEN_FAMILIES)
def test_load_checkpoint_round_trip(checkpoints, tokenizer, family):
    loaded = load_checkpoint(checkpoints[family])
    assert isinstance(loaded, LoadedCheckpoint)
    assert loaded.family == family == detect_family(checkpoints[family])
    assert type(loaded.model) is family_class(family).model_class
    assert not loaded.model.training
    assert all(p.dtype == torch.float32 for p in loaded.model.parameters())
    assert loaded.preprocessor_config["patch_size"] == loaded.config.vision_config.patch_size

    # The tokenizer read back encodes exactly like the in-memory one, specials and template included.
    for text in ROUND_TRIP_TEXTS:
        assert _ids(loaded.tokenizer, text) == _ids(tokenizer, text)
    assert loaded.tokenizer.chat_template == tokenizer.chat_template
    assert special_token_ids(loaded.tokenizer) == special_token_ids(tokenizer)

    # Same seed in memory -> bit-identical logits on a multimodal (video + text) forward.
    reference = build_tiny_model(family, tokenizer, seed=0)
    inputs = _video_inputs(family, tokenizer)
    with torch.no_grad():
        expected = reference(**inputs).logits
        actual = loaded.model(**inputs).logits
        other_video = loaded.model(**{**inputs, **_video_inputs(family, tokenizer, seed=2)}).logits
    assert actual.shape == (1, inputs["input_ids"].shape[1], len(tokenizer))
    # The weights come back bit for bit. The logits may not: CPU kernels (the MoE families' grouped expert matmul)
    # can round differently over two copies of the same weights in memory (1.4e-6 seen with the loaded,
    # memory-mapped tensors, equal again once they are copied), so the forward is compared within 1e-5.
    loaded_state = loaded.model.state_dict()
    assert all(torch.equal(tensor, loaded_state[name]) for name, tensor in reference.state_dict().items())
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5)
    # The video really reaches the logits (the forward is multimodal, not text-only).
    assert (other_video - actual).abs().max() > 1e-3


def test_seed_changes_the_weights(tokenizer):
    a = build_tiny_model("qwen2_5_vl", tokenizer, seed=0)
    b = build_tiny_model("qwen2_5_vl", tokenizer, seed=1)
    assert not torch.equal(a.lm_head.weight, b.lm_head.weight)


@pytest.mark.parametrize("family", QWEN_FAMILIES)
def test_greedy_decoding_is_varied_and_well_separated(tokenizer, family):
    # Parity tests compare greedy tokens across backends: argmaxes must not hinge on float noise.
    model = build_tiny_model(family, tokenizer, seed=0)
    inputs = _video_inputs(family, tokenizer)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=16, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    new_tokens = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    media_ids = set(tokenizer.convert_tokens_to_ids(
        ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"]))
    assert len(set(new_tokens)) >= len(new_tokens) // 2
    assert not media_ids & set(new_tokens)
    gaps = [float(step[0].topk(2).values.diff().abs()) for step in out.logits]
    assert min(gaps) > 1e-3
    # Typical gaps are far above float noise (the HF default init, std 0.02, gives a median ~0.03).
    assert sorted(gaps)[len(gaps) // 2] > 0.1


# ---------------------------------------------------------------- loader errors


def test_other_model_type_is_rejected(tmp_path):
    folder = tmp_path / "qwen2_text_only"
    Qwen2Config(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2).save_pretrained(folder)
    with pytest.raises(ValueError, match=r"model_type='qwen2'.*qwen2_5_vl, qwen3_vl"):
        load_checkpoint(folder)


def test_missing_tokenizer_is_reported(checkpoints, tmp_path):
    folder = tmp_path / "no_tokenizer"
    shutil.copytree(checkpoints["qwen3_vl"], folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (folder / name).unlink(missing_ok=True)
    with pytest.raises(ValueError, match=f"{folder}.*no tokenizer"):
        load_checkpoint(folder)


def test_folder_without_config_is_reported(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        load_checkpoint(tmp_path)

