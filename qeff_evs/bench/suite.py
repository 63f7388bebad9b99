"""One benchmark run: build and export the graphs, run the three measurements, write every output."""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from qeff_evs.bench import plots, report
from qeff_evs.bench.config import BenchConfig, validate
from qeff_evs.bench.graphs import build_graphs, model_config
from qeff_evs.bench.overhead import run_evs_overhead
from qeff_evs.bench.pruning import run_pruning_sweep
from qeff_evs.bench.vision_sweep import run_vision_sweep
from qeff_evs.bench.window_sweep import run_window_sweep
from qeff_evs.bench.workload import synthetic_clip
from qeff_evs.models.registry import family_class
from qeff_evs.runtime.inputs.processor import VisionPreprocessSpec

Progress = Callable[[str], None]

RESULTS_JSON = "results.json"
RESULTS_MD = "results.md"
LATENCY_PNG = "latency_vs_q.png"
WINDOW_PNG = "window_sweep.png"
VISION_PNG = "vision_sweep.png"
KEPT_PNG = "kept_tokens.png"


def model_summary(hf_config) -> dict:
    text, vision = hf_config.text_config, hf_config.vision_config
    return {"text_hidden": text.hidden_size, "text_layers": text.num_hidden_layers, "vocab_size": text.vocab_size,
            "attention_heads": text.num_attention_heads, "kv_heads": text.num_key_value_heads,
            "vision_hidden": vision.hidden_size, "vision_layers": vision.depth, "vision_heads": vision.num_heads}


def write_reports(results: dict, output: Path) -> list[Path]:
    """results.json's companions: results.md and the four PNGs (also re-renders a saved results.json)."""
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    (output / RESULTS_MD).write_text(report.markdown(results))
    config = report.config_from_json(results["config"])
    vc = family_class(config.family).config_paths.read(model_config(config))
    spec = VisionPreprocessSpec.for_family(config.family, patch_size=vc.patch_size,
                                           temporal_patch_size=vc.temporal_patch_size, merge_size=vc.merge_size)
    sweep = results["pruning_sweep"]
    clip = synthetic_clip(spec, config.vision_frames, config.vision_frame_size, config.seed)
    kept = {s["q"]: np.asarray(s["vision_retained_indices"]) for s in sweep["samples"]}
    return [
        output / RESULTS_MD,
        plots.plot_latency_vs_q(results, output / LATENCY_PNG),
        plots.plot_window_sweep(results, output / WINDOW_PNG),
        plots.plot_vision_sweep(results, output / VISION_PNG),
        plots.plot_kept_tokens(clip.frames, tuple(sweep["vision_merged_grid"]), kept,
                               vc.patch_size * vc.merge_size, vc.temporal_patch_size, output / KEPT_PNG),
    ]


def render_saved(results_json: Path, output: Path) -> dict:
    """Numbers, Markdown and plots again from a saved results.json's raw samples."""
    results = report.rebuild(json.loads(Path(results_json).read_text()))
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    (output / RESULTS_JSON).write_text(json.dumps(results, indent=1) + "\n")
    write_reports(results, output)
    return results


# Fields that decide the graphs and the shared clip: a partial run must match its base run on them.
GRAPH_FIELDS = ("family", "widths", "text_layers", "vision_layers", "frame_size", "prefill_seq_len", "ctx_len",
                "user_vision_size", "frames_per_call", "seed")
MEASURE = {"pruning_sweep": run_pruning_sweep, "window_sweep": run_window_sweep,
           "vision_sweep": run_vision_sweep, "evs_overhead": run_evs_overhead}
LANGUAGE_PHASES = ("pruning_sweep", "window_sweep")  # the others run the vision graphs only


def load_base(config: BenchConfig, only: tuple[str, ...], base: Path) -> dict:
    """The saved run whose phases outside ``only`` a partial run keeps; raises unless it fits ``config``."""
    unknown = [phase for phase in only if phase not in report.PHASES]
    if unknown or not only:
        raise ValueError(f"--only takes phases among {', '.join(report.PHASES)}, got {', '.join(only) or 'none'}")
    saved = json.loads(Path(base).read_text())
    differs = [f"{name} ({saved['config'].get(name)!r} there, {getattr(config, name)!r} here)"
               for name in GRAPH_FIELDS if saved["config"].get(name) != getattr(config, name)]
    if differs:
        raise ValueError(f"--base {base} was measured with other graphs: {'; '.join(differs)}; "
                         "pass the same settings or re-run every phase")
    return saved


def run_suite(config: BenchConfig, output: Path, workdir: Path | None, progress: Progress,
              only: tuple[str, ...] | None = None, base: Path | None = None) -> dict:
    """Run every measurement of ``config`` (or the phases ``only``, keeping the others of the saved run
    ``base``); write results.json, results.md and the PNGs to ``output``."""
    hf_config = model_config(config)
    vc = hf_config.vision_config
    validate(config, vc.patch_size, vc.spatial_merge_size, vc.temporal_patch_size)
    if (only is None) != (base is None):
        raise ValueError("--only and --base go together: the phases to measure, and the results.json that "
                         "holds the others")
    saved = load_base(config, only, base) if only is not None else None
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="qeff-evs-bench-") as scratch:
        graphs_dir = Path(workdir) if workdir else Path(scratch)
        started = time.perf_counter()
        phases = only or report.PHASES
        graphs = build_graphs(config, graphs_dir, progress, language=any(p in LANGUAGE_PHASES for p in phases))
        phase_seconds = {"build_export_open": time.perf_counter() - started}
        measured, phase_runs = {}, {}
        if saved is not None:
            measured, phase_runs = report.measured_from_json(saved), report.saved_phase_runs(saved)
            phase_seconds = {**saved["phase_seconds"], **phase_seconds}
        for phase in phases:
            started = time.perf_counter()
            measured[phase] = MEASURE[phase](config, graphs, progress)
            phase_seconds[phase] = time.perf_counter() - started
            phase_runs[phase] = report.run_stamp()
        results = report.build_results(config, model_summary(hf_config), phase_seconds,
                                       *(measured[phase] for phase in report.PHASES), phase_runs=phase_runs)
        del graphs  # close the ORT sessions before their files go
    (output / RESULTS_JSON).write_text(json.dumps(results, indent=1) + "\n")
    write_reports(results, output)
    progress(f"results written to {output}")
    return results
