"""One benchmark run: build and export the graphs, run the phases (``phases.PHASES``), write every output."""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

from qeff_evs.bench import phases, report
from qeff_evs.bench.checkpoint import model_config
from qeff_evs.bench.config import BenchConfig, validate
from qeff_evs.bench.graphs import build_graphs
from qeff_evs.bench.phase import Progress
from qeff_evs.models.registry import family_class

RESULTS_JSON = "results.json"
RESULTS_MD = "results.md"


def model_summary(hf_config) -> dict:
    text, vision = hf_config.text_config, hf_config.vision_config
    return {"text_hidden": text.hidden_size, "text_layers": text.num_hidden_layers, "vocab_size": text.vocab_size,
            "attention_heads": text.num_attention_heads, "kv_heads": text.num_key_value_heads,
            "vision_hidden": vision.hidden_size,
            # Qwen's towers say depth / num_heads, RADIO (Nemotron-H) num_hidden_layers / num_attention_heads
            "vision_layers": getattr(vision, "depth", None) or vision.num_hidden_layers,
            "vision_heads": getattr(vision, "num_heads", None) or vision.num_attention_heads}


def write_reports(results: dict, output: Path) -> list[Path]:
    """results.json's companions: results.md and the phases' PNGs (also re-renders a saved results.json)."""
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    (output / RESULTS_MD).write_text(report.markdown(results))
    written = [output / RESULTS_MD]
    for phase in phases.PHASES:
        if phase.name in results:
            written += [draw(results, output / name) for name, draw in phase.plots.items()]
    return written


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


def load_base(config: BenchConfig, only: tuple[str, ...], base: Path) -> dict:
    """The saved run whose phases outside ``only`` a partial run keeps; raises unless it fits ``config``."""
    phases.select(only)
    saved = json.loads(Path(base).read_text())
    differs = [f"{name} ({saved['config'].get(name)!r} there, {getattr(config, name)!r} here)"
               for name in GRAPH_FIELDS if saved["config"].get(name) != getattr(config, name)]
    if differs:
        raise ValueError(f"--base {base} was measured with other graphs: {'; '.join(differs)}; "
                         "pass the same settings or re-run every phase")
    return saved


def run_suite(config: BenchConfig, output: Path, workdir: Path | None, progress: Progress,
              only: tuple[str, ...] | None = None, base: Path | None = None) -> dict:
    """Run every phase of ``config`` (or the phases ``only``, keeping the others of the saved run
    ``base``); write results.json, results.md and the PNGs to ``output``."""
    config = phases.with_option_defaults(config)
    hf_config = model_config(config)
    vc = family_class(config.family).config_paths.read(hf_config)
    validate(config, vc.patch_size, vc.merge_size, vc.temporal_patch_size)
    if base is not None and only is None:
        raise ValueError("--base keeps the phases --only does not measure: pass --only PHASES with it")
    saved = load_base(config, only, base) if base is not None else None  # --only alone: those phases only
    selected = phases.select(only)
    for phase in selected:
        if phase.check is not None:
            phase.check(config, vc)
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="qeff-evs-bench-") as scratch:
        graphs_dir = Path(workdir) if workdir else Path(scratch)
        started = time.perf_counter()
        graphs = build_graphs(config, graphs_dir, progress, language=any(phase.language for phase in selected))
        phase_seconds = {"build_export_open": time.perf_counter() - started}
        sections, phase_runs = {}, {}
        if saved is not None:
            skip = tuple(phase.name for phase in selected)
            sections, phase_runs = report.saved_sections(saved, skip), report.saved_phase_runs(saved)
            phase_seconds = {**saved["phase_seconds"], **phase_seconds}
        for phase in selected:
            started = time.perf_counter()
            sections[phase.name] = phase.section(phase.measure(config, graphs, progress))
            phase_seconds[phase.name] = time.perf_counter() - started
            phase_runs[phase.name] = report.run_stamp()
        results = report.build_results(config, model_summary(hf_config), phase_seconds, sections,
                                       phase_runs=phase_runs)
        del graphs  # close the ORT sessions before their files go
    (output / RESULTS_JSON).write_text(json.dumps(results, indent=1) + "\n")
    write_reports(results, output)
    progress(f"results written to {output}")
    return results
