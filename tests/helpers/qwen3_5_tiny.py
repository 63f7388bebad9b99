"""A tiny Qwen3.5 checkpoint through the real transformers classes, for the linear-attention tests.

Text: 4 layers ``linear, linear, full, linear`` (Qwen3.5 puts full attention every 4th layer), 2 key and
4 value heads of linear attention (Hv > Hk, so the key-head sharing is exercised), dk 16 != dv 8 (so a
transposed state would not fit). Vision: one block. Saved with ``save_pretrained`` and read back with
``from_pretrained``, as a user's checkpoint is.

transformers initialises every head's decay alike (``dt_bias = 1``, ``A`` up to 16): state forgotten
within a token or two, which would hide a state that is not carried. The linear layers here get
Mamba-style decays instead (``dt`` from 1e-3 to 1e-1 per head, ``A`` from 1 to 8), so some heads remember
hundreds of tokens, as trained Gated DeltaNet heads do.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

LAYER_TYPES = ["linear_attention", "linear_attention", "full_attention", "linear_attention"]
TEXT = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=len(LAYER_TYPES),
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_conv_kernel_dim=4,
    linear_key_head_dim=16, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
    layer_types=LAYER_TYPES, max_position_embeddings=1024, tie_word_embeddings=False,
    # Larger than transformers' 0.02 so layer outputs are O(1); much larger and the gated RMSNorm of
    # near-zero outputs amplifies fp32 noise past 1e-4 (transformers' own chunked and recurrent forms
    # then differ by 1e-4 as well).
    initializer_range=0.15,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                     "mrope_section": [1, 1, 2], "mrope_interleaved": True},
)
VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=16,
              num_position_embeddings=64)
TOKEN_IDS = dict(image_token_id=500, video_token_id=501, vision_start_token_id=502, vision_end_token_id=503)


def tiny_config() -> Qwen3_5Config:
    return Qwen3_5Config(text_config=dict(TEXT), vision_config=dict(VISION), **TOKEN_IDS)


def mamba_like_decays(gdn: torch.nn.Module, generator: torch.Generator,
                      dt_range=(1e-3, 1e-1), a_range=(1.0, 8.0)) -> None:
    """Per-head ``dt`` log-uniform in ``dt_range`` (``dt_bias`` = its inverse softplus), ``A`` uniform in ``a_range``."""
    heads = gdn.num_v_heads
    dt = torch.exp(torch.empty(heads).uniform_(math.log(dt_range[0]), math.log(dt_range[1]), generator=generator))
    a = torch.empty(heads).uniform_(*a_range, generator=generator)
    with torch.no_grad():
        gdn.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
        gdn.A_log.copy_(torch.log(a))


def save_tiny_qwen3_5(folder: str | Path, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    model = Qwen3_5ForConditionalGeneration(tiny_config()).eval()
    generator = torch.Generator().manual_seed(seed)
    for layer in model.model.language_model.layers:
        if hasattr(layer, "linear_attn"):
            mamba_like_decays(layer.linear_attn, generator)
    model.save_pretrained(folder)
    return Path(folder)


def load_qwen3_5(folder: str | Path) -> Qwen3_5ForConditionalGeneration:
    return Qwen3_5ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()


def linear_layers(model) -> list[torch.nn.Module]:
    """The ``Qwen3_5GatedDeltaNet`` modules of the text model, in layer order."""
    return [layer.linear_attn for layer in model.model.language_model.layers if hasattr(layer, "linear_attn")]
