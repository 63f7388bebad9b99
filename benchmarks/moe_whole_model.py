"""The whole model at released widths, MoE beside its dense sibling: `qeff-evs bench`'s pruning sweep alone.

One process per family (a released-width MoE checkpoint is gigabytes; run each under ``flock /tmp/qeff-heavy.lock``
and ``/usr/bin/time -v`` on a shared machine)::

    python benchmarks/moe_whole_model.py run qwen3_vl_moe OUT_DIR [--text-layers 2] [--repeats 1]
    python benchmarks/moe_whole_model.py table OUT_DIR qwen3_vl_moe:qwen3_vl [qwen3_5_moe:qwen3_5]

``run`` is the bench's own path (``suite``'s random checkpoint, ``qeff-evs export``'s pipeline, the
``pruning_sweep`` phase on a 16-frame 448x448 clip at q 0, 0.5, 0.75) without the other phases, whose frame buckets
it does not export; it writes ``OUT_DIR/<family>.json`` with the export time (save + export + open) and the
phase's section. ``table`` writes ``OUT_DIR/moe_whole_model.md``: per MoE family and its dense sibling at the same
depth, prefill CPU and wall time per q, the q 0.75 / q 0 ratio, peak RSS, export time, and each expert form's
computed MLP bytes and FLOPs per chunk; and ``OUT_DIR/moe_whole_model.png``, the prefill times and their ratios.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from qeff_evs.bench import phases, pruning
from qeff_evs.bench.checkpoint import model_config
from qeff_evs.bench.config import preset, validate
from qeff_evs.bench.graphs import build_graphs
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


def run(family: str, out: Path, text_layers: int, vision_layers: int, repeats: int, widths: str = "realistic") -> dict:
    # Every phase's frame counts set to the clip's, so the export holds the one bucket the sweep runs.
    config = preset("full", family).replace(
        text_layers=text_layers, vision_layers=vision_layers, frames=FRAMES, frame_size=SIDE, vision_frames=FRAMES,
        vision_frame_size=SIDE, window_frames=(FRAMES,), vision_sweep_frames=(FRAMES,), overhead_frames=FRAMES,
        pruning_rates=RATES, ctx_len=2048, repeats=repeats, widths=widths)
    config = phases.with_option_defaults(config)
    hf_config = model_config(config)
    vc = family_class(family).config_paths.read(hf_config)
    validate(config, vc.patch_size, vc.merge_size, vc.temporal_patch_size)
    workdir = out / f"work_{family}"
    started = time.perf_counter()
    graphs = build_graphs(config, workdir, lambda m: print(f"[{time.strftime('%H:%M:%S')}] {m}", flush=True))
    export_s = time.perf_counter() - started
    export_peak_mb = peak_mb()
    sweep = pruning.run_pruning_sweep(config, graphs, lambda m: print(f"[{time.strftime('%H:%M:%S')}] {m}", flush=True))
    result = {"family": family, "config": config.to_json(), "model": model_summary(hf_config),
              "environment": environment(), "export_open_s": export_s, "export_peak_rss_mb": export_peak_mb,
              "export_bytes": sum(f.stat().st_size for f in graphs.export_dir.rglob("*") if f.is_file()),
              "pruning_sweep": pruning.section(sweep)}
    (out / f"{family}.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def mlp_cost(family: str, tokens: int = 128, form: str = HIT) -> tuple[float, float]:
    """fp16 GB and GFLOP of one text layer's MLP for a ``tokens``-token chunk: the sparse block in expert form
    ``form`` (``moe_expert_forms.cost``: experts, router, shared expert), or the dense sibling's MLP."""
    text = realistic_config(family, 1, 2).text_config
    if getattr(text, "num_experts", None):
        c = cost(form, tokens, MODELS[family])
        return c["weight_bytes"] / 1e9, c["flops"] / 1e9
    weights = 3 * text.hidden_size * text.intermediate_size
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
        label = MODELS[family]["label"] + " widths (hit)" if family in MODELS else f"dense {family} widths"
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
             "| export + open s | export peak RSS MB | MLP per layer and chunk (fp16 GB, GFLOP) |",
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
            gb, gflop = mlp_cost(family)
            for row in rows:
                lines.append(
                    f"| {family} ({r['model']['text_layers']}+{r['model']['vision_layers']} layers) | {row['q']:g} "
                    f"| {row['kept_tokens']} | {row['prefill_chunks']} | {row[CPU]['prefill_ms'] / 1000:.1f} "
                    f"| {row[WALL]['prefill_ms'] / 1000:.1f} | {row[CPU]['prefill_ms'] / q0[CPU]['prefill_ms']:.2f} "
                    f"| {row['peak_rss_mb']:.0f} | {r['export_open_s']:.0f} | {r['export_peak_rss_mb']:.0f} "
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
    r = sub.add_parser("run")
    r.add_argument("family")
    r.add_argument("out", type=Path)
    r.add_argument("--text-layers", type=int, default=2)
    r.add_argument("--vision-layers", type=int, default=2)
    r.add_argument("--repeats", type=int, default=1)
    r.add_argument("--widths", choices=("realistic", "tiny"), default="realistic", help="tiny: a check of this script")
    t = sub.add_parser("table")
    t.add_argument("out", type=Path)
    t.add_argument("pairs", nargs="+", help="MOE:DENSE family pairs")
    args = parser.parse_args()
    if args.command == "run":
        args.out.mkdir(parents=True, exist_ok=True)
        run(args.family, args.out, args.text_layers, args.vision_layers, args.repeats, args.widths)
    else:
        print(table(args.out, [tuple(p.split(":")) for p in args.pairs]))


if __name__ == "__main__":
    main()
