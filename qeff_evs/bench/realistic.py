"""Released-checkpoint widths with few layers: the benchmarked models' configs (random weights, timing only).

Each family declares its released widths (``ModelFamily.realistic_config_kwargs``); special ids are those of the
family's tiny tokenizer, which the bench saves beside the config (``bench.checkpoint``): every id the config names is
a token of the checkpoint's own tokenizer.
"""

from __future__ import annotations

from qeff_evs.models.registry import family_class


def realistic_config(family: str, text_layers: int = 2, vision_layers: int = 2, audio_layers: int = 0):
    """Released-checkpoint widths with ``text_layers`` / ``vision_layers`` layers (not for accuracy), and an audio
    encoder of ``audio_layers`` where asked (a family with audio only)."""
    spec = family_class(family)
    if text_layers < 1 or vision_layers < 1:
        raise ValueError(
            f"text_layers={text_layers}, vision_layers={vision_layers}: both must be >= 1"
        )
    if not audio_layers:
        return spec.config_class(**spec.realistic_config_kwargs(text_layers, vision_layers))
    if "audio" not in spec.modalities:
        raise ValueError(f"{family} has no audio encoder; a sound track is benchmarked on nemotron_h_omni")
    return spec.config_class(**spec.realistic_config_kwargs(text_layers, vision_layers, audio_layers=audio_layers))
