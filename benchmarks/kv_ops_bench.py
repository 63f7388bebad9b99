"""CPU cost of the language graph's KV writes/reads under ONNX Runtime (tiny models, long cache).

At a large ``ctx_len`` the tiny models' weights cost next to nothing, so a call's time is mostly
what the graph does per cache element: the CtxScatter/CtxGather bodies and the reads' zeroing.
Two steps, so that checkouts can be compared in one process (timings on a shared machine drift
between processes more than the differences measured)::

    # export the tiny Qwen2.5-VL / Qwen3-VL language graphs of the qeff_evs on the path
    PYTHONPATH=/path/to/checkout python benchmarks/kv_ops_bench.py export before/
    python benchmarks/kv_ops_bench.py export after/
    # time one decode step and one prefill chunk of every graph, the folders' runs interleaved
    python benchmarks/kv_ops_bench.py time before/ after/

``time`` prints the median process CPU time per call (ONNX Runtime on one thread, so CPU time is
the work done, whatever else runs on the machine).

``state FOLDER`` times the runtime's session over the same graphs two ways, interleaved in one process: the
retained state fed as host arrays and read back every call (``session.run``, as the language session did
earlier), and ``OrtLanguageSession`` with each cache bound in place (IOBinding, no copies)::

    python benchmarks/kv_ops_bench.py state after/ [--ctx-len 8192]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from pathlib import Path

import numpy as np
import onnxruntime as ort

FAMILIES = ("qwen2_5_vl", "qwen3_vl")
CB_ROWS = 4  # continuous batching: full_batch_size, and the rows of a decode call


def export(folder: Path) -> None:
    from qeff_evs.export.language import export_language_graph
    from qeff_evs.models.tiny import build_tiny_model, build_tokenizer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for family in FAMILIES:
            model = build_tiny_model(family, build_tokenizer())
            for cb in (False, True):
                export_language_graph(model, folder / f"{family}{'_cb' if cb else ''}.onnx", continuous_batching=cb)


def feeds(session: ort.InferenceSession, seq_len: int, ctx_len: int, start: int, batch: int) -> dict[str, np.ndarray]:
    """A call of ``batch`` rows writing slots ``start .. start + seq_len`` of a random cache."""
    symbols = {"batch_size": batch, "seq_len": seq_len, "vision_size": seq_len, "ctx_len": ctx_len,
               "full_batch_size": CB_ROWS}
    rng = np.random.default_rng(0)
    values = {}
    for value in session.get_inputs():
        shape = [symbols[d] if isinstance(d, str) else d for d in value.shape]
        if value.name == "input_ids":
            values[value.name] = rng.integers(0, 100, shape, dtype=np.int64)
        elif value.name == "position_ids":
            values[value.name] = np.broadcast_to(np.arange(start, start + seq_len), shape).astype(np.int64).copy()
        elif value.name == "batch_index":
            values[value.name] = np.arange(batch, dtype=np.int64).reshape(shape)
        elif value.name == "image_idx":
            values[value.name] = np.zeros(shape, np.int64)
        else:
            values[value.name] = rng.standard_normal(shape, dtype=np.float32)
    return values


def time_folders(folders: list[Path], ctx_len: int, prefill_seq_len: int, repeats: int) -> None:
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    for graph in sorted(p.name for p in folders[0].glob("*.onnx")):
        sessions = [ort.InferenceSession(str(folder / graph), options, providers=["CPUExecutionProvider"])
                    for folder in folders]
        batch = CB_ROWS if graph.endswith("_cb.onnx") else 1
        for label, seq_len, start, rows in (("decode", 1, 200, batch), (f"prefill {prefill_seq_len}", prefill_seq_len, 0, 1)):
            calls = [(s, feeds(s, seq_len, ctx_len, start, rows)) for s in sessions]
            samples = [[] for _ in sessions]
            for session, values in calls:
                session.run(None, values)  # warm-up
            for _ in range(repeats):
                for i, (session, values) in enumerate(calls):
                    begin = time.process_time()
                    session.run(None, values)
                    samples[i].append((time.process_time() - begin) * 1e3)
            medians = "  ".join(f"{statistics.median(s):7.2f}" for s in samples)
            print(f"{graph[:-5]:14s} {label:12s} rows {rows}: {medians}  ms", flush=True)


def language_shape(session: ort.InferenceSession, ctx_len: int, vision_size: int):
    """The ``LanguageShape`` of one of these graphs at ``ctx_len``, read from its inputs."""
    from qeff_evs.manifest import LanguageShape

    dims = {i.name: i.shape for i in session.get_inputs()}
    layers = sum(name.startswith("past_key.") for name in dims)
    _, kv_heads, _, head_dim = dims["past_key.0"]
    extras = {name: shape[0] for name, shape in dims.items() if name == "deepstack_features"}
    cb = "batch_index" in dims
    return LanguageShape(layers, kv_heads, head_dim, dims["vision_embeds"][2], ctx_len, vision_size, extras,
                         CB_ROWS if cb else 1, continuous_batching=cb)


def time_state(folder: Path, ctx_len: int, prefill_seq_len: int, repeats: int) -> None:
    from qeff_evs.runtime.backends.base import LanguageInputs
    from qeff_evs.runtime.backends.ort import OrtLanguageSession

    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    for graph in sorted(p.name for p in folder.glob("*.onnx")):
        session = ort.InferenceSession(str(folder / graph), options, providers=["CPUExecutionProvider"])
        shape = language_shape(session, ctx_len, prefill_seq_len)
        bound = OrtLanguageSession(session, shape)
        retained = list(bound.state)
        host = {name: np.zeros_like(value) for name, value in bound.state.items()}
        outputs = [o.name for o in session.get_outputs()]
        batch = CB_ROWS if shape.continuous_batching else 1
        for label, seq_len, start, rows in (("decode", 1, 200, batch), (f"prefill {prefill_seq_len}", prefill_seq_len, 0, 1)):
            values = feeds(session, seq_len, ctx_len, start, rows)
            per_call = {k: v for k, v in values.items() if k not in retained or (seq_len > 1 and not k.startswith("past_"))}

            def copied():  # the state as host arrays: fed in whole, every output read back
                results = dict(zip(outputs, session.run(None, {**host, **per_call})))
                host.update({name: results[name + "_RetainedState"] for name in retained})

            step = LanguageInputs(values["input_ids"], values["position_ids"], per_call.get("vision_embeds"),
                                  {k: per_call[k] for k in shape.extras if k in per_call}, values["image_idx"], 0)
            batch_index = values["batch_index"].reshape(-1).tolist() if shape.continuous_batching else None

            def in_place():
                bound.run_rows(step, batch_index) if batch_index is not None else bound.run(step)

            samples = {"copied": [], "in place": []}
            for run in (copied, in_place):
                run()  # warm-up
            for repeat in range(repeats):
                for name, run in (("copied", copied), ("in place", in_place))[:: 1 if repeat % 2 == 0 else -1]:
                    begin = time.process_time()
                    run()
                    samples[name].append((time.process_time() - begin) * 1e3)
            medians = {name: statistics.median(s) for name, s in samples.items()}
            print(f"{graph[:-5]:14s} {label:12s} rows {rows}: copied {medians['copied']:7.2f}  in place "
                  f"{medians['in place']:7.2f} ms  ({medians['copied'] / medians['in place']:.2f}x)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("export").add_argument("folder", type=Path)
    timing = commands.add_parser("time")
    timing.add_argument("folders", type=Path, nargs="+")
    timing.add_argument("--ctx-len", type=int, default=8192)
    timing.add_argument("--prefill-seq-len", type=int, default=128)
    timing.add_argument("--repeats", type=int, default=50)
    state = commands.add_parser("state")
    state.add_argument("folder", type=Path)
    state.add_argument("--ctx-len", type=int, default=8192)
    state.add_argument("--prefill-seq-len", type=int, default=128)
    state.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    if args.command == "export":
        args.folder.mkdir(parents=True, exist_ok=True)
        export(args.folder)
    elif args.command == "state":
        print("median CPU ms per call, the state copied in and out / bound in place")
        time_state(args.folder, args.ctx_len, args.prefill_seq_len, args.repeats)
    else:
        print("median CPU ms per call, columns: " + "  ".join(str(f) for f in args.folders))
        time_folders(args.folders, args.ctx_len, args.prefill_seq_len, args.repeats)


if __name__ == "__main__":
    main()
