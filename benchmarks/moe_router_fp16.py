"""The MoE router alone under the card's fp16 conversion: how many tokens change their top-k set, router in fp16
against router kept in fp32 (node precision), at released widths.

The router is ``qeff_evs.models.sparse_moe.route`` (logits MatMul, fp32 softmax, top-k, renormalisation) of
Qwen3-VL-30B-A3B (hidden 2048, 128 experts, 8 per token) or Qwen3.5-35B-A3B (256 experts, 8 per token) with the
bench's random weights (uniform, std 0.02, as ``qeff_evs.bench.checkpoint``), exported to ONNX and emulated as
``qeff-evs verify --fp16`` emulates the card: ``convert_to_fp16`` (every op rounded to fp16, weights fp16), and
the same with the router's path (``node_precision.router_paths``) kept in fp32, reading fp16-rounded hidden states.
Inputs: video-like rows with norms 20..100 (a post-norm hidden state of width 2048 has norm ~45), frames drifting.
This isolates what node precision changes: the router's own arithmetic. (``qeff-evs verify --fp16`` on an export
measures the whole graph, where the hidden states' fp16 drift through earlier layers adds to it.)

    python benchmarks/moe_router_fp16.py OUT_DIR [--tokens 4096]

Writes ``OUT_DIR/moe_router_fp16.json``: per model and variant, the share of tokens whose top-k set differs from
fp32's, and for the flipped tokens fp32's margin between the k-th and (k+1)-th probability (near-ties of random
weights), beside the margins of all tokens.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch
from torch import nn

from qeff_evs.export.fp16 import convert_to_fp16
from qeff_evs.export.node_precision import keep_in_fp32, router_paths
from qeff_evs.export.verify_runs import EVS_NORMS, video_like_rows
from qeff_evs.models.sparse_moe import route

MODELS = {"qwen3_vl_moe": ("Qwen3-VL-30B-A3B", 2048, 128, 8), "qwen3_5_moe": ("Qwen3.5-35B-A3B", 2048, 256, 8)}
WEIGHT_STD = 0.02


class Router(nn.Module):
    def __init__(self, weight: torch.Tensor, top_k: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.top_k = top_k

    def forward(self, hidden):
        weights, experts = route(hidden, self.weight, self.top_k)
        return weights, experts


def measure(label: str, hidden: int, experts: int, top_k: int, tokens: int, folder: Path) -> dict:
    generator = torch.Generator().manual_seed(0)
    bound = WEIGHT_STD * 3 ** 0.5
    weight = torch.empty(experts, hidden).uniform_(-bound, bound, generator=generator)
    path = folder / f"{label}.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(Router(weight, top_k), (torch.randn(4, hidden),), str(path), opset_version=17,
                          dynamo=False, input_names=["hidden"], output_names=["weights", "experts"],
                          dynamic_axes={"hidden": {0: "tokens"}})
    model = onnx.load(str(path))
    paths = router_paths(model)
    assert len(paths) == 1, paths
    converted = convert_to_fp16(model)
    variants = {"fp32": model, "router_fp16": converted, "router_fp32": keep_in_fp32(converted, paths[0])}
    rows = video_like_rows(tokens // 256, 256, hidden, EVS_NORMS, seed=1)
    chosen = {}
    for name, graph in variants.items():
        session = ort.InferenceSession(graph.SerializeToString(), providers=["CPUExecutionProvider"])
        chosen[name] = np.sort(session.run(["experts"], {"hidden": rows})[0], axis=-1)
    logits = torch.from_numpy(rows) @ weight.T
    probs = torch.softmax(logits, dim=-1).sort(dim=-1, descending=True).values.numpy()
    margins = probs[:, top_k - 1] - probs[:, top_k]
    result = {"model": label, "hidden": hidden, "experts": experts, "top_k": top_k, "tokens": len(rows),
              "margin_quantiles": {q: float(np.quantile(margins, q)) for q in (0.01, 0.1, 0.5)}}
    for name in ("router_fp16", "router_fp32"):
        flipped = np.any(chosen[name] != chosen["fp32"], axis=-1)
        result[name] = {"flipped_share": float(flipped.mean()), "flipped": int(flipped.sum()),
                        "flipped_margin_max": float(margins[flipped].max()) if flipped.any() else None,
                        "flipped_margin_median": float(np.median(margins[flipped])) if flipped.any() else None}
    print(json.dumps(result), flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--tokens", type=int, default=4096)
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        results = [measure(*spec, args.tokens, Path(scratch)) for spec in MODELS.values()]
    (args.out_dir / "moe_router_fp16.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
