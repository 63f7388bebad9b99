"""Prefill/decode disaggregation through vllm-router: what a hand-over moves, how long it takes, and what it spares a
running request's decode.

One export of a random checkpoint at a released model's widths with few layers (default: Qwen2.5-VL-3B's, 4 text +
4 vision layers, 4 KV rows, ctx 4096, a 16-frame 448x448 clip) is served three ways, one after the other:

1. **Hand-over against q.** A prefill instance (``kv_producer``, pinned to core 0 with ``taskset``) and a decode
   instance (``kv_consumer``, core 1) behind ``vllm-router --vllm-pd-disaggregation``; the clip at each q of
   ``--rates`` (per-request ``mm_processor_kwargs``): the prompt's tokens, the bytes handed over (the instances'
   own log lines: arrays and wire bytes), the prefill instance's copy, the decode instance's pull (connect, send,
   parse) and write, against the kept tokens.
2. **Decode stall, P/D.** The same two instances: request A (text, ``--decode-tokens`` tokens, streamed) decodes on
   the decode instance; once it has streamed 8 tokens, request B (the clip at q = 0, one token) arrives and runs its
   prompt on the prefill instance. A's gaps between tokens before, during and after B.
3. **Decode stall, colocated.** One instance (both cores) behind the router, the same A and B: B's prefill chunks
   share each step with A's decode.

Heavy and timed: run it alone, under the shared lock.

    flock /tmp/qeff-heavy.lock .venv/bin/python benchmarks/pd_handover.py --workdir /tmp/pd \\
        -o benchmarks/results/pd_handover

writes ``pd_handover.json``, ``.md`` and ``.png`` (the export is kept in ``--workdir`` for a rerun).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conversation_reuse import clips, prepare_export, video_part  # noqa: E402

from qeff_evs.bench.server_process import free_port, start_router, stop, wait_healthy  # noqa: E402

SERVED_NAME = "qeff-evs"
KV_LINE = {
    "kept": re.compile(r"handing over (\S+): (\d+) tokens, (\d+) bytes \(arrays (\d+) B; ([0-9.]+) ms to copy\)"),
    "received": re.compile(r"received (\S+): (\d+) tokens, (\d+) bytes into row \d+ \(pulled in ([0-9.]+) ms, "
                           r"([0-9.]+) ms to write\)"),
}


def serve(export: Path, workdir: Path, name: str, cores: str, flags: list[str], rows: int):
    """``taskset -c CORES vllm serve EXPORT FLAGS`` on a free port, once healthy: (process, url, log)."""
    port = free_port()
    log = workdir / f"serve_{name}.log"
    argv = ["taskset", "-c", cores, str(Path(sys.executable).with_name("vllm")), "serve", str(export), "--host",
            "127.0.0.1", "--port", str(port), "--max-num-seqs", str(rows), "--served-model-name", SERVED_NAME,
            "--trust-request-mm-kwargs", *flags]
    with open(log, "w") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                   env=dict(os.environ, QEFF_EVS_BACKEND="ort"))
    wait_healthy(port, process, 1200, log)
    return process, f"http://127.0.0.1:{port}", log


def kv_flags(role: str) -> list[str]:
    return ["--kv-transfer-config", json.dumps({"kv_connector": "QeffEvsKVConnector", "kv_role": role})]


def video_request(clip: Path, rate: float, max_tokens: int = 1) -> dict:
    return {"model": SERVED_NAME, "temperature": 0, "max_tokens": max_tokens, "return_token_ids": True,
            "messages": [{"role": "user", "content": [video_part(clip), {"type": "text",
                                                                         "text": "What happens in this video?"}]}],
            "mm_processor_kwargs": {"video_pruning_rate": rate}}


def post(url: str, body: dict) -> dict:
    import requests

    reply = requests.post(f"{url}/v1/chat/completions", json=body, timeout=3600)
    reply.raise_for_status()
    return reply.json()


def log_lines(log: Path, kind: str) -> list[tuple]:
    return KV_LINE[kind].findall(log.read_text(errors="replace"))


def handover_sweep(router: str, p_log: Path, d_log: Path, clip: Path, rates: list[float]) -> list[dict]:
    rows = []
    for rate in rates:
        before_p, before_d = len(log_lines(p_log, "kept")), len(log_lines(d_log, "received"))
        started = time.perf_counter()
        reply = post(router, video_request(clip, rate, max_tokens=2))
        wall = time.perf_counter() - started
        [(_, tokens, wire, arrays, copy_ms)] = log_lines(p_log, "kept")[before_p:]
        [(_, _, _, pull_ms, write_ms)] = log_lines(d_log, "received")[before_d:]
        rows.append(dict(rate=rate, prompt_tokens=len(reply["prompt_token_ids"]), handed_tokens=int(tokens),
                         array_bytes=int(arrays), wire_bytes=int(wire), copy_ms=float(copy_ms),
                         pull_ms=float(pull_ms), write_ms=float(write_ms), request_s=wall))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def stream_times(url: str, body: dict, times: list[float], started: threading.Event) -> None:
    """Stream ``body``; append each token's arrival time (monotonic); set ``started`` after 8 tokens."""
    import requests

    with requests.post(f"{url}/v1/chat/completions", json={**body, "stream": True}, stream=True,
                       timeout=3600) as reply:
        for line in reply.iter_lines():
            if not line.startswith(b"data: {"):
                continue
            ids = json.loads(line[6:])["choices"][0].get("token_ids") or []
            now = time.monotonic()
            times.extend([now] * len(ids))
            if len(times) >= 8:
                started.set()


def decode_stall(url: str, clip: Path, decode_tokens: int) -> dict:
    """A decodes; B (a long video prompt) arrives after A's 8th token: A's gaps, B's time to its answer."""
    times: list[float] = []
    started = threading.Event()
    a = {"model": SERVED_NAME, "temperature": 0, "max_tokens": decode_tokens, "ignore_eos": True,
         "return_token_ids": True, "messages": [{"role": "user", "content": "Tell me a long story."}]}
    thread = threading.Thread(target=stream_times, args=(url, a, times, started))
    thread.start()
    started.wait(600)
    b_start = time.monotonic()
    reply = post(url, video_request(clip, 0.0))
    b_end = time.monotonic()
    thread.join()
    gaps = [(t1 - t0, t1) for t0, t1 in zip(times, times[1:]) if t1 > t0]
    before = [g for g, t in gaps if t <= b_start]
    during = [g for g, t in gaps if b_start < t <= b_end + 0.5]
    after = [g for g, t in gaps if t > b_end + 0.5]
    median_before = statistics.median(before) if before else None
    return dict(b_prompt_tokens=len(reply["prompt_token_ids"]), b_seconds=b_end - b_start,
                a_tokens=len(times), a_gap_before_ms=1e3 * median_before if median_before else None,
                a_gap_max_during_ms=1e3 * max(during) if during else None,
                a_gap_mean_during_ms=1e3 * statistics.mean(during) if during else None,
                a_gap_after_ms=1e3 * statistics.median(after) if after else None,
                a_tokens_during=len(during),
                a_stalled_s=sum(g - median_before for g in during) if during and median_before else None)


def markdown(result: dict) -> str:
    s = result["setup"]
    lines = [f"Prefill/decode hand-over through vllm-router ({s['family']} widths, {s['text_layers']} text + "
             f"{s['vision_layers']} vision layers, {s['frames']} frames {s['size']}x{s['size']}, ONNX Runtime fp32, "
             "prefill instance on core 0, decode instance on core 1, this 2-core machine)", "",
             "| q | prompt tokens | handed over (tokens) | arrays (bytes) | wire (bytes) | bytes/token | P copy ms | "
             "D pull ms | D write ms |", "|---|---|---|---|---|---|---|---|---|"]
    for r in result["handover"]:
        lines.append(f"| {r['rate']} | {r['prompt_tokens']} | {r['handed_tokens']} | {r['array_bytes']:,} | "
                     f"{r['wire_bytes']:,} | {r['array_bytes'] / r['handed_tokens']:,.0f} | {r['copy_ms']:.1f} | "
                     f"{r['pull_ms']:.1f} | {r['write_ms']:.1f} |")
    lines += ["", "A running request's decode (A, text, streamed) when a long video prompt (B, q = 0) arrives:", "",
              "| deployment | B prompt tokens | B seconds | A gap before (ms) | A max gap during B (ms) | "
              "A mean gap during B (ms) | A tokens during B | A stalled (s) |", "|---|---|---|---|---|---|---|---|"]
    for name, r in result["stall"].items():
        def f(v, spec=".0f"):
            return "-" if v is None else format(v, spec)
        lines.append(f"| {name} | {r['b_prompt_tokens']} | {r['b_seconds']:.1f} | {f(r['a_gap_before_ms'])} | "
                     f"{f(r['a_gap_max_during_ms'])} | {f(r['a_gap_mean_during_ms'])} | {r['a_tokens_during']} | "
                     f"{f(r['a_stalled_s'], '.1f')} |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["handover"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot([r["rate"] for r in rows], [r["array_bytes"] / 1e6 for r in rows], "o-", label="handed over (MB)")
    left.set_xlabel("video pruning rate q")
    left.set_ylabel("MB from prefill to decode instance")
    twin = left.twinx()
    twin.plot([r["rate"] for r in rows], [r["handed_tokens"] for r in rows], "s--", color="grey", label="tokens")
    twin.set_ylabel("tokens handed over")
    left.set_title("hand-over per request against q")
    names = list(result["stall"])
    right.bar(names, [result["stall"][n]["a_gap_max_during_ms"] or 0 for n in names])
    right.set_ylabel("longest gap between A's tokens while B prefills (ms)")
    right.set_title("a running decode when a long video prompt arrives")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("-o", "--output", type=Path, required=True, help="output path without suffix")
    parser.add_argument("--family", default="qwen2_5_vl")
    parser.add_argument("--text-layers", type=int, default=4)
    parser.add_argument("--vision-layers", type=int, default=4)
    parser.add_argument("--frames", type=int, default=16)
    parser.add_argument("--size", type=int, default=448)
    parser.add_argument("--rates", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 0.9])
    parser.add_argument("--decode-tokens", type=int, default=160)
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    rows = 4
    export = prepare_export(args.workdir, args.family, args.text_layers, args.vision_layers, args.frames, args.size,
                            rows, 0.0)
    [clip] = clips(args.workdir, 1, args.frames, args.size)
    result = dict(setup=dict(family=args.family, text_layers=args.text_layers, vision_layers=args.vision_layers,
                             frames=args.frames, size=args.size, rows=rows, cpu_count=os.cpu_count()),
                  stall={})
    processes = []
    try:
        p = serve(export, args.workdir, "prefill", "0", kv_flags("kv_producer"), rows)
        processes.append(p[0])
        d = serve(export, args.workdir, "decode", "1", kv_flags("kv_consumer"), rows)
        processes.append(d[0])
        router, url = start_router(["--vllm-pd-disaggregation", "--prefill", p[1], "--decode", d[1]],
                                   args.workdir / "router_pd.log")
        processes.append(router)
        post(url, video_request(clip, 0.9, 2))  # warm up both instances
        result["handover"] = handover_sweep(url, p[2], d[2], clip, args.rates)
        result["stall"]["P/D (core 0 / core 1)"] = decode_stall(url, clip, args.decode_tokens)
        print(json.dumps(result["stall"]), flush=True)
    finally:
        for process in reversed(processes):
            stop(process)
    processes = []
    try:
        one = serve(export, args.workdir, "colocated", "0,1", [], rows)
        processes.append(one[0])
        router, url = start_router(["--worker-urls", one[1]], args.workdir / "router_one.log")
        processes.append(router)
        post(url, video_request(clip, 0.9, 2))
        result["stall"]["colocated (cores 0,1)"] = decode_stall(url, clip, args.decode_tokens)
        print(json.dumps(result["stall"]), flush=True)
    finally:
        for process in reversed(processes):
            stop(process)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    args.output.with_suffix(".md").write_text(markdown(result))
    plot(result, args.output.with_suffix(".png"))
    print(markdown(result))


if __name__ == "__main__":
    main()
