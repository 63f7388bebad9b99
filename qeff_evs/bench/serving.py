"""``qeff-evs bench --serving``: vLLM's own benchmark client against ``vllm serve`` over exports, one rate each.

For each ``(export, q)`` target: ``QEFF_EVS_BACKEND=ort vllm serve EXPORT --video-pruning-rate q`` on
127.0.0.1, then ``vllm bench serve --backend openai-chat --endpoint /v1/chat/completions --dataset-name
sharegpt`` over a local ShareGPT-style file whose entries carry local videos (vLLM's ShareGPT loader sends
an entry's ``"video"`` path as a ``file://`` ``video_url``; the server allows the folder with
``--allowed-local-media-path``), then the server stops. vLLM's client reports median and p99 TTFT, TPOT
and request throughput per target; the sweep puts them side by side (Markdown table and PNG).

Targets are a list of ``(export, q)`` pairs: today an export serves the rate it was made for, so the
default sweep exports one random checkpoint once per rate; an export that serves several rates can be
listed once per rate. The default checkpoint has Qwen2.5-VL-3B's hidden widths with 2 text and 2 vision
layers (prefill is a visible share of TTFT) and the tiny tokenizer's 512-token vocabulary, so that vLLM's
detokenizer knows every id a random model can emit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from qeff_evs.bench.server_process import free_port, stop, wait_healthy

Progress = Callable[[str], None]
SERVED_NAME = "qeff-evs"
METRICS = ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "request_throughput")


@dataclass(frozen=True)
class ServingTarget:
    """One export served at one pruning rate."""

    export: Path
    q: float


@dataclass(frozen=True)
class ServingLoad:
    """What vLLM's client sends: ``num_prompts`` chat requests, each a question about one of ``clips`` videos."""

    num_prompts: int = 12
    max_concurrency: int = 4
    output_len: int = 16
    clips: int = 4
    frames: int = 8
    frame_size: int = 448
    fps: int = 2
    seed: int = 0


def write_video(path: Path, frames: np.ndarray, fps, sound: np.ndarray | None = None, sound_rate: int = 16000
                ) -> Path:
    """Lossless (FFV1, RGB) Matroska, so the server's decoder sees exactly these pixels; ``sound``: a mono float32
    soundtrack beside them (32-bit float PCM, lossless too)."""
    import av

    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("ffv1", rate=fps)
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "bgr0"
        audio = None
        if sound is not None:
            audio = container.add_stream("pcm_f32le", rate=sound_rate, layout="mono")
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
        if audio is not None:
            samples = np.asarray(sound, dtype=np.float32).reshape(1, -1)
            for start in range(0, samples.shape[1], 1024):
                chunk = av.AudioFrame.from_ndarray(np.ascontiguousarray(samples[:, start:start + 1024]),
                                                   format="flt", layout="mono")
                chunk.sample_rate, chunk.pts = sound_rate, start
                container.mux(audio.encode(chunk))
            container.mux(audio.encode())
    return path


def write_sharegpt_videos(path: Path, clips: Sequence[Path], count: int,
                          answer: str = "A square moves across the frame.") -> Path:
    """A ShareGPT-style JSON list for ``vllm bench serve --dataset-name sharegpt``: ``count`` entries, each a
    human question and a reference answer (its token count is the output length unless
    ``--sharegpt-output-len``), with ``"video"`` naming a local clip (round robin over ``clips``)."""
    entries = [{"id": f"clip-{n}", "video": str(Path(clips[n % len(clips)]).resolve()),
                "conversations": [{"from": "human", "value": f"Question {n}: what happens in this video, and why?"},
                                  {"from": "gpt", "value": answer}]}
               for n in range(count)]
    path.write_text(json.dumps(entries, indent=1))
    return path


def serve_command(target: ServingTarget, port: int, media: Path, max_num_seqs: int) -> list[str]:
    return [str(Path(sys.executable).with_name("vllm")), "serve", str(target.export), "--host", "127.0.0.1",
            "--port", str(port), "--video-pruning-rate", str(target.q), "--max-num-seqs", str(max_num_seqs),
            "--served-model-name", SERVED_NAME, "--allowed-local-media-path", str(Path(media).resolve())]


def bench_command(target: ServingTarget, port: int, dataset: Path, load: ServingLoad, result: Path) -> list[str]:
    return [str(Path(sys.executable).with_name("vllm")), "bench", "serve", "--model", str(target.export),
            "--served-model-name", SERVED_NAME, "--backend", "openai-chat", "--endpoint", "/v1/chat/completions",
            "--host", "127.0.0.1", "--port", str(port), "--dataset-name", "sharegpt", "--dataset-path", str(dataset),
            "--num-prompts", str(load.num_prompts), "--sharegpt-output-len", str(load.output_len),
            "--max-concurrency", str(load.max_concurrency), "--seed", str(load.seed), "--ignore-eos",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
            "--save-result", "--result-dir", str(result.parent), "--result-filename", result.name]


def bench_target(target: ServingTarget, dataset: Path, media: Path, load: ServingLoad, folder: Path,
                 progress: Progress, max_num_seqs: int = 4, start_timeout_s: float = 600) -> dict:
    """Serve ``target``, run vLLM's client against it, stop the server: vLLM's result JSON (plus the target)."""
    port, name = free_port(), f"q{target.q:g}"
    log = folder / f"serve_{name}.log"
    env = dict(os.environ, QEFF_EVS_BACKEND="ort")
    with open(log, "w") as out:
        process = subprocess.Popen(serve_command(target, port, media, max_num_seqs), stdout=out,
                                   stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        progress(f"q={target.q:g}: starting vllm serve {target.export}")
        wait_healthy(port, process, start_timeout_s, log)
        result = folder / f"bench_{name}.json"
        progress(f"q={target.q:g}: vllm bench serve, {load.num_prompts} requests at concurrency {load.max_concurrency}")
        load_before = os.getloadavg()[0]
        done = subprocess.run(bench_command(target, port, dataset, load, result), env=env, capture_output=True,
                              text=True)
        machine_load = (load_before, os.getloadavg()[0])
        (folder / f"bench_{name}.log").write_text(done.stdout + done.stderr)
        if done.returncode != 0 or not result.is_file():
            raise RuntimeError(f"vllm bench serve failed ({done.returncode}):\n{(done.stdout + done.stderr)[-4000:]}")
    finally:
        stop(process)
    measured = json.loads(result.read_text())
    # The 1-minute load average when the client started and ended: other programs' work shows in the latencies.
    return dict(target=dict(export=str(target.export), q=target.q), load_average=machine_load, **measured)


def serving_checkpoint(family: str, folder: Path, seed: int = 0, text_layers: int = 2, vision_layers: int = 2) -> Path:
    """A random checkpoint folder with the released model's hidden widths, 2 + 2 layers unless told, the tiny
    tokenizer."""
    from qeff_evs.models.registry import family_class
    from qeff_evs.models.tiny import save_tiny_checkpoint

    text, vision = family_class(family).realistic_widths(text_layers=text_layers, vision_layers=vision_layers)
    # The tiny tokenizer sets the vocabulary (and so the tied head); the long RoPE table serves long prompts.
    text = {k: v for k, v in text.items() if k not in ("vocab_size", "tie_word_embeddings")}
    text["max_position_embeddings"] = max(8192, text.get("max_position_embeddings", 0) or 0)
    return save_tiny_checkpoint(family, folder, seed=seed, text_config=text, vision_config=vision)


def export_targets(checkpoint: Path, folder: Path, rates: Sequence[float], load: ServingLoad,
                   progress: Progress, prefill_seq_len: int = 128, ctx_len: int = 4096) -> list[ServingTarget]:
    """One export of ``checkpoint`` per rate (frames and size of the load's clips, 4 KV rows)."""
    from qeff_evs.export.pipeline import ExportOptions, export_checkpoint

    targets = []
    for q in rates:
        out = folder / f"export_q{q:g}"
        if not (out / "manifest.json").is_file():
            progress(f"exporting {checkpoint} at q={q:g}")
            options = ExportOptions(q, (load.frames,), ((load.frame_size, load.frame_size),), prefill_seq_len, ctx_len,
                                    full_batch_size=4)
            export_checkpoint(checkpoint, out, options, progress=lambda m: None)
        targets.append(ServingTarget(out, q))
    return targets


def run_serving_sweep(targets: Sequence[ServingTarget], folder: Path, load: ServingLoad,
                      progress: Progress) -> list[dict]:
    """The load's clips and dataset under ``folder``, then every target in turn."""
    from qeff_evs.runtime.inputs.synthetic import moving_square_video

    folder.mkdir(parents=True, exist_ok=True)
    media = folder / "media"
    media.mkdir(exist_ok=True)
    clips = [write_video(media / f"clip{n}.mkv", moving_square_video(load.frames, load.frame_size, load.frame_size,
                                                                       seed=load.seed + n), load.fps)
             for n in range(load.clips)]
    dataset = write_sharegpt_videos(folder / "sharegpt_videos.json", clips, load.num_prompts)
    return [bench_target(t, dataset, media, load, folder, progress) for t in targets]


def serving_markdown(results: Sequence[dict], load: ServingLoad) -> str:
    lines = [f"{load.num_prompts} requests ({load.frames} frames {load.frame_size}x{load.frame_size}, {load.output_len} "
             f"new tokens each) at concurrency {load.max_concurrency}, `vllm bench serve` (sharegpt, openai-chat):", "",
             "| q | completed / failed | median TTFT ms | p99 TTFT ms | median TPOT ms | p99 TPOT ms | requests/s | "
             "load average (start, end) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        start, end = r.get("load_average", (float("nan"), float("nan")))
        lines.append(f"| {r['target']['q']:g} | {r['completed']} / {r['failed']} | {r['median_ttft_ms']:.0f} | "
                     f"{r['p99_ttft_ms']:.0f} | {r['median_tpot_ms']:.0f} | {r['p99_tpot_ms']:.0f} | "
                     f"{r['request_throughput']:.3f} | {start:.1f}, {end:.1f} |")
    return "\n".join(lines)


def plot_serving(results: Sequence[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    qs = [r["target"]["q"] for r in results]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    for ax, (title, keys) in zip(axes, (("TTFT (ms)", ("median_ttft_ms", "p99_ttft_ms")),
                                         ("TPOT (ms)", ("median_tpot_ms", "p99_tpot_ms")),
                                         ("requests / s", ("request_throughput",)))):
        for key in keys:
            ax.plot(qs, [r[key] for r in results], marker="o", label=key.split("_")[0])
        ax.set_xlabel("video pruning rate q")
        ax.set_title(title)
        ax.set_ylim(bottom=0)
        if len(keys) > 1:
            ax.legend()
    fig.suptitle("vllm bench serve over qeff-evs exports (ONNX Runtime, CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def save_serving(results: Sequence[dict], load: ServingLoad, output: Path) -> list[Path]:
    output.mkdir(parents=True, exist_ok=True)
    kept = [{k: r[k] for k in ("target", "completed", "failed", "duration", "load_average", *METRICS)} for r in results]
    files = [output / "serving.json", output / "serving.md"]
    files[0].write_text(json.dumps(dict(load=asdict(load), results=kept), indent=2) + "\n")
    files[1].write_text(serving_markdown(results, load) + "\n")
    files.append(plot_serving(results, output / "serving.png"))
    return files
