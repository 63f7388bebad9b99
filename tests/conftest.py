"""Shared fixtures: one tiny Qwen2.5-VL checkpoint folder and ONE export of it, for the whole session.

Exports cost seconds each, so the end-to-end, CLI and artifact tests all read this one folder;
tests that need other chunk lengths build engines with their own ``EngineConfig`` over the same
graphs (``seq_len``, ``vision_size`` and ``ctx_len`` are symbols of the language graph, and ONNX
Runtime ignores specializations), each with a language session whose shape states the lengths it sends
(``LanguageShape.prefill_lens``: a session refuses any other, as the card does). Tests that modify an
export work on a copy.

The export serves two resolutions x two frame counts at q = 0.5, with ``user_vision_size`` (48)
different from the prefill length (32) so that a test can tell which of the two a file carries.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from qeff_evs.export.pipeline import ExportOptions
from qeff_evs.models.tiny import save_tiny_checkpoint
from qeff_evs.runtime.inputs.synthetic import moving_square_video
from helpers.exports import export_quietly

FAMILY = "qwen2_5_vl"
CHECKPOINT_SEED = 0

# 112x196 px = 8x14 patches = 4x7 merged tokens per temporal patch; 168x168 = 6x6 merged.
EXPORT_OPTIONS = ExportOptions(
    video_pruning_rate=0.5,
    frames=(4, 8),
    resolutions=((112, 196), (168, 168)),
    prefill_seq_len=32,
    ctx_len=256,
    user_vision_size=48,
)

# The clip the tests ask about: 8 frames at 2 fps (the .npy default rate), aspect 0.6, so the
# processor keeps all 8 frames and resizes to 112x196 -> grid (4, 8, 14), merged (4, 4, 7).
VIDEO_FRAMES = 8
VIDEO_HEIGHT, VIDEO_WIDTH = 120, 200
VIDEO_SEED = 3
QUESTION = "What happens in this video?"


@pytest.fixture(scope="session")
def export_options() -> ExportOptions:
    return EXPORT_OPTIONS


@pytest.fixture(scope="session")
def question() -> str:
    return QUESTION


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """A complete tiny Qwen2.5-VL checkpoint folder (config, safetensors, tokenizer, preprocessor)."""
    return save_tiny_checkpoint(FAMILY, tmp_path_factory.mktemp("checkpoint"), seed=CHECKPOINT_SEED)


@pytest.fixture(scope="session")
def tiny_export(tiny_checkpoint, tmp_path_factory) -> Path:
    """The session's one export folder. Read it; copy it before changing anything in it."""
    return export_quietly(tiny_checkpoint, tmp_path_factory.mktemp("export"), EXPORT_OPTIONS)


@pytest.fixture(scope="session")
def video_npy(tmp_path_factory) -> Path:
    """A moving-square clip as a (T, H, W, 3) uint8 ``.npy``."""
    path = tmp_path_factory.mktemp("video") / "moving_square.npy"
    np.save(path, moving_square_video(VIDEO_FRAMES, VIDEO_HEIGHT, VIDEO_WIDTH, seed=VIDEO_SEED))
    return path


# Exports for serving (vLLM plugin and scheduler tests): 4 KV rows, 16-token prefill chunks, so a step's
# budget ends inside video placeholders and requests outnumber rows.
SERVED_FULL_BATCH, SERVED_PREFILL, SERVED_CTX_LEN = 4, 16, 256
SERVED_RESOLUTIONS = {"qwen2_5_vl": ((112, 112), (112, 168)), "qwen3_vl": ((128, 128), (128, 192)),
                      "qwen3_5": ((128, 128), (128, 192)), "qwen3_vl_moe": ((128, 128),), "qwen3_5_moe": ((128, 128),),
                      # the tiny tile rule's sizes for square and 3:2 clips (2x2 and 2x3 rows per tubelet)
                      "nemotron_h_omni": ((64, 64), (64, 96))}


@pytest.fixture(scope="session")
def served_export(tmp_path_factory):
    """``served_export(family)``: (checkpoint folder, export folder) of one family, made once per session."""
    made: dict[str, tuple[Path, Path]] = {}

    def get(family: str) -> tuple[Path, Path]:
        if family not in made:
            folder = tmp_path_factory.mktemp(f"served_{family}")
            checkpoint = save_tiny_checkpoint(family, folder / "checkpoint", seed=1)
            options = ExportOptions(0.5, (2, 4, 8), SERVED_RESOLUTIONS[family], SERVED_PREFILL, SERVED_CTX_LEN,
                                    full_batch_size=SERVED_FULL_BATCH)
            made[family] = (checkpoint, export_quietly(checkpoint, folder / "export", options))
        return made[family]
    return get
