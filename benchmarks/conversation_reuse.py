"""Row reuse through ``vllm serve``: a follow-up's time to first token against turn 1's, and its tokens against a
server that reuses nothing.

One export of a random checkpoint at a released model's widths with few layers (default: Qwen2.5-VL-3B's, 4 text +
4 vision layers, 2 KV rows, 16 frames 448x448) is served twice, one server after the other: with row reuse (vLLM's
prefix caching, on by default) and with ``--no-enable-prefix-caching``. Each server gets, through the OpenAI API
(streamed, so the first token's arrival is timed):

* one conversation: turn 1 (a video and a question), then the follow-up (the same video, turn 1's answer and a new
  question);
* four conversations at once on the export's two rows: every turn 1 at once, then every follow-up at once (rows are
  reused where a conversation's row still holds it, recomputed where another conversation took it).

The reused server's follow-ups must give the tokens the reuse-off server gives for the same messages (exact, greedy),
and ``usage.prompt_tokens_details.cached_tokens`` says how much each reused. Heavy: run under the shared lock.

    flock /tmp/qeff-heavy.lock .venv/bin/python benchmarks/conversation_reuse.py --workdir /tmp/reuse \\
        -o benchmarks/results/conversation_reuse

writes ``conversation_reuse.json``, ``.md`` and ``.png`` (the export is kept in ``--workdir`` for a rerun).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from qeff_evs.bench.server_process import free_port, stop, wait_healthy

SERVED_NAME = "qeff-evs"
QUESTIONS = ("What happens in this video?", "And what colour is the moving square?")


def prepare_export(workdir: Path, family: str, text_layers: int, vision_layers: int, frames: int, size: int,
                   rows: int, rate: float) -> Path:
    """The checkpoint (released widths, few layers, the tiny tokenizer) and its export, made once per workdir."""
    from qeff_evs.bench.serving import serving_checkpoint
    from qeff_evs.export.pipeline import ExportOptions, export_checkpoint

    export = workdir / f"export_{family}_{text_layers}x{vision_layers}_rows{rows}"
    if not (export / "manifest.json").is_file():
        checkpoint = serving_checkpoint(family, workdir / f"checkpoint_{family}_{text_layers}x{vision_layers}",
                                        text_layers=text_layers, vision_layers=vision_layers)
        print(f"exporting {checkpoint} -> {export}", flush=True)
        export_checkpoint(checkpoint, export, ExportOptions(rate, (frames,), ((size, size),), 128, 4096,
                                                            full_batch_size=rows), progress=lambda m: None)
    return export


def clips(workdir: Path, count: int, frames: int, size: int) -> list[Path]:
    from qeff_evs.bench.serving import write_video
    from qeff_evs.runtime.inputs.synthetic import moving_square_video

    media = workdir / "media"
    media.mkdir(parents=True, exist_ok=True)
    return [write_video(media / f"clip{n}_{frames}x{size}.mkv", moving_square_video(frames, size, size, seed=n), 2)
            for n in range(count)]


def video_part(path: Path) -> dict:
    url = "data:video/x-matroska;base64," + base64.b64encode(path.read_bytes()).decode()
    return {"type": "video_url", "video_url": {"url": url}}


def turn_1(path: Path) -> list[dict]:
    return [{"role": "user", "content": [video_part(path), {"type": "text", "text": QUESTIONS[0]}]}]


def follow_up(path: Path, answer: str) -> list[dict]:
    return [*turn_1(path), {"role": "assistant", "content": answer}, {"role": "user", "content": QUESTIONS[1]}]


def timed_chat(client, messages: list[dict], max_tokens: int, salt: str | None = None) -> dict:
    """A streamed greedy chat completion: its tokens, text, time to first token and usage (``salt``: vLLM's
    ``cache_salt``; another salt than the conversation's reuses nothing)."""
    start = time.perf_counter()
    first, tokens, text, usage = None, [], [], None
    extra = {"return_token_ids": True} if salt is None else {"return_token_ids": True, "cache_salt": salt}
    stream = client.chat.completions.create(model=SERVED_NAME, messages=messages, temperature=0, max_tokens=max_tokens,
                                            stream=True, stream_options={"include_usage": True}, extra_body=extra)
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            ids = getattr(choice, "token_ids", None) or []
            if ids and first is None:
                first = time.perf_counter() - start
            tokens += ids
            text.append(choice.delta.content or "")
    details = usage.prompt_tokens_details
    return dict(ttft_s=first, e2e_s=time.perf_counter() - start, token_ids=tokens, text="".join(text),
                prompt_tokens=usage.prompt_tokens, cached_tokens=(details.cached_tokens if details else 0) or 0)


def serve(export: Path, workdir: Path, name: str, flags: list[str], rate: float, rows: int):
    port = free_port()
    log = workdir / f"serve_{name}.log"
    argv = [str(Path(sys.executable).with_name("vllm")), "serve", str(export), "--host", "127.0.0.1", "--port",
            str(port), "--video-pruning-rate", str(rate), "--max-num-seqs", str(rows), "--served-model-name",
            SERVED_NAME, "--enable-prompt-tokens-details", *flags]
    with open(log, "w") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                   env=dict(os.environ, QEFF_EVS_BACKEND="ort"))
    wait_healthy(port, process, 900, log)
    return process, port


def conversations(port: int, videos: list[Path], answers: list[str] | None, max_tokens: int) -> dict:
    """One conversation alone, then all of ``videos`` at once; ``answers``: turn 1's answers to use in the
    follow-ups (the reused server's, so both servers get the same follow-up messages), else this server's own."""
    from openai import OpenAI

    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=1800, max_retries=0)
    timed_chat(client, [{"role": "user", "content": "warm up"}], 2)
    alone_1 = timed_chat(client, turn_1(videos[0]), max_tokens)
    answer = alone_1["text"] if answers is None else answers[0]
    alone_2 = timed_chat(client, follow_up(videos[0], answer), max_tokens)
    # The same follow-up right after, under another cache_salt: computed from its start on the same server, seconds
    # apart (the video's encoder output may still be in vLLM's encoder cache, as for a server without reuse).
    salted = timed_chat(client, follow_up(videos[0], answer), max_tokens, salt="another conversation")
    with ThreadPoolExecutor(len(videos)) as pool:
        firsts = list(pool.map(lambda v: timed_chat(client, turn_1(v), max_tokens), videos))
        texts = [f["text"] for f in firsts] if answers is None else answers[1:]
        seconds = list(pool.map(lambda va: timed_chat(client, follow_up(*va), max_tokens), zip(videos, texts)))
    return dict(alone=dict(turn_1=alone_1, follow_up=alone_2, follow_up_other_salt=salted),
                together=dict(turn_1=firsts, follow_up=seconds))


def markdown(result: dict) -> str:
    on, off, setup = result["reuse"], result["no_reuse"], result["setup"]
    lines = [f"Row reuse through `vllm serve` ({setup['family']} widths, {setup['text_layers']} text + "
             f"{setup['vision_layers']} vision layers, {setup['rows']} KV rows, {setup['frames']} frames "
             f"{setup['size']}x{setup['size']}, q {setup['rate']}, ORT on CPU; {setup['machine']}).", "",
             "| request | reuse: TTFT s | cached / prompt tokens | no reuse: TTFT s | same tokens |",
             "|---|---|---|---|---|"]

    def row(label: str, a: dict, b: dict) -> str:
        return (f"| {label} | {a['ttft_s']:.2f} | {a['cached_tokens']} / {a['prompt_tokens']} | {b['ttft_s']:.2f} | "
                f"{'yes' if a['token_ids'] == b['token_ids'] else 'NO'} |")

    lines.append(row("one conversation, turn 1", on["alone"]["turn_1"], off["alone"]["turn_1"]))
    lines.append(row("one conversation, follow-up", on["alone"]["follow_up"], off["alone"]["follow_up"]))
    salted = "follow_up_other_salt" in on["alone"]  # measured since the second run
    if salted:
        lines.append(row("the same follow-up again, another cache_salt", on["alone"]["follow_up_other_salt"],
                         off["alone"]["follow_up_other_salt"]))
    for n, (a, b) in enumerate(zip(on["together"]["turn_1"], off["together"]["turn_1"])):
        lines.append(row(f"4 at once on {setup['rows']} rows, #{n} turn 1", a, b))
    for n, (a, b) in enumerate(zip(on["together"]["follow_up"], off["together"]["follow_up"])):
        lines.append(row(f"4 at once on {setup['rows']} rows, #{n} follow-up", a, b))
    alone = on["alone"]
    same_server = (f"; the reused follow-up / the same follow-up computed from its start seconds later on the same "
                   f"server (another cache_salt) {alone['follow_up']['ttft_s'] / alone['follow_up_other_salt']['ttft_s']:.3f}"
                   f" ({alone['follow_up_other_salt']['ttft_s']:.2f} s)") if salted else ""
    lines += ["", f"One conversation, reuse on: follow-up TTFT / turn 1 TTFT "
              f"{alone['follow_up']['ttft_s'] / alone['turn_1']['ttft_s']:.3f} "
              f"({alone['follow_up']['ttft_s']:.2f} s / {alone['turn_1']['ttft_s']:.2f} s){same_server}. Reuse off: "
              f"follow-up / turn 1 {off['alone']['follow_up']['ttft_s'] / off['alone']['turn_1']['ttft_s']:.3f}. "
              "TTFTs at once include the wait for a free row (2 rows, 4 conversations)."]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    on, off = result["reuse"], result["no_reuse"]
    alone = ("turn_1", "follow_up", "follow_up_other_salt")[:3 if "follow_up_other_salt" in on["alone"] else 2]
    labels = ["alone: turn 1", "alone: follow-up", "alone: follow-up, other salt"][:len(alone)] + [
        f"at once #{n}: follow-up" for n in range(len(on["together"]["follow_up"]))]
    values_on = [on["alone"][k]["ttft_s"] for k in alone] + [r["ttft_s"] for r in on["together"]["follow_up"]]
    values_off = [off["alone"][k]["ttft_s"] for k in alone] + [r["ttft_s"] for r in off["together"]["follow_up"]]
    fig, ax = plt.subplots(figsize=(9, 4))
    at = range(len(labels))
    ax.bar([x - 0.2 for x in at], values_on, 0.4, label="row reuse (default)")
    ax.bar([x + 0.2 for x in at], values_off, 0.4, label="--no-enable-prefix-caching")
    ax.set_xticks(list(at), labels, rotation=20, ha="right")
    ax.set_ylabel("time to first token (s)")
    ax.set_title("Follow-ups through vllm serve, with and without row reuse")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("-o", "--output", type=Path, required=True, help="path stem of the .json / .md / .png")
    parser.add_argument("--family", default="qwen2_5_vl")
    parser.add_argument("--text-layers", type=int, default=4)
    parser.add_argument("--vision-layers", type=int, default=4)
    parser.add_argument("--frames", type=int, default=16)
    parser.add_argument("--size", type=int, default=448)
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--rate", type=float, default=0.5)
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    export = prepare_export(args.workdir, args.family, args.text_layers, args.vision_layers, args.frames, args.size,
                            args.rows, args.rate)
    videos = clips(args.workdir, args.conversations, args.frames, args.size)
    result = dict(setup=dict(family=args.family, text_layers=args.text_layers, vision_layers=args.vision_layers,
                             rows=args.rows, frames=args.frames, size=args.size, rate=args.rate,
                             max_tokens=args.max_tokens, load_average_before=os.getloadavg()[0]))
    for name, flags in (("reuse", []), ("no_reuse", ["--no-enable-prefix-caching"])):
        process, port = serve(export, args.workdir, name, flags, args.rate, args.rows)
        try:
            print(f"{name}: conversations", flush=True)
            answers = None
            if name == "no_reuse":  # the same follow-up messages as the reused server's
                reused = result["reuse"]
                answers = [reused["alone"]["turn_1"]["text"]] + [t["text"] for t in reused["together"]["turn_1"]]
            result[name] = conversations(port, videos, answers, args.max_tokens)
        finally:
            stop(process)
    result["setup"]["load_average_after"] = os.getloadavg()[0]
    result["setup"]["machine"] = (f"shared 2-core machine, 1-min load {result['setup']['load_average_before']:.1f} "
                                  f"before, {result['setup']['load_average_after']:.1f} after")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.with_suffix(".json").write_text(json.dumps(result, indent=1))
    args.output.with_suffix(".md").write_text(markdown(result))
    plot(result, args.output.with_suffix(".png"))
    print(markdown(result))


if __name__ == "__main__":
    main()
