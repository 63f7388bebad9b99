"""Time to first token against transformers' own ``generate`` on the same checkpoint and clip.

The baseline is what a user without a card tries first: the bench's random checkpoint loaded back with
``from_pretrained`` (fp32) and transformers' ``generate`` (greedy, one new token) on the pruning sweep's clip,
unpruned: its patches (the ``MediaInput`` the engine takes) and the engine's own prompt ids at q 0, with the
family's keyword arguments (``hf_video_inputs``). Ours is ``qeff-evs run``'s engine on ONNX Runtime (encoder
calls, the pruning graph's ranking, chunked prefill with its windows, the first token) at each ``--ttft-rates``
rate, over the sessions ``qeff-evs run`` opens (``runtime.sessions.sessions_for``: ONNX Runtime's defaults, its
memory arena and thread spinning on), not the bench's timing sessions (``bench.sessions``, arena and spinning off):
the time a user waits is the verdict. Spinning threads count as CPU time, so our CPU column includes their spin.
Frame preprocessing is outside both clocks.

Order: one untimed pass of each (warm-up; at q 0 the engine's first token must equal transformers', the
same fp32 weights), then per repetition every run once, in alternating order. Medians; the verdict uses wall
time (what a user waits for) and shows CPU time beside it.

Where the time goes (``parts``): ours splits into the vision side (encoder calls and the EVS ranking: the engine's
``VisionSession.encode``), the language calls (every prefill chunk) and the rest (prompt layout, windows; the
host's own work), clocked inside the same timed runs. transformers' vision side is its
``get_video_features`` on the same pixels, timed as a call of its own once per repetition; its rest is
``generate`` less that.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from qeff_evs.bench import plots
from qeff_evs.bench.config import BenchConfig
from qeff_evs.bench.phase import Option, Phase, Progress, fmt, measured_in
from qeff_evs.bench.timing import CLOCKS, WALL, Samples, alternating, median, timed
from qeff_evs.bench.workload import first_special_id, prompt_pieces, question_ids, synthetic_clip

if TYPE_CHECKING:
    from qeff_evs.bench.graphs import BenchGraphs

NAME = "ttft"
TRANSFORMERS = "transformers"


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(v) for v in text.replace(",", " ").split())


VISION, LANGUAGE, REST, TOTAL = "vision", "language", "rest", "total"
# Which ONNX Runtime sessions ours ran over (results saved before this was recorded used the bench's).
RUN_SESSIONS, BENCH_SESSIONS = "qeff-evs run", "bench"
SESSIONS_TEXT = {RUN_SESSIONS: "the ONNX Runtime sessions `qeff-evs run` opens (its defaults: memory arena and thread "
                               "spinning on; the spin counts as CPU time)",
                 BENCH_SESSIONS: "the bench's timing sessions (memory arena and thread spinning off)"}


class _Clocked:
    """A session whose ``method`` calls are clocked into ``pending`` (delegation, no class swapping);
    one sample per request: ``take`` sums the calls since the last one."""

    def __init__(self, inner, method: str):
        self.inner, self.method, self.pending = inner, method, Samples()

    def __getattr__(self, name):
        value = getattr(self.inner, name)
        if name != self.method:
            return value

        def clocked(*args, **kwargs):
            return timed(lambda: value(*args, **kwargs), self.pending)
        return clocked

    def take(self, into: Samples) -> None:
        into.add(*self.pending.total())
        self.pending = Samples()


def _engines(config: BenchConfig, graphs: BenchGraphs, rates):
    """``({q: Engine}, vision clock, language clock)`` over one set of sessions, those ``qeff-evs run`` opens on the
    export, one new token each."""
    from qeff_evs.models.pruning import VideoPruning
    from qeff_evs.runtime.builders import engine_config
    from qeff_evs.runtime.engine.single_request import Engine
    from qeff_evs.runtime.export_bundle import open_export
    from qeff_evs.runtime.sessions import sessions_for

    bundle = open_export(graphs.export_dir)
    pipeline, language_session = sessions_for(bundle, "ort", method="evs")
    vision = _Clocked(pipeline, "encode")
    language = _Clocked(language_session, "run")
    engines = {q: Engine(bundle.family, vision, language,
                         engine_config(bundle, VideoPruning("evs", q), max_new_tokens=1)) for q in rates}
    return engines, vision, language


def measure(config: BenchConfig, graphs: BenchGraphs, progress: Progress) -> dict:
    import torch

    rates = tuple(sorted({0.0, *config.option("ttft_rates")}))
    clip = synthetic_clip(graphs.preprocess, config.frames, config.frame_size, config.seed)
    question = question_ids(config.question_tokens, first_special_id(graphs.family), config.seed)
    pieces = prompt_pieces(graphs.family, question)
    engines, vision_clock, language_clock = _engines(config, graphs, rates)

    def ours(q: float):
        engine = engines[q]
        return engine.generate(engine.prepare(pieces, [clip.video]), eos_ids=())

    progress("ttft: loading the checkpoint into transformers")
    model = graphs.family.model_class.from_pretrained(graphs.checkpoint_dir, dtype=torch.float32).eval()
    ids = torch.tensor([ours(0.0).prompt_token_ids])
    hf_inputs = graphs.family.hf_video_inputs(ids, clip.video)

    def their_vision():
        with torch.no_grad():
            model.model.get_video_features(hf_inputs["pixel_values_videos"], hf_inputs["video_grid_thw"])

    def theirs():
        with torch.no_grad():
            return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **hf_inputs, max_new_tokens=1,
                                  min_new_tokens=1, do_sample=False)[0, ids.shape[1]:].tolist()

    runs = {TRANSFORMERS: theirs, **{f"q={q:g}": (lambda q=q: ours(q).generated_token_ids) for q in rates}}
    progress("ttft: warm-up pass")
    first = {name: run() for name, run in runs.items()}
    for clock in (vision_clock, language_clock):
        clock.take(Samples())  # the warm-up's calls
    samples = {name: Samples() for name in runs}
    parts = {name: {VISION: Samples(), LANGUAGE: Samples()} for name in runs}
    for repetition in range(config.repeats):
        for name in alternating(list(runs), repetition):
            progress(f"ttft: repetition {repetition + 1}/{config.repeats}, {name}")
            timed(runs[name], samples[name])
            if name == TRANSFORMERS:
                timed(their_vision, parts[name][VISION])
            else:
                vision_clock.take(parts[name][VISION])
                language_clock.take(parts[name][LANGUAGE])
    del model
    return {"rates": list(rates), "prompt_tokens": int(ids.shape[1]), "frames": config.frames,
            "frame_size": config.frame_size, "text_layers": config.text_layers,
            "vision_layers": config.vision_layers, "sessions": RUN_SESSIONS, "first_tokens": first,
            "same_first_token_at_q0": first[TRANSFORMERS] == first["q=0"],
            "samples": {name: asdict(s) for name, s in samples.items()},
            "part_samples": {name: {part: asdict(s) for part, s in by_part.items() if s.wall}
                             for name, by_part in parts.items()}}


def _parts(raw: dict) -> dict:
    """Median seconds per part and clock: vision, language (ours; transformers' has none apart), rest = total less
    the parts, each part's median taken alone."""
    out = {}
    for name, by_part in raw.get("part_samples", {}).items():
        total = {clock: median(raw["samples"][name][clock]) for clock in CLOCKS}
        parts = {part: {clock: median(s[clock]) for clock in CLOCKS} for part, s in by_part.items()}
        parts[REST] = {clock: total[clock] - sum(p[clock] for p in parts.values()) for clock in CLOCKS}
        out[name] = {**parts, TOTAL: total}
    return out


def section(raw: dict) -> dict:
    medians = {name: {clock: median(s[clock]) for clock in CLOCKS} for name, s in raw["samples"].items()}
    base = medians[TRANSFORMERS]
    ratios = {name: {clock: m[clock] / base[clock] for clock in CLOCKS} for name, m in medians.items()}
    return {**raw, "median_s": medians, "vs_transformers": ratios, "parts_s": _parts(raw)}


def load(saved: dict) -> dict:
    return {k: v for k, v in saved.items() if k not in ("median_s", "vs_transformers", "parts_s")}


def markdown(results: dict) -> list[str]:
    s = results[NAME]
    lines = ["", f"### Time to first token against transformers' generate: {s['frames']} frames "
             f"{s['frame_size']}x{s['frame_size']}, {s['text_layers']} text + {s['vision_layers']} vision layers",
             "", measured_in(results, NAME), "",
             f"{s['prompt_tokens']} prompt tokens at q 0; first token at q 0 "
             f"{'equals' if s['same_first_token_at_q0'] else 'DIFFERS from'} transformers'. "
             f"{len(s['samples'][TRANSFORMERS]['wall'])} timed runs each, medians; ours over "
             f"{SESSIONS_TEXT[s.get('sessions', BENCH_SESSIONS)]}.", "",
             "| run | TTFT wall (s) | CPU (s) | wall / transformers | CPU / transformers |", "|---|---|---|---|---|"]
    for name, m in s["median_s"].items():
        r = s["vs_transformers"][name]
        label = "transformers `generate`" if name == TRANSFORMERS else f"qeff-evs ORT, {name}"
        lines.append(f"| {label} | {fmt(m['wall'], 2)} | {fmt(m['cpu'], 2)} | {r['wall']:.2f} | {r['cpu']:.2f} |")
    parts = s.get("parts_s")
    if parts:
        lines += ["", "Where the time goes, CPU seconds (wall in brackets), medians: transformers' vision is its "
                  "`get_video_features` timed apart and its language side the rest of `generate`; ours is the "
                  "vision side (encoder and EVS ranking), the language calls, and the host's rest.", "",
                  "| run | vision | language | rest | total |", "|---|---|---|---|---|"]
        for name, p in parts.items():
            label = "transformers `generate`" if name == TRANSFORMERS else f"qeff-evs ORT, {name}"
            cells = [f"{fmt(p[part]['cpu'], 2)} ({fmt(p[part]['wall'], 2)})" if part in p else "-"
                     for part in (VISION, LANGUAGE, REST, TOTAL)]
            if LANGUAGE not in p:  # transformers: its language side is all of the rest
                cells[1], cells[2] = cells[2], "-"
            lines.append(f"| {label} | {' | '.join(cells)} |")
    return lines


def draw(results: dict, path: Path) -> Path:
    s = results[NAME]
    names = list(s["median_s"])
    figure = plots.figure(5.5, 3.2)
    axes = figure.add_subplot()
    values = [s["median_s"][name][WALL] for name in names]
    bars = axes.bar(range(len(names)), values, color=["#888888"] + ["#3b75af"] * (len(names) - 1))
    axes.bar_label(bars, labels=[f"{s['vs_transformers'][n][WALL]:.2f}x" for n in names], fontsize=8)
    axes.set_xticks(range(len(names)), ["transformers\ngenerate", *(f"qeff-evs\n{n}" for n in names[1:])])
    axes.set_ylabel("time to first token, wall (s)")
    axes.set_title(f"TTFT, {s['frames']} frames {s['frame_size']}px (ratio to transformers)", fontsize=9)
    return plots.save(figure, path)


# language=False: the phase opens its own sessions, as `qeff-evs run` does, not the bench's language session.
PHASE = Phase(NAME, measure, section=section, load=load, markdown=markdown, plots={"ttft.png": draw}, language=False,
              options=(Option("ttft_rates", _floats, {"full": (0.0, 0.5, 0.75)},
                              "pruning rates the engine runs against transformers' generate"),))
