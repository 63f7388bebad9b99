"""``qeff-evs bench``: pruning sweep, window sweep, vision sweep, EVS overhead.

Each measurement is a phase, one module each, listed in ``phases.PHASES``: ``pruning`` (phase
``pruning_sweep``: latency vs q), ``window_sweep`` (user_vision_size vs the QEfficient way), ``vision_sweep``
(the vision side per temporal patch, 4 to 128 frames), ``overhead`` (phase ``evs_overhead``: the EVS graph's
cost); ``phase.py`` says what a phase declares. ``suite`` saves a random checkpoint (``checkpoint``), has
``qeff-evs export``'s pipeline export it and opens the graphs (``graphs``), runs the phases; ``report`` puts
their sections into results.json and results.md. Measuring helpers: ``timing``, ``memory``, ``sessions``,
``workload``.
``benchmarks/README.md`` has the results; ``benchmarks/bench_targets.py`` judges a run against the
published targets.
``--serving`` runs ``serving`` instead: vLLM's own benchmark client against ``vllm serve`` over exports.
``--vs-qefficient CHECKPOINT`` runs ``vs_qefficient`` instead: a user's checkpoint and clip through
QEfficient's graphs (exported by QEfficient in its own Python) and ours, side by side. Neither is a
phase: they measure a given checkpoint or export, not the suite's random one.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from qeff_evs.bench.config import PRESETS, BenchConfig, preset
from qeff_evs.models.registry import DEFAULT_FAMILY, family_names
from qeff_evs.specializations import TARGETS


class _Families:
    """``--family`` choices, read from the registry only when parsing (importing the families takes seconds)."""

    def __contains__(self, name: object) -> bool:
        return name in family_names()

    def __iter__(self):
        return iter(family_names())


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(v) for v in text.replace(",", " ").split())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers separated by commas, got {text!r}") from None


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.replace(",", " ").split())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, got {text!r}") from None


def _names(text: str) -> tuple[str, ...]:
    return tuple(v for v in text.replace(",", " ").split())


# argparse dest -> BenchConfig field, for the flags that override a preset.
_OVERRIDES = {
    "family": "family", "text_layers": "text_layers", "vision_layers": "vision_layers", "frames": "frames",
    "size": "frame_size", "question_tokens": "question_tokens", "pruning_rates": "pruning_rates",
    "prefill_seq_len": "prefill_seq_len", "ctx_len": "ctx_len", "user_vision_size": "user_vision_size",
    "window_frames": "window_frames", "window_rate": "window_rate", "vision_frames": "vision_frames",
    "vision_frame_size": "vision_frame_size", "vision_sweep_frames": "vision_sweep_frames",
    "frames_per_call": "frames_per_call", "target": "target",
    "overhead_frames": "overhead_frames", "repeats": "repeats", "overhead_repeats": "overhead_repeats", "seed": "seed",
}


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    from qeff_evs.bench.phases import options, phase_names

    full = PRESETS["full"]
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true",
                      help="smaller videos and 1 text layer, same widths (under 2 minutes on 2 cores)")
    # Tiny widths: the test suite's smoke run. Not a benchmark, so not advertised.
    mode.add_argument("--smoke", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("-o", "--output", default="bench_out", type=Path,
                        help="folder for results.json, results.md and the PNG plots")
    parser.add_argument("--render", type=Path, default=None, metavar="RESULTS_JSON",
                        help="measure nothing: re-render results.md and the plots of a saved results.json")
    parser.add_argument("--only", type=_names, default=None, metavar="PHASES",
                        help=f"measure only these phases ({', '.join(phase_names())}); with --base, keep the others from it")
    parser.add_argument("--base", type=Path, default=None, metavar="RESULTS_JSON",
                        help="with --only: the saved results.json whose other phases are kept (each section says "
                             "which run measured it)")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="keep the random checkpoint (WORKDIR/checkpoint) and its export (WORKDIR/export, "
                             "which qeff-evs run takes) here (default: a temporary folder, removed)")
    parser.add_argument("--family", choices=_Families(), default=None, help=f"model family (default {full.family})")
    parser.add_argument("--text-layers", type=int, default=None, help=f"default {full.text_layers}")
    parser.add_argument("--vision-layers", type=int, default=None, help=f"default {full.vision_layers} (>= 2)")
    parser.add_argument("--frames", type=int, default=None, help=f"pruning-sweep frames (default {full.frames})")
    parser.add_argument("--size", type=int, default=None,
                        help=f"language-side frame side in pixels (default {full.frame_size}; scaled to the "
                        "family's merged-token size)")
    parser.add_argument("--question-tokens", type=int, default=None, help=f"default {full.question_tokens}")
    parser.add_argument("--pruning-rates", type=_floats, default=None,
                        help="q values, e.g. 0,0.25,0.5,0.75,0.9 (q=0 is always added)")
    parser.add_argument("--target", choices=tuple(TARGETS), default=None,
                        help="export the graphs as `export --target` does (cpu: chunks of "
                             f"{TARGETS['cpu'].prefill_seq_len} unless --prefill-seq-len is given, compute context "
                             "lengths in steps of 2); default card")
    parser.add_argument("--prefill-seq-len", type=int, default=None, help=f"default {full.prefill_seq_len}")
    parser.add_argument("--ctx-len", type=int, default=None, help=f"default {full.ctx_len}")
    parser.add_argument("--user-vision-size", type=int, default=None, help="default: the prefill length")
    parser.add_argument("--window-frames", type=_ints, default=None, help="window-sweep frame counts, e.g. 4,8,16,32,64")
    parser.add_argument("--window-rate", type=float, default=None, help=f"window-sweep q (default {full.window_rate})")
    parser.add_argument("--vision-frames", type=int, default=None,
                        help=f"frames of the clip the vision graph is timed on (default {full.vision_frames})")
    parser.add_argument("--vision-frame-size", type=int, default=None,
                        help=f"frame side of that clip (default {full.vision_frame_size})")
    parser.add_argument("--vision-sweep-frames", type=_ints, default=None,
                        help="vision-sweep frame counts (default " + ",".join(map(str, full.vision_sweep_frames)) + ")")
    parser.add_argument("--frames-per-call", type=int, default=None,
                        help=f"temporal patches per encoder call (default {full.frames_per_call})")
    parser.add_argument("--overhead-frames", type=int, default=None,
                        help=f"frames of the EVS-overhead clip (default {full.overhead_frames})")
    parser.add_argument("--repeats", type=int, default=None, help=f"default {full.repeats}")
    parser.add_argument("--overhead-repeats", type=int, default=None, help=f"default {full.overhead_repeats}")
    parser.add_argument("--seed", type=int, default=None)
    for option in options():  # the phases' own settings
        parser.add_argument("--" + option.name.replace("_", "-"), dest=option.name, type=option.parse, default=None,
                            help=f"{option.help} (default {option.value('full')})".lstrip())
    serving = parser.add_argument_group("serving sweep (--serving): vllm bench serve against vllm serve")
    serving.add_argument("--serving", action="store_true",
                         help="run the serving sweep instead: vllm bench serve (sharegpt, local videos) per export")
    serving.add_argument("--serve-export", action="append", default=None, metavar="EXPORT:Q",
                         help="an export and the rate to serve it at (repeat; default: a random checkpoint with "
                              "Qwen2.5-VL-3B widths exported at each --serving-rates under --workdir)")
    serving.add_argument("--serving-rates", type=_floats, default=(0.0, 0.5, 0.75), help="default 0,0.5,0.75")
    serving.add_argument("--num-prompts", type=int, default=None, help="requests per export (default 12)")
    serving.add_argument("--max-concurrency", type=int, default=None, help="default 4")
    serving.add_argument("--output-len", type=int, default=None, help="new tokens per request (default 16)")
    versus = parser.add_argument_group(
        "QEfficient comparison (--vs-qefficient): a checkpoint and clip through QEfficient's graphs and ours; "
        "takes --frames (default 16), --size (default 448), --pruning-rates (default 0,0.5,0.75), "
        "--prefill-seq-len (default 128), --ctx-len (default 8192), -o, --workdir")
    versus.add_argument("--vs-qefficient", type=Path, default=None, metavar="CHECKPOINT",
                        help="a transformers checkpoint folder (Qwen2.5-VL or Qwen3-VL) to compare on")
    versus.add_argument("--clip", type=Path, default=None, help="the video (a file, or a (T, H, W, 3) uint8 .npy)")
    versus.add_argument("--qefficient-python", default=None, metavar="PYTHON",
                        help="the Python of an environment with QEfficient installed (default "
                             "$QEFF_EVS_QEFFICIENT_PYTHON; none: qeff-evs is measured alone, and the report says so)")
    versus.add_argument("--new-tokens", type=int, default=8, help="greedy tokens compared per side (default 8)")
    versus.add_argument("--question", default="What happens in this video?")
    scaling = parser.add_argument_group(
        "export scaling (--export-scaling): qeff-evs export's peak memory, time and disk against depth at released "
        "widths, streamed and in memory; takes -o, --workdir (the random checkpoints, up to 18 GB each) and --clip "
        "(the video a case marked 'run' answers a question about)")
    scaling.add_argument("--export-scaling", action="store_true", help="run the export scaling measurement instead")
    scaling.add_argument("--scaling-cases", type=_names, default=None, metavar="CASES",
                         help="MODEL:TEXT_LAYERS[:streamed|in_memory[:float32|float16[:run]]], comma separated "
                              "(default: Qwen3-VL-8B at 2, 6 and 36 layers, Qwen3-VL-30B-A3B at 2, 6 and 12)")
    openvino = parser.add_argument_group(
        "OpenVINO GenAI comparison (--vs-openvino): a random checkpoint at released widths through OpenVINO GenAI's "
        "VLMPipeline (fp32, and its default) and through qeff-evs on the CPU, alternated; takes --text-layers and "
        "--vision-layers (default 4), --frames (default 16), --size (default 448), --pruning-rates (default "
        "0,0.5,0.75), --new-tokens, --question, -o, --workdir (the checkpoints, conversions, exports and the side "
        "environment)")
    openvino.add_argument("--vs-openvino", type=_names, nargs="?", const=("qwen2_5_vl", "qwen3_vl"), default=None,
                          metavar="FAMILIES", help="the families to compare (default qwen2_5_vl,qwen3_vl)")
    openvino.add_argument("--openvino-python", default=None, metavar="PYTHON",
                          help="the Python of an environment with openvino-genai and optimum-intel (default "
                               "$QEFF_EVS_OPENVINO_PYTHON, else one built under --workdir)")
    openvino.add_argument("--backends", type=_names, default=("ort",), metavar="BACKENDS",
                          help="qeff-evs's backends compared, of ort, openvino, openvino-bf16, torch (default ort)")
    openvino.add_argument("--rounds", type=int, default=3, help="measured rounds after the warm-up (default 3)")
    versus.add_argument("--accounting-frames", type=_ints, default=(64,), metavar="FRAMES",
                        help="frame counts whose vision bytes per chunk are counted from the shapes (default 64)")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    from qeff_evs.bench.phases import options

    name = "quick" if args.quick else "smoke" if getattr(args, "smoke", False) else "full"
    changes = {field: getattr(args, dest) for dest, field in _OVERRIDES.items() if getattr(args, dest, None) is not None}
    if "target" in changes and "prefill_seq_len" not in changes:
        changes["prefill_seq_len"] = TARGETS[changes["target"]].prefill_seq_len
    chosen = {option.name: getattr(args, option.name) for option in options()
              if getattr(args, option.name, None) is not None}
    return preset(name, changes.get("family", PRESETS[name].family)).replace(**changes, options=chosen)


BENCH_EXTRA = "pip install 'qeff-evs[bench]'"


def require_plotting() -> None:
    """The bench's plots need matplotlib, an optional extra: say how to install it before any work."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError(f"the bench draws its plots with matplotlib, which is not installed; {BENCH_EXTRA}") from None


def run_serving(args: argparse.Namespace, progress) -> int:
    import dataclasses
    import tempfile

    from qeff_evs.bench.serving import (ServingLoad, ServingTarget, export_targets, run_serving_sweep, save_serving,
                                        serving_checkpoint, serving_markdown)

    load = ServingLoad()
    load = dataclasses.replace(load, **{k: v for k, v in (("num_prompts", args.num_prompts),
                                                          ("max_concurrency", args.max_concurrency),
                                                          ("output_len", args.output_len)) if v is not None})
    with tempfile.TemporaryDirectory(prefix="qeff_evs_serving_") as scratch:
        workdir = Path(args.workdir or scratch)
        if args.serve_export:
            targets = []
            for item in args.serve_export:
                export, sep, q = item.rpartition(":")
                if not sep:
                    raise ValueError(f"--serve-export {item!r}: give EXPORT:Q, e.g. build/:0.5")
                targets.append(ServingTarget(Path(export), float(q)))
        else:
            checkpoint = workdir / "checkpoint"
            if not (checkpoint / "config.json").is_file():
                progress(f"building a random {DEFAULT_FAMILY} checkpoint at released widths (2 + 2 layers)")
                serving_checkpoint(DEFAULT_FAMILY, checkpoint)
            targets = export_targets(checkpoint, workdir, args.serving_rates, load, progress)
        results = run_serving_sweep(targets, workdir / "serving", load, progress)
        save_serving(results, load, args.output)
    print(serving_markdown(results, load))
    return 0


def run_vs_qefficient(args: argparse.Namespace, progress) -> int:
    import sys
    import tempfile

    from qeff_evs.bench.vs_qefficient import VsConfig, qefficient_python, run_comparison
    from qeff_evs.bench.vs_qefficient_report import markdown

    if args.clip is None:
        raise ValueError("--vs-qefficient needs --clip: the video both sides are given")
    for path, flag in ((args.vs_qefficient, "--vs-qefficient"), (args.clip, "--clip")):
        if not path.exists():
            raise ValueError(f"{flag} {path}: not found")
    given = {"frames": args.frames, "pruning_rates": args.pruning_rates, "prefill_seq_len": args.prefill_seq_len,
             "ctx_len": args.ctx_len}
    config = VsConfig(args.vs_qefficient, args.clip, qefficient_python(args.qefficient_python),
                      new_tokens=args.new_tokens, question=args.question, accounting_frames=args.accounting_frames,
                      **({"size": (args.size, args.size)} if args.size else {}),
                      **{k: v for k, v in given.items() if v is not None})
    with tempfile.TemporaryDirectory(prefix="qeff_evs_vs_qefficient_") as scratch:
        results = run_comparison(config, args.output, Path(args.workdir or scratch), progress,
                                 command=" ".join(["qeff-evs", *sys.argv[1:]]))
    print("\n".join(markdown(results)))
    return 0


def run_vs_openvino(args: argparse.Namespace, progress) -> int:
    import sys
    import tempfile

    from qeff_evs.bench.vs_openvino import VsOpenVinoConfig, run_comparison
    from qeff_evs.bench.vs_openvino_report import markdown

    unknown = [f for f in args.vs_openvino if f not in ("qwen2_5_vl", "qwen3_vl")]
    if unknown:
        raise ValueError(f"--vs-openvino {','.join(unknown)}: OpenVINO GenAI serves video for qwen2_5_vl and "
                         "qwen3_vl; give those")
    from qeff_evs.runtime.sessions import BACKENDS

    backends = tuple(b for b in BACKENDS if b != "qaic")  # the comparison runs on the CPU
    unknown = [b for b in args.backends if b not in backends]
    if unknown:
        raise ValueError(f"--backends {','.join(unknown)}: the comparison runs qeff-evs on the CPU backends "
                         f"{', '.join(backends)}; give some of those")
    given = {"text_layers": args.text_layers, "vision_layers": args.vision_layers, "frames": args.frames,
             "size": args.size, "pruning_rates": args.pruning_rates}
    config = VsOpenVinoConfig(tuple(args.vs_openvino), backends=tuple(args.backends), rounds=args.rounds,
                              new_tokens=args.new_tokens, question=args.question,
                              smoke=bool(getattr(args, "smoke", False)),
                              openvino_python=Path(args.openvino_python) if args.openvino_python else None,
                              **{k: v for k, v in given.items() if v is not None})
    with tempfile.TemporaryDirectory(prefix="qeff_evs_vs_openvino_") as scratch:
        results = run_comparison(config, args.output, Path(args.workdir or scratch), progress,
                                 command=" ".join(["qeff-evs", *sys.argv[1:]]))
    print("\n".join(markdown(results)))
    return 0


def run_export_scaling(args: argparse.Namespace, progress) -> int:
    import sys
    import tempfile

    from qeff_evs.bench.export_scaling import DEFAULT_CASES, ScalingCase, markdown, run_scaling

    cases = [ScalingCase.parse(text) for text in (args.scaling_cases or DEFAULT_CASES)]
    if args.clip is not None and not args.clip.exists():
        raise ValueError(f"--clip {args.clip}: not found")
    with tempfile.TemporaryDirectory(prefix="qeff_evs_export_scaling_") as scratch:
        results = run_scaling(cases, Path(args.workdir or scratch), args.output, args.clip, progress,
                              command=" ".join(["qeff-evs", *sys.argv[1:]]))
    print("\n".join(markdown(results)))
    return 0


def run_bench(args: argparse.Namespace, progress) -> int:
    require_plotting()
    if args.export_scaling:
        return run_export_scaling(args, progress)
    if args.serving:
        return run_serving(args, progress)
    if args.vs_qefficient is not None:
        return run_vs_qefficient(args, progress)
    if args.vs_openvino is not None:
        return run_vs_openvino(args, progress)
    from qeff_evs.bench.report import markdown
    from qeff_evs.bench.suite import render_saved, run_suite

    if args.render is not None:
        results = render_saved(args.render, args.output)
    else:
        results = run_suite(config_from_args(args), args.output, args.workdir, progress,
                            only=args.only, base=args.base)
    print(markdown(results))
    return 0
