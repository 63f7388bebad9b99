"""Prefill against the pruning rate at Nemotron 3 Nano Omni widths, beside Qwen3-VL-30B-A3B at the same depth.

Each family runs ``moe_whole_model.py``'s pruning sweep alone (random weights at released widths, ``qeff-evs
export``'s pipeline, a 16-frame 448x448 clip at q 0, 0.5, 0.75, export and sweep in two processes), one family at
a time under ``flock /tmp/qeff-heavy.lock``::

    python benchmarks/moe_whole_model.py run nemotron_h_omni OUT --text-layers 3
    python benchmarks/moe_whole_model.py run qwen3_vl_moe OUT --text-layers 3
    python benchmarks/nemotron_h_prefill.py OUT

This script reads their ``OUT/<family>.json`` and writes ``OUT/nemotron_h_prefill.md`` (per family and q: kept rows,
prompt tokens, chunks of 128, prefill CPU and wall time, each over q 0's, peak RSS, and the computed bytes and FLOPs
of one sparse MLP layer per chunk) and ``OUT/nemotron_h_prefill.png`` (prefill CPU time per q; its ratio to q 0's
beside the prompt's).

Three text layers are Nemotron 3 Nano's first three (Mamba2, MoE, Mamba2), the last made attention (a language graph
keeps its KV slots there): one layer of each kind. Qwen3-VL-30B-A3B's three are attention with a sparse MLP each.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from moe_expert_forms import FP16, MODELS, cost  # this folder's scripts

from qeff_evs.bench.timing import CPU, WALL

FAMILIES = {"nemotron_h_omni": "Nemotron 3 Nano Omni", "qwen3_vl_moe": "Qwen3-VL-30B-A3B"}
CHUNK = 128
# Nemotron 3 Nano's MoE: 128 un-gated experts (up, down) of 1856 on hidden 2688, 6 per token, a shared expert of 3712.
NEMOTRON_MOE = dict(hidden=2688, experts=128, top_k=6, width=1856, shared=3712)


def nemotron_moe_cost(tokens: int = CHUNK) -> tuple[float, float]:
    """fp16 GB and GFLOP of one Nemotron-H MoE layer in the ``hit`` form for a ``tokens``-token chunk: the experts
    some token chose (every expert once 128 x 6 >= 128), two matrices each; the router; the shared expert."""
    m = NEMOTRON_MOE
    experts = min(m["experts"], tokens * m["top_k"])
    matrix, shared, router = 2 * m["hidden"] * m["width"], 2 * m["hidden"] * m["shared"], m["hidden"] * m["experts"]
    weights = experts * matrix + shared + router
    flops = 2 * tokens * (experts * matrix + shared + router)
    return weights * FP16 / 1e9, flops / 1e9


def mlp_cost(family: str) -> tuple[float, float]:
    if family == "nemotron_h_omni":
        return nemotron_moe_cost()
    c = cost("hit", CHUNK, MODELS[family])
    return c["weight_bytes"] / 1e9, c["flops"] / 1e9


def load(out: Path) -> dict[str, dict]:
    return {family: json.loads((out / f"{family}.json").read_text()) for family in FAMILIES
            if (out / f"{family}.json").is_file()}


def table(runs: dict[str, dict]) -> str:
    lines = ["| model | q | kept rows | prompt tokens | chunks | prefill CPU s | prefill wall s | CPU / q 0's "
             "| prompt / q 0's | peak RSS MB (sweep) | export peak RSS MB | sparse MLP per layer and chunk (fp16 GB, "
             "GFLOP) |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for family, r in runs.items():
        rows = r["pruning_sweep"]["rows"]
        q0 = rows[0]
        gb, gflop = mlp_cost(family)
        for row in rows:
            lines.append(
                f"| {FAMILIES[family]} ({r['model']['text_layers']}+{r['model']['vision_layers']} layers) "
                f"| {row['q']:g} | {row['kept_tokens']} | {row['prompt_tokens']} | {row['prefill_chunks']} "
                f"| {row[CPU]['prefill_ms'] / 1000:.1f} | {row[WALL]['prefill_ms'] / 1000:.1f} "
                f"| {row[CPU]['prefill_ms'] / q0[CPU]['prefill_ms']:.2f} "
                f"| {row['prompt_tokens'] / q0['prompt_tokens']:.2f} | {row['peak_rss_mb']:.0f} "
                f"| {r['export_peak_rss_mb']:.0f} | {gb:.3f}, {gflop:.1f} |")
    return "\n".join(lines) + "\n"


def plot(runs: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (seconds, ratio) = plt.subplots(1, 2, figsize=(10, 4))
    for family, r in runs.items():
        rows = r["pruning_sweep"]["rows"]
        qs, cpu = [row["q"] for row in rows], [row[CPU]["prefill_ms"] / 1000 for row in rows]
        label = f"{FAMILIES[family]} widths, {r['model']['text_layers']} text layers"
        seconds.plot(qs, cpu, "o-", label=label)
        line = ratio.plot(qs, [c / cpu[0] for c in cpu], "o-", label=f"{FAMILIES[family]}: prefill CPU")[0]
        ratio.plot(qs, [row["prompt_tokens"] / rows[0]["prompt_tokens"] for row in rows], "--",
                   color=line.get_color(), label=f"{FAMILIES[family]}: prompt tokens")
    seconds.set(xlabel="pruning rate q", ylabel="prefill CPU s (16 frames 448x448)", title="prefill")
    ratio.set(xlabel="pruning rate q", ylabel="over q 0's", title="what pruning buys")
    for axes in (seconds, ratio):
        axes.legend(fontsize=8)
        axes.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path, help="the folder moe_whole_model.py run wrote <family>.json into")
    args = parser.parse_args()
    runs = load(args.out)
    if not runs:
        raise SystemExit(f"no {' or '.join(f'{f}.json' for f in FAMILIES)} in {args.out}; run moe_whole_model.py first")
    text = table(runs)
    (args.out / "nemotron_h_prefill.md").write_text(text)
    plot(runs, args.out / "nemotron_h_prefill.png")
    print(text)


if __name__ == "__main__":
    main()
