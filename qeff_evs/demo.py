"""``qeff-evs demo``: the whole pipeline on a tiny random Qwen2.5-VL and a synthetic video.

A moving square crosses a still textured background; EVS should keep frame 0 whole and, in later
frames, mostly the tokens the square passes over. The tiny model has random weights, so its words
mean nothing; what the demo shows is the path: checkpoint folder -> export -> ORT run.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

from qeff_evs.export.pipeline import ExportOptions, export_checkpoint
from qeff_evs.models.registry import DEFAULT_FAMILY
from qeff_evs.models.tiny import save_tiny_checkpoint
from qeff_evs.runtime.inputs.prompt import video_question_pieces
from qeff_evs.runtime.builders import build_engine, stop_ids
from qeff_evs.runtime.export_bundle import open_export
from qeff_evs.runtime.media import video_from_file
from qeff_evs.runtime.inputs.synthetic import moving_square_video

DEMO_FRAMES = 16
DEMO_SIZE = 168  # 12x12 patches of 14 -> 6x6 merged tokens per temporal patch
DEMO_Q = 0.5
DEMO_QUESTION = "What moves in this video?"


def kept_map(kept_indices: np.ndarray, grid: tuple[int, int, int]) -> list[str]:
    """One text block per temporal patch: '#' kept, '.' pruned, frames side by side."""
    t, h, w = grid
    keep = np.zeros(t * h * w, dtype=bool)
    keep[kept_indices] = True
    keep = keep.reshape(t, h, w)
    header = " ".join(f"t{f:<{w - 1}}" for f in range(t))
    rows = [" ".join("".join("#" if keep[f, r, c] else "." for c in range(w)) for f in range(t)) for r in range(h)]
    return [header, *rows]


def run_demo(workdir: Path | None = None, backend: str = "ort",
             progress: Callable[[str], None] = lambda message: None) -> int:
    with tempfile.TemporaryDirectory(prefix="qeff-evs-demo-") as scratch:
        root = Path(workdir) if workdir else Path(scratch)
        root.mkdir(parents=True, exist_ok=True)
        progress(f"saving a tiny random Qwen2.5-VL checkpoint to {root / 'checkpoint'}")
        checkpoint = save_tiny_checkpoint(DEFAULT_FAMILY, root / "checkpoint", seed=0)
        options = ExportOptions(video_pruning_rate=DEMO_Q, frames=(DEMO_FRAMES,),
                                resolutions=((DEMO_SIZE, DEMO_SIZE),), prefill_seq_len=64, ctx_len=1024)
        export_checkpoint(checkpoint, root / "export", options, progress=progress)

        video_path = root / "moving_square.npy"
        np.save(video_path, moving_square_video(DEMO_FRAMES, DEMO_SIZE, DEMO_SIZE, seed=0))
        bundle = open_export(root / "export")
        engine = build_engine(bundle, backend, max_new_tokens=12, progress=progress)
        video = video_from_file(video_path, bundle)
        pieces = video_question_pieces(bundle.tokenizer, DEMO_QUESTION, bundle.family.token_strings)
        prompt = engine.prepare(pieces, [video])
        result = engine.generate(prompt, eos_ids=stop_ids(bundle))

        grid = bundle.family.merged_grid(video.grid_thw)
        kept = prompt.encoded[0].kept_per_frame
        print(f"video: {DEMO_FRAMES} frames {DEMO_SIZE}x{DEMO_SIZE} -> merged grid {grid}, q = {DEMO_Q}")
        print(f"kept {sum(kept)} of {int(np.prod(grid))} video tokens; per temporal patch: {list(kept)}")
        print("kept map ('#' kept, '.' pruned):")
        for line in kept_map(prompt.encoded[0].kept_indices, grid):
            print("  " + line)
        print(f"prompt: {len(result.prompt_token_ids)} tokens in {result.num_prefill_chunks} prefill chunks, "
              f"vision rows per chunk {result.vision_rows_per_chunk}")
        print(f"generated token ids ({backend}): {result.generated_token_ids}")
        print(f"generated text: {bundle.tokenizer.decode(result.generated_token_ids)!r}")
    return 0
