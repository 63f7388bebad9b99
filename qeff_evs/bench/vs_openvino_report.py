"""The OpenVINO GenAI comparison's results: ``vs_openvino.json``, its Markdown tables and a PNG of each family's time to
first token per arm. Reads the results dict ``vs_openvino.run_comparison`` builds; draws nothing it did not measure.
"""

from __future__ import annotations

import json
from pathlib import Path

from qeff_evs.bench import plots

RESULTS = "vs_openvino"


def save(results: dict, output: Path) -> None:
    output.mkdir(parents=True, exist_ok=True)
    (output / f"{RESULTS}.json").write_text(json.dumps(results, indent=2) + "\n")
    (output / f"{RESULTS}.md").write_text("\n".join(markdown(results)) + "\n")
    plot(results, output / f"{RESULTS}.png")


def _num(value, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _ratio(value) -> str:
    return "n/a" if value is None else f"**{value:.2f}x**"


def _prefill(arm: dict) -> str:
    """TTFT past the vision side: the prompt's prefill to the first token."""
    return "" if arm.get("vision_s") is None else _num(arm["ttft_s"] - arm["vision_s"])


def markdown(results: dict) -> list[str]:
    cfg = results["config"]
    lines = [
        f"### qeff-evs vs OpenVINO GenAI {results['openvino_genai']}: {cfg['frames']} frames {cfg['size']}x"
        f"{cfg['size']}, {cfg['text_layers']} text + {cfg['vision_layers']} vision layers"
        f"{' (tiny widths)' if cfg['smoke'] else ' at released widths'}, {cfg['threads']} threads",
        "",
        f"Measured {results['started_utc']} to {results['finished_utc']} UTC on {results['cpu']} (bf16 instructions: "
        f"{'yes' if results['bf16'] else 'no'}), load average {results['load_average']}; medians of {cfg['rounds']} "
        f"rounds after a warm-up, the arms alternated. {cfg['new_tokens']} greedy tokens each. Command: "
        f"`{results['command']}`",
        "",
    ]
    for family in results["families"]:
        lines += [f"#### {family['family']}", "",
                  "| arm | prompt tokens | kept video tokens | TTFT s | of which vision s | of which prefill s | "
                  "total s | CPU s | peak RSS MiB | tokens = OpenVINO fp32 unpruned |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        reference = next((a for a in family["arms"] if a["runtime"] != "qeff-evs" and a["variant"] == "fp32"
                          and a["rate"] == 0 and a.get("ids")), None)
        for arm in family["arms"]:
            if arm["failure"]:
                lines.append(f"| {arm['label']} | refused: {arm['failure']} | | | | | | | | |")
                continue
            same = ("n/a" if reference is None else "yes" if arm["ids"] == reference["ids"] else "no"
                    if arm["prompt_tokens"] == reference["prompt_tokens"] or arm["rate"] else "n/a: other prompt")
            lines.append(f"| {arm['label']} | {arm['prompt_tokens']} | {arm['kept_tokens'] or ''} | "
                         f"{_num(arm['ttft_s'])} | {_num(arm.get('vision_s'))} | {_prefill(arm)} | "
                         f"{_num(arm['total_s'])} | {_num(arm['cpu_s'])} | "
                         f"{_num(arm['peak_mb'], 0)} | {same} |")
        verdict = family["verdict"]
        lines.append("")
        for backend, entry in verdict["backends"].items():
            parts = [f"TTFT q 0 / OpenVINO fp32 {_ratio(entry.get('ttft_q0_over_openvino_fp32'))} (CPU "
                     f"{_num(entry.get('cpu_q0_over_openvino_fp32'))}x)",
                     f"/ OpenVINO default {_ratio(entry.get('ttft_q0_over_openvino_default'))}",
                     f"peak RSS / OpenVINO fp32 {_num(entry.get('peak_over_openvino_fp32'))}x, / OpenVINO default "
                     f"{_num(entry.get('peak_over_openvino_default'))}x"]
            parts += [f"TTFT q {key.split('_')[1][1:]} / OpenVINO's fastest ({verdict['fastest_openvino']}) "
                      f"{_ratio(value)}" for key, value in entry.items() if key.endswith("_over_fastest_openvino")]
            parts.append(f"q 0 tokens equal OpenVINO fp32's: {entry.get('q0_ids_equal_openvino_fp32')}")
            lines.append(f"- qeff-evs ({backend}): " + "; ".join(parts))
        lines.append("")
    return lines


def plot(results: dict, path: Path) -> Path:
    families = results["families"]
    figure = plots.figure(4.5 * len(families), 3.6)
    for index, family in enumerate(families, start=1):
        axes = figure.add_subplot(1, len(families), index)
        arms = [a for a in family["arms"] if a.get("ttft_s") is not None]
        colors = ["tab:blue" if a["runtime"] == "qeff-evs" else "tab:orange" for a in arms]
        axes.barh(range(len(arms)), [a["ttft_s"] for a in arms], color=colors, label="prefill")
        axes.barh(range(len(arms)), [a.get("vision_s") or 0 for a in arms], color=colors, hatch="//",
                  edgecolor="white", label="vision (frames to the prompt's rows)")
        axes.set_yticks(range(len(arms)), [a["label"].replace("OpenVINO GenAI", "OpenVINO") for a in arms],
                        fontsize=7)
        axes.invert_yaxis()
        axes.set_xlabel("time to first token, s (median)")
        axes.set_title(family["family"], fontsize=10)
        axes.grid(alpha=0.3, axis="x")
        if index == len(families):
            axes.legend(fontsize=7, loc="lower right")
    return plots.save(figure, path)
