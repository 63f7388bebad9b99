"""The pruning graphs (EVS and VidCom2 rankings over a frame bucket) against vLLM 0.32.0's own functions.

Four graphs are exported, one per method and scoring width (Qwen2.5-VL: the merger rows; Qwen3-VL: the rows and
three deepstack levels as ``score_extras``), each traced at a size unrelated to the cases (5 tokens per frame, a
bucket of 3, T = 2). Each one then serves every bucket (2, 4, 8, 16 temporal patches), every T in the bucket and
every q: the host keeps the first K(q, T) entries of the ranking and that set must equal vLLM's mask, in eager
torch and in ONNX Runtime. Padding rows hold garbage on purpose: they must change nothing.

Embeddings: random, and kinds that put the cut inside exact ties (``helpers.pruning_oracles``). VidCom2's ties are
structural (identical vectors) and survive any float arithmetic; EVS through ONNX Runtime uses rows whose cosines
both runtimes compute exactly (with generic floats, 1 - cos(x, x) differs in its last bit between them).
"""

from __future__ import annotations

import functools
import warnings
import zlib
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from helpers.pruning_oracles import EXACT_COSINE_KINDS, GENERIC_KINDS, vllm_count, vllm_kept

from qeff_evs.evs import kept_from_ranking
from qeff_evs.export.onnx_graph import DATA_DEPENDENT_OPS
from qeff_evs.export.vision import _export
from qeff_evs.models.pruning import (
    BUCKET_TOKENS,
    FRAME_BUCKET,
    PRUNING_METHODS,
    PruningRanking,
    pad_to_bucket,
    pruning_symbols,
)

ort = pytest.importorskip("onnxruntime")

BUCKETS = {2: (4, 5), 4: (3, 4), 8: (2, 3), 16: (3, 4)}  # frame bucket -> merged grid (h, w)
RATES = (0.0, 0.1, 0.5, 0.75, 0.9)
HIDDEN = 32  # rows of 16 and 64 scoring channels: every row a whole number of SIMD vectors
LEVELS = (0, 3)  # score_extras levels: none (Qwen2.5-VL), three deepstack levels (Qwen3-VL)
GRAPHS = [(method, levels) for method in PRUNING_METHODS for levels in LEVELS]


def _graph_id(graph: tuple[str, int]) -> str:
    return f"{graph[0]}-levels{graph[1]}"


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict[tuple[str, int], Path]:
    folder = tmp_path_factory.mktemp("pruning_graphs")
    paths = {}
    for method, levels in GRAPHS:
        module = PruningRanking(method, levels)
        inputs = module.dummy_inputs(tokens_per_frame=5, bucket=3, hidden=HIDDEN, frame_count=2)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the legacy exporter's notices
            paths[method, levels] = _export(module, module.graph_spec, inputs, folder / f"{method}{levels}.onnx",
                                            f"{method} ranking", progress=lambda message: None)
    return paths


def _session(path: Path):
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1  # graphs this small run faster without the thread pool
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module")
def sessions(exported) -> dict[tuple[str, int], object]:
    return {key: _session(path) for key, path in exported.items()}


def _split(rows: np.ndarray, levels: int) -> dict[str, np.ndarray]:
    """Full-width rows ``(N, HIDDEN*(1+levels))`` -> ``merged_embeds`` and ``score_extras`` (level-major)."""
    feeds = {"merged_embeds": np.ascontiguousarray(rows[:, :HIDDEN])}
    if levels:
        extras = rows[:, HIDDEN:].reshape(rows.shape[0], levels, HIDDEN).transpose(1, 0, 2)
        feeds["score_extras"] = np.ascontiguousarray(extras)
    return feeds


KIND_SETS = {"generic": GENERIC_KINDS, "exact_cosine": EXACT_COSINE_KINDS}


def _video(kinds: str, kind: str, levels: int, bucket: int, frames: int) -> np.ndarray:
    seed = zlib.crc32(f"{kinds}{kind}{levels}{bucket}{frames}".encode())
    return KIND_SETS[kinds][kind](np.random.default_rng(seed), frames, int(np.prod(BUCKETS[bucket])), HIDDEN * (1 + levels))


@functools.lru_cache(maxsize=None)
def _expected(method: str, kinds: str, kind: str, levels: int, bucket: int, frames: int, q: float) -> np.ndarray:
    """vLLM's kept indices (computed once for the eager and the ONNX Runtime test alike)."""
    return vllm_kept(method, _video(kinds, kind, levels, bucket, frames), frames, BUCKETS[bucket], q)


def _cases(kinds: str, levels: int, kind: str):
    """Every bucket, T in it and q: ``(bucket, T, q, padded feeds)``; padding rows hold garbage."""
    for bucket, (h, w) in BUCKETS.items():
        for frames in range(1, bucket + 1):
            video = _video(kinds, kind, levels, bucket, frames)
            garbage = np.random.default_rng(frames).standard_normal(((bucket - frames) * h * w, video.shape[1])) * 50
            feeds = _split(np.concatenate([video, garbage.astype(np.float32)]), levels)
            for q in RATES:
                yield bucket, frames, q, feeds


def _check(method: str, kinds: str, kind: str, levels: int, ranking: np.ndarray, bucket: int, frames: int,
           q: float, label: str) -> None:
    tokens = int(np.prod(BUCKETS[bucket]))
    assert ranking.dtype == np.int64 and ranking.shape == (bucket * tokens,), label
    assert np.array_equal(np.sort(ranking), np.arange(bucket * tokens)), f"{label}: not a permutation"
    assert np.array_equal(ranking[frames * tokens:], np.arange(frames * tokens, bucket * tokens)), \
        f"{label}: padding rows must rank last, in index order"
    got = kept_from_ranking(ranking, vllm_count(method, tokens, frames, q))
    want = _expected(method, kinds, kind, levels, bucket, frames, q)
    if not np.array_equal(got, want):
        pytest.fail(f"{label} B={bucket} T={frames} q={q}: kept {np.setdiff1d(got, want)[:8]} instead of "
                    f"{np.setdiff1d(want, got)[:8]}")


@pytest.mark.parametrize("kind", list(GENERIC_KINDS))
@pytest.mark.parametrize("graph", GRAPHS, ids=_graph_id)
def test_eager_ranking_equals_vllm(graph, kind):
    method, levels = graph
    module = PruningRanking(method, levels)
    for bucket, frames, q, feeds in _cases("generic", levels, kind):
        inputs = {name: torch.from_numpy(array) for name, array in
                  {**feeds, **module.host_inputs(bucket, frames, q)}.items()}
        with torch.no_grad():
            ranking = module(*inputs.values()).numpy()
        _check(method, "generic", kind, levels, ranking, bucket, frames, q, f"eager {_graph_id(graph)} {kind}")


@pytest.mark.parametrize("kind", list(GENERIC_KINDS))
@pytest.mark.parametrize("graph", GRAPHS, ids=_graph_id)
def test_onnx_ranking_equals_vllm(sessions, graph, kind):
    method, levels = graph
    module, session = PruningRanking(method, levels), sessions[graph]
    kinds = "exact_cosine" if method == "evs" else "generic"
    for bucket, frames, q, feeds in _cases(kinds, levels, kind):
        (ranking,) = session.run(["ranking"], {**feeds, **module.host_inputs(bucket, frames, q)})
        _check(method, kinds, kind, levels, ranking, bucket, frames, q, f"ORT {_graph_id(graph)} {kind}")


@pytest.mark.parametrize("graph", GRAPHS, ids=_graph_id)
def test_graph_interface_is_per_bucket_only(exported, graph):
    """Named symbols for the bucket and its rows only (none for T or q), static ops, TopK selection."""
    method, levels = graph
    module = PruningRanking(method, levels)
    model = onnx.load(str(exported[graph]))
    onnx.checker.check_model(model)
    dims = {value.name: [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]
            for value in [*model.graph.input, *model.graph.output]}
    want = {"merged_embeds": [BUCKET_TOKENS, HIDDEN]}
    if levels:
        want["score_extras"] = [levels, BUCKET_TOKENS, HIDDEN]
    want.update(bucket_carrier=[FRAME_BUCKET], frame_count=[1])
    if method == "vidcom2":
        want["retention_ratio"] = [1]
    want["ranking"] = [BUCKET_TOKENS]
    assert dims == want and list(dims) == [*module.graph_spec.input_names, *module.graph_spec.output_names]
    assert module.graph_spec.symbols == {FRAME_BUCKET, BUCKET_TOKENS}
    assert module.symbols(12, 8) == pruning_symbols(12, 8) == {FRAME_BUCKET: 8, BUCKET_TOKENS: 96}
    ops = {node.op_type for node in model.graph.node}
    assert "TopK" in ops and not ops & (DATA_DEPENDENT_OPS | {"Loop", "If", "Scan"}), ops
    assert model.opset_import[0].version == 17


@pytest.mark.parametrize("graph", GRAPHS, ids=_graph_id)
def test_padding_content_never_matters(sessions, graph):
    """Zeros, huge values or NaN in the padding rows: the same ranking, eager and in ONNX Runtime."""
    method, levels = graph
    module, session = PruningRanking(method, levels), sessions[graph]
    bucket, (h, w), frames = 8, (2, 3), 5
    video = GENERIC_KINDS["random"](np.random.default_rng(5), frames, h * w, HIDDEN * (1 + levels))
    rankings = []
    for fill in (0.0, 1e4, np.nan):
        rows = pad_to_bucket(video, bucket * h * w)
        rows[frames * h * w:] = fill
        feeds = {**_split(rows, levels), **module.host_inputs(bucket, frames, 0.5)}
        rankings.append(session.run(["ranking"], feeds)[0])
        with torch.no_grad():
            rankings.append(module(*(torch.from_numpy(v) for v in feeds.values())).numpy())
    assert all(np.array_equal(r, rankings[0]) for r in rankings), graph


def _rounded_rows(seed: int, frames: int, tokens: int, width: int) -> np.ndarray:
    """Video-like rows with realistic norms (20..100), rounded to fp16 (what fp16 custom I/O delivers)."""
    rng = np.random.default_rng(seed)
    base = rng.standard_normal((tokens, width))
    rows = []
    for _ in range(frames):
        base = base + rng.standard_normal((tokens, width)) * rng.uniform(0.05, 0.5, size=(tokens, 1))
        rows.append(base * rng.uniform(20, 100, size=(tokens, 1)) / np.linalg.norm(base, axis=1, keepdims=True))
    return np.concatenate(rows).astype(np.float16)


@pytest.mark.parametrize("method", PRUNING_METHODS)
def test_fp16_io_keeps_fp32_arithmetic(tmp_path, method):
    """An fp16-I/O export casts its rows to fp32 at the edge and computes nothing in fp16: it keeps exactly what
    vLLM keeps on the same (fp16-valued) rows in fp32, as the fp32 graph does when fed those rows (the card's
    custom I/O on a graph compiled without -convert-to-fp16, as ``verify --fp16`` runs it)."""
    module = PruningRanking(method, score_levels=3)
    width, bucket, (h, w) = 64, 8, (3, 4)
    inputs = module.dummy_inputs(5, 3, width, frame_count=2, dtype=torch.float16)
    path = _export(module, module.graph_spec, inputs, tmp_path / "fp16.onnx", "fp16 ranking", lambda m: None)
    model = onnx.shape_inference.infer_shapes(onnx.load(str(path)))
    graph = model.graph
    half = {v.name for v in [*graph.input, *graph.value_info, *graph.output]
            if v.type.tensor_type.elem_type == onnx.TensorProto.FLOAT16}
    assert half == {"merged_embeds", "score_extras"}, half
    readers = [node for node in graph.node if set(node.input) & half]
    assert readers and all(node.op_type == "Shape" or node.op_type == "Cast" and node.attribute[0].i == onnx.TensorProto.FLOAT
                           for node in readers), [n.op_type for n in readers]

    fp16_session = _session(path)
    for frames in (1, 5, 8):
        video = _rounded_rows(frames, frames, h * w, width * 4)
        rows = pad_to_bucket(video, bucket * h * w)
        for q in RATES:
            host = module.host_inputs(bucket, frames, q)
            feeds = {"merged_embeds": rows[:, :width],
                     "score_extras": np.ascontiguousarray(rows[:, width:].reshape(-1, 3, width).transpose(1, 0, 2))}
            (ranking,) = fp16_session.run(["ranking"], {**feeds, **host})
            want = vllm_kept(method, video.astype(np.float32), frames, (h, w), q)
            k = vllm_count(method, h * w, frames, q)
            assert np.array_equal(kept_from_ranking(ranking, k), want), (method, frames, q)
            with torch.no_grad():  # the fp32 module on the rounded rows (custom I/O): the same set
                eager = module(*(torch.from_numpy(np.asarray(v, dtype=np.float32) if v.dtype == np.float16
                                                         else v) for v in {**feeds, **host}.values()))
            assert np.array_equal(kept_from_ranking(eager, k), want), (method, frames, q)


def test_kept_indices_takes_a_prefix_in_ascending_order():
    ranking = np.array([5, 0, 3, 1, 4, 2], dtype=np.int64)
    kept = kept_from_ranking(ranking, 3)
    assert kept.dtype == np.int64 and kept.tolist() == [0, 3, 5]
    assert kept_from_ranking(torch.from_numpy(ranking), 6).tolist() == list(range(6))
    for bad in (0, 7, 2.5, True):
        with pytest.raises(ValueError, match="cannot keep"):
            kept_from_ranking(ranking, bad)
    with pytest.raises(ValueError, match="1-D integer"):
        kept_from_ranking(ranking.astype(np.float32), 2)


def test_host_inputs_and_eager_checks_refuse_bad_requests():
    module = PruningRanking("vidcom2")
    assert module.host_inputs(4, 3, 0.25)["retention_ratio"].tolist() == [0.75]
    with pytest.raises(ValueError, match=r"frame_count 5 is outside \[1, 4\]"):
        module.host_inputs(4, 5, 0.5)
    with pytest.raises(ValueError, match="pruning rate"):
        PruningRanking("evs").host_inputs(4, 2, 1.0)
    with pytest.raises(ValueError, match="unknown video pruning method 'dart'"):
        PruningRanking("dart")
    inputs = module.dummy_inputs(6, 4, 8)
    inputs["frame_count"] = torch.tensor([5])
    with pytest.raises(ValueError, match=r"frame_count 5 is outside \[1, 4\]"):
        module(*inputs.values())
    with pytest.raises(ValueError, match="do not split into a bucket of 5"):
        module(inputs["merged_embeds"], torch.zeros(5, dtype=torch.int64), torch.tensor([2]),
               inputs["retention_ratio"])
    with pytest.raises(ValueError, match="do not fit a bucket of 10"):
        pad_to_bucket(np.zeros((12, 3)), 10)
