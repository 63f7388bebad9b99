"""``qeff-evs bench --export-scaling``: what ``qeff-evs export`` costs against the model's depth, streamed against the
in-memory export, at released widths.

For each case (a released model's widths at some text depth, one way of exporting, one weight dtype) a random
checkpoint is written as released (bf16 shards with their index, ``checkpoint.write_random_checkpoint``: shard by
shard, never more memory than exporting it), then ``qeff-evs export`` runs on it in a process of its own, watched
from here (``memory.watch_process``): its peak resident memory (exact), its largest anonymous and file-backed resident
sizes (sampled), its wall time, and the disk the export takes; a streamed export is then run again into its folder
(``resumed``: what a resume costs when every unit is kept, checked by content). Optionally ``qeff-evs run`` then
answers a question about a clip on the export, watched the same way. Checkpoints and exports are deleted as soon as no case needs them
(a full-depth 8B checkpoint is 17.5 GB).

Results: ``export_scaling.json`` (every reading), ``export_scaling.md`` and ``export_scaling.png``
(docs/results/export_scaling.md holds the published run).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from qeff_evs.bench.config import Progress
from qeff_evs.bench.memory import watch_process
from qeff_evs.bench.phase import fmt, table_head
from qeff_evs.bench.report import run_stamp
from qeff_evs.models.registry import family_class

GIB, GB = 1 << 30, 1e9
STREAMED, IN_MEMORY = "streamed", "in_memory"
# The export every case makes: one small resolution (the encoder's cost does not depend on the depth), 4 frames,
# chunks of 128, a context of 1024 (the RoPE tables and a run's KV cache stay small).
EXPORT_ARGS = ("--height", "224", "--width", "224", "--frames", "4", "--prefill-seq-len", "128", "--ctx-len", "1024",
               "--full-batch-size", "1")
RUN_QUESTION = "What happens in this video?"
# A watched ``qeff-evs`` command: the CLI run as ``__main__``, its own peak resident size (VmHWM, exact; the kernel's
# ru_maxrss of a forked child would start from this process's size) written to the file named first when it ends.
CHILD = """import json, runpy, sys
out = sys.argv.pop(1)
try:
    runpy.run_module("qeff_evs.cli", run_name="__main__", alter_sys=True)
finally:
    status = dict(line.split(":", 1) for line in open("/proc/self/status"))
    json.dump({key: int(status[key].split()[0]) / 1024 for key in ("VmHWM", "RssAnon", "RssFile")}, open(out, "w"))
"""
# The random checkpoint, written by a process of its own (this one stays small while the exports run beside it).
WRITER = """import sys
from pathlib import Path
from qeff_evs.bench.checkpoint import write_random_checkpoint
from qeff_evs.bench.export_scaling import MODELS
model, text, vision, folder = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
write_random_checkpoint(MODELS[model].config(text, vision), MODELS[model].family, folder, progress=print)
"""


@dataclass(frozen=True)
class ReleasedModel:
    """A released checkpoint's widths: ``family`` with text and vision config kwargs (the depths are the case's)."""

    family: str
    text: dict
    vision: dict
    full_text_layers: int
    full_vision_layers: int

    def config(self, text_layers: int, vision_layers: int):
        spec = family_class(self.family)
        kwargs = spec.realistic_config_kwargs(text_layers, vision_layers)
        deepstack = [i for i in self.vision.get("deepstack_visual_indexes", ()) if i < vision_layers]
        vision = {**kwargs["vision_config"], **self.vision, "depth": vision_layers}
        if "deepstack_visual_indexes" in self.vision:
            vision["deepstack_visual_indexes"] = deepstack or [vision_layers - 1]
        text = {**kwargs["text_config"], **self.text, "num_hidden_layers": text_layers}
        tied = text.pop("tie_word_embeddings", kwargs.get("tie_word_embeddings", False))
        return spec.config_class(**{**kwargs, "text_config": text, "vision_config": vision,
                                    "tie_word_embeddings": tied})


def _moe_widths() -> tuple[dict, dict]:
    text, vision = family_class("qwen3_vl_moe").realistic_widths(48, 27)
    return {**text, "tie_word_embeddings": False}, {**vision, "deepstack_visual_indexes": [8, 16, 24]}


# Qwen3-VL-8B-Instruct's config.json (text and vision widths); Qwen3-VL-30B-A3B's are the MoE family's released ones.
MODELS = {
    "Qwen3-VL-8B": ReleasedModel(
        "qwen3_vl",
        text=dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_attention_heads=32,
                  num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
        vision=dict(hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=4096, patch_size=16,
                    spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304,
                    deepstack_visual_indexes=[8, 16, 24]),
        full_text_layers=36, full_vision_layers=27),
    "Qwen3-VL-30B-A3B": ReleasedModel("qwen3_vl_moe", *_moe_widths(), full_text_layers=48, full_vision_layers=27),
}


@dataclass(frozen=True)
class ScalingCase:
    """One export measured: ``model`` at ``text_layers`` (vision at its full depth unless given), ``way`` (streamed or
    in memory), ``weight_dtype``; ``run``: then ``qeff-evs run`` on a clip with the export."""

    model: str
    text_layers: int
    way: str = STREAMED
    weight_dtype: str = "float32"
    vision_layers: int | None = None
    run: bool = False
    functions: bool = False  # --layer-functions

    @classmethod
    def parse(cls, text: str) -> "ScalingCase":
        """``MODEL:TEXT[:WAY[:DTYPE[:FLAG...]]]``, flags ``run`` and ``functions``, e.g.
        ``Qwen3-VL-8B:36:streamed:float16:run``."""
        parts = text.split(":")
        if parts[0] not in MODELS or len(parts) < 2 or not parts[1].isdigit():
            raise ValueError(f"--scaling-cases {text!r}: give MODEL:TEXT_LAYERS[:WAY[:DTYPE[:run]]] with MODEL one of "
                             f"{', '.join(MODELS)}")
        way = parts[2] if len(parts) > 2 else STREAMED
        if way not in (STREAMED, IN_MEMORY):
            raise ValueError(f"--scaling-cases {text!r}: the way is {STREAMED} or {IN_MEMORY}, not {way!r}")
        flags = set(parts[4:])
        if flags - {"run", "functions"}:
            raise ValueError(f"--scaling-cases {text!r}: the flags are run and functions, not {sorted(flags)}")
        return cls(parts[0], int(parts[1]), way, parts[3] if len(parts) > 3 else "float32", run="run" in flags,
                   functions="functions" in flags)

    @property
    def vision_depth(self) -> int:
        return self.vision_layers or MODELS[self.model].full_vision_layers

    @property
    def label(self) -> str:
        return f"{self.model} {self.text_layers}L {self.way} {self.weight_dtype}" + (" functions" if self.functions
                                                                                    else "")


DEFAULT_CASES = (
    "Qwen3-VL-8B:2:in_memory", "Qwen3-VL-8B:2:streamed:float32", "Qwen3-VL-8B:2:streamed:float16",
    "Qwen3-VL-8B:6:streamed:float32", "Qwen3-VL-8B:6:streamed:float16", "Qwen3-VL-8B:36:streamed:float16:run",
    "Qwen3-VL-30B-A3B:2:in_memory", "Qwen3-VL-30B-A3B:2:streamed:float16", "Qwen3-VL-30B-A3B:6:streamed:float16",
    "Qwen3-VL-30B-A3B:12:streamed:float16",
)


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())


def model_sizes(case: ScalingCase) -> dict:
    """Parameters of the case's model, of one decoder layer, and its fp32 bytes (from the shapes: nothing built)."""
    import torch

    config = MODELS[case.model].config(case.text_layers, case.vision_depth)
    with torch.device("meta"):
        model = family_class(MODELS[case.model].family).model_class(config)
    total = sum(p.numel() for p in model.parameters())
    layer = sum(p.numel() for p in model.model.language_model.layers[0].parameters())
    return {"parameters": total, "layer_parameters": layer, "fp32_bytes": 4 * total, "layer_fp32_bytes": 4 * layer}


def _watched(arguments: list[str], log: Path) -> dict:
    """``qeff-evs ARGUMENTS`` in a process of its own: wall time, its exact peak resident size, its largest
    anonymous and file-backed resident sizes (sampled)."""
    peak_file = log.with_suffix(".peak.json")
    command = [sys.executable, "-c", CHILD, str(peak_file), *arguments]
    started = time.perf_counter()
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        sampled = watch_process(process)
    wall = time.perf_counter() - started
    if process.returncode != 0:
        raise RuntimeError(f"qeff-evs {' '.join(arguments)} failed ({process.returncode}); its output: {log}")
    own = json.loads(peak_file.read_text())
    return {"wall_s": wall, "peak_rss_mib": own["VmHWM"], "peak_anon_mib": sampled["RssAnon"],
            "peak_file_mib": sampled["RssFile"]}


def measure_case(case: ScalingCase, checkpoint: Path, workdir: Path, clip: Path | None, progress: Progress) -> dict:
    export = workdir / "export"
    shutil.rmtree(export, ignore_errors=True)
    command = ["export", str(checkpoint), "-o", str(export), *EXPORT_ARGS,
               *(["--in-memory"] if case.way == IN_MEMORY else ["--weight-dtype", case.weight_dtype]),
               *(["--layer-functions"] if case.functions else [])]
    progress(f"export scaling: {case.label}: qeff-evs {' '.join(command)}")
    reading = {"case": asdict(case), "label": case.label, **model_sizes(case),
               "checkpoint_bytes": folder_bytes(checkpoint), "export": _watched(command, workdir / "export.log")}
    reading["export"]["disk_bytes"] = folder_bytes(export)
    reading["export"]["language_graph_bytes"] = (export / "language" / "language.onnx").stat().st_size
    progress(f"export scaling: {case.label}: {reading['export']}")
    if case.way == STREAMED:  # the same export again into its folder: every unit checked by content and kept
        reading["resumed"] = _watched(command, workdir / "resumed.log")
        reading["resumed"]["of_first"] = reading["resumed"]["wall_s"] / reading["export"]["wall_s"]
        progress(f"export scaling: {case.label}: the same export again {reading['resumed']}")
    if case.run and clip is not None:
        command = ["run", str(export), "--video", str(clip), "--prompt", RUN_QUESTION,
                   "--max-new-tokens", "4"]
        reading["run"] = _watched(command, workdir / "run.log")
        reading["run"]["output"] = (workdir / "run.log").read_text().splitlines()[-8:]
        progress(f"export scaling: {case.label}: run {reading['run']}")
    shutil.rmtree(export, ignore_errors=True)
    return reading


def run_scaling(cases: Sequence[ScalingCase], workdir: Path, output: Path, clip: Path | None,
                progress: Progress, command: str = "") -> dict:
    """Every case, grouped by checkpoint (each written once, deleted after its last case); results written as they
    come (a long run keeps what it measured)."""
    workdir, output = Path(workdir), Path(output)
    workdir.mkdir(parents=True, exist_ok=True)
    output.mkdir(parents=True, exist_ok=True)
    results = {"command": command, "export_args": list(EXPORT_ARGS), "readings": [], "checkpoints": {}}
    order: dict[tuple, list[ScalingCase]] = {}
    for case in cases:
        order.setdefault((case.model, case.text_layers, case.vision_depth), []).append(case)
    for (model, text_layers, vision_layers), group in order.items():
        checkpoint = workdir / "checkpoint"
        shutil.rmtree(checkpoint, ignore_errors=True)
        started = time.perf_counter()
        subprocess.run([sys.executable, "-c", WRITER, model, str(text_layers), str(vision_layers), str(checkpoint)],
                       check=True, stdout=subprocess.DEVNULL)
        results["checkpoints"][f"{model} {text_layers}L"] = {"bytes": folder_bytes(checkpoint),
                                                              "write_s": time.perf_counter() - started}
        for case in group:
            results["readings"].append({**measure_case(case, checkpoint, workdir, clip, progress), **run_stamp()})
            save(results, output)
        shutil.rmtree(checkpoint, ignore_errors=True)
    return results


def save(results: dict, output: Path) -> None:
    (output / "export_scaling.json").write_text(json.dumps(results, indent=1) + "\n")
    (output / "export_scaling.md").write_text("\n".join(markdown(results)) + "\n")
    if results["readings"]:
        plot(results, output / "export_scaling.png")


def markdown(results: dict) -> list[str]:
    lines = ["# Export cost against depth: streamed and in-memory", "",
             f"Command: `{results.get('command', '')}`; each export: `qeff-evs export CHECKPOINT "
             f"{' '.join(results['export_args'])}` in a process of its own. Peak RSS is the kernel's (exact); anon and "
             "file are the largest anonymous and file-backed resident sizes seen (sampled every 0.1 s).", "",
             *table_head("| model | text layers | export | weights | peak RSS GiB | anon GiB | file GiB | peak / fp32 "
                         "model | wall s | export GB | language graph MB | checkpoint GB |")]
    for r in results["readings"]:
        case, export = r["case"], r["export"]
        lines.append(
            f"| {case['model']} | {case['text_layers']} | {case['way'].replace('_', '-')} | "
            f"{'fp32' if case['way'] == IN_MEMORY else case['weight_dtype'].replace('float', 'fp')}"
            f"{', functions' if case.get('functions') else ''} | "
            f"{export['peak_rss_mib'] / 1024:.2f} | {export['peak_anon_mib'] / 1024:.2f} | "
            f"{export['peak_file_mib'] / 1024:.2f} | {export['peak_rss_mib'] * 2**20 / r['fp32_bytes']:.2f} | "
            f"{fmt(export['wall_s'])} | {export['disk_bytes'] / GB:.1f} | "
            f"{export.get('language_graph_bytes', 0) / 1e6:.1f} | {r['checkpoint_bytes'] / GB:.1f} |")
    runs = [r for r in results["readings"] if "run" in r]
    for r in runs:
        run = r["run"]
        lines += ["", f"`qeff-evs run` on the {r['label']} export: peak RSS {run['peak_rss_mib'] / 1024:.2f} GiB "
                      f"(anon {run['peak_anon_mib'] / 1024:.2f}, file {run['peak_file_mib'] / 1024:.2f}), "
                      f"{run['wall_s']:.0f} s. It printed:", "", "```", *run["output"], "```"]
    lines += ["", *flatness(results)]
    return lines


def flatness(results: dict) -> list[str]:
    """The streamed export's peak between its shallowest and deepest case, against one layer's fp32 bytes."""
    lines = []
    for model in dict.fromkeys(r["case"]["model"] for r in results["readings"]):
        for dtype in ("float32", "float16"):
            rows = sorted((r for r in results["readings"] if r["case"]["model"] == model and not r["case"]["functions"]
                           and r["case"]["way"] == STREAMED and r["case"]["weight_dtype"] == dtype),
                          key=lambda r: r["case"]["text_layers"])
            if len(rows) < 2:
                continue
            low, high = rows[0], rows[-1]
            grew = (high["export"]["peak_rss_mib"] - low["export"]["peak_rss_mib"]) * 2**20
            lines.append(f"- {model}, streamed, {dtype}: peak RSS {low['case']['text_layers']} -> "
                         f"{high['case']['text_layers']} layers grew by {grew / GIB:+.2f} GiB; one decoder layer in "
                         f"fp32 is {high['layer_fp32_bytes'] / GIB:.2f} GiB; the {high['case']['text_layers']}-layer "
                         f"model in fp32 is {high['fp32_bytes'] / GIB:.1f} GiB.")
    return lines


def plot(results: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    series: dict[str, list] = {}
    for r in results["readings"]:
        case = r["case"]
        key = f"{case['model']} {case['way'].replace('_', '-')}" + (
            "" if case["way"] == IN_MEMORY else f" {case['weight_dtype'].replace('float', 'fp')}") + (
            " functions" if case.get("functions") else "")
        series.setdefault(key, []).append(r)
    for key, rows in series.items():
        rows.sort(key=lambda r: r["case"]["text_layers"])
        depth = [r["case"]["text_layers"] for r in rows]
        style = "--o" if "in-memory" in key else "-o"
        axes[0].plot(depth, [r["export"]["peak_rss_mib"] / 1024 for r in rows], style, label=key)
        axes[1].plot(depth, [r["export"]["wall_s"] for r in rows], style, label=key)
        axes[2].plot(depth, [r["export"]["disk_bytes"] / GB for r in rows], style, label=key)
    models = {r["case"]["model"]: r for r in results["readings"]}
    for model, r in models.items():
        depths = sorted({x["case"]["text_layers"] for x in results["readings"] if x["case"]["model"] == model})
        per_layer, rest = r["layer_fp32_bytes"], r["fp32_bytes"] - r["case"]["text_layers"] * r["layer_fp32_bytes"]
        axes[0].plot(depths, [(rest + d * per_layer) / GIB for d in depths], ":", color="grey")
    axes[0].set_title("peak RSS of the export (GiB); dotted: the fp32 model")
    axes[1].set_title("wall time (s)")
    axes[2].set_title("export on disk (GB)")
    for axis in axes:
        axis.set_xlabel("text layers")
        axis.grid(alpha=0.3)
    axes[0].set_yscale("log")
    axes[0].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path

