"""Keep an AWQ/GPTQ weight packed in the graph (``com.microsoft::MatMulNBits``, as QEfficient does) or dequantize it
to a plain MatMul (what qeff-evs exports)? One linear layer at Qwen2.5-VL-7B-AWQ's widths on ONNX Runtime's CPU.

Both graphs hold the same 4-bit weight (random codes, zero points and fp16 scales, group 128 along the input, as
AWQ releases): the plain graph its dequantized fp32 ``(q - z) * s``, the packed one the codes, zero points and
scales in MatMulNBits' layout (``accuracy_level`` unset: fp32 activations). Timed per call, alternating the two
graphs, medians over ``--repeats``: a decode step (1 token) and a prefill chunk (128 and 2048 tokens), for the
MLP's up projection (3584 -> 18944) and down projection (18944 -> 3584). Also: the weight bytes each graph holds,
each session's resident memory, and the largest difference of their outputs relative to the output's scale.

    python benchmarks/packed_int4_matmul.py OUT_DIR [--repeats 7]

Writes ``OUT_DIR/packed_int4_matmul.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

HIDDEN, INTERMEDIATE = 3584, 18944  # Qwen2.5-VL-7B's decoder (its -AWQ release: 4 bits, group 128)
LAYERS = {"up_proj": (HIDDEN, INTERMEDIATE), "down_proj": (INTERMEDIATE, HIDDEN)}  # (in, out)
GROUP, BITS = 128, 4
TOKENS = (1, 128, 2048)


def random_awq_weight(k: int, n: int, rng) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(codes (n, k) uint8, zeros (n, k/g) uint8, scales (n, k/g) fp32 from fp16)`` of a 4-bit group-wise weight."""
    codes = rng.integers(0, 16, size=(n, k), dtype=np.uint8)
    zeros = rng.integers(4, 12, size=(n, k // GROUP), dtype=np.uint8)
    scales = (rng.uniform(0.002, 0.02, size=(n, k // GROUP)).astype(np.float16)).astype(np.float32)
    return codes, zeros, scales


def dequantized(codes, zeros, scales) -> np.ndarray:
    """``(k, n)`` fp32: the plain MatMul's weight."""
    n, k = codes.shape
    spread_z = np.repeat(zeros, GROUP, axis=1).astype(np.float32)
    spread_s = np.repeat(scales, GROUP, axis=1)
    return ((codes.astype(np.float32) - spread_z) * spread_s).T.copy()


def nibbles(values: np.ndarray) -> np.ndarray:
    """Pairs of 4-bit values along the last axis in one byte, the first in the low bits (MatMulNBits' packing)."""
    return (values[..., 0::2] | (values[..., 1::2] << 4)).astype(np.uint8)


def plain_graph(weight: np.ndarray) -> onnx.ModelProto:
    k, n = weight.shape
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "plain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["tokens", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["tokens", n])],
        [numpy_helper.from_array(weight, "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def packed_graph(codes, zeros, scales) -> onnx.ModelProto:
    n, k = codes.shape
    blocks = k // GROUP
    packed = nibbles(codes.reshape(n, blocks, GROUP))  # (n, blocks, group / 2)
    node = helper.make_node("MatMulNBits", ["x", "b", "scales", "zeros"], ["y"], domain="com.microsoft",
                            K=k, N=n, bits=BITS, block_size=GROUP)
    graph = helper.make_graph(
        [node], "packed",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["tokens", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["tokens", n])],
        [numpy_helper.from_array(packed, "b"), numpy_helper.from_array(scales, "scales"),
         numpy_helper.from_array(nibbles(zeros), "zeros")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def session(model: onnx.ModelProto, folder: Path, name: str) -> tuple[ort.InferenceSession, float, int]:
    """``(session, resident MiB it added, weight bytes in the graph)``."""
    path = folder / f"{name}.onnx"
    onnx.save(model, str(path))
    before = rss_mib()
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    created = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    weights = sum(numpy_helper.to_array(t).nbytes for t in model.graph.initializer)
    return created, rss_mib() - before, weights


def measure(repeats: int, folder: Path) -> dict:
    rng = np.random.default_rng(0)
    out = {}
    for layer, (k, n) in LAYERS.items():
        codes, zeros, scales = random_awq_weight(k, n, rng)
        plain, plain_rss, plain_bytes = session(plain_graph(dequantized(codes, zeros, scales)), folder, f"{layer}_plain")
        packed, packed_rss, packed_bytes = session(packed_graph(codes, zeros, scales), folder, f"{layer}_packed")
        rows = {"weight_bytes": {"plain": plain_bytes, "packed": packed_bytes},
                "session_rss_mib": {"plain": round(plain_rss), "packed": round(packed_rss)}, "tokens": {}}
        for tokens in TOKENS:
            x = rng.standard_normal((tokens, k)).astype(np.float32)
            y_plain, y_packed = plain.run(None, {"x": x})[0], packed.run(None, {"x": x})[0]  # also the warm-up
            times = {"plain": [], "packed": []}
            for _ in range(repeats):
                for name, s in (("plain", plain), ("packed", packed)):
                    start = time.perf_counter()
                    s.run(None, {"x": x})
                    times[name].append(time.perf_counter() - start)
            medians = {name: statistics.median(t) for name, t in times.items()}
            rows["tokens"][tokens] = {
                "median_ms": {name: round(v * 1e3, 3) for name, v in medians.items()},
                "packed_over_plain": round(medians["packed"] / medians["plain"], 3),
                "max_relative_difference": float(np.abs(y_packed - y_plain).max() / np.abs(y_plain).max()),
                "samples_ms": {name: [round(v * 1e3, 3) for v in t] for name, t in times.items()}}
        out[layer] = {"in": k, "out": n, **rows}
        del plain, packed
    return out


def markdown(result: dict) -> str:
    lines = ["# A 4-bit AWQ/GPTQ weight on ONNX Runtime (CPU): packed (MatMulNBits) against dequantized (MatMul)", "",
             f"Qwen2.5-VL-7B-AWQ widths, group {GROUP}, fp32 activations, {result['threads']} threads, median of "
             f"{result['repeats']} alternating calls; {result['machine']}, onnxruntime {result['onnxruntime']}.", "",
             "| layer | tokens | MatMul ms | MatMulNBits ms | packed / plain | max rel. diff |", "|---|---|---|---|---|---|"]
    for layer, row in result["layers"].items():
        for tokens, t in row["tokens"].items():
            lines.append(f"| {layer} {row['in']}->{row['out']} | {tokens} | {t['median_ms']['plain']} | "
                         f"{t['median_ms']['packed']} | {t['packed_over_plain']} | {t['max_relative_difference']:.1e} |")
    lines += ["", "| layer | weight MiB plain / packed | session RSS MiB plain / packed |", "|---|---|---|"]
    for layer, row in result["layers"].items():
        w, r = row["weight_bytes"], row["session_rss_mib"]
        lines.append(f"| {layer} | {w['plain'] / 2**20:.0f} / {w['packed'] / 2**20:.0f} | {r['plain']} / {r['packed']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as folder:
        layers = measure(args.repeats, Path(folder))
    result = {"repeats": args.repeats, "threads": 2, "onnxruntime": ort.__version__,
              "machine": f"{platform.machine()}, {len(__import__('os').sched_getaffinity(0))} cores",
              "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024), "layers": layers}
    (args.out / "packed_int4_matmul.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "packed_int4_matmul.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
