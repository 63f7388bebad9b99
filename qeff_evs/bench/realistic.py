"""Released-checkpoint widths with few layers: the benchmarked models' configs (random weights, timing only).

qwen2_5_vl: Qwen2.5-VL-3B widths. qwen3_vl: Qwen3-VL-2B widths. Special ids are Qwen's real ones.
"""

from __future__ import annotations

from qeff_evs.models.registry import FAMILIES, family_module


def _realistic_fullatt_blocks(vision_layers: int) -> list[int]:
    # The 3B model uses full attention on every 8th block (7, 15, 23, 31); keep at least the last one.
    blocks = [i for i in range(7, vision_layers, 8)]
    return blocks or [vision_layers - 1]


def _realistic_deepstack_levels(vision_layers: int) -> list[int]:
    # The 2B/4B models tap blocks 5, 11, 17 of 24; with fewer blocks tap up to three spread evenly.
    levels = [i for i in (5, 11, 17) if i < vision_layers]
    return levels or sorted({(vision_layers - 1) * (j + 1) // 3 for j in range(min(3, vision_layers))})


def realistic_config(family: str, text_layers: int = 2, vision_layers: int = 2):
    """Released-checkpoint widths with ``text_layers`` / ``vision_layers`` layers (not for accuracy)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; use one of {', '.join(FAMILIES)}")
    if text_layers < 1 or vision_layers < 1:
        raise ValueError(
            f"text_layers={text_layers}, vision_layers={vision_layers}: both must be >= 1"
        )
    media_ids = dict(image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653)
    text_ids = dict(bos_token_id=151643, eos_token_id=151645)
    if family == "qwen2_5_vl":
        text = dict(
            vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=text_layers,
            num_attention_heads=16, num_key_value_heads=2, max_position_embeddings=128000, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
            tie_word_embeddings=True, **text_ids,
        )
        vision = dict(
            depth=vision_layers, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048,
            patch_size=14, temporal_patch_size=2, spatial_merge_size=2, window_size=112,
            fullatt_block_indexes=_realistic_fullatt_blocks(vision_layers), tokens_per_second=2, in_channels=3,
        )
    else:
        text = dict(
            vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=text_layers,
            num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=262144,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [24, 20, 20],
                             "mrope_interleaved": True},
            **text_ids,
        )
        vision = dict(
            depth=vision_layers, hidden_size=1024, intermediate_size=4096, num_heads=16, out_hidden_size=2048,
            patch_size=16, temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=2304,
            deepstack_visual_indexes=_realistic_deepstack_levels(vision_layers), in_channels=3,
        )
    config_class = family_module(family).CONFIG_CLASS
    return config_class(text_config=text, vision_config=vision, tie_word_embeddings=True, **media_ids)
