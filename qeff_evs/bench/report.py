"""From raw samples to the published numbers: medians, limits, JSON and a Markdown report.

Everything derived lives here as pure functions of the sweeps' raw samples, so the JSON keeps both
the samples and what was concluded from them.
"""

from __future__ import annotations

import dataclasses
import os
import platform
from dataclasses import asdict

from qeff_evs.bench.config import BenchConfig
from qeff_evs.bench.overhead import WITH_EVS, WITHOUT_EVS, OverheadResult
from qeff_evs.bench.pruning import PruningPoint, PruningSweep
from qeff_evs.bench.timing import CLOCKS, CPU, WALL, Samples, median
from qeff_evs.bench.vision_sweep import ENCODER, VisionSweep, VisionSweepPoint, vision_rows
from qeff_evs.bench.window_sweep import QEFFICIENT, USER_VISION_SIZE, WAYS, WayMeasurement, WindowPoint, WindowSweep

# The measured phases, in run order; a run may re-measure some and keep the others (``phase_runs``).
PHASES = ("pruning_sweep", "window_sweep", "vision_sweep", "evs_overhead")

MS = 1e3
MIB = 1024 * 1024


def _bytes(count: int) -> str:
    return f"{count / MIB:.2f} MiB" if count >= MIB else f"{count / 1024:.1f} KiB"


def _percent(fraction: float | None, digits: int = 3) -> str:
    return "n/a" if fraction is None else f"{fraction:+.{digits}%}"


# ---------------------------------------------------------------------------------------------
# derived rows (every timing on both clocks)


def pruning_rows(sweep: PruningSweep) -> list[dict]:
    """Per q: medians, and the unpruned prefill scaled by tokens (proportional) and by chunks."""
    reference = next(p for p in sweep.points if p.q == 0.0)
    rows = []
    for p in sweep.points:
        row = {
            "q": p.q, "video_tokens": p.video_tokens, "retained_tokens": p.retained_tokens,
            "text_tokens": p.text_tokens, "prompt_tokens": p.prompt_tokens, "prefill_chunks": p.prefill_chunks,
            "vision_retained_tokens": p.vision_retained_tokens, "peak_rss_mb": p.peak_rss_mb,
            "peak_above_start_mb": p.peak_above_start_mb, "encoder_cache_bytes": p.encoder_cache_bytes,
        }
        for clock in CLOCKS:
            reference_ms = median(reference.prefill.clock(clock)) * MS
            prefill_ms = median(p.prefill.clock(clock)) * MS
            proportional_ms = reference_ms * p.prompt_tokens / reference.prompt_tokens
            ttft = [v + f for v, f in zip(p.vision.clock(clock), p.prefill.clock(clock))]
            row[clock] = {
                "vision_ms": median(p.vision.clock(clock)) * MS,
                "prefill_ms": prefill_ms,
                "ttft_ms": median(ttft) * MS,
                "proportional_ms": proportional_ms,
                "chunk_limit_ms": reference_ms * p.prefill_chunks / reference.prefill_chunks,
                "prefill_over_proportional": prefill_ms / proportional_ms,
                "prefill_speedup": reference_ms / prefill_ms,
            }
        rows.append(row)
    return rows


def window_rows(sweep: WindowSweep) -> list[dict]:
    rows = []
    for p in sweep.points:
        row = {"frames": p.frames, "video_tokens": p.video_tokens, "retained_tokens": p.retained_tokens,
               "prompt_tokens": p.prompt_tokens, "chunks": p.chunks, "logits_max_abs_diff": p.logits_max_abs_diff}
        for way in WAYS:
            m = p.ways[way]
            row[way] = {
                "vision_size": m.vision_size,
                "bytes_per_chunk": max(m.bytes_per_chunk),
                "bytes_per_chunk_constant": len(set(m.bytes_per_chunk)) == 1,
                "ms_per_chunk": {clock: median(m.chunks.clock(clock)) * MS for clock in CLOCKS},
                "chunk_samples": len(m.chunks.wall),
            }
        rows.append(row)
    return rows


def overhead_summary(result: OverheadResult) -> dict:
    """The EVS graph's share of the encoder's time: (encoder + EVS) / encoder - 1, per repetition's medians."""
    with_ms = {clock: median(result.samples[WITH_EVS].clock(clock)) * MS for clock in CLOCKS}
    without_ms = {clock: median(result.samples[WITHOUT_EVS].clock(clock)) * MS for clock in CLOCKS}
    fraction = {clock: (with_ms[clock] - without_ms[clock]) / without_ms[clock] for clock in CLOCKS}
    profile = result.profile_us
    profiled = profile["selection"] / profile["tower"] if profile.get("tower") else None
    return {"frames": result.frames, "frame_size": result.frame_size, "q": result.q,
            "video_tokens": result.video_tokens, "retained_tokens": result.retained_tokens,
            "with_evs_ms": with_ms, "without_evs_ms": without_ms,
            "overhead_fraction": fraction,
            "profiled_selection_us": profile.get("selection"), "profiled_tower_us": profile.get("tower"),
            "profiled_overhead_fraction": profiled}


# ---------------------------------------------------------------------------------------------
# JSON and Markdown


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


def _samples(sweep) -> list[dict]:
    """Raw samples of every point, without the bulky arrays."""
    out = []
    for point in sweep.points:
        data = asdict(point)
        for way in data.get("ways", {}).values():
            way.pop("first_token_logits", None)
        out.append(data)
    return out


def run_stamp(env: dict | None = None) -> dict:
    """When a phase was measured, and how loaded the machine was then (other programs skew wall time)."""
    import datetime

    load = load_average() if env is None else env.get("load_average_at_end")
    return {"finished_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
            "load_average": load}


def build_results(config: BenchConfig, model: dict, phase_seconds: dict, pruning: PruningSweep, window: WindowSweep,
                  vision: VisionSweep, overhead: OverheadResult, env: dict | None = None,
                  phase_runs: dict | None = None) -> dict:
    """``phase_runs``: per phase, the run that measured it (``run_stamp``); default: all of them now."""
    env = env if env is not None else environment()
    p_rows, w_rows, o_summary = pruning_rows(pruning), window_rows(window), overhead_summary(overhead)
    v_rows = vision_rows(vision, CLOCKS)
    return {
        "config": asdict(config),
        "model": model,
        "environment": env,
        "phase_seconds": phase_seconds,
        "pruning_sweep": {"language_clip": list(pruning.language_clip), "vision_clip": list(pruning.vision_clip),
                          "vision_merged_grid": list(pruning.vision_merged_grid), "rows": p_rows,
                          "samples": _samples(pruning)},
        "window_sweep": {"frame_size": window.frame_size, "q": window.q, "prefill_seq_len": window.prefill_seq_len,
                         "rows": w_rows, "samples": _samples(window)},
        "vision_sweep": {"frame_size": vision.frame_size, "q": vision.q, "frames_per_call": vision.frames_per_call,
                         "call_peak_mb": vision.call_peak_mb, "rows": v_rows, "samples": _samples(vision)},
        "evs_overhead": {**o_summary, "samples": {name: asdict(v) for name, v in overhead.samples.items()}},
        "phase_runs": phase_runs if phase_runs is not None else {phase: run_stamp(env) for phase in PHASES},
    }


def _fmt(value, digits: int = 0) -> str:
    if value is None:
        return "n/a"
    return f"{value:,.{digits}f}"


def _s(ms: float) -> str:
    return f"{ms / MS:.2f}"


def _measured_in(results: dict, phase: str) -> str:
    run = results["phase_runs"][phase]
    when = f"{run['finished_utc']} UTC" if run.get("finished_utc") else "an earlier run (time not recorded)"
    return f"Measured: {when}, load average (1/5/15 min) {run.get('load_average')}."


def markdown(results: dict) -> str:
    cfg, model, env = results["config"], results["model"], results["environment"]
    ps, ws, ov = results["pruning_sweep"], results["window_sweep"], results["evs_overhead"]
    lf, ls = ps["language_clip"]
    vf, vs = ps["vision_clip"]
    u = cfg["user_vision_size"] or cfg["prefill_seq_len"]
    lines = [
        f"## qeff-evs bench ({cfg['preset']}): {cfg['family']}, {cfg['widths']} widths",
        "",
        f"Model: random weights, text hidden {model['text_hidden']}, {model['text_layers']} text layers, vocab "
        f"{model['vocab_size']:,}; vision hidden {model['vision_hidden']}, {model['vision_layers']} vision layers. "
        f"ONNX Runtime {env['onnxruntime']} (CPU, {env['cpu_count']} cores), fp32. "
        f"Medians of {cfg['repeats']} repetitions; configurations alternate, prefills interleave chunk by chunk. "
        f"CPU = process CPU time (the work), wall = elapsed. "
        f"Load average at the end (1/5/15 min): {env['load_average_at_end']}.",
        "",
        f"### Pruning sweep: {lf} frames {ls}x{ls} + {cfg['question_tokens']}-token question, "
        f"prefill chunks of {cfg['prefill_seq_len']}, ctx_len {cfg['ctx_len']}",
        "",
        _measured_in(results, "pruning_sweep"),
        "",
        f"proportional = q=0 prefill x (K+text)/(V+text); chunk limit = q=0 prefill x chunks/chunks(q=0). "
        f"Vision side (encoder calls of {cfg['frames_per_call']} temporal patches, then the EVS graph) timed on "
        f"{vf} frames {vs}x{vs}; TTFT = that vision time + prefill. Peak RSS: the q's vision run and prefill alone.",
        "",
        "| q | K | prompt tokens | chunks | prefill CPU s | proportional CPU s | chunk limit CPU s "
        "| CPU / proportional | speedup CPU | prefill wall s | speedup wall | vision wall s (K) | TTFT wall s "
        "| peak RSS MB | peak above start MB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in ps["rows"]:
        c, w = r[CPU], r[WALL]
        lines.append(
            f"| {r['q']:g} | {r['retained_tokens']} | {r['prompt_tokens']} | {r['prefill_chunks']} | "
            f"{_s(c['prefill_ms'])} | {_s(c['proportional_ms'])} | {_s(c['chunk_limit_ms'])} | "
            f"{c['prefill_over_proportional']:.2f} | {c['prefill_speedup']:.2f}x | {_s(w['prefill_ms'])} | "
            f"{w['prefill_speedup']:.2f}x | {_s(w['vision_ms'])} ({r['vision_retained_tokens']}) | "
            f"{_s(w['ttft_ms'])} | {_fmt(r['peak_rss_mb'])} | {_fmt(r['peak_above_start_mb'])} |")
    lines += [
        "",
        f"### Window sweep: q={ws['q']:g}, {ws['frame_size']}x{ws['frame_size']}, prefill chunks of "
        f"{ws['prefill_seq_len']}",
        "",
        _measured_in(results, "window_sweep"),
        "",
        f"Bytes: the vision inputs sent with each chunk (fp32 here; fp16 custom IO on AI 100 halves both). "
        f"user_vision_size (U): {u} window rows, image_idx=0. QEfficient (QEff): vision_size=K, all rows every "
        "chunk, image_idx advancing. Times are medians over every chunk of every repetition.",
        "",
        "| frames | V | K | prompt tokens | chunks | bytes/chunk U | CPU ms/chunk U | wall ms/chunk U "
        "| bytes/chunk QEff | CPU ms/chunk QEff | wall ms/chunk QEff | logits max abs diff |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in ws["rows"]:
        ours, theirs = r[USER_VISION_SIZE], r[QEFFICIENT]
        lines.append(
            f"| {r['frames']} | {r['video_tokens']} | {r['retained_tokens']} | {r['prompt_tokens']} | {r['chunks']} | "
            f"{_bytes(ours['bytes_per_chunk'])} | {_fmt(ours['ms_per_chunk'][CPU])} | {_fmt(ours['ms_per_chunk'][WALL])} | "
            f"{_bytes(theirs['bytes_per_chunk'])} | {_fmt(theirs['ms_per_chunk'][CPU])} | "
            f"{_fmt(theirs['ms_per_chunk'][WALL])} | {r['logits_max_abs_diff']:.1e} |")
    samples = len(ov["samples"][WITH_EVS]["wall"])
    vsw = results["vision_sweep"]
    lines += [
        "",
        f"### Vision sweep: {vsw['frame_size']}x{vsw['frame_size']}, q={vsw['q']:g}, encoder calls of "
        f"{vsw['frames_per_call']} temporal patches + the EVS graph",
        "",
        _measured_in(results, "vision_sweep") + f" One encoder call of {vsw['frames_per_call']} temporal patches "
        f"peaks at {_fmt(vsw.get('call_peak_mb'))} MB above the loaded graphs.",
        "",
        "| frames | temporal patches | K | encoder+EVS CPU s / patch | wall s / patch | peak above loaded MB "
        "| accumulated rows MB |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in vsw["rows"]:
        ours = r[ENCODER]
        lines.append(
            f"| {r['frames']} | {r['temporal_patches']} | {r['retained_tokens']} | {ours['cpu_s_per_patch']:.2f} | "
            f"{ours['wall_s_per_patch']:.2f} | {_fmt(ours['peak_above_start_mb'])} | {r['accumulated_mb']:.0f} |")
    lines += [
        "",
        f"### EVS overhead: {ov['frames']} frames {ov['frame_size']}x{ov['frame_size']}, "
        f"q={ov['q']:g} (K={ov['retained_tokens']} of {ov['video_tokens']}), {samples} runs",
        "",
        _measured_in(results, "evs_overhead"),
        "",
        "| vision side | CPU ms | wall ms |",
        "|---|---|---|",
        f"| encoder calls + EVS graph | {_fmt(ov['with_evs_ms'][CPU])} | {_fmt(ov['with_evs_ms'][WALL])} |",
        f"| encoder calls alone | {_fmt(ov['without_evs_ms'][CPU])} | {_fmt(ov['without_evs_ms'][WALL])} |",
        f"| EVS graph / encoder (medians) | {_percent(ov['overhead_fraction'][CPU], 2)} | "
        f"{_percent(ov['overhead_fraction'][WALL], 2)} |",
        f"| EVS graph nodes / encoder nodes (ORT profiler) | {_percent(ov['profiled_overhead_fraction'])} | |",
    ]
    return "\n".join(lines) + "\n"


def config_from_json(data: dict) -> BenchConfig:
    """The config of a saved run; keys of settings the bench no longer has (whole_video_max_frames) are dropped."""
    known = {f.name for f in dataclasses.fields(BenchConfig)}
    data = {key: value for key, value in data.items() if key in known}
    return BenchConfig(**{**data, "pruning_rates": tuple(data["pruning_rates"]),
                          "window_frames": tuple(data["window_frames"]),
                          "vision_sweep_frames": tuple(data["vision_sweep_frames"])})


def measured_from_json(results: dict) -> dict:
    """The raw measurements of a saved results.json, per phase (``PHASES``), as the sweeps return them."""
    ps, ws, ov = results["pruning_sweep"], results["window_sweep"], results["evs_overhead"]
    points = [PruningPoint(**{**sample, "vision": Samples(**sample["vision"]), "prefill": Samples(**sample["prefill"])})
              for sample in ps["samples"]]
    pruning = PruningSweep(tuple(ps["language_clip"]), tuple(ps["vision_clip"]), tuple(ps["vision_merged_grid"]),
                           points)
    window_points = []
    for sample in ws["samples"]:
        ways = {way: WayMeasurement(**{**m, "chunks": Samples(**m["chunks"])}) for way, m in sample["ways"].items()}
        window_points.append(WindowPoint(**{**sample, "ways": ways}))
    window = WindowSweep(ws["frame_size"], ws["q"], ws["prefill_seq_len"], window_points)
    vsw = results["vision_sweep"]
    vision = VisionSweep(vsw["frame_size"], vsw["q"], vsw["frames_per_call"], [
        VisionSweepPoint(**{**p, "samples": {name: Samples(**v) for name, v in p["samples"].items()}})
        for p in vsw["samples"]], vsw.get("call_peak_mb"))
    overhead = OverheadResult(ov["frames"], ov["frame_size"], ov["q"], ov["video_tokens"], ov["retained_tokens"],
                              {name: Samples(**v) for name, v in ov["samples"].items()},
                              {"selection": ov["profiled_selection_us"], "tower": ov["profiled_tower_us"]})
    return dict(zip(PHASES, (pruning, window, vision, overhead)))


def saved_phase_runs(results: dict) -> dict:
    """Per phase, the run that measured it; a results.json from before ``phase_runs`` has one run, undated."""
    undated = {"finished_utc": None, "load_average": results["environment"].get("load_average_at_end")}
    return results.get("phase_runs") or {phase: undated for phase in PHASES}


def rebuild(results: dict) -> dict:
    """Recompute every derived number of a saved results.json from its raw samples."""
    measured = measured_from_json(results)
    return build_results(config_from_json(results["config"]), results["model"], results["phase_seconds"],
                         *(measured[phase] for phase in PHASES), env=results["environment"],
                         phase_runs=saved_phase_runs(results))
