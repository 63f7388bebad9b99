"""``qeff-evs bench --vs-openvino``: the runtime a user without a card would pick instead, OpenVINO GenAI, side by side
with the embedded path on the same checkpoint, frames and question.

* The checkpoint: a random one at a family's released widths with few layers (``bench.checkpoint``, fp32: both sides
  compute in fp32), or the tiny test widths (``smoke``).
* OpenVINO: optimum-intel converts the checkpoint (``optimum-cli export openvino --weight-format fp32``) in a side
  environment (``openvino_python``: given, or built in the work folder: optimum-intel pins a transformers older than
  ours), and ``VLMPipeline`` answers in child processes (``openvino_driver``): one with fp32 compute and KV, one with
  its defaults (bf16 compute on a CPU with bf16 instructions); unpruned, and with CDPruner at the ratios that match
  our rates where OpenVINO accepts video pruning for the family.
* qeff-evs: ``qeff-evs export --target cpu`` of the checkpoint at the clip's frames and size, the engine in a child
  process (``engine_driver``) per backend, at each video pruning rate.
Every arm (a runtime and a setting) answers once per round, the rounds alternating forward and backward; the first
round warms up and is dropped, the medians of the others are reported. Both sides are given the same uint8 frames
and greedy-decode the same number of tokens; the tokens of our q = 0 run are checked against OpenVINO's unpruned fp32
run. Peak memory is each child's ``VmHWM``. Results: ``vs_openvino_report``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from qeff_evs.bench.phase import Progress
from qeff_evs.bench.timing import alternating, median

OPENVINO_PYTHON_ENV = "QEFF_EVS_OPENVINO_PYTHON"
OPENVINO_DRIVER = Path(__file__).with_name("openvino_driver.py")
# What the side environment installs (torch first: the local CPU wheel, so nothing pulls a CUDA build); optimum-intel
# 2.2's Qwen-VL exporters refuse transformers past 5.0; torchvision comes along and cannot load beside this torch.
OPENVINO_PACKAGES = ("optimum-intel[openvino]==2.2.0", "openvino-genai==2026.4.1.0", "openvino==2026.4.1",
                     "openvino-tokenizers==2026.4.1.0", "transformers==5.0.0")
TORCH_PIN = "torch==2.13.0"
OURS, OPENVINO = "qeff-evs", "OpenVINO GenAI"
FP32, DEFAULT = "fp32", "default"
# CDPruner's ratio is a percentage of the visual tokens dropped: ratio 100 q matches our rate q in kept tokens
CDPRUNER_FAMILIES = ("qwen3_vl",)  # OpenVINO GenAI 2026.4 refuses video pruning for Qwen2-VL and Qwen2.5-VL


@dataclass(frozen=True)
class VsOpenVinoConfig:
    families: tuple[str, ...] = ("qwen2_5_vl", "qwen3_vl")
    text_layers: int = 4
    vision_layers: int = 4
    frames: int = 16
    size: int = 448
    fps: float = 2.0
    pruning_rates: tuple[float, ...] = (0.0, 0.5, 0.75)
    backends: tuple[str, ...] = ("ort",)
    rounds: int = 3  # measured rounds, after one warm-up round
    new_tokens: int = 8
    threads: int = 2
    question: str = "What happens in this video?"
    smoke: bool = False  # tiny widths: the suite's run of the whole case
    openvino_python: Path | None = None
    ctx_len: int = 4096
    timeout_s: float = 3600.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "pruning_rates", tuple(sorted({0.0, *map(float, self.pruning_rates)})))
        if self.rounds < 1 or self.new_tokens < 1:
            raise ValueError(f"--rounds and --new-tokens must be >= 1, got {self.rounds} and {self.new_tokens}")


@dataclass(frozen=True)
class Arm:
    """One runtime at one setting: ``rate`` is our video pruning rate or CDPruner's ratio / 100."""

    runtime: str  # OURS or OPENVINO
    variant: str  # our backend, or OpenVINO's FP32 / DEFAULT
    rate: float

    @property
    def label(self) -> str:
        if self.runtime == OURS:
            return f"{OURS} ({self.variant}) q {self.rate:g}"
        pruning = f"CDPruner {round(self.rate * 100)}" if self.rate else "unpruned"
        return f"{OPENVINO} {self.variant} {pruning}"


@dataclass
class ArmResult:
    arm: Arm
    replies: list[dict] = field(default_factory=list)  # the measured rounds' replies
    failure: str | None = None

    def summary(self) -> dict:
        out = {"label": self.arm.label, **asdict(self.arm), "failure": self.failure}
        if self.replies:
            last = self.replies[-1]
            out.update({key: median([r[key] for r in self.replies]) for key in ("ttft_s", "total_s", "cpu_s")})
            visions = [r.get("vision_s") for r in self.replies]
            out["vision_s"] = median(visions) if None not in visions else None
            out.update(ttft_samples=[r["ttft_s"] for r in self.replies], ids=last["ids"],
                       prompt_tokens=last["prompt_tokens"], kept_tokens=last.get("kept_tokens"),
                       same_ids_every_round=all(r["ids"] == last["ids"] for r in self.replies))
        return out


def openvino_python(given: str | Path | None, workdir: Path, progress: Progress) -> Path:
    """``--openvino-python`` (or $QEFF_EVS_OPENVINO_PYTHON), else the side environment under ``workdir``, built there
    the first time (a few minutes: ``OPENVINO_PACKAGES``)."""
    value = given or os.environ.get(OPENVINO_PYTHON_ENV)
    if value:
        path = Path(value)
        if not path.is_file() or not os.access(path, os.X_OK):
            raise ValueError(f"--openvino-python {value}: no executable Python there; give the Python of an "
                             f"environment with openvino-genai and optimum-intel (or leave it out: one is built)")
        return path
    venv = workdir / "openvino-venv"
    python = venv / "bin" / "python"
    if python.is_file() and subprocess.run([str(python), "-c", "import openvino_genai, optimum.intel"],
                                           capture_output=True).returncode == 0:
        return python
    progress(f"building OpenVINO GenAI's side environment in {venv} (a few minutes; log: {venv}.log)")
    with open(f"{venv}.log", "w") as log:
        for command in ([sys.executable, "-m", "venv", "--clear", str(venv)],
                        [str(python), "-m", "pip", "install", "-q", TORCH_PIN],
                        [str(python), "-m", "pip", "install", "-q", *OPENVINO_PACKAGES, TORCH_PIN],
                        [str(python), "-m", "pip", "uninstall", "-q", "-y", "torchvision"]):
            if subprocess.run(command, stdout=log, stderr=subprocess.STDOUT).returncode != 0:
                raise ValueError(f"building OpenVINO GenAI's environment failed at `{' '.join(command)}`; see "
                                 f"{venv}.log, or give one with --openvino-python")
    return python


def convert_checkpoint(python: Path, checkpoint: Path, out: Path, progress: Progress, timeout_s: float) -> Path:
    """optimum-intel's conversion of ``checkpoint`` to OpenVINO IR with fp32 weights (kept when already there)."""
    if (out / "openvino_language_model.xml").is_file():
        return out
    progress(f"optimum-cli export openvino of {checkpoint} (log: {out}.log)")
    with open(f"{out}.log", "w") as log:
        code = subprocess.run([str(python), "-m", "optimum.commands.optimum_cli", "export", "openvino", "--model",
                               str(checkpoint), "--task", "image-text-to-text", "--weight-format", "fp32", str(out)],
                              stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s).returncode
    if code != 0:
        raise ValueError(f"optimum-cli could not convert {checkpoint} (exit {code}); see {out}.log")
    return out


class Driver:
    """A child process answering one JSON request per line (``openvino_driver``, ``engine_driver``)."""

    def __init__(self, command: Sequence[str], log: Path, env: dict | None = None):
        self.log = open(log, "w")
        self.process = subprocess.Popen(list(command), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=self.log, text=True, env=env)
        self.ready = self._reply()

    def _reply(self) -> dict:
        for line in self.process.stdout:
            if line.startswith("{"):
                return json.loads(line)
        return {"error": f"the process exited {self.process.wait()} without a reply; see {self.log.name}"}

    def ask(self, request: dict) -> dict:
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        return self._reply()

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.log.close()


def build_checkpoint(config: VsOpenVinoConfig, family: str, folder: Path, progress: Progress) -> Path:
    """The compared checkpoint (kept when already written): released widths at the configured depths, fp32."""
    if (folder / "config.json").is_file():
        return folder
    if config.smoke:
        from qeff_evs.models.tiny import save_tiny_checkpoint

        return save_tiny_checkpoint(family, folder)
    import torch

    from qeff_evs.bench.checkpoint import write_random_checkpoint
    from qeff_evs.bench.realistic import realistic_config

    progress(f"random {family} checkpoint at released widths, {config.text_layers} text + {config.vision_layers} "
             f"vision layers, fp32")
    hf_config = realistic_config(family, text_layers=config.text_layers, vision_layers=config.vision_layers)
    return write_random_checkpoint(hf_config, family, folder, dtype=torch.float32, progress=progress)


def export_ours(config: VsOpenVinoConfig, checkpoint: Path, out: Path, progress: Progress) -> Path:
    """``qeff-evs export --target cpu`` at the clip's frames and size (every chunk as a CPU user would export it)."""
    from qeff_evs.export.pipeline import ExportOptions, export_checkpoint
    from qeff_evs.specializations import TARGETS

    cpu = TARGETS["cpu"]
    progress(f"qeff-evs export of {checkpoint} ({config.frames} frames, {config.size}x{config.size}, --target cpu)")
    export_checkpoint(checkpoint, out, ExportOptions(
        0.0, (config.frames,), ((config.size, config.size),), cpu.prefill_seq_len, config.ctx_len,
        comp_ctx_step=cpu.comp_ctx_step, weight_dtype=cpu.weight_dtype,
        max_video_pruning_rate=max(0.9, *config.pruning_rates)), progress=progress)
    return out


def arms_of(config: VsOpenVinoConfig, family: str) -> list[Arm]:
    ours = [Arm(OURS, backend, q) for backend in config.backends for q in config.pruning_rates]
    ratios = [q for q in config.pruning_rates if q > 0] if family in CDPRUNER_FAMILIES else []
    theirs = [Arm(OPENVINO, variant, r) for variant in (FP32, DEFAULT) for r in (0.0, *ratios)]
    return ours + theirs


def openvino_properties(variant: str, threads: int) -> dict:
    hints = {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32"} if variant == FP32 else {}
    return {"INFERENCE_NUM_THREADS": threads, **hints}


def request_for(arm: Arm, config: VsOpenVinoConfig, frames: Path) -> dict:
    if arm.runtime == OURS:
        return {"frames": str(frames), "fps": config.fps, "question": config.question,
                "max_new_tokens": config.new_tokens, "video_pruning_rate": arm.rate}
    return {"frames": str(frames), "prompt": config.question, "max_new_tokens": config.new_tokens,
            "pruning_ratio": round(arm.rate * 100)}


def compare_family(config: VsOpenVinoConfig, family: str, python: Path, workdir: Path, progress: Progress) -> dict:
    from qeff_evs.runtime.inputs.synthetic import moving_square_video

    folder = workdir / family
    folder.mkdir(parents=True, exist_ok=True)
    checkpoint = build_checkpoint(config, family, folder / "checkpoint", progress)
    converted = convert_checkpoint(python, checkpoint, folder / "openvino", progress, config.timeout_s)
    export = folder / "qeff_evs_export"
    if not (export / "manifest.json").is_file():
        export_ours(config, checkpoint, export, progress)
    frames = folder / "clip.npy"
    np.save(frames, moving_square_video(config.frames, config.size, config.size, seed=0))

    arms = arms_of(config, family)
    env = {**os.environ, "OMP_NUM_THREADS": str(config.threads)}
    drivers: dict[tuple[str, str], Driver] = {}
    for arm in arms:
        key = (arm.runtime, arm.variant)
        if key in drivers:
            continue
        progress(f"{family}: starting {arm.runtime} ({arm.variant})")
        command = ([sys.executable, "-m", "qeff_evs.bench.engine_driver", str(export), arm.variant]
                   if arm.runtime == OURS else
                   [str(python), str(OPENVINO_DRIVER), str(converted),
                    json.dumps(openvino_properties(arm.variant, config.threads))])
        drivers[key] = Driver(command, folder / f"{arm.runtime.split()[0]}-{arm.variant}.log", env)
    results = {arm: ArmResult(arm) for arm in arms}
    peaks = {key: driver.ready.get("peak_mb") for key, driver in drivers.items()}
    for arm, result in results.items():
        ready = drivers[(arm.runtime, arm.variant)].ready
        if "error" in ready:
            result.failure = ready["error"]
    try:
        for round_ in range(config.rounds + 1):
            for arm in alternating(arms, round_):
                result = results[arm]
                if result.failure:
                    continue
                reply = drivers[(arm.runtime, arm.variant)].ask(request_for(arm, config, frames))
                if "error" in reply:
                    result.failure = reply["error"]
                    progress(f"{family}: {arm.label}: {reply['error']}")
                    continue
                peaks[(arm.runtime, arm.variant)] = reply.get("peak_mb")  # VmHWM only grows: the latest is the peak
                if round_ > 0:
                    result.replies.append(reply)
                    progress(f"{family} round {round_}/{config.rounds}: {arm.label}: TTFT {reply['ttft_s']:.2f} s, "
                             f"{reply['prompt_tokens']} prompt tokens")
    finally:
        for driver in drivers.values():
            driver.close()
    arms_json = []
    for arm, result in results.items():
        summary = result.summary()
        summary["peak_mb"] = peaks[(arm.runtime, arm.variant)]
        arms_json.append(summary)
    return {"family": family, "checkpoint": str(checkpoint), "openvino_ir": str(converted), "export": str(export),
            "arms": arms_json, "verdict": verdict(arms_json, config)}


def verdict(arms: list[dict], config: VsOpenVinoConfig) -> dict:
    """The ratios docs/performance.md reads: TTFT of ours at q 0 over OpenVINO's unpruned fp32 and default runs, ours at each
    q > 0 over OpenVINO's fastest arm (any setting it accepts), peak memory, and whether the q = 0 tokens agree."""
    measured = [a for a in arms if a.get("ttft_s") is not None]

    def pick(runtime: str, variant: str | None, rate: float) -> dict | None:
        return next((a for a in measured if a["runtime"] == runtime and (variant is None or a["variant"] == variant)
                     and a["rate"] == rate), None)

    theirs = [a for a in measured if a["runtime"] == OPENVINO]
    fastest = min(theirs, key=lambda a: a["ttft_s"]) if theirs else None
    out: dict = {"fastest_openvino": fastest["label"] if fastest else None, "backends": {}}
    for backend in config.backends:
        ours0 = pick(OURS, backend, 0.0)
        entry: dict = {}
        for variant in (FP32, DEFAULT):
            theirs0 = pick(OPENVINO, variant, 0.0)
            if ours0 and theirs0:
                entry[f"ttft_q0_over_openvino_{variant}"] = ours0["ttft_s"] / theirs0["ttft_s"]
                entry[f"cpu_q0_over_openvino_{variant}"] = ours0["cpu_s"] / theirs0["cpu_s"]
                entry[f"peak_over_openvino_{variant}"] = ours0["peak_mb"] / theirs0["peak_mb"]
        reference = pick(OPENVINO, FP32, 0.0)
        if ours0 and reference:
            entry["q0_ids_equal_openvino_fp32"] = ours0["ids"] == reference["ids"]
            entry["q0_prompt_tokens_equal"] = ours0["prompt_tokens"] == reference["prompt_tokens"]
        for q in config.pruning_rates:
            ours_q = pick(OURS, backend, q)
            if q > 0 and ours_q and fastest:
                entry[f"ttft_q{q:g}_over_fastest_openvino"] = ours_q["ttft_s"] / fastest["ttft_s"]
        out["backends"][backend] = entry
    return out


def run_comparison(config: VsOpenVinoConfig, output: Path, workdir: Path, progress: Progress,
                   command: str = "") -> dict:
    from qeff_evs.bench.vs_openvino_report import save

    workdir.mkdir(parents=True, exist_ok=True)
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
    python = openvino_python(config.openvino_python, workdir, progress)
    version = subprocess.run([str(python), "-c", "import openvino_genai; print(openvino_genai.__version__)"],
                             capture_output=True, text=True).stdout.strip()
    families = [compare_family(config, family, python, workdir, progress) for family in config.families]
    results = {"config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(config).items()},
               "openvino_genai": version, "started_utc": started,
               "finished_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
               "cpu": cpu_name(), "bf16": cpu_has_bf16(), "load_average": [round(v, 2) for v in os.getloadavg()],
               "families": families, "command": command}
    save(results, output)
    return results


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def cpu_has_bf16() -> bool:
    """Whether the CPU has bf16 instructions, where OpenVINO's default computes in bf16."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags
