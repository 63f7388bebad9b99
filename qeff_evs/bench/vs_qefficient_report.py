"""The QEfficient comparison's results: ``vs_qefficient.json``, its Markdown table and PNG, and the one table of
several runs (``summary_row`` / ``summary_markdown``: QEfficient's cost over ours, each side's fidelity).

Reads the results dict ``vs_qefficient.run_comparison`` builds; draws nothing it did not measure.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from qeff_evs.bench import plots
from qeff_evs.bench.phase import MIB
from qeff_evs.bench.timing import CPU

QEFFICIENT, OURS = "qefficient", "qeff_evs"
RESULTS = "vs_qefficient"


def save(results: dict, output: Path) -> None:
    (output / f"{RESULTS}.json").write_text(json.dumps(results, indent=2) + "\n")
    (output / f"{RESULTS}.md").write_text("\n".join(markdown(results)) + "\n")
    plot(results, output / f"{RESULTS}.png")


def _ratio(a: float | None, b: float | None) -> str:
    return "n/a" if not a or not b else f"{a / b:.2f}x"


def markdown(results: dict) -> list[str]:
    cfg = results["config"]
    qe = results["qefficient"]
    lines = [
        f"### qeff-evs vs QEfficient: {cfg['family']}, {cfg['frames_sampled']} frames {cfg['height']}x{cfg['width']}, "
        f"prefill chunks of {cfg['prefill_seq_len']}, ONNX Runtime (CPU)",
        "",
        f"Measured {results['finished_utc']} UTC, load average {results['load_average']}. QEfficient "
        + (f"{qe.get('version')} (transformers {qe.get('transformers')})" if not qe["failure"] else "not measured")
        + "; its video goes in as one image per frame (it has no video input).",
        "",
    ]
    if qe["failure"]:
        lines += [f"**{qe['failure']}**", ""]
    lines += [
        "| side | prompt tokens | chunks | vision rows per chunk | vision bytes per chunk | all bytes per chunk "
        "| vision s | prefill s | ms per chunk | TTFT s | QEfficient's TTFT / this TTFT |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    theirs = qe["cost"]
    base_ttft = theirs["wall"]["ttft_s"] if theirs else None
    rows = ([("QEfficient (frames as images)", theirs)] if theirs else []) + [
        (f"qeff-evs q={q}", cost) for q, cost in results[OURS]["rates"].items()]
    for name, cost in rows:
        t = cost["wall"]
        lines.append(
            f"| {name} | {cost['prompt_tokens']:,} | {cost['chunks']} | {cost['vision_rows_per_chunk']:,} | "
            f"{cost['vision_bytes_per_chunk'] / MIB:.2f} MiB | {cost['all_bytes_per_chunk'] / MIB:.2f} MiB | "
            f"{t['vision_s']:.2f} | {t['prefill_s']:.2f} | {t['ms_per_chunk']:.0f} | {t['ttft_s']:.2f} | "
            f"{_ratio(base_ttft, t['ttft_s'])} |" if theirs else
            f"| {name} | {cost['prompt_tokens']:,} | {cost['chunks']} | {cost['vision_rows_per_chunk']:,} | "
            f"{cost['vision_bytes_per_chunk'] / MIB:.2f} MiB | {cost['all_bytes_per_chunk'] / MIB:.2f} MiB | "
            f"{t['vision_s']:.2f} | {t['prefill_s']:.2f} | {t['ms_per_chunk']:.0f} | {t['ttft_s']:.2f} | n/a |")
    lines += ["", "Fidelity against transformers on the same inputs (first-token logits, greedy tokens):", "",
              "| side | max \\|logit diff\\| | logit scale | greedy tokens |", "|---|---|---|---|"]
    for side, name in ((QEFFICIENT, "QEfficient (images)"), (OURS, "qeff-evs q=0 (video, vLLM positions)")):
        f = results["fidelity"].get(side)
        if f is None:
            continue
        tokens = ("equal" if f["tokens_equal"] else f"diverge at token {f['first_divergence']}") + \
            f" ({len(f['tokens'])} tokens)"
        lines.append(f"| {name} | {f['max_abs_logit_diff']:.2e} | {f['logit_scale']:.1f} | {tokens} |")
    lines += ["", "Vision bytes fed per prefill chunk (fp32; counted from the shapes, the "
              f"{cfg['frames_sampled']}-frame row is also what the run fed):", "",
              "| frames | QEfficient rows | qeff-evs rows | QEfficient | qeff-evs | ratio |",
              "|---|---|---|---|---|---|"]
    for p in results["vision_bytes_per_chunk"]:
        lines.append(f"| {p['frames']} | {p['qefficient_rows']:,} | {p['qeff_evs_rows']:,} | "
                     f"{p['qefficient_bytes'] / MIB:.2f} MiB | {p['qeff_evs_bytes'] / MIB:.2f} MiB | "
                     f"{p['ratio']:.1f}x |")
    lines += ["", "On a card:", "", "```bash", *results["card_commands"], "```"]
    return lines


def summary_row(results: dict, rates: tuple[str, ...] = ("0", "0.75")) -> dict:
    """One run's headline numbers: QEfficient's cost over ours (vision bytes per chunk at every counted frame count,
    prefill and TTFT on process CPU time at ``rates``), and each side's max |logit diff| from transformers."""
    cfg, theirs = results["config"], results["qefficient"]["cost"]
    row = {"family": cfg["family"], "frames": cfg["frames_sampled"], "size": f"{cfg['height']}x{cfg['width']}",
           "qefficient_failure": results["qefficient"]["failure"],
           "vision_bytes_ratio": {str(p["frames"]): p["ratio"] for p in results["vision_bytes_per_chunk"]}}
    row["qefficient_over_ours"] = {
        q: {key: (theirs[CPU][key] / results[OURS]["rates"][q][CPU][key] if theirs else None)
            for key in ("prefill_s", "ttft_s")} for q in rates}
    row["fidelity"] = {side: {"max_abs_logit_diff": f["max_abs_logit_diff"], "logit_scale": f["logit_scale"],
                              "tokens_equal": f["tokens_equal"], "first_divergence": f["first_divergence"]}
                       for side, f in results["fidelity"].items()}
    return row


def summary_markdown(rows: Sequence[dict]) -> list[str]:
    """The one table of several runs (one per family): QEfficient's cost over ours, and fidelity."""
    frames = sorted({int(f) for row in rows for f in row["vision_bytes_ratio"]})
    rates = list(rows[0]["qefficient_over_ours"])

    def fidelity(row, side):
        f = row["fidelity"].get(side)
        if f is None:
            return "n/a"
        tokens = "tokens equal" if f["tokens_equal"] else f"tokens diverge at {f['first_divergence']}"
        return f"{f['max_abs_logit_diff']:.1e} (of {f['logit_scale']:.1f}); {tokens}"

    head = (["family", "clip"] + [f"vision bytes/chunk, {f} frames" for f in frames]
            + [f"{what} q={q}" for q in rates for what in ("prefill", "TTFT")]
            + ["QEfficient vs transformers", "qeff-evs q=0 vs transformers"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [row["family"], f"{row['frames']} frames {row['size']}"]
        cells += [f"{row['vision_bytes_ratio'][str(f)]:.0f}x" if str(f) in row["vision_bytes_ratio"] else "n/a"
                  for f in frames]
        ratios = row["qefficient_over_ours"]
        cells += [("n/a" if ratios[q][what] is None else f"{ratios[q][what]:.2f}x")
                  for q in rates for what in ("prefill_s", "ttft_s")]
        cells += [fidelity(row, QEFFICIENT), fidelity(row, OURS)]
        lines.append("| " + " | ".join(cells) + " |")
    failures = [f"{row['family']}: {row['qefficient_failure']}" for row in rows if row["qefficient_failure"]]
    return lines + ([""] + failures if failures else [])


def plot(results: dict, path: Path) -> Path:
    """TTFT split into vision and prefill, and vision bytes per chunk, per side."""
    qe = results["qefficient"]["cost"]
    sides = ([("QEfficient", qe)] if qe else []) + [(f"ours q={q}", c) for q, c in results[OURS]["rates"].items()]
    figure = plots.figure(8.0, 3.2)
    left, right = figure.add_subplot(1, 2, 1), figure.add_subplot(1, 2, 2)
    names = [name for name, _ in sides]
    vision = [c["wall"]["vision_s"] for _, c in sides]
    prefill = [c["wall"]["prefill_s"] for _, c in sides]
    left.bar(names, vision, label="vision")
    left.bar(names, prefill, bottom=vision, label="prefill")
    left.set_ylabel("time to first token (s, wall)")
    left.legend(fontsize=7)
    right.bar(names, [c["vision_bytes_per_chunk"] / MIB for _, c in sides], color="tab:green")
    right.set_ylabel("vision input per chunk (MiB)")
    for axes in (left, right):
        axes.tick_params(axis="x", labelsize=7, rotation=20)
        axes.grid(alpha=0.3, axis="y")
    cfg = results["config"]
    figure.suptitle(f"{cfg['family']}: {cfg['frames_sampled']} frames {cfg['height']}x{cfg['width']}, ONNX Runtime",
                    fontsize=10)
    return plots.save(figure, path)
