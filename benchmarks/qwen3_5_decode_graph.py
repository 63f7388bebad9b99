"""Qwen3.5 decode step on ONNX Runtime: the prefill+decode language graph against the decode-only twin.

Random weights at Qwen3.5-0.8B widths with a few text layers (three Gated DeltaNet layers and one full-attention
layer for 4), both graphs exported from one model (prefill length 128), timed alternately on one-token calls at
one KV slot, each from its own zeroed state, through the runtime's ``OrtLanguageSession``::

    flock /tmp/qeff-heavy.lock python benchmarks/qwen3_5_decode_graph.py OUT_DIR [--text-layers 4] [--steps 15]

Prints one line per graph and writes ``OUT_DIR/qwen3_5_decode_graph.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
import warnings
from pathlib import Path

from qeff_evs.bench.checkpoint import random_model
from qeff_evs.bench.realistic import realistic_config
from qeff_evs.export.language import export_language_graph
from qeff_evs.manifest import LanguageShape
from qeff_evs.models.language import language_spec
from qeff_evs.runtime.backends.base import DecodeRow, decode_batch
from qeff_evs.runtime.backends.ort import OrtLanguageSession

FAMILY = "qwen3_5"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--text-layers", type=int, default=4)
    parser.add_argument("--prefill-seq-len", type=int, default=128)
    parser.add_argument("--ctx-len", type=int, default=4096)
    parser.add_argument("--slot", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=15)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model = random_model(realistic_config(FAMILY, text_layers=args.text_layers, vision_layers=2), FAMILY, 0)
    spec = language_spec(model)
    paths = {"prefill+decode graph": args.out / "both" / "language.onnx",
             "decode-only graph": args.out / "decode" / "language.onnx"}
    for (label, path), seq_len in zip(paths.items(), (args.prefill_seq_len, 1)):
        print(f"exporting the {label}", flush=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            export_language_graph(model, path, rope_positions=args.ctx_len, prefill_seq_len=seq_len)
    del model
    shape = LanguageShape(spec.num_layers, spec.kv_heads, spec.head_dim, spec.hidden_size, args.ctx_len,
                          args.prefill_seq_len, vocab=spec.vocab_size, rope_positions=args.ctx_len,
                          kv_layers=spec.io_kv_layers, layer_states=spec.layer_states)
    sessions = {label: OrtLanguageSession(path, dataclasses.replace(shape)) for label, path in paths.items()}
    step, _ = decode_batch([DecodeRow(0, 1, args.slot, args.slot)], 1, 1)
    times = {label: [] for label in sessions}
    for label, session in sessions.items():
        session.run(step)  # warm-up
    for rep in range(args.steps):
        for label in (list(sessions) if rep % 2 == 0 else list(reversed(sessions))):
            started = time.process_time()
            sessions[label].run(step)
            times[label].append(time.process_time() - started)
    result = {"text_layers": args.text_layers, "layer_types": list(getattr(shape, "kv_layers") or ()),
              "prefill_seq_len": args.prefill_seq_len, "ctx_len": args.ctx_len, "slot": args.slot,
              "median_cpu_ms": {label: statistics.median(t) * 1e3 for label, t in times.items()},
              "samples_cpu_s": times}
    both, decode = (result["median_cpu_ms"][label] for label in paths)
    result["ratio"] = both / decode
    for label, ms in result["median_cpu_ms"].items():
        print(f"{label}: {ms:.1f} ms CPU per decode step (median of {args.steps})")
    print(f"prefill+decode / decode-only: {result['ratio']:.2f}x")
    (args.out / "qwen3_5_decode_graph.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
