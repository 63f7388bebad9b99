"""The streamed export (the default: a hollow model traced, the language graph stamped layer by layer, the weights
written from the checkpoint one tensor at a time) computes what the in-memory export (``--in-memory``: the whole
model loaded and traced at once, the export as it was) computes.

For every family, one tiny checkpoint exported both ways with continuous batching, a compute-context ladder and (where
the family's graph allows) a shorter prefill length: every graph's outputs at every specialization of the export, on
random inputs with media tokens, within 1e-6 (they come out bit-equal), and the greedy tokens of requests served
through the serving engine (chunks interleaved with decodes) equal. Then what only the streamed export does: a
checkpoint in several safetensors shards with their index exports to the same graphs; weights stored in fp16 equal
the in-memory export of the same weights rounded to fp16; an interrupted export resumes at the first layer not
written; an export the disk cannot hold is refused in one line naming both numbers.
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from helpers.exports import export_quietly
from qeff_evs.export import budget
from qeff_evs.export import weights as export_weights
from qeff_evs.export.compile import compile_export
from qeff_evs.export.pipeline import ExportOptions, export_checkpoint
from qeff_evs.manifest import LANGUAGE_DECODE, read_manifest
from qeff_evs.models.checkpoint import open_weights
from qeff_evs.models.registry import shipped_family_names
from qeff_evs.models.tiny import build_tiny_model, build_tokenizer, save_tiny_checkpoint
from qeff_evs.runtime.builders import engine_config, generate_all
from qeff_evs.runtime.engine.scheduler import SchedulerConfig
from qeff_evs.runtime.engine.serving import ServeRequest, ServingEngine
from qeff_evs.runtime.export_bundle import open_export
from qeff_evs.runtime.inputs.prompt import video_question_pieces
from qeff_evs.runtime.inputs.synthetic import moving_square_video
from qeff_evs.runtime.media import video_from_file
from qeff_evs.runtime.sessions import sessions_for
from qeff_evs.specializations import CompileOptions
from qeff_evs.specializations import read_specializations_json

FAMILIES = shipped_family_names()
RESOLUTIONS = {"qwen2_5_vl": ((112, 112),), "qwen3_vl": ((128, 128),), "qwen3_5": ((128, 128),),
               "qwen3_vl_moe": ((128, 128),), "qwen3_5_moe": ((128, 128),), "nemotron_h_omni": ((64, 64),)}
# Families whose language graph is unrolled for one prefill length (layer states): no shorter one.
HYBRID = ("qwen3_5", "qwen3_5_moe", "nemotron_h_omni")
PREFILL, CTX_LEN, LADDER, SHORT = 16, 128, (64,), (8,)
GRAPH_TOLERANCE = 1e-6


def options(family: str, **changes) -> ExportOptions:
    hybrid = family in HYBRID
    return ExportOptions(0.5, (2, 4), RESOLUTIONS[family], PREFILL, CTX_LEN, full_batch_size=3, ctx_lengths=LADDER,
                         short_prefill_lens=None if hybrid else SHORT, **changes)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """``pair(family)``: (checkpoint, streamed export, in-memory export) of one tiny checkpoint, made once."""
    made: dict[str, tuple[Path, Path, Path]] = {}

    def get(family: str) -> tuple[Path, Path, Path]:
        if family not in made:
            folder = tmp_path_factory.mktemp(f"streamed_{family}")
            checkpoint = save_tiny_checkpoint(family, folder / "checkpoint", seed=2, text_layers=3)
            streamed = export_quietly(checkpoint, folder / "streamed", options(family))
            in_memory = export_quietly(checkpoint, folder / "in_memory", options(family, in_memory=True))
            made[family] = (checkpoint, streamed, in_memory)
        return made[family]
    return get


def _session(path: Path) -> ort.InferenceSession:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def _feeds(session: ort.InferenceSession, symbols: dict, manifest, rng: np.random.Generator) -> dict:
    """Random inputs of one language specialization: a chunk with media tokens at positions its context length
    covers, each batch row its own cache row; floats (windows, caches, states) random."""
    batch, seq = symbols["batch_size"], symbols["seq_len"]
    keys = symbols.get("comp_ctx_len", symbols["ctx_len"])
    dims = {**symbols, "num_logits": 1}
    feeds = {}
    for value in session.get_inputs():
        shape = [d if isinstance(d, int) else dims[d] for d in value.shape]
        feeds[value.name] = rng.standard_normal(shape).astype(np.float32) if value.type == "tensor(float)" else None
    start = keys - seq - 1
    ids = rng.integers(0, 300, (batch, seq))
    ids[:, 1: 1 + min(seq // 2, 3)] = manifest.special_tokens.video_pad
    feeds["input_ids"] = ids.astype(np.int64)
    feeds["position_ids"] = np.broadcast_to(np.arange(start, start + seq), (4, batch, seq)).astype(np.int64).copy()
    feeds["image_idx"] = np.zeros((1, 1), np.int64)
    if "batch_index" in feeds:
        feeds["batch_index"] = rng.permutation(symbols["full_batch_size"])[:batch].reshape(-1, 1).astype(np.int64)
    if "comp_ctx_lengths" in feeds:
        feeds["comp_ctx_lengths"] = np.arange(keys, dtype=np.int64)
    if "logits_rows" in feeds:
        feeds["logits_rows"] = np.zeros(1, np.int64)
    return feeds


def assert_graphs_equal(streamed: Path, in_memory: Path, roles=("encoder", "language", LANGUAGE_DECODE)) -> None:
    """Every language specialization (the decode twin at the one-token ones) and the encoder's, the same outputs."""
    manifest = read_manifest(streamed)
    rng = np.random.default_rng(0)
    specs = read_specializations_json(streamed / manifest.files["language_specializations"])
    for role in roles:
        if role not in manifest.files:
            continue
        ours, theirs = _session(manifest.path(streamed, role)), _session(read_manifest(in_memory).path(in_memory, role))
        if role == "encoder":
            entry = manifest.encoder_entries[0]
            host = open_export(streamed).family.encoder_host_inputs(entry.grid_hw, entry.frames_per_call)
            pixels = rng.standard_normal((entry.symbols["grid_height"], entry.symbols["grid_width"]))
            cases = [{"pixel_values": pixels.astype(np.float32), **host}]
        else:
            cases = [_feeds(ours, spec.symbols, manifest, rng) for spec in specs
                     if (role == LANGUAGE_DECODE) == (spec.symbols["seq_len"] == 1)]
        assert cases, role
        for feeds in cases:
            for name, got, want in zip([o.name for o in ours.get_outputs()], ours.run(None, feeds),
                                       theirs.run(None, feeds)):
                np.testing.assert_allclose(got, want, atol=GRAPH_TOLERANCE, rtol=0, err_msg=f"{role} {name}")


def served_tokens(export: Path, folder: Path) -> dict[str, list[int]]:
    """Two requests through the serving engine (a 12-token budget: prefill chunks share steps with decodes)."""
    bundle = open_export(export)
    m = bundle.manifest
    vision, language = sessions_for(bundle, "ort")
    scheduler = SchedulerConfig(max_num_batched_tokens=12, max_num_seqs=m.language_shape.full_batch_size,
                                prefill_seq_len=m.prefill_seq_len, ctx_len=m.ctx_len,
                                encoder_compute_budget=200, encoder_cache_size=200)
    engine = ServingEngine(bundle.family, vision, language, engine_config(bundle), scheduler)
    requests = []
    for number, frames in enumerate((4, 2)):
        path = folder / f"clip_{number}.npy"
        np.save(path, moving_square_video(frames, 120, 130, seed=7 + number))
        pieces = video_question_pieces(bundle.tokenizer, "what moves" + "?" * number, bundle.family.token_strings)
        requests.append(ServeRequest(f"r{number}", pieces, [video_from_file(path, bundle)], max_new_tokens=6))
    tokens = generate_all(engine, requests)
    engine.close()
    return tokens


@pytest.mark.parametrize("family", FAMILIES)
def test_streamed_equals_in_memory(pair, family, tmp_path):
    checkpoint, streamed, in_memory = pair(family)
    assert_graphs_equal(streamed, in_memory)
    assert served_tokens(streamed, tmp_path) == served_tokens(in_memory, tmp_path)
    stamped = (streamed / "language" / "language.onnx").stat().st_size
    assert stamped < 2_000_000 and list((streamed / "language" / "weights").glob("layers.*.data"))


def test_a_sharded_checkpoint_exports_to_the_same_graphs(pair, tmp_path):
    """The checkpoint in many shards with their index (``save_pretrained``'s own sharding): the same graphs."""
    family = "qwen3_vl"
    checkpoint, streamed, _ = pair(family)
    model = build_tiny_model(family, build_tokenizer(family), seed=2, text_layers=3)
    sharded = tmp_path / "sharded"
    shutil_copy_checkpoint(checkpoint, sharded)
    model.save_pretrained(sharded, max_shard_size="100KB")
    shards = sorted(p.name for p in sharded.glob("*.safetensors"))
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(shards) > 3 and sorted(set(index["weight_map"].values())) == shards
    export = export_quietly(sharded, tmp_path / "export", options(family))
    assert_graphs_equal(export, streamed, roles=("encoder", "language"))


def test_layers_as_functions_compute_the_same(pair, tmp_path):
    """``--layer-functions``: one ONNX function per kind of layer, a call per layer; the same outputs. A family whose
    graph needs node-precision entries (layer states, MoE routers) is refused."""
    family = "qwen3_vl"
    checkpoint, _, in_memory = pair(family)
    export = export_quietly(checkpoint, tmp_path / "functions", options(family, layer_functions=True))
    model = onnx.load(str(export / "language" / "language.onnx"), load_external_data=False)
    calls = [node for node in model.graph.node if node.domain == "qeff_evs.layers"]
    assert len(calls) == 3 and len({node.op_type for node in calls}) == 2  # deepstack level 0, then plain layers
    assert_graphs_equal(export, in_memory, roles=("language",))
    # qaic-compile is told (QEfficient's -sub-functions), on the language graph's line alone; -mxfp6-matmul refused
    lines = [line for line in (export / "compile.sh").read_text().splitlines() if line.startswith('"$QAIC_COMPILE"')]
    assert [("-sub-functions" in line) for line in lines] == [("language.onnx" in line) for line in lines]
    assert any("language.onnx" in line for line in lines)
    with pytest.raises(ValueError, match="whose weights -mxfp6-matmul cannot compress"):
        compile_export(export, CompileOptions(mxfp6_matmul=True))
    with pytest.raises(ValueError, match="--layer-functions: this model's graph keeps some ops in fp32"):
        export_checkpoint(pair("qwen3_vl_moe")[0], tmp_path / "moe", options("qwen3_vl_moe", layer_functions=True))


def shutil_copy_checkpoint(source: Path, target: Path) -> None:
    """The checkpoint's files but its weights (config, tokenizer, preprocessor)."""
    target.mkdir(parents=True)
    for path in source.iterdir():
        if path.suffix != ".safetensors" and path.name != "model.safetensors.index.json":
            target.joinpath(path.name).write_bytes(path.read_bytes())


def test_fp16_weights_equal_the_in_memory_export_of_fp16_rounded_weights(tmp_path):
    """``--weight-dtype float16``: the graph reads its weights through a Cast from fp16. Reference: the checkpoint
    with every weight the export stores in fp16 rounded to fp16 by torch, exported in memory in fp32."""
    family = "qwen3_vl_moe"
    checkpoint = save_tiny_checkpoint(family, tmp_path / "checkpoint", seed=3)
    half = export_quietly(checkpoint, tmp_path / "half", options(family, weight_dtype="float16"))
    model = build_tiny_model(family, build_tokenizer(family), seed=3)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() >= 2:  # matrices are stored fp16, vectors fp32 (weights.stored_dtype)
                parameter.copy_(parameter.half().float())
    rounded = tmp_path / "rounded"
    shutil_copy_checkpoint(checkpoint, rounded)
    model.save_pretrained(rounded)
    reference = export_quietly(rounded, tmp_path / "reference", options(family, in_memory=True))
    assert read_manifest(half).weight_dtype == "float16"
    halves = [p for p in (half / "language" / "weights").glob("*.json")
              if any(t["data_type"] == 10 for t in json.loads(p.read_text())["tensors"])]
    assert halves, "no weight stored in fp16"
    assert_graphs_equal(half, reference, roles=("language",))
    # The fp32-kept router ops stay listed, the same nodes as in the fp32 export's file.
    assert (half / "language" / "node_precision.yaml").read_text().count("- ") > 0


class RowCountingReader:
    """A checkpoint reader that counts the tensors read by rows (``rows``) and whole (``whole``)."""

    def __init__(self, inner):
        self.inner, self.rows, self.whole = inner, set(), set()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def tensor(self, name: str):
        self.whole.add(name)
        return self.inner.tensor(name)

    def read_rows(self, name: str, start: int, stop: int):
        self.rows.add(name)
        return self.inner.read_rows(name, start, stop)


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5", "nemotron_h_omni"])
def test_matrices_read_by_rows_write_the_same_weights(pair, family, tmp_path, monkeypatch):
    """A matrix over ``BY_ROWS_ABOVE`` (at full size: the embedding and the LM head) is read and written a block of
    rows at a time. With both at 1 KiB every matrix of the tiny model goes that way (Nemotron-H's attention projections
    from a part of the fused ``qkv``): the same graphs as the in-memory export, and in fp16 byte for byte the weight
    files of the export that reads each matrix whole. The RoPE tables (over ``TABLE_BYTES``, here also 1 KiB) leave
    each language graph's file for a tables file of its own (Qwen3.5's decode twin has its own)."""
    checkpoint, _, in_memory = pair(family)
    whole = export_quietly(checkpoint, tmp_path / "whole", options(family, weight_dtype="float16"))
    monkeypatch.setattr(export_weights, "ROW_BLOCK", 1 << 10)
    monkeypatch.setattr(export_weights, "BY_ROWS_ABOVE", 1 << 10)
    monkeypatch.setattr(export_weights, "TABLE_BYTES", 1 << 10)
    for dtype in ("float32", "float16"):
        with open_weights(checkpoint) as inner:
            reader = RowCountingReader(inner)
            export = export_checkpoint(checkpoint, tmp_path / dtype, options(family, weight_dtype=dtype),
                                       weights=reader)
        assert any(".embed" in name for name in reader.rows) and any("lm_head" in name for name in reader.rows)
        if family == "nemotron_h_omni":
            assert any("q_proj" in name for name in reader.rows)
        if dtype == "float32":
            assert_graphs_equal(tmp_path / dtype, in_memory)
            graphs = sorted((tmp_path / dtype / "language").glob("*.onnx"))
            tables = sorted(p.name for p in (tmp_path / dtype / "language" / "weights").glob("*.tables.data"))
            assert tables == ([f"{graph.stem}.tables.data" for graph in graphs] if family != "nemotron_h_omni" else [])
            for graph in graphs:
                model = onnx.load(str(graph), load_external_data=False)
                assert not [n for n in model.graph.node if n.op_type == "Constant" and n.attribute[0].t.ByteSize() > 2048]
            continue
        for folder in ("vision", "language"):
            files = sorted(p.name for p in (whole / folder / "weights").iterdir())
            assert files == sorted(p.name for p in (tmp_path / dtype / folder / "weights").iterdir()
                                   if ".tables." not in p.name)
            for name in files:
                assert (whole / folder / "weights" / name).read_bytes() == \
                    (tmp_path / dtype / folder / "weights" / name).read_bytes(), name


class FailingReader:
    """A checkpoint reader that fails when asked for a tensor whose name holds ``stop_at`` (an export interrupted
    while writing its weights; ``None``: never); ``names_read``: every tensor it gave."""

    def __init__(self, inner, stop_at: str | None):
        self.inner, self.stop_at, self.names_read = inner, stop_at, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def tensor(self, name: str):
        if self.stop_at is not None and self.stop_at in name:
            raise KeyboardInterrupt(f"interrupted at {name}")
        self.names_read.append(name)
        return self.inner.tensor(name)


def test_an_interrupted_export_resumes_at_the_first_layer_not_written(pair, tmp_path):
    family = "qwen2_5_vl"
    checkpoint, streamed, _ = pair(family)
    out = tmp_path / "export"
    with open_weights(checkpoint) as weights, pytest.raises(KeyboardInterrupt), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        export_checkpoint(checkpoint, out, options(family), weights=FailingReader(weights, "language_model.layers.1."))
    written = sorted(p.name for p in (out / "language" / "weights").iterdir())
    assert written == ["embedding.data", "embedding.json", "layers.0.data", "layers.0.json", "layers.1.data.partial"]
    assert not (out / "language" / "language.onnx").exists()
    messages = []
    with open_weights(checkpoint) as weights, warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        reader = FailingReader(weights, None)
        export_checkpoint(checkpoint, out, options(family), progress=messages.append, weights=reader)
    assert any("language.onnx weights: 2 of 5 units already written, resuming at layers.1" in m for m in messages)
    assert reader.names_read and not any("layers.0." in name or "visual" in name for name in reader.names_read)
    assert_graphs_equal(out, streamed, roles=("encoder", "language"))


def test_an_export_the_disk_cannot_hold_is_refused_naming_both_numbers(pair, tmp_path, monkeypatch):
    family = "qwen2_5_vl"
    checkpoint, _, _ = pair(family)
    monkeypatch.setattr(budget, "free_disk", lambda folder: 1 << 20)
    with pytest.raises(ValueError) as refused:
        export_checkpoint(checkpoint, tmp_path / "export", options(family))
    line = str(refused.value)
    assert "\n" not in line and "--weight-dtype float16" in line
    assert re.search(r"needs about \d+\.\d GiB of disk in .*export \(weights in float32\), 0\.0 GiB free there", line)
    assert not (tmp_path / "export" / "language" / "weights").exists()
