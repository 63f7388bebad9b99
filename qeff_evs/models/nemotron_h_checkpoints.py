"""Nemotron-H checkpoints for tests and the bench: tiny widths saved with transformers' own classes, and released
widths with few layers (random weights, timing only)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from qeff_evs.models.nemotron_h_language import MAMBA, MOE, released_layer_kinds, tiny_layer_kinds
from qeff_evs.models.nemotron_h_tokens import (
    CHAT_TEMPLATE,
    END_OF_TEXT,
    IM_END,
    SPECIAL_TOKENS,
    VIDEO_PROCESSOR,
    tokenizer_ids,
)

# Tiny test models: widths, and Mamba2 steps that stay clear of transformers' prefill clamp (see mamba2.py).
INITIALIZER_RANGE = 0.3
TINY_DT_RANGE = (1e-2, 0.5)
TINY_DT_PROJECTION_SCALE = 0.1
# The projector's output layer scaled down: at INITIALIZER_RANGE its squared-ReLU rows come out with std ~30,
# which would swamp the text embeddings (std ~0.3) and every fp32 rounding with them.
TINY_PROJECTOR_SCALE = 0.03
TINY_TARGET_PATCHES = 24
TINY_TILE_SIZE = 64  # 4 x 4 patches, 4 rows per tile


def tiny_tokenizer():
    from qeff_evs.models.tiny import train_tokenizer

    return train_tokenizer(SPECIAL_TOKENS, eos_token=IM_END, pad_token=END_OF_TEXT, chat_template=CHAT_TEMPLATE)


def tiny_config_kwargs(tokenizer, text_layers: int = 6, vision_layers: int = 2) -> dict[str, Any]:
    ids = tokenizer_ids(tokenizer)
    text = dict(
        vocab_size=len(tokenizer), hidden_size=64, layers_block_type=tiny_layer_kinds(text_layers),
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
        mamba_num_heads=4, mamba_head_dim=8, n_groups=2, ssm_state_size=8, conv_kernel=4, chunk_size=8,
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=32, n_group=2, topk_group=1, routed_scaling_factor=2.5,
        # the vision norm transformers and vLLM build for checkpoints with MTP layers (the released one's)
        num_nextn_predict_layers=1, max_position_embeddings=1024, initializer_range=INITIALIZER_RANGE,
        time_step_min=1e-4, eos_token_id=ids["eos"], bos_token_id=ids["pad"], pad_token_id=ids["pad"],
    )
    # max_img_size 256: a 16 x 16 position table, resampled for the tiny frames.
    vision = dict(hidden_size=32, num_hidden_layers=vision_layers, num_attention_heads=2, patch_size=16,
                  max_img_size=256, num_cls_tokens=2, num_registers=2, video_temporal_patch_size=2,
                  initializer_range=INITIALIZER_RANGE)
    # force_image_size and use_thumbnail: the tiler's settings, as released configs store them (transformers'
    # config keeps them as given)
    # A Parakeet encoder of two conformer blocks, 16 mel bins (the released sound_config's keys).
    audio = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, num_mel_bins=16,
                 subsampling_conv_channels=8, conv_kernel_size=9, projection_hidden_size=48,
                 projection_bias=False, sampling_rate=16000, initializer_range=INITIALIZER_RANGE)
    return dict(text_config=text, vision_config=vision, audio_config=audio, projector_hidden_size=48,
                vision_hidden_size=32, video_temporal_patch_size=2, downsample_ratio=0.5,
                image_token_id=ids["image"], video_token_id=ids["image"], audio_token_id=ids["audio"],
                force_image_size=TINY_TILE_SIZE, use_thumbnail=True)


def prepare_tiny_model(model, tokenizer) -> None:
    """Zero the output rows of the image markers (a random model would emit them, and an ``<image>`` fed back
    would be taken for a media row); scale the projector's output to the text embeddings' size
    (``TINY_PROJECTOR_SCALE``); give the Mamba2 heads steps in ``TINY_DT_RANGE`` with a small input dependence,
    so some heads remember and no step meets transformers' prefill clamp; make the MoE correction bias random
    (transformers' init is zero: a choice that ignored it would go unnoticed)."""
    ids = tokenizer_ids(tokenizer)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        markers = [ids[key] for key in ("image", "img_start", "img_end", "audio", "audio_start", "audio_end")]
        model.language_model.lm_head.weight[markers] = 0.0
        model.multi_modal_projector.linear_2.weight *= TINY_PROJECTOR_SCALE
        if model.embed_audio is not None:
            model.embed_audio.linear_2.weight *= TINY_PROJECTOR_SCALE
            for module in model.audio_tower.modules():  # running statistics a trained encoder would have
                if isinstance(module, nn.BatchNorm1d):
                    module.running_mean.uniform_(-0.5, 0.5, generator=generator)
                    module.running_var.uniform_(0.5, 1.5, generator=generator)
        for layer in model.language_model.model.layers:
            if layer.block_type == MAMBA:
                mixer = layer.mixer
                heads = mixer.num_heads
                low, high = (math.log(v) for v in TINY_DT_RANGE)
                dt = torch.exp(torch.empty(heads).uniform_(low, high, generator=generator))
                mixer.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
                mixer.in_proj.weight[-heads:] *= TINY_DT_PROJECTION_SCALE
            elif layer.block_type == MOE:
                layer.mixer.gate.e_score_correction_bias.copy_(
                    torch.empty(layer.mixer.gate.num_experts).uniform_(-0.5, 0.5, generator=generator))


def tiny_generation_config(tokenizer):
    from transformers import GenerationConfig

    ids = tokenizer_ids(tokenizer)
    return GenerationConfig(bos_token_id=ids["pad"], eos_token_id=[ids["eos"]], pad_token_id=ids["pad"],
                            do_sample=False)


def tiny_preprocessor_config(config) -> dict[str, Any]:
    """transformers' video processor config keys (``video_preprocessor_config.json`` of the released folder)."""
    vision = config.vision_config
    return {"video_processor_type": VIDEO_PROCESSOR, "norm_mean": list(vision.norm_mean),
            "norm_std": list(vision.norm_std), "patch_size": vision.patch_size,
            "downsample_ratio": config.downsample_ratio, "video_target_num_patches": TINY_TARGET_PATCHES,
            "video_maintain_aspect_ratio": True}


def realistic_config_kwargs(text_layers: int = 6, vision_layers: int = 4,
                            audio_layers: int = 0) -> dict[str, Any]:
    """Released widths; the ``<image>`` and ``<so_embedding>`` ids are the tiny tokenizer's, whose text the bench's
    prompts are made of (the frame separators and markers come from the tokenizer, the pads from the config: they
    must agree). ``audio_layers``: a Parakeet encoder of that depth (``realistic_audio_widths``); none for 0."""
    text, vision = realistic_widths(text_layers, vision_layers)
    ids = tokenizer_ids(tiny_tokenizer())
    audio = {} if not audio_layers else dict(audio_config=realistic_audio_widths(audio_layers),
                                             audio_token_id=ids["audio"])
    return dict(text_config=text, vision_config=vision, projector_hidden_size=4096, vision_hidden_size=1280,
                video_temporal_patch_size=2, downsample_ratio=0.5, image_token_id=ids["image"],
                video_token_id=ids["image"], force_image_size=512, use_thumbnail=True, **audio)


def realistic_audio_widths(layers: int) -> dict[str, Any]:
    """A Parakeet encoder at transformers' ``ParakeetEncoderConfig`` widths (Parakeet 0.6B: hidden 1024, 8 heads,
    FFN 4096, 80 mel bins, subsampling by 8 through 256 channels) with ``layers`` conformer blocks, its projector
    4096 wide as the vision one; the released Omni's own sound widths are not in our references."""
    return dict(hidden_size=1024, num_hidden_layers=layers, num_attention_heads=8, intermediate_size=4096,
                num_mel_bins=80, subsampling_conv_channels=256, conv_kernel_size=9, projection_hidden_size=4096,
                projection_bias=False, sampling_rate=16000)


def realistic_widths(text_layers: int, vision_layers: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Nemotron 3 Nano Omni 30B-A3B widths: the language model is Nemotron 3 Nano 30B-A3B's (its config.json as
    third parties quote it), the vision tower transformers' RADIO defaults (C-RADIO-H), with these depths."""
    text = dict(
        vocab_size=131072, hidden_size=2688, layers_block_type=released_layer_kinds(text_layers),
        num_attention_heads=32, num_key_value_heads=2, head_dim=128, intermediate_size=1856,
        mamba_num_heads=64, mamba_head_dim=64, n_groups=8, ssm_state_size=128, conv_kernel=4, chunk_size=128,
        n_routed_experts=128, num_experts_per_tok=6, moe_intermediate_size=1856,
        moe_shared_expert_intermediate_size=3712, n_group=1, topk_group=1, routed_scaling_factor=2.5,
        norm_topk_prob=True, layer_norm_epsilon=1e-5, max_position_embeddings=262144, tie_word_embeddings=False,
        num_nextn_predict_layers=0, eos_token_id=11,
    )
    vision = dict(hidden_size=1280, num_hidden_layers=vision_layers, num_attention_heads=16, patch_size=16,
                  max_img_size=2048, num_cls_tokens=3, num_registers=7, video_temporal_patch_size=2)
    return text, vision
