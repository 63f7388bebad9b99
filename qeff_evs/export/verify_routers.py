"""``qeff-evs verify --fp16``'s router check: the MoE routers of the language graph in fp32, under the fp16 emulation,
and with their path kept in fp32, over video-like prefill chunks: which tokens' top-k sets flip, how near a tie
each flip was, and the routers' probability error."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import yaml

from qeff_evs.export.fp16 import convert_to_fp16, round_external_weights
from qeff_evs.export.node_precision import keep_in_fp32, router_paths
from qeff_evs.export.verify_runs import EVS_NORMS, Comparison, LanguageRun, chunk_feeds, video_like_rows
from qeff_evs.manifest import read_manifest

ROUTER_CHUNKS = 8  # the router workload: prefill chunks of video-like media rows


def _router_outputs(model: onnx.ModelProto, paths: list[list[str]]) -> tuple[list[str], list[str]]:
    """Each router's probabilities (its Softmax output) and chosen experts (its TopK indices) in the fp32 graph (the
    fp16 emulation keeps both names)."""
    producers = {name: node for node in model.graph.node for name in node.output}
    chosen = [next(producers[name].output[1] for name in path if producers[name].op_type == "TopK") for path in paths]
    return [path[1] for path in paths], chosen


def _router_probe(model: onnx.ModelProto, probs: list[str], chosen: list[str]) -> onnx.ModelProto:
    """``model`` with the routers' probabilities and chosen experts as extra graph outputs."""
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    probe.graph.output.extend([onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None) for name in probs]
                              + [onnx.helper.make_tensor_value_info(name, onnx.TensorProto.INT64, None) for name in chosen])
    return probe


@dataclass(frozen=True)
class RouterChunk:
    """One prefill chunk of a router workload: the language graph's per-call feeds (no state) and which of its
    tokens are real (a padded last chunk's padding is not counted)."""

    input_ids: np.ndarray  # (1, S)
    position_ids: np.ndarray  # (4, 1, S)
    vision: dict[str, np.ndarray]  # vision_embeds and the family's extra rows, by input name
    real: np.ndarray  # (S,) bool


def video_like_router_chunks(export_dir: Path, chunks: int = ROUTER_CHUNKS) -> list[RouterChunk]:
    """``chunks`` prefill chunks of the compiled length whose tokens are video-like media rows (norms 20..100,
    frames drifting) after one text token, at consecutive KV slots."""
    manifest = read_manifest(export_dir)
    seq_len, shape = manifest.prefill_seq_len, manifest.language_shape
    rows = video_like_rows(chunks, seq_len - 1, shape.hidden, EVS_NORMS, seed=5)
    workload = []
    for c in range(chunks):
        ids, positions, vision = chunk_feeds(shape, manifest.special_tokens, seq_len, 0, seed=200 + c,
                                              media_rows=rows[c * (seq_len - 1):(c + 1) * (seq_len - 1)])
        workload.append(RouterChunk(ids, positions + c * seq_len, vision, np.ones(seq_len, bool)))
    return workload


def _router_run(export_dir: Path, probe: onnx.ModelProto, weights: Path, workload: list[RouterChunk],
                names: list[str]) -> list[list[np.ndarray]]:
    """Per chunk, ``names``' values (each router's probabilities, then its chosen experts) for the real tokens of
    ``probe`` (a graph without its weights, which lie in ``weights``); the session closed when done (a
    released-width graph is gigabytes: one variant open at a time)."""
    run = LanguageRun(export_dir, probe.SerializeToString(), tuple(names), weights)
    values = []
    for chunk in workload:
        outputs = run.call(chunk.input_ids, chunk.position_ids, **chunk.vision)
        values.append([outputs[name].reshape(chunk.real.size, -1)[chunk.real] for name in names])
    return values


def router_comparison(export_dir: Path, chunks: int = ROUTER_CHUNKS,
                      workload: list[RouterChunk] | None = None) -> Comparison | None:
    """The MoE routers of the language graph under the fp16 emulation, with the router in fp16 and kept in fp32
    (its path from logits to renormalised weights in the node-precision list; the rest as the export's
    node-precision file says), over ``workload``'s prefill chunks (default: ``video_like_router_chunks``, ``chunks``
    of them; a real prompt's chunks give the router what a video's tokens give it), each run carrying its own
    KV/state. Per (real token, sparse layer): whether the fp16 run's top-k set differs from fp32's, and for each
    flipped one fp32's margin between its k-th and (k+1)-th router probability (how near a tie the flip was).
    None for a graph without routers.

    One variant is open at a time, and the fp16 emulation is converted once, in place, its weights written once
    for both fp16 variants: at released widths the graph is gigabytes (past protobuf's 2 GB)."""
    manifest = read_manifest(export_dir)
    language = manifest.path(export_dir, "language")
    model = onnx.load(str(language), load_external_data=False)
    paths = router_paths(model)
    if not paths:
        return None
    listed = []
    if "language_node_precision" in manifest.files:
        listed = yaml.safe_load(manifest.path(export_dir, "language_node_precision").read_text())
        listed = listed.get("FP32NodeInstanceNames") or []
    router_nodes = {name for path in paths for name in path}
    others = [name for name in listed if name not in router_nodes]
    fp32_inputs = [name for state in manifest.language_shape.layer_states if state.precision == "float32"
                   for name in state.input_names]
    workload = video_like_router_chunks(export_dir, chunks) if workload is None else workload
    probs, chosen = _router_outputs(model, paths)
    names = [*probs, *chosen]
    outputs = {}
    # The fp32 probe reads the export's own weights (loaded without them, the graph is small).
    outputs["fp32"] = _router_run(export_dir, _router_probe(model, probs, chosen), language.parent, workload, names)
    del model
    with tempfile.TemporaryDirectory() as scratch:
        # The graph without its weights, converted; the weights rounded file to file into one of scratch's, so
        # they never enter the proto. Each variant below only edits nodes.
        converted = convert_to_fp16(onnx.load(str(language), load_external_data=False), in_place=True)
        round_external_weights(converted, language.parent, Path(scratch), "converted.data")
        for label, kept in (("router_fp16", others), ("router_fp32", others + sorted(router_nodes))):
            probe = _router_probe(keep_in_fp32(converted, kept, fp32_inputs), probs, chosen)
            outputs[label] = _router_run(export_dir, probe, Path(scratch), workload, names)
    detail = router_agreement(outputs, len(paths))
    compiled = set(router_nodes) <= set(listed)
    return Comparison("router", detail={**detail, "compiled_router_precision": "float32" if compiled else "float16"})


def _by_router(outputs: list[list[np.ndarray]], index: int) -> np.ndarray:
    """Router ``index``'s values (probabilities, or chosen experts at ``routers + index``) over every chunk."""
    return np.concatenate([values[index] for values in outputs])


def router_agreement(outputs: dict[str, list[list[np.ndarray]]], routers: int) -> dict:
    """``router_comparison``'s numbers from its runs' values (per chunk: each router's probabilities, then its
    chosen experts), fp32 (``outputs["fp32"]``) against each fp16 variant:

    * per (token, sparse layer), whether the top-k set changes, with fp32's k-th - (k+1)-th margin of each flip
      (also per layer);
    * the error of the probabilities themselves, not a count of near-ties: per (token, layer) the largest
      ``|p - p_fp32|`` over the experts, its median and max (over all layers and per layer), and the share of
      (token, layer) pairs whose margin is within twice that pair's error (those the error could flip; a flip
      needs the two probabilities' errors to exceed the margin);
    * ``router_own_error_*``: at the first sparse layer, whose input both fp16 variants compute alike, the two
      variants' probabilities against each other: what the router's own precision adds, apart from the rounding
      of the hidden state it reads."""
    reference = [_by_router(outputs["fp32"], r) for r in range(routers)]
    top_k = _by_router(outputs["fp32"], routers).shape[-1]
    ranked = [-np.sort(-p, axis=-1) for p in reference]  # descending
    margins = np.concatenate([p[:, top_k - 1] - p[:, top_k] for p in ranked])
    detail = {"routers": routers, "top_k": int(top_k), "tokens_x_layers": int(margins.size),
              "median_margin": float(np.median(margins))}
    layer = np.concatenate([np.full(len(p), r) for r, p in enumerate(reference)])
    chosen = [np.sort(_by_router(outputs["fp32"], routers + r), axis=-1) for r in range(routers)]
    for label in ("router_fp16", "router_fp32"):
        flipped = np.concatenate([np.any(chosen[r] != np.sort(_by_router(outputs[label], routers + r), axis=-1),
                                         axis=-1) for r in range(routers)])
        detail[f"flipped_share_{label}"] = float(flipped.mean())
        # A later layer's flips include tokens whose earlier experts changed (a different hidden state, not a tie).
        detail[f"flipped_by_layer_{label}"] = [[float(m) for m in sorted(margins[flipped & (layer == r)])]
                                               for r in range(routers)]
        detail[f"flipped_margins_{label}"] = sorted(float(m) for m in margins[flipped])
        detail[f"flipped_margin_max_{label}"] = float(margins[flipped].max()) if flipped.any() else 0.0
        errors = [np.abs(_by_router(outputs[label], r) - reference[r]).max(axis=-1) for r in range(routers)]
        error = np.concatenate(errors)
        detail[f"prob_error_max_{label}"] = float(error.max())
        detail[f"prob_error_median_{label}"] = float(np.median(error))
        detail[f"prob_error_by_layer_{label}"] = [[float(np.median(e)), float(e.max())] for e in errors]
        detail[f"within_error_share_{label}"] = float(np.mean(margins <= 2 * error))
        # Later layers split by whether the token's experts changed at an earlier layer: the error that follows a
        # flip (another expert's output in the hidden state) against the rounding alone.
        earlier = np.cumsum(flipped.reshape(routers, -1), axis=0)[:-1] > 0  # (routers - 1, tokens)
        later = np.stack(errors[1:]) if routers > 1 else np.zeros((0, earlier.shape[1]))
        for name, mask in (("after_flip", earlier), ("no_earlier_flip", ~earlier)):
            detail[f"later_layers_prob_error_max_{name}_{label}"] = float(later[mask].max()) if mask.any() else 0.0
    own = np.abs(_by_router(outputs["router_fp16"], 0) - _by_router(outputs["router_fp32"], 0)).max(axis=-1)
    detail["router_own_error_median"], detail["router_own_error_max"] = float(np.median(own)), float(own.max())
    return detail
