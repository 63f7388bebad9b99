"""One Qwen3.5 Gated DeltaNet layer at Qwen3.5-0.8B widths: state sizes, fp32 accuracy, ORT cost, fp16 drift.

The layer is transformers' ``Qwen3_5GatedDeltaNet`` (hidden 1024, 16 key / 16 value heads of 128, conv
kernel 4) with random weights and Mamba-style decays (per head ``dt`` log-uniform in [1e-3, 1e-1], ``A``
in [1, 8]; a "slow" variant takes ``dt`` in [1e-4, 1e-3]: heads remembering thousands of tokens), run
through ``qeff_evs.models.linear_attention.GatedDeltaNetStep``::

    python benchmarks/gdn_layer_bench.py sizes                  # state bytes per request row vs KV bytes
    python benchmarks/gdn_layer_bench.py accuracy               # fp32 vs transformers; UT solvers vs fp64
    python benchmarks/gdn_layer_bench.py time OUT_DIR           # ORT CPU ms per call (S = 64, S = 1)
    python benchmarks/gdn_layer_bench.py precision OUT_DIR      # fp16 (-convert-to-fp16 emulation) drift

Each prints a table and writes ``OUT_DIR/<command>.json`` (``--json``) with every number.

fp16 precision: the graphs are converted with ``qeff_evs.export.fp16.convert_to_fp16`` (what
``qeff-evs verify --fp16`` runs) and fed the same tokens as the fp32 graph, each run carrying its own
state from call to call. Ways to keep the recurrent state on the card:

* ``fp16``: every tensor fp16, state I/O too (QEfficient's ``kv_cache_dtype`` fp16);
* ``fp32-io``: the state's I/O fp32 (custom IO) but every op fp16, so the state is rounded by its first op;
* ``fp32-path``: fp32 I/O and the ops that produce state-shaped tensors on the way from the state input
  to its ``_RetainedState`` output kept in fp32 (``qeff_evs.export.node_precision``: a
  ``-node-precision-info`` list); all else fp16;
* ``mxint8``: ``fp16`` plus the state stored as MXINT8 between calls (blocks of 32 along dv sharing a
  power-of-two scale, 8-bit elements with 6 fraction bits; QEfficient's ``mxint8_kv_cache``).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch
from transformers import Qwen3_5TextConfig
from transformers.cache_utils import DynamicCache
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from qeff_evs.export.fp16 import convert_to_fp16
from qeff_evs.export.node_precision import keep_in_fp32, state_path
from qeff_evs.export.onnx_graph import legacy_export
from qeff_evs.models import gated_delta as gd
from qeff_evs.models.linear_attention import (
    ExportableLinearAttention, GatedDeltaNetStep, linear_state_spec, state_names,
)
from qeff_evs.specializations import RETAINED_SUFFIX

# Qwen3.5-0.8B (docs/models.md, Qwen3.5): 24 layers = 18 Gated DeltaNet + 6 full attention.
WIDTHS_0_8B = dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2,
                   head_dim=256, linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
                   linear_num_key_heads=16, linear_num_value_heads=16, intermediate_size=3584, vocab_size=1024)
RELEASED = {  # (hidden, GDN layers, full layers, KV heads, Hk, Hv) from §1.3; dk = dv = 128, head_dim 256, K 4
    "0.8B": (1024, 18, 6, 2, 16, 16), "4B": (2560, 24, 8, 4, 16, 32), "27B": (5120, 48, 16, 4, 16, 48)}
CTX_LEN, ROWS, CHUNK = 8192, 4, 64
MXINT8_BYTES = 1 + 1 / 32  # 8-bit element + one 8-bit scale per 32


def build_layer(seed: int = 0, dt_range=(1e-3, 1e-1)) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = Qwen3_5TextConfig(**WIDTHS_0_8B)
    layer = hf.Qwen3_5GatedDeltaNet(config, layer_idx=0).eval()
    generator = torch.Generator().manual_seed(seed)
    heads = layer.num_v_heads
    dt = torch.exp(torch.empty(heads).uniform_(math.log(dt_range[0]), math.log(dt_range[1]), generator=generator))
    with torch.no_grad():
        layer.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
        layer.A_log.copy_(torch.log(torch.empty(heads).uniform_(1.0, 8.0, generator=generator)))
    return layer, config


# --------------------------------------------------------------------------------------------- sizes
def sizes() -> dict:
    rows = {}
    for name, (hidden, linear, full, kv_heads, hk, hv) in RELEASED.items():
        conv_dim, history, dk = 2 * hk * 128 + hv * 128, 3, 128
        conv = linear * conv_dim * history
        recurrent = linear * hv * dk * dk
        kv = full * 2 * kv_heads * CTX_LEN * 256
        rows[name] = {"conv_fp16": conv * 2, "conv_4_columns_fp16": linear * conv_dim * 4 * 2,
                      "recurrent_fp16": recurrent * 2, "recurrent_fp32": recurrent * 4,
                      "recurrent_mxint8": round(recurrent * MXINT8_BYTES), "kv_fp16_ctx8192": kv * 2,
                      "kv_mxint8_ctx8192": round(kv * MXINT8_BYTES)}
    mib = 2 ** 20
    print(f"bytes per request row (MiB); KV at ctx_len {CTX_LEN}")
    print(f"{'model':6s} {'conv fp16':>10s} {'(K cols)':>9s} {'rec fp16':>9s} {'rec fp32':>9s} {'rec mx8':>8s} "
          f"{'KV fp16':>8s} {'KV mx8':>7s}")
    for name, r in rows.items():
        print(f"{name:6s} {r['conv_fp16'] / mib:10.3f} {r['conv_4_columns_fp16'] / mib:9.3f} "
              f"{r['recurrent_fp16'] / mib:9.2f} {r['recurrent_fp32'] / mib:9.2f} {r['recurrent_mxint8'] / mib:8.2f} "
              f"{r['kv_fp16_ctx8192'] / mib:8.1f} {r['kv_mxint8_ctx8192'] / mib:7.1f}")
    return rows


# ------------------------------------------------------------------------------------------ accuracy
def _hf_run(layer, config, tokens, prompt_len, chunk):
    cache = DynamicCache(config=config)
    outs = []
    with torch.no_grad():
        for start in range(0, prompt_len, chunk):
            outs.append(layer(tokens[None, start:min(start + chunk, prompt_len)], cache_params=cache)[0])
        for t in range(prompt_len, len(tokens)):
            outs.append(layer(tokens[None, t:t + 1], cache_params=cache)[0])
    state = cache.layers[0]
    return torch.cat(outs), state.conv_states[0][0, :, 1:], state.recurrent_states[0][0]


def _our_run(layer, tokens, prompt_len, chunk):
    step = GatedDeltaNetStep(layer)
    spec = linear_state_spec(layer)
    conv, recurrent = torch.zeros(spec.conv_shape(1)), torch.zeros(spec.recurrent_shape(1))
    outs = []
    with torch.no_grad():
        for start in range(0, prompt_len, chunk):
            end = min(start + chunk, prompt_len)
            hidden = torch.zeros(1, chunk, tokens.shape[1])
            hidden[0, :end - start] = tokens[start:end]
            slots = torch.full((1, chunk), -1)
            slots[0, :end - start] = torch.arange(start, end)
            out, conv, recurrent = step(hidden, slots, conv, recurrent)
            outs.append(out[0, :end - start])
        for t in range(prompt_len, len(tokens)):
            out, conv, recurrent = step(tokens[None, t:t + 1], torch.tensor([[t]]), conv, recurrent)
            outs.append(out[0])
    return torch.cat(outs), conv[0], recurrent[0]


def _solver_errors(seed: int = 0) -> dict:
    """Chunked rule over 1024 tokens of one layer's real q/k/v/g/beta with three UT solvers, vs fp64."""
    layer, _ = build_layer(seed)
    tokens = torch.randn(1, 1024, layer.hidden_size, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():  # the layer's own projections and conv (transformers' functions), as its forward
        mixed = hf.causal_conv1d_fn(layer.in_proj_qkv(tokens).transpose(1, 2), layer.conv1d.weight.squeeze(1),
                                    None, activation="silu").transpose(1, 2)
        q, k, v = torch.split(mixed, [layer.key_dim, layer.key_dim, layer.value_dim], dim=-1)
        q, k = (x.reshape(1, 1024, -1, layer.head_k_dim) for x in (q, k))
        v = v.reshape(1, 1024, -1, layer.head_v_dim)
        g, beta = gd.gates(layer.in_proj_a(tokens), layer.in_proj_b(tokens), layer.A_log, layer.dt_bias)
    t = lambda x: x.transpose(1, 2)  # noqa: E731
    ours_in = (t(gd.l2_normalize(q)) * q.shape[-1] ** -0.5, t(gd.l2_normalize(k)), t(v), t(g), t(beta))
    state0 = torch.zeros(1, v.shape[2], q.shape[-1], v.shape[-1])
    truth_out, truth_state = gd.recurrent_gated_delta_rule(*(x.double() for x in ours_in), state0.double())
    results = {}

    def record(name, out, state):
        results[name] = {"out_max_abs": float((out.double() - truth_out).abs().max()),
                         "state_max_abs": float((state.double() - truth_state).abs().max()),
                         "state_max": float(truth_state.abs().max())}

    record("block doubling (ours)", *gd.chunked_gated_delta_rule(*ours_in, state0, chunk_size=CHUNK))
    kwargs = dict(g=g, beta=beta, chunk_size=CHUNK, initial_state=state0, output_final_state=True,
                  use_qk_l2norm_in_kernel=True)
    out, state = hf.torch_chunk_gated_delta_rule(q, k, v, **kwargs)
    record("solve_triangular (transformers)", t(out), state)
    exporting = hf.is_torchdynamo_exporting
    hf.is_torchdynamo_exporting = lambda: True  # transformers' export branch: 63-step forward substitution
    try:
        out, state = hf.torch_chunk_gated_delta_rule(q, k, v, **kwargs)
    finally:
        hf.is_torchdynamo_exporting = exporting
    record("forward substitution (transformers export)", t(out), state)
    out, state = gd.recurrent_gated_delta_rule(*ours_in, state0)
    record("per-token recurrence fp32", out, state)
    return results


def accuracy() -> dict:
    layer, config = build_layer(0)
    tokens = torch.randn(250 + 32, layer.hidden_size, generator=torch.Generator().manual_seed(1))
    ours = _our_run(layer, tokens, 250, CHUNK)
    ref = _hf_run(layer, config, tokens, 250, CHUNK)
    result = {"layer_vs_transformers": {
        "tokens": "250 prompt tokens in chunks of 64 (last right-padded), then 32 decode steps",
        "out_max_abs": float((ours[0] - ref[0]).abs().max()), "out_max": float(ref[0].abs().max()),
        "conv_state_max_abs": float((ours[1] - ref[1]).abs().max()),
        "recurrent_state_max_abs": float((ours[2] - ref[2]).abs().max()),
        "recurrent_state_max": float(ref[2].abs().max())}}
    result["solvers_vs_fp64_recurrence"] = _solver_errors(0)
    r = result["layer_vs_transformers"]
    print(f"layer vs transformers (0.8B widths, fp32): output max abs {r['out_max_abs']:.2e} (|out| <= {r['out_max']:.2f}), "
          f"conv state {r['conv_state_max_abs']:.1e}, recurrent state {r['recurrent_state_max_abs']:.2e} "
          f"(|state| <= {r['recurrent_state_max']:.2f})")
    print("chunked rule over 1024 tokens vs fp64 recurrence (max abs error): output, final state")
    for name, e in result["solvers_vs_fp64_recurrence"].items():
        print(f"  {name:44s} {e['out_max_abs']:.2e}  {e['state_max_abs']:.2e}")
    return result


# ---------------------------------------------------------------------------------------------- export
def export_graph(layer, path: Path, seq_len: int, cb: bool, prefill_seq_len: int | None = None) -> Path:
    graph = ExportableLinearAttention(GatedDeltaNetStep(layer, prefill_seq_len=prefill_seq_len), 0, continuous_batching=cb)
    spec = linear_state_spec(layer)
    batch = 1
    rows = ROWS if cb else batch
    slots = torch.arange(seq_len).expand(4, batch, seq_len).contiguous()
    inputs = [torch.randn(batch, seq_len, layer.hidden_size), slots, torch.zeros(spec.conv_shape(rows)),
              torch.zeros(spec.recurrent_shape(rows))] + ([torch.tensor([[0]])] if cb else [])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        legacy_export(graph, inputs, path, input_names=graph.input_names, output_names=graph.output_names,
                      dynamic_axes=graph.dynamic_axes)
    return path


def _session(model, threads: int = 1) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = threads
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    source = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])


def _feeds(layer, seq_len: int, batch: int, rows: int, cb: bool, start: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    spec = linear_state_spec(layer)
    conv, recurrent = state_names(0)
    feeds = {"hidden_states": rng.standard_normal((batch, seq_len, layer.hidden_size), dtype=np.float32),
             "position_ids": np.broadcast_to(np.arange(start, start + seq_len), (4, batch, seq_len)).astype(np.int64).copy(),
             conv: rng.standard_normal(spec.conv_shape(rows), dtype=np.float32),
             recurrent: rng.standard_normal(spec.recurrent_shape(rows), dtype=np.float32) * 0.1}
    if cb:
        feeds["batch_index"] = np.arange(batch, dtype=np.int64).reshape(batch, 1)
    return feeds


def timing(out_dir: Path, repeats: int) -> dict:
    layer, _ = build_layer(0)
    graphs = {
        "prefill S=64 (per-length graph)": (export_graph(layer, out_dir / "s64_cb.onnx", 64, cb=True), 64, 1),
        "decode S=1 (per-length graph)": (export_graph(layer, out_dir / "s1_cb.onnx", 1, cb=True), 1, ROWS),
    }
    both = export_graph(layer, out_dir / "one_graph_cb.onnx", 64, cb=True, prefill_seq_len=64)
    graphs["prefill S=64 (one graph for both)"] = (both, 64, 1)
    graphs["decode S=1 (one graph for both)"] = (both, 1, ROWS)
    results = {}
    print(f"ORT CPU ms per call, 1 thread, median of {repeats}; states hold {ROWS} rows (CB)")
    for label, (path, seq_len, batch) in graphs.items():
        session = _session(path)
        feeds = _feeds(layer, seq_len, batch, ROWS, True, start=100)
        session.run(None, feeds)
        samples = []
        for _ in range(repeats):
            begin = time.process_time()
            session.run(None, feeds)
            samples.append((time.process_time() - begin) * 1e3)
        model = onnx.load(str(path), load_external_data=False)
        results[label] = {"batch": batch, "seq_len": seq_len, "median_ms": statistics.median(samples),
                          "samples_ms": samples, "nodes": len(model.graph.node),
                          "file_mib": path.stat().st_size / 2 ** 20}
        print(f"  {label:36s} batch {batch}: {results[label]['median_ms']:8.2f} ms  "
              f"({results[label]['nodes']} nodes, {results[label]['file_mib']:.0f} MiB)")
    return results


# ------------------------------------------------------------------------------------------- precision
def _to_mxint8(x: np.ndarray, block: int = 32) -> np.ndarray:
    """MXINT8 round trip along the last axis: per block a power-of-two scale 2^floor(log2 max|x|),
    elements int8 with 6 fraction bits (values -2 .. 127/64 times the scale)."""
    shape = x.shape
    blocks = x.reshape(-1, block)
    top = np.abs(blocks).max(axis=1, keepdims=True)
    scale = np.exp2(np.floor(np.log2(np.where(top > 0, top, 1.0))))
    q = np.clip(np.round(blocks / scale * 64), -128, 127) / 64
    return (q * scale).reshape(shape).astype(np.float32)


def precision(out_dir: Path, chunks: int, decode_steps: int) -> dict:
    results = {}
    conv_name, recurrent_name = state_names(0)
    for regime, dt_range in (("mamba dt 1e-3..1e-1", (1e-3, 1e-1)), ("slow dt 1e-4..1e-3", (1e-4, 1e-3))):
        layer, _ = build_layer(0, dt_range)
        spec = linear_state_spec(layer)
        paths = {s: export_graph(layer, out_dir / f"p{s}.onnx", s, cb=False) for s in (CHUNK, 1)}
        sessions = {}
        for s, path in paths.items():
            model = onnx.load(str(path))
            half = convert_to_fp16(model)
            island = state_path(model, recurrent_name, recurrent_name + RETAINED_SUFFIX)
            sessions[("fp32", s)] = _session(model)
            sessions[("fp16", s)] = _session(half)
            sessions[("fp32-io", s)] = _session(keep_in_fp32(half, [], [recurrent_name]))
            sessions[("fp32-path", s)] = _session(keep_in_fp32(half, island, [recurrent_name]))
            sessions[("mxint8", s)] = sessions[("fp16", s)]
            results.setdefault("fp32_path_tensors", {})[str(s)] = island
        variants = ("fp32", "fp16", "fp32-io", "fp32-path", "mxint8")
        state = {v: (np.zeros(spec.conv_shape(1), np.float32), np.zeros(spec.recurrent_shape(1), np.float32))
                 for v in variants}
        rng = np.random.default_rng(1)
        trace = {v: [] for v in variants if v != "fp32"}
        calls = [(CHUNK, i * CHUNK) for i in range(chunks)] + [(1, chunks * CHUNK + i) for i in range(decode_steps)]
        for number, (seq_len, start) in enumerate(calls):
            hidden = rng.standard_normal((1, seq_len, layer.hidden_size), dtype=np.float32)
            slots = np.broadcast_to(np.arange(start, start + seq_len), (4, 1, seq_len)).astype(np.int64).copy()
            outs = {}
            for v in variants:
                feeds = {"hidden_states": hidden, "position_ids": slots, conv_name: state[v][0], recurrent_name: state[v][1]}
                out, conv, recurrent = sessions[(v, seq_len)].run(None, feeds)
                if v == "mxint8":
                    recurrent = _to_mxint8(recurrent)
                state[v] = (conv, recurrent)
                outs[v] = out
            ref_state, ref_out = state["fp32"][1][0], outs["fp32"]
            for v in trace:
                diff = state[v][1][0] - ref_state
                per_head = np.linalg.norm(diff.reshape(diff.shape[0], -1), axis=1) / \
                    np.linalg.norm(ref_state.reshape(ref_state.shape[0], -1), axis=1)
                trace[v].append({"call": number, "seq_len": seq_len, "tokens": start + seq_len,
                                 "state_rel": float(np.linalg.norm(diff) / np.linalg.norm(ref_state)),
                                 "state_rel_worst_head": float(per_head.max()),
                                 "out_rel": float(np.abs(outs[v] - ref_out).max() / np.sqrt((ref_out ** 2).mean()))})
        results[regime] = trace
        print(f"{regime}: {chunks} prefill chunks of {CHUNK} then {decode_steps} decode steps; relative errors vs fp32")
        marks = {"prefill": chunks - 1, **{f"+{n} decode": chunks + n - 1 for n in (64, 256, 1024, 4096)
                                           if n <= decode_steps}}
        print(f"  {'state (worst head)':18s} " + " ".join(f"{m:>20s}" for m in marks) + f" {'out err / rms':>14s}")
        for v, rows in trace.items():
            cells = " ".join(f"{rows[i]['state_rel']:9.2e} ({rows[i]['state_rel_worst_head']:8.2e})" for i in marks.values())
            print(f"  {v:18s} {cells} {max(r['out_rel'] for r in rows):14.2e}")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("sizes")
    commands.add_parser("accuracy")
    timing_cmd = commands.add_parser("time")
    timing_cmd.add_argument("out_dir", type=Path)
    timing_cmd.add_argument("--repeats", type=int, default=20)
    precision_cmd = commands.add_parser("precision")
    precision_cmd.add_argument("out_dir", type=Path)
    precision_cmd.add_argument("--chunks", type=int, default=16)
    precision_cmd.add_argument("--decode-steps", type=int, default=256)
    for command in commands.choices.values():
        command.add_argument("--json", type=Path, help="write the numbers to this file")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.command == "sizes":
        result = sizes()
    elif args.command == "accuracy":
        result = accuracy()
    elif args.command == "time":
        args.out_dir.mkdir(parents=True, exist_ok=True)
        result = timing(args.out_dir, args.repeats)
    else:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        result = precision(args.out_dir, args.chunks, args.decode_steps)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
