"""A run's results.json and results.md: the phases' sections under the config, model and machine they ran on.

Each phase turns its raw samples into its section (``Phase.section``: the samples and what is derived
from them) and its lines of results.md; here they are put together in ``phases.PHASES`` order, with
when each phase was measured (a partial run keeps other phases of an earlier one).
"""

from __future__ import annotations

import os
import platform
from collections.abc import Mapping

from qeff_evs.bench.config import BenchConfig
from qeff_evs.bench import phases


def environment() -> dict:
    import onnxruntime
    import torch
    import transformers

    return {"python": platform.python_version(), "platform": platform.platform(), "cpu_count": os.cpu_count(),
            "onnxruntime": onnxruntime.__version__, "torch": torch.__version__,
            "transformers": transformers.__version__, "load_average_at_end": load_average()}


def load_average() -> list[float] | None:
    """1/5/15-minute load averages: other work on the machine shows up here, and in the timings."""
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:
        return None


def run_stamp(env: dict | None = None) -> dict:
    """When a phase was measured, and how loaded the machine was then (other programs skew wall time)."""
    import datetime

    load = load_average() if env is None else env.get("load_average_at_end")
    return {"finished_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
            "load_average": load}


def build_results(config: BenchConfig, model: dict, phase_seconds: dict, sections: Mapping[str, dict],
                  env: dict | None = None, phase_runs: dict | None = None) -> dict:
    """results.json: ``sections`` by phase name, in table order. ``phase_runs``: per phase, the run that
    measured it (``run_stamp``); default: all of them now."""
    env = env if env is not None else environment()
    ordered = {phase.name: sections[phase.name] for phase in phases.PHASES if phase.name in sections}
    return {
        "config": config.to_json(),
        "model": model,
        "environment": env,
        "phase_seconds": phase_seconds,
        **ordered,
        "phase_runs": phase_runs if phase_runs is not None else {name: run_stamp(env) for name in ordered},
    }


def header(results: dict) -> list[str]:
    cfg, model, env = results["config"], results["model"], results["environment"]
    return [
        f"## qeff-evs bench ({cfg['preset']}): {cfg['family']}, {cfg['widths']} widths",
        "",
        f"Model: random weights, text hidden {model['text_hidden']}, {model['text_layers']} text layers, vocab "
        f"{model['vocab_size']:,}; vision hidden {model['vision_hidden']}, {model['vision_layers']} vision layers. "
        f"ONNX Runtime {env['onnxruntime']} (CPU, {env['cpu_count']} cores), fp32. "
        f"Medians of {cfg['repeats']} repetitions; configurations alternate, prefills interleave chunk by chunk. "
        f"CPU = process CPU time (the work), wall = elapsed. "
        f"Load average at the end (1/5/15 min): {env['load_average_at_end']}.",
    ]


def markdown(results: dict) -> str:
    lines = header(results)
    for phase in phases.PHASES:
        if phase.name in results:
            lines += phase.markdown(results)
    return "\n".join(lines) + "\n"


def saved_phase_runs(results: dict) -> dict:
    """Per phase, the run that measured it; a results.json from before ``phase_runs`` has one run, undated."""
    undated = {"finished_utc": None, "load_average": results["environment"].get("load_average_at_end")}
    return results.get("phase_runs") or {phase.name: undated for phase in phases.PHASES if phase.name in results}


def saved_sections(results: dict, skip: tuple[str, ...] = ()) -> dict[str, dict]:
    """The phases' sections of a saved results.json (but ``skip``), derived numbers recomputed from raw samples."""
    return {phase.name: phase.rebuilt(results[phase.name]) for phase in phases.PHASES
            if phase.name in results and phase.name not in skip}


def rebuild(results: dict) -> dict:
    """Recompute every derived number of a saved results.json from its raw samples."""
    return build_results(BenchConfig.from_json(results["config"]), results["model"], results["phase_seconds"],
                         saved_sections(results), env=results["environment"], phase_runs=saved_phase_runs(results))
