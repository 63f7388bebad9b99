"""Bytes an encoder instance ships per video in vLLM's encoder disaggregation, at each pruning rate.

For every ``EXPORT:Q`` pair, starts one encoder instance of that export (``vllm serve EXPORT
--video-pruning-rate Q`` with qeff-evs's EC connector, ``ec_role: ec_producer``: the encoder and pruning
graphs only), sends each video the way vLLM's disaggregated-encoder proxy does (the video alone, text removed,
``max_tokens`` 1), and measures what the instance wrote for the prefill/decode instances: the kept-rows file
of each video (its size on disk and its arrays' bytes: rows, kept indices, per-frame counts, extra rows)
against the same tensors for every row of the unpruned merged grid (what vLLM ships without pruning on the
encoder side). An export serves every rate its RoPE tables cover, so one export can be given with several rates
(the results below were measured when each rate needed its own export).

    QEFF_EVS_BACKEND=ort python benchmarks/epd_bytes.py build_q0:0 build_q05:0.5 build_q075:0.75 \\
        --video clip.mp4 -o epd_bytes.md

Prints (and writes with ``-o``) a markdown table and, beside it, the raw numbers as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from qeff_evs.bench.server_process import free_port, healthy, stop

START_TIMEOUT_S = 600


def parse_pair(text: str) -> tuple[Path, float]:
    export, sep, rate = text.rpartition(":")
    if not sep or not export:
        raise argparse.ArgumentTypeError(f"{text!r} is not EXPORT:Q (e.g. build_q05:0.5)")
    return Path(export), float(rate)


class EncoderInstance:
    """``vllm serve`` as an EC producer on 127.0.0.1, stopped on exit."""

    def __init__(self, export: Path, rate: float, storage: Path, log: Path, max_num_seqs: int):
        self.port = free_port()
        config = {"ec_connector": "QeffEvsECConnector", "ec_role": "ec_producer",
                  "ec_connector_extra_config": {"shared_storage_path": str(storage)}}
        argv = [str(Path(sys.executable).with_name("vllm")), "serve", str(export), "--host", "127.0.0.1",
                "--port", str(self.port), "--video-pruning-rate", str(rate), "--max-num-seqs", str(max_num_seqs),
                "--served-model-name", "export", "--ec-transfer-config", json.dumps(config)]
        self.log = log
        env = dict(os.environ)
        env.setdefault("QEFF_EVS_BACKEND", "ort")
        with open(log, "w") as out:
            self.process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                            start_new_session=True)

    def __enter__(self) -> EncoderInstance:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.process.poll() is not None:
                raise SystemExit(f"the encoder instance exited with {self.process.returncode}:\n"
                                 f"{self.log.read_text()[-4000:]}")
            if healthy(f"http://127.0.0.1:{self.port}"):
                return self
            if time.monotonic() > deadline:
                raise SystemExit(f"the encoder instance was not ready after {START_TIMEOUT_S} s; see {self.log}")
            time.sleep(1)

    def __exit__(self, *exc) -> None:
        stop(self.process)

    def encode(self, video: Path) -> str:
        """Send the video alone, as the proxy does; the mm_hash the instance shipped it under."""
        import base64
        import mimetypes

        mime = mimetypes.guess_type(video.name)[0] or "video/mp4"
        url = f"data:{mime};base64," + base64.b64encode(video.read_bytes()).decode()
        body = {"model": "export", "max_tokens": 1,
                "messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}}]}]}
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/chat/completions",
                                         data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as reply:
            [mm_hash] = json.loads(reply.read())["ec_transfer_params"]
        return mm_hash


def measure(pairs: list[tuple[Path, float]], videos: list[Path], max_num_seqs: int) -> list[dict]:
    from safetensors.numpy import load_file

    from qeff_evs.runtime.engine import kept_rows
    from qeff_evs.runtime.export_bundle import open_export
    from qeff_evs.runtime.media import video_from_file
    from qeff_evs.vllm.ec_connector.connector import payload_path

    rows = []
    with tempfile.TemporaryDirectory(prefix="epd_bytes_") as scratch:
        for number, (export, rate) in enumerate(pairs):
            bundle = open_export(export)
            storage = Path(scratch) / f"storage{number}"
            log = Path(scratch) / f"encoder{number}.log"
            print(f"[epd_bytes] {export} at q={rate}: starting an encoder instance", flush=True)
            with EncoderInstance(export, rate, storage, log, max_num_seqs) as instance:
                for video in videos:
                    path = Path(payload_path(storage, instance.encode(video)))
                    arrays = load_file(path)
                    t, h, w = bundle.family.merged_grid(video_from_file(video, bundle).grid_thw)
                    k = len(arrays[kept_rows.INDICES])
                    unpruned = kept_rows.unpruned_nbytes(arrays, t * h * w)
                    rows.append(dict(export=str(export), q=rate, video=video.name, temporal_patches=t,
                                     tokens_per_patch=h * w, kept=k, unpruned_rows=t * h * w,
                                     dtype=str(arrays[kept_rows.ROWS].dtype), hidden=arrays[kept_rows.ROWS].shape[1],
                                     extras=sorted(n for n in arrays if n.startswith(kept_rows.EXTRA_PREFIX)),
                                     array_bytes=kept_rows.nbytes(arrays), file_bytes=path.stat().st_size,
                                     unpruned_bytes=unpruned))
                    print(f"[epd_bytes]   {video.name}: {k}/{t * h * w} rows kept, {path.stat().st_size} bytes "
                          f"shipped, unpruned {unpruned}", flush=True)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| export | q | video | kept rows / unpruned | row width | bytes shipped (file) | kept-row arrays | "
             "unpruned rows | shipped / unpruned |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        extras = f" + {', '.join(e.removeprefix('extra.') for e in r['extras'])}" if r["extras"] else ""
        lines.append(f"| {Path(r['export']).name} | {r['q']:g} | {r['video']} | {r['kept']} / {r['unpruned_rows']} | {r['hidden']} {r['dtype']}"
                     f"{extras} | {r['file_bytes']:,} | {r['array_bytes']:,} | {r['unpruned_bytes']:,} | "
                     f"{r['file_bytes'] / r['unpruned_bytes']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pairs", nargs="+", type=parse_pair, metavar="EXPORT:Q",
                        help="an export folder and the pruning rate to serve it at")
    parser.add_argument("--video", type=Path, action="append", required=True, help="a video file (repeatable)")
    parser.add_argument("--max-num-seqs", type=int, default=1, help="the exports' KV rows (--full-batch-size)")
    parser.add_argument("-o", "--out", type=Path, help="write the table (.md) and the numbers (.json) here")
    args = parser.parse_args(argv)
    rows = measure(args.pairs, args.video, args.max_num_seqs)
    text = table(rows)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
        args.out.with_suffix(".json").write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
