"""The whole model at released widths, MoE beside its dense sibling: `qeff-evs bench`'s pruning sweep alone.

One family at a time (a released-width MoE checkpoint is gigabytes; run each under ``flock /tmp/qeff-heavy.lock``
on a shared machine)::

    python benchmarks/moe_whole_model.py run qwen3_vl_moe OUT_DIR [--text-layers 2] [--repeats 1]
    python benchmarks/moe_whole_model.py run qwen3_5 OUT_DIR --sibling-of qwen3_5_moe
    python benchmarks/moe_whole_model.py table OUT_DIR qwen3_vl_moe:qwen3_vl [qwen3_5_moe:qwen3_5]

``run`` is the bench's own path (``suite``'s random checkpoint, ``qeff-evs export``'s pipeline, the
``pruning_sweep`` phase on a 16-frame 448x448 clip at q 0, 0.5, 0.75) without the other phases, whose frame buckets
it does not export, in two processes one after the other (``export``, then ``sweep``, each its own subcommand), so
the torch model and the export's memory are gone before ONNX Runtime opens the graphs and each step's peak is its
own; it writes ``OUT_DIR/<family>.json`` with the export time (save + export), each process's peak RSS and the
phase's section. ``--sibling-of MOE``: the dense family at the MoE checkpoint's own widths with a dense MLP as wide as
a token's active experts (``dense_sibling_config``), where the family's own released widths differ from the MoE's
(Qwen3.5-0.8B's hidden is 1024, Qwen3.5-35B-A3B's 2048). ``table`` writes ``OUT_DIR/moe_whole_model.md``: per MoE family and its dense sibling at the same
depth, prefill CPU and wall time per q, the q 0.75 / q 0 ratio, peak RSS, export time, and each expert form's
computed MLP bytes and FLOPs per chunk; and ``OUT_DIR/moe_whole_model.png``, the prefill times and their ratios.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from qeff_evs.bench import phases, pruning
from qeff_evs.bench.checkpoint import model_config
from qeff_evs.bench.config import preset, validate
from qeff_evs.bench.graphs import export_graphs, open_graphs
from qeff_evs.bench.memory import peak_mb
from qeff_evs.bench.realistic import realistic_config
from qeff_evs.bench.report import environment
from qeff_evs.bench.suite import model_summary
from qeff_evs.bench.timing import CPU, WALL
from qeff_evs.models.registry import family_class
from qeff_evs.models.sparse_moe import EXPERT_FORMS, HIT

from moe_expert_forms import FP16, MODELS, cost  # this folder's script: the sparse block's computed cost

RATES = (0.0, 0.5, 0.75)
FRAMES, SIDE = 16, 448


# The dense family beside each MoE one, and the MoE text config's keys a dense config does not take.
DENSE_OF = {"qwen3_vl_moe": "qwen3_vl", "qwen3_5_moe": "qwen3_5"}
MOE_KEYS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")


def bench_config(family: str, text_layers: int, vision_layers: int, repeats: int, widths: str):
    # Every phase's frame counts set to the clip's, so the export holds the one bucket the sweep runs.
    config = preset("full", family).replace(
        text_layers=text_layers, vision_layers=vision_layers, frames=FRAMES, frame_size=SIDE, vision_frames=FRAMES,
        vision_frame_size=SIDE, window_frames=(FRAMES,), vision_sweep_frames=(FRAMES,), overhead_frames=FRAMES,
        pruning_rates=RATES, ctx_len=2048, repeats=repeats, widths=widths)
    return phases.with_option_defaults(config)


def dense_sibling_config(moe_family: str, text_layers: int, vision_layers: int):
    """``DENSE_OF[moe_family]``'s config at the MoE checkpoint's released widths (attention, linear attention, vocab,
    untied embeddings, vision tower) with a dense MLP of ``k x moe_intermediate + shared`` (Qwen3.5-35B-A3B: 8 x 512
    + 512 = 4,608): per token the same MLP work as the MoE's routed and shared experts."""
    dense = family_class(DENSE_OF[moe_family])
    text, vision = family_class(moe_family).realistic_widths(text_layers, vision_layers)
    width = text["num_experts_per_tok"] * text["moe_intermediate_size"] + text.get("shared_expert_intermediate_size", 0)
    kwargs = dense.realistic_config_kwargs(text_layers, vision_layers)
    kwargs["text_config"] = {**kwargs["text_config"], **{k: v for k, v in text.items() if k not in MOE_KEYS},
                             "intermediate_size": width}
    kwargs["vision_config"] = vision
    kwargs["tie_word_embeddings"] = text["tie_word_embeddings"]
    return dense.config_class(**kwargs)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def export_step(family: str, out: Path, text_layers: int, vision_layers: int, repeats: int, widths: str,
                sibling_of: str | None) -> dict:
    """Save the random checkpoint and export it (this process holds nothing else); ``OUT/work_<family>/export.json``:
    the export time and this process's peak RSS."""
    config = bench_config(family, text_layers, vision_layers, repeats, widths)
    hf_config = dense_sibling_config(sibling_of, text_layers, vision_layers) if sibling_of else model_config(config)
    vc = family_class(family).config_paths.read(hf_config)
    validate(config, vc.patch_size, vc.merge_size, vc.temporal_patch_size)
    workdir = out / f"work_{family}"
    started = time.perf_counter()
    export_dir = export_graphs(config, workdir, log, hf_config)
    result = {"export_s": time.perf_counter() - started, "export_peak_rss_mb": peak_mb(), "sibling_of": sibling_of,
              "export_bytes": sum(f.stat().st_size for f in export_dir.rglob("*") if f.is_file())}
    (workdir / "export.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def sweep_step(family: str, out: Path, text_layers: int, vision_layers: int, repeats: int, widths: str) -> dict:
    """Open ``export_step``'s graphs in ORT and run the pruning sweep; writes ``OUT/<family>.json``."""
    config = bench_config(family, text_layers, vision_layers, repeats, widths)
    workdir = out / f"work_{family}"
    exported = json.loads((workdir / "export.json").read_text())
    graphs = open_graphs(workdir, log)
    open_peak_mb = peak_mb()
    sweep = pruning.run_pruning_sweep(config, graphs, log)
    text = graphs.hf_config.text_config
    result = {"family": family, "config": config.to_json(), "model": model_summary(graphs.hf_config),
              "mlp": {"hidden": text.hidden_size, "intermediate": getattr(text, "intermediate_size", None)},
              "environment": environment(), **exported, "open_peak_rss_mb": open_peak_mb,
              "sweep_peak_rss_mb": peak_mb(), "pruning_sweep": pruning.section(sweep)}
    (out / f"{family}.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def run(args: argparse.Namespace) -> None:
    """``export`` then ``sweep``, each in its own process."""
    common = [str(args.out), "--text-layers", str(args.text_layers), "--vision-layers", str(args.vision_layers),
              "--repeats", str(args.repeats), "--widths", args.widths]
    sibling = ["--sibling-of", args.sibling_of] if args.sibling_of else []
    for step, extra in (("export", sibling), ("sweep", [])):
        status = subprocess.run([sys.executable, __file__, step, args.family, *common, *extra]).returncode
        if status:
            raise SystemExit(f"the {step} step of {args.family} exited with status {status}")


def mlp_cost(family: str, tokens: int = 128, form: str = HIT, mlp: dict | None = None) -> tuple[float, float]:
    """fp16 GB and GFLOP of one text layer's MLP for a ``tokens``-token chunk: the sparse block in expert form
    ``form`` (``moe_expert_forms.cost``: experts, router, shared expert), or the dense MLP of ``mlp`` (a run's
    measured hidden and intermediate widths; default the family's released ones)."""
    if family in MODELS:
        c = cost(form, tokens, MODELS[family])
        return c["weight_bytes"] / 1e9, c["flops"] / 1e9
    if mlp is None:
        text = realistic_config(family, 1, 2).text_config
        mlp = {"hidden": text.hidden_size, "intermediate": text.intermediate_size}
    weights = 3 * mlp["hidden"] * mlp["intermediate"]
    return weights * FP16 / 1e9, 2 * tokens * weights / 1e9


def ratios(out: Path, pairs: list[tuple[str, str]]) -> list[str]:
    """Per pair, each q's prefill CPU time over q 0's, MoE beside dense, and the chunk counts' ratio."""
    lines = ["| q | chunks / q 0's | " + " | ".join(f"{moe} / q 0 | {dense} / q 0" for moe, dense in pairs)
             + " | " + " | ".join(f"{moe} / {dense}" for moe, dense in pairs) + " |",
             "|---|---|" + "---|---|" * len(pairs) + "---|" * len(pairs)]
    runs = {family: json.loads((out / f"{family}.json").read_text())["pruning_sweep"]["rows"]
            for pair in pairs for family in pair if (out / f"{family}.json").is_file()}
    if not all(family in runs for pair in pairs for family in pair):
        return []
    first = runs[pairs[0][0]]
    for i, row in enumerate(first):
        cells = [f"{row['q']:g}", f"{row['prefill_chunks'] / first[0]['prefill_chunks']:.2f}"]
        for moe, dense in pairs:
            cells += [f"{runs[f][i][CPU]['prefill_ms'] / runs[f][0][CPU]['prefill_ms']:.2f}" for f in (moe, dense)]
        cells += [f"{runs[moe][i][CPU]['prefill_ms'] / runs[dense][i][CPU]['prefill_ms']:.1f}x" for moe, dense in pairs]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def forms(families: list[str]) -> list[str]:
    """Each expert form's computed MLP cost per text layer and 128-token chunk (fp16 weights, as the card stores
    them): the graphs run ``hit``, which for a 128-token chunk reads and computes what ``dense`` does."""
    lines = ["| model | " + " | ".join(f"`{form}`: fp16 GB, GFLOP" for form in EXPERT_FORMS) + " |",
             "|---|" + "---|" * len(EXPERT_FORMS)]
    for family in families:
        if family in MODELS:
            lines.append(f"| {MODELS[family]['label']} | " + " | ".join(
                "{:.3f}, {:.1f}".format(*mlp_cost(family, form=form)) for form in EXPERT_FORMS) + " |")
    return lines


def plot(out: Path, pairs: list[tuple[str, str]]) -> Path | None:
    """``OUT/moe_whole_model.png``: prefill CPU time per q of each measured family, and over q 0's beside the
    chunk count's ratio."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {family: json.loads((out / f"{family}.json").read_text())["pruning_sweep"]["rows"]
            for pair in pairs for family in pair if (out / f"{family}.json").is_file()}
    if not runs:
        return None
    fig, (seconds, ratio) = plt.subplots(1, 2, figsize=(10, 4))
    for family, rows in runs.items():
        qs, cpu = [r["q"] for r in rows], [r[CPU]["prefill_ms"] / 1000 for r in rows]
        sibling = json.loads((out / f"{family}.json").read_text()).get("sibling_of")
        label = (MODELS[family]["label"] + " widths (hit)" if family in MODELS
                 else f"dense {family} at {MODELS[sibling]['label']} widths" if sibling else f"dense {family} widths")
        seconds.plot(qs, cpu, "o-", label=label)
        ratio.plot(qs, [c / cpu[0] for c in cpu], "o-", label=label)
    rows = next(iter(runs.values()))
    ratio.plot([r["q"] for r in rows], [r["prefill_chunks"] / rows[0]["prefill_chunks"] for r in rows], "k--",
               label="chunks / q 0's")
    seconds.set(xlabel="pruning rate q", ylabel=f"prefill CPU s ({FRAMES} frames {SIDE}x{SIDE})", yscale="log",
                title="prefill")
    ratio.set(xlabel="pruning rate q", ylabel="prefill CPU time / q 0's", title="what pruning buys, MoE beside dense")
    for axes in (seconds, ratio):
        axes.legend()
        axes.grid(alpha=0.3)
    fig.tight_layout()
    path = out / "moe_whole_model.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def table(out: Path, pairs: list[tuple[str, str]]) -> str:
    lines = ["| model | q | K | chunks | prefill CPU s | prefill wall s | q / q0 CPU | peak RSS MB (sweep) "
             "| export s | export peak RSS MB | MLP per layer and chunk (fp16 GB, GFLOP) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for pair in pairs:
        for family in pair:
            path = out / f"{family}.json"
            if not path.is_file():
                lines.append(f"| {family} | not measured | | | | | | | | | |")
                continue
            r = json.loads(path.read_text())
            rows = r["pruning_sweep"]["rows"]
            q0 = next(row for row in rows if row["q"] == 0.0)
            gb, gflop = mlp_cost(family, mlp=r.get("mlp"))
            export_s = r.get("export_s", r.get("export_open_s"))  # earlier runs timed save + export + open
            name = f"{family} at {r['sibling_of']} widths" if r.get("sibling_of") else family
            for row in rows:
                lines.append(
                    f"| {name} ({r['model']['text_layers']}+{r['model']['vision_layers']} layers) | {row['q']:g} "
                    f"| {row['kept_tokens']} | {row['prefill_chunks']} | {row[CPU]['prefill_ms'] / 1000:.1f} "
                    f"| {row[WALL]['prefill_ms'] / 1000:.1f} | {row[CPU]['prefill_ms'] / q0[CPU]['prefill_ms']:.2f} "
                    f"| {row['peak_rss_mb']:.0f} | {export_s:.0f} | {r['export_peak_rss_mb']:.0f} "
                    f"| {gb:.3f}, {gflop:.1f} |")
    pairs_ratios = ratios(out, pairs)
    if pairs_ratios:
        lines += ["", "Prefill CPU time at each q over q 0's, MoE beside its dense sibling, and MoE over dense:", "",
                  *pairs_ratios]
    lines += ["", "The sparse MLP per text layer and 128-token chunk in each expert form (computed):", "",
              *forms([moe for moe, _ in pairs])]
    text = "\n".join(lines) + "\n"
    out.mkdir(parents=True, exist_ok=True)
    (out / "moe_whole_model.md").write_text(text)
    plot(out, pairs)
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for command in ("run", "export", "sweep"):
        r = sub.add_parser(command)
        r.add_argument("family")
        r.add_argument("out", type=Path)
        r.add_argument("--text-layers", type=int, default=2)
        r.add_argument("--vision-layers", type=int, default=2)
        r.add_argument("--repeats", type=int, default=1)
        r.add_argument("--widths", choices=("realistic", "tiny"), default="realistic",
                       help="tiny: a check of this script")
        if command != "sweep":
            r.add_argument("--sibling-of", choices=sorted(DENSE_OF), default=None,
                           help="the dense family at this MoE family's widths (dense_sibling_config)")
    t = sub.add_parser("table")
    t.add_argument("out", type=Path)
    t.add_argument("pairs", nargs="+", help="MOE:DENSE family pairs")
    args = parser.parse_args()
    if args.command == "table":
        print(table(args.out, [tuple(p.split(":")) for p in args.pairs]))
        return
    if getattr(args, "sibling_of", None) and DENSE_OF[args.sibling_of] != args.family:
        parser.error(f"--sibling-of {args.sibling_of} builds a {DENSE_OF[args.sibling_of]} checkpoint; "
                     f"run it as family {DENSE_OF[args.sibling_of]}, not {args.family}")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.command == "run":
        run(args)
    elif args.command == "export":
        export_step(args.family, args.out, args.text_layers, args.vision_layers, args.repeats, args.widths,
                    args.sibling_of)
    else:
        sweep_step(args.family, args.out, args.text_layers, args.vision_layers, args.repeats, args.widths)


if __name__ == "__main__":
    main()
