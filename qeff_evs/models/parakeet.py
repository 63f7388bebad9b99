"""The Parakeet audio encoder of Nemotron-H Omni checkpoints and its projector as an exportable graph, one clip a call.

transformers' ``ParakeetEncoder`` (the checkpoint's ``sound_encoder``, vLLM's ``ProjectedParakeet`` runs the same
class) takes a clip's log-mel features: a convolutional subsampling by 8 in time (three stride-2 stages, the running
length masked after each), relative-position conformer blocks whose attention and convolutions skip the masked
frames, then the projector to the language model's width (RMSNorm, linear, squared ReLU, linear). A clip padded with
zero features to a longer bucket and masked gives its rows unchanged, so the graph takes one clip padded to a frame
bucket (``audio_frames``, a specialization each, as frame counts are for videos) and its mask, and the host keeps the
clip's own rows (``subsampled_frames``). The inputs keep the names every encoder graph's have (``pixel_values``, its
features; ``vision_embeds``, its rows), so the backends' encoder sessions run it as they are.

=====================  ======  ==================  ============================================
name                   dtype   shape               meaning
=====================  ======  ==================  ============================================
pixel_values           float   (audio_frames, M)   one clip's normalised log-mel features, padded
feature_mask           int64   (audio_frames,)     1 on the clip's frames, 0 on the padding
vision_embeds          float   (audio_rows, D)     projected rows, 8 frames a row (the padding's last)
=====================  ======  ==================  ============================================
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from qeff_evs.models.graph_io import VisionGraphSpec
from qeff_evs.models.vision_common import share_weights_copy

AUDIO_FRAMES, AUDIO_ROWS = "audio_frames", "audio_rows"

GRAPH_SPEC = VisionGraphSpec(
    inputs={"pixel_values": {0: AUDIO_FRAMES}, "feature_mask": {0: AUDIO_FRAMES}},
    outputs={"vision_embeds": {0: AUDIO_ROWS}},
)


def subsampled_frames(frames: int, kernel: int, stride: int, stages: int) -> int:
    """Rows the subsampling leaves of ``frames`` feature frames: ``(L + 2p - k) // s + 1`` per stage, ``p`` the
    convolutions' ``(k - 1) // 2`` (transformers' ``_get_subsampling_output_length``, which vLLM counts with)."""
    padding = (kernel - 1) // 2
    for _ in range(stages):
        frames = (frames + 2 * padding - kernel) // stride + 1
    return frames


def audio_symbols(bucket_frames: int, kernel: int, stride: int, stages: int) -> dict[str, int]:
    """The symbols one audio encoder specialization binds: a clip of up to ``bucket_frames`` feature frames."""
    return {AUDIO_FRAMES: int(bucket_frames), AUDIO_ROWS: subsampled_frames(int(bucket_frames), kernel, stride, stages)}


class AudioEncoder(nn.Module):
    """The audio side of a Nemotron-H Omni model over one padded clip (module docstring): a structural copy of its
    Parakeet tower (eager attention, so the caller's model keeps its own) and its audio projector, sharing their
    parameters."""

    graph_spec = GRAPH_SPEC

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        if getattr(model, "audio_tower", None) is None:
            raise ValueError(f"{type(model).__name__} has no audio tower (its config has no audio_config / "
                             "sound_config); this checkpoint serves no audio")
        self.tower = share_weights_copy(model.audio_tower)
        self.tower.config._attn_implementation = "eager"
        self.projector = model.embed_audio
        self.mels = int(self.tower.config.num_mel_bins)

    def forward(self, pixel_values: torch.Tensor, feature_mask: torch.Tensor) -> torch.Tensor:
        """Returns ``vision_embeds (audio_rows, hidden)``."""
        hidden = self.tower(input_features=pixel_values[None], attention_mask=feature_mask[None]).last_hidden_state
        return self.projector(hidden[0])

    def dummy_inputs(self, grid_hw: Sequence[int], frames: int = 1, seed: int = 0) -> dict[str, torch.Tensor]:
        """Export examples: ``grid_hw`` is ``(bucket frames, mels)``; the clip fills three quarters of the bucket."""
        bucket = int(grid_hw[0])
        generator = torch.Generator().manual_seed(seed)
        features = torch.randn(bucket, self.mels, generator=generator)
        mask = torch.zeros(bucket, dtype=torch.int64)
        mask[:max(1, 3 * bucket // 4)] = 1
        return {"pixel_values": features * mask[:, None], "feature_mask": mask}

    def run(self, pixel_values: torch.Tensor, host_inputs: dict[str, np.ndarray]) -> torch.Tensor:
        """Eager forward of one call (the PyTorch reference backend's call)."""
        mask = torch.from_numpy(np.asarray(host_inputs["feature_mask"])).to(pixel_values.device)
        with torch.no_grad():
            return self(pixel_values, mask)
