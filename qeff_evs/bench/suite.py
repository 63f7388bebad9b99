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
    vc = model_config(config).vision_config
    spec = VisionPreprocessSpec.for_family(config.family, patch_size=vc.patch_size,
                                           temporal_patch_size=vc.temporal_patch_size, merge_size=vc.spatial_merge_size)
    sweep = results["pruning_sweep"]
    clip = synthetic_clip(spec, config.vision_frames, config.vision_frame_size, config.seed)
    kept = {s["q"]: np.asarray(s["vision_retained_indices"]) for s in sweep["samples"]}
    return [
        output / RESULTS_MD,
        plots.plot_latency_vs_q(results, output / LATENCY_PNG),
        plots.plot_window_sweep(results, output / WINDOW_PNG),
        plots.plot_vision_sweep(results, output / VISION_PNG),
        plots.plot_kept_tokens(clip.frames, tuple(sweep["vision_merged_grid"]), kept,
                               vc.patch_size * vc.spatial_merge_size, vc.temporal_patch_size, output / KEPT_PNG),
    ]


def render_saved(results_json: Path, output: Path) -> dict:
    """Numbers, verdicts, Markdown and plots again from a saved results.json's raw samples."""
    results = report.rebuild(json.loads(Path(results_json).read_text()))
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    (output / RESULTS_JSON).write_text(json.dumps(results, indent=1) + "\n")
    write_reports(results, output)
    return results


def run_suite(config: BenchConfig, output: Path, workdir: Path | None, progress: Progress) -> dict:
    """Run every measurement of ``config``; write results.json, results.md and the PNGs to ``output``."""
    hf_config = model_config(config)
    vc = hf_config.vision_config
    validate(config, vc.patch_size, vc.spatial_merge_size, vc.temporal_patch_size)
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="qeff-evs-bench-") as scratch:
        graphs_dir = Path(workdir) if workdir else Path(scratch)
        started = time.perf_counter()
        graphs = build_graphs(config, graphs_dir, progress)
        phase_seconds = {"build_export_open": time.perf_counter() - started}
        measured = {}
        for phase, run in (("pruning_sweep", run_pruning_sweep), ("window_sweep", run_window_sweep),
                           ("vision_sweep", run_vision_sweep), ("evs_overhead", run_evs_overhead)):
            started = time.perf_counter()
            measured[phase] = run(config, graphs, progress)
            phase_seconds[phase] = time.perf_counter() - started
        results = report.build_results(config, model_summary(hf_config), phase_seconds, measured["pruning_sweep"],
                                       measured["window_sweep"], measured["vision_sweep"], measured["evs_overhead"])
        del graphs  # close the ORT sessions before their files go
    (output / RESULTS_JSON).write_text(json.dumps(results, indent=1) + "\n")
    write_reports(results, output)
    progress(f"results written to {output}")
    return results
