"""Where our first-token logits differ from transformers' at released widths, stage by stage, against float64.

One random checkpoint per family at released widths with 2 text + 2 vision layers (``bench.serving.serving_checkpoint``,
the checkpoint the QEfficient comparison measured: the tiny checkpoints' 0.3 init range), one 16-frame 448x448 clip,
the plain video prompt at q 0. Each stage is run by transformers and by our PyTorch modules (the ones the graphs are
exported from, run eagerly), in float32, and by transformers in float64 (the truth both float32 runs round away from):

* ``vision rows``: transformers' vision tower on the whole video against our encoder (F temporal patches per call,
  segment attention), max |diff| and the rows' scale;
* ``first-token logits``: transformers' text model against our language graph on the *same* rows (transformers'
  float32 ones), so the language side is measured alone;
* ``end to end``: our rows through our language graph against transformers' whole model (what the comparison's
  "qeff-evs q=0 vs transformers" column measured, there on ONNX Runtime).

If our float32 run is as far from float64 as transformers' own float32 run is, the difference between the two is
float32 rounding the model amplifies, not a divergence. Measured (shared machine, 2 cores, about 4 min), max |diff|:

| family | stage | scale | ours vs transformers fp32 | transformers fp32 vs fp64 | ours vs fp64 |
|---|---|---|---|---|---|
| qwen2_5_vl | vision rows | 1.7e+03 | 3.40e-03 | 1.08e-01 | 1.09e-01 |
| qwen2_5_vl | logits, same rows | 44.4 | 0.00e+00 | 7.23e-05 | 7.23e-05 |
| qwen2_5_vl | logits, end to end | 44.4 | 3.53e-04 | 1.19e-02 | 1.16e-02 |
| qwen3_vl | vision rows | 1.44e+03 | 6.71e-03 | 1.59e-01 | 1.60e-01 |
| qwen3_vl | logits, same rows | 51.5 | 3.43e-05 | 6.43e-05 | 7.14e-05 |
| qwen3_vl | logits, end to end | 51.5 | 1.50e-04 | 2.37e-03 | 2.45e-03 |

Run alone (a few GB, a few minutes on 2 cores)::

    flock /tmp/qeff-heavy.lock .venv/bin/python benchmarks/released_width_parity.py --workdir /tmp/parity
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch
from transformers import AutoTokenizer

from qeff_evs.bench import hf_reference
from qeff_evs.bench.serving import serving_checkpoint
from qeff_evs.bench.workload import first_special_id, prompt_pieces, question_ids, synthetic_clip
from qeff_evs.manifest import LanguageShape
from qeff_evs.models.language import ExportableLanguageGraph
from qeff_evs.models.registry import family_class, family_for_config
from qeff_evs.runtime.backends.torch_reference import TorchEncoderSession, TorchLanguageSession
from qeff_evs.runtime.backends.vision import VisionPipeline
from qeff_evs.runtime.engine.request import EncodedMedia, prepare_prompt
from qeff_evs.runtime.engine.steps import prefill_step
from qeff_evs.runtime.inputs.preprocess_spec import VisionPreprocessSpec
from qeff_evs import evs

FRAMES, SIZE, QUESTION_TOKENS, SEED = 16, 448, 32, 0


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


Rows = tuple  # (rows (K, hidden), {extra name: (levels, K, hidden)}), float64
DEEPSTACK = "deepstack_features"  # Qwen3-VL's extra rows, transformers' deepstack_visual_embeds


def hf_rows(model, video) -> Rows:
    with torch.no_grad():
        dtype = next(model.parameters()).dtype
        tower = model.model.visual(torch.as_tensor(video.pixel_values, dtype=dtype),
                                   grid_thw=torch.tensor([list(video.grid_thw)]))
        levels = getattr(tower, "deepstack_features", None)
        extras = {DEEPSTACK: torch.stack(list(levels)).double().numpy()} if levels else {}
        return tower.pooler_output.double().numpy(), extras


def hf_logits(model, prompt, rows: Rows) -> np.ndarray:
    """transformers' text model on the prompt with ``rows`` at its video pads (``hf_reference.video_reference``'s
    forward, rows given), first-token logits."""
    dtype = next(model.parameters()).dtype
    config = model.config
    ids = torch.from_numpy(prompt.ids)[None]
    text = model.model.language_model
    is_video = ids == config.video_token_id
    merged, extras = rows
    extra = ({"visual_pos_masks": is_video, "deepstack_visual_embeds": list(torch.as_tensor(extras[DEEPSTACK],
                                                                                            dtype=dtype))}
             if extras else {})
    with torch.no_grad():
        embeds = text.embed_tokens(ids).clone()
        embeds[is_video] = torch.as_tensor(merged, dtype=dtype)
        out = text(inputs_embeds=embeds, position_ids=torch.from_numpy(prompt.positions)[:, None], **extra)
        return model.lm_head(out.last_hidden_state[0, -1]).double().numpy()


def our_logits(family, model, prompt, rows: Rows) -> np.ndarray:
    """Our language graph (eager, float32) on the whole prompt in one chunk, ``rows`` in its window."""
    rows, extras = rows
    n = len(prompt.ids)
    language = ExportableLanguageGraph(family.language_graph(model, family.special_tokens().media_pads, 2 * n))
    spec = language.graph.spec
    shape = LanguageShape(spec.num_layers, spec.kv_heads, spec.head_dim, spec.hidden_size, 2 * n, n,
                          dict(spec.extras), rope_positions=2 * n)
    session = TorchLanguageSession(language, shape, "cpu")
    with_rows = prompt.__class__(prompt.ids, prompt.positions, prompt.decode_start, prompt.placeholders,
                                 [EncodedMedia(rows.astype(np.float32), prompt.encoded[0].kept_indices,
                                               {name: value.astype(np.float32) for name, value in extras.items()},
                                               prompt.encoded[0].kept_per_frame)])
    step = prefill_step(with_rows, 0, n, n, n, shape.hidden, shape.extras)
    return session.run(step).reshape(-1).astype(np.float64)


def our_rows(family, model, video) -> Rows:
    t = int(video.grid_thw[0])
    vision = VisionPipeline(family, TorchEncoderSession(family.encoder(model), "cpu"), {}, 2, (t,))
    merged = vision.merged_rows(video)
    return merged.rows.astype(np.float64), {name: value.astype(np.float64) for name, value in merged.extras.items()}


def diff(a: Rows | np.ndarray, b: Rows | np.ndarray) -> float:
    if isinstance(a, tuple):  # rows and every extra row
        return max([diff(a[0], b[0]), *(diff(a[1][name], b[1][name]) for name in a[1])])
    return float(np.abs(a - b).max())


def measure(family_name: str, workdir: Path, frames: int = FRAMES, size: int = SIZE) -> dict:
    folder = workdir / family_name
    if not (folder / "config.json").is_file():
        progress(f"{family_name}: random checkpoint at released widths, 2 + 2 layers")
        serving_checkpoint(family_name, folder)
    model32 = hf_reference.load_reference_model(folder, family_class(family_name).model_class)
    family = family_for_config(model32.config, AutoTokenizer.from_pretrained(folder, local_files_only=True))
    spec = VisionPreprocessSpec.from_pretrained_dir(folder, model32.config)
    clip = synthetic_clip(spec, frames, size, SEED)
    video = clip.video
    t, h, w = family.merged_grid(video.grid_thw)
    indices = np.arange(t * h * w, dtype=np.int64)
    question = question_ids(QUESTION_TOKENS, first_special_id(family), SEED)
    placeholder_rows = np.zeros((len(indices), family.normalized_config.hidden_size), np.float32)
    placeholder_extras = {name: np.zeros((levels, len(indices), placeholder_rows.shape[1]), np.float32)
                          for name, levels in family.extras.items()}
    per_frame = tuple(evs.tokens_per_frame_kept(indices, t, h * w))
    prompt = prepare_prompt(prompt_pieces(family, question), [video],
                            [EncodedMedia(placeholder_rows, indices, placeholder_extras, per_frame)], family)
    progress(f"{family_name}: prompt of {len(prompt.ids)} tokens ({len(indices)} video rows)")

    progress("vision: transformers float32 and ours")
    rows32 = hf_rows(model32, video)
    ours_rows = our_rows(family, model32, video)
    progress("language: transformers float32 and ours on transformers' rows, then ours end to end")
    logits32 = hf_logits(model32, prompt, rows32)
    ours_same_rows = our_logits(family, model32, prompt, rows32)
    ours_e2e = our_logits(family, model32, prompt, ours_rows)
    progress("float64: transformers")
    model64 = model32.double()
    rows64 = hf_rows(model64, video)
    logits64 = hf_logits(model64, prompt, rows64)
    logits64_on_32_rows = hf_logits(model64, prompt, rows32)
    return {
        "family": family_name,
        "rows_scale": float(np.abs(rows64[0]).max()),
        "rows_ours_vs_hf32": diff(ours_rows, rows32),
        "rows_hf32_vs_hf64": diff(rows32, rows64),
        "rows_ours_vs_hf64": diff(ours_rows, rows64),
        "logit_scale": float(np.abs(logits64).max()),
        "logits_ours_vs_hf32_same_rows": diff(ours_same_rows, logits32),
        "logits_hf32_vs_hf64_same_rows": diff(logits32, logits64_on_32_rows),
        "logits_ours_vs_hf64_same_rows": diff(ours_same_rows, logits64_on_32_rows),
        "e2e_ours_vs_hf32": diff(ours_e2e, logits32),
        "e2e_hf32_vs_hf64": diff(logits32, logits64),
        "e2e_ours_vs_hf64": diff(ours_e2e, logits64),
        "top_token_equal": int(np.argmax(ours_e2e)) == int(np.argmax(logits32)) == int(np.argmax(logits64)),
    }


def table(results: list[dict]) -> str:
    lines = ["| family | stage | scale | ours vs transformers fp32 | transformers fp32 vs fp64 | ours vs fp64 |",
             "|---|---|---|---|---|---|"]
    for r in results:
        lines += [
            f"| {r['family']} | vision rows | {r['rows_scale']:.3g} | {r['rows_ours_vs_hf32']:.2e} | "
            f"{r['rows_hf32_vs_hf64']:.2e} | {r['rows_ours_vs_hf64']:.2e} |",
            f"| {r['family']} | logits, same rows | {r['logit_scale']:.3g} | "
            f"{r['logits_ours_vs_hf32_same_rows']:.2e} | "
            f"{r['logits_hf32_vs_hf64_same_rows']:.2e} | {r['logits_ours_vs_hf64_same_rows']:.2e} |",
            f"| {r['family']} | logits, end to end | {r['logit_scale']:.3g} | {r['e2e_ours_vs_hf32']:.2e} | "
            f"{r['e2e_hf32_vs_hf64']:.2e} | {r['e2e_ours_vs_hf64']:.2e} |",
        ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default="qwen2_5_vl,qwen3_vl")
    parser.add_argument("--workdir", type=Path, required=True, help="the random checkpoints")
    parser.add_argument("--frames", type=int, default=FRAMES)
    parser.add_argument("--size", type=int, default=SIZE)
    args = parser.parse_args()
    torch.set_num_threads(2)
    results = []
    for name in args.families.split(","):
        results.append(measure(name, args.workdir, args.frames, args.size))
        print(table(results[-1:]), flush=True)
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
