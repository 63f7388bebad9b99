"""One sparse MoE layer at released widths: each expert form's ONNX Runtime time, bytes and FLOPs per call.

The layer is transformers' sparse block (random weights) of Qwen3-VL-30B-A3B (hidden 2048, 128 experts, 8 per token,
``moe_intermediate_size`` 768) or Qwen3.5-35B-A3B (hidden 2048, 256 experts, 8 per token, 512, a shared expert of
512), computed by ``qeff_evs.models.sparse_moe`` in each of its forms (``gathered``: QEfficient's default, each token
gathers its k experts; ``dense``: every expert over every token; ``hit``: the experts the call chose, padded to
``min(E, tokens x k)`` slots), exported to ONNX and timed on ONNX Runtime (CPU) for the calls a language graph makes:
a 128-token prefill chunk, and decode steps of 1 and 4 rows::

    python benchmarks/moe_expert_forms.py OUT_DIR [--models qwen3_vl_moe qwen3_5_moe] [--repeats 5]

Writes ``OUT_DIR/moe_expert_forms.json`` and ``.md``. Bytes and FLOPs are computed, per call, for the card: fp16
expert weights (what ``-convert-to-fp16`` stores), the router and shared expert counted once beside the experts.
The expert weights enter the timed graph as inputs (no ONNX Runtime prepacking for any form; a layer's fp32 experts
are 2.4-3.2 GB, past protobuf's 2 GB for initializers). A form whose call would materialise more than
``--max-gather-gb`` of gathered weights is not run (the gathered prefill chunk: 12.9 GB at Qwen3-VL-30B-A3B widths)
and says so. Run it under ``flock /tmp/qeff-heavy.lock`` on a shared machine: a layer's weights take 2.4-3.2 GB.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
from torch import nn

from qeff_evs.models.sparse_moe import EXPERT_FORMS, FORMS, GATHERED, HIT, ExpertWeights, route

FP16 = 2
MODELS = {  # hidden, experts, per token, expert width, shared expert width
    "qwen3_vl_moe": dict(label="Qwen3-VL-30B-A3B", hidden=2048, experts=128, top_k=8, width=768, shared=0),
    "qwen3_5_moe": dict(label="Qwen3.5-35B-A3B", hidden=2048, experts=256, top_k=8, width=512, shared=512),
}
CALLS = {"prefill 128": (1, 128), "decode 1 row": (1, 1), "decode 4 rows": (4, 1)}  # (rows, tokens per row)


def experts_read(form: str, tokens: int, experts: int, top_k: int) -> int:
    """Expert matrices a call reads (a gathered expert is read once per token that gathers it)."""
    return {GATHERED: tokens * top_k, "dense": experts, HIT: min(experts, tokens * top_k)}[form]


def expert_products(form: str, tokens: int, experts: int, top_k: int) -> int:
    """(token, expert) pairs a call computes."""
    return tokens * {GATHERED: top_k, "dense": experts, HIT: min(experts, tokens * top_k)}[form]


def cost(form: str, tokens: int, model: dict) -> dict:
    h, e, k, i, s = (model[key] for key in ("hidden", "experts", "top_k", "width", "shared"))
    matrix = 3 * h * i  # gate, up, down of one expert
    weights = experts_read(form, tokens, e, k) * matrix + h * e + (3 * h * s + h if s else 0)
    flops = 2 * (expert_products(form, tokens, e, k) * matrix + tokens * h * e + (tokens * (3 * h * s + h) if s else 0))
    return {"weight_bytes": weights * FP16, "flops": flops, "experts_read": experts_read(form, tokens, e, k),
            "expert_products": expert_products(form, tokens, e, k)}


class FormGraph(nn.Module):
    """One form over ``hidden (tokens, H)`` with the layer's weights as inputs (no shared expert: it is the same
    dense MLP in every form and is counted beside it)."""

    def __init__(self, form: str, top_k: int) -> None:
        super().__init__()
        self.form, self.top_k = form, top_k

    def forward(self, hidden, router, gate_up, down):
        return FORMS[self.form](hidden, route(hidden, router, self.top_k), ExpertWeights(gate_up, down, nn.functional.silu))


def export_form(form: str, model: dict, folder: Path) -> Path:
    h, e, i = model["hidden"], model["experts"], model["width"]
    path = folder / f"{form}.onnx"
    example = (torch.randn(4, h), torch.randn(e, h), torch.randn(e, 2 * i, h) * 0.02, torch.randn(e, h, i) * 0.02)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(FormGraph(form, model["top_k"]), example, str(path), opset_version=17, dynamo=False,
                          input_names=["hidden", "router", "gate_up", "down"], output_names=["out"],
                          dynamic_axes={"hidden": {0: "tokens"}})
    return path


def time_calls(model: dict, folder: Path, repeats: int, max_gather_gb: float) -> list[dict]:
    rng = np.random.default_rng(0)
    h, e, i = model["hidden"], model["experts"], model["width"]
    weights = {"router": rng.standard_normal((e, h), dtype=np.float32),
               "gate_up": rng.standard_normal((e, 2 * i, h), dtype=np.float32) * 0.02,
               "down": rng.standard_normal((e, h, i), dtype=np.float32) * 0.02}
    rows = []
    for form in EXPERT_FORMS:
        options = ort.SessionOptions()
        options.log_severity_level = 3
        session = ort.InferenceSession(str(export_form(form, model, folder)), options,
                                       providers=["CPUExecutionProvider"])
        for call, (batch, per_row) in CALLS.items():
            tokens = batch * per_row
            row = {"model": model["label"], "form": form, "call": call, "tokens": tokens, **cost(form, tokens, model)}
            gathered_gb = tokens * model["top_k"] * 3 * h * i * 4 / 1e9 if form == GATHERED else 0.0
            if gathered_gb > max_gather_gb:
                row["ms"] = None
                row["note"] = f"not run: materialises {gathered_gb:.1f} GB of gathered fp32 weights"
            else:
                feeds = {"hidden": rng.standard_normal((tokens, h), dtype=np.float32), **weights}
                session.run(None, feeds)  # warm-up
                times = []
                for _ in range(repeats):
                    start = time.perf_counter()
                    session.run(None, feeds)
                    times.append((time.perf_counter() - start) * 1e3)
                row["ms"] = statistics.median(times)
            rows.append(row)
            print(f"{row['model']:18s} {form:9s} {call:14s} ms {row['ms'] if row['ms'] is None else round(row['ms'], 2)!s:>8s} "
                  f"GB {row['weight_bytes'] / 1e9:7.3f} GFLOP {row['flops'] / 1e9:8.2f} {row.get('note', '')}", flush=True)
        del session
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| model | call | form | experts read | (token, expert) products | weight GB (fp16) | GFLOP | ORT ms |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    for r in sorted(rows, key=lambda r: (r["model"], list(CALLS).index(r["call"]), EXPERT_FORMS.index(r["form"]))):
        ms = "not run" if r["ms"] is None else f"{r['ms']:.1f}"
        lines.append(f"| {r['model']} | {r['call']} | {r['form']} | {r['experts_read']} | {r['expert_products']} | "
                     f"{r['weight_bytes'] / 1e9:.3f} | {r['flops'] / 1e9:.2f} | {ms} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=sorted(MODELS, reverse=True))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-gather-gb", type=float, default=4.0)
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.models:
        rows += time_calls(MODELS[name], args.out_dir, args.repeats, args.max_gather_gb)
    (args.out_dir / "moe_expert_forms.json").write_text(json.dumps(rows, indent=2) + "\n")
    (args.out_dir / "moe_expert_forms.md").write_text(markdown(rows))
    print(markdown(rows))


if __name__ == "__main__":
    main()
