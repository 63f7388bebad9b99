"""The export folder's real files (docs/design.md#the-three-graphs): manifest, specializations (both layouts), custom
IO, compile script, and the "every symbol bound" check run on the exported graphs themselves.

Expected values are derived here from the export options, the tokenizer and transformers'
own helpers; the files are read with json / yaml / onnx / shlex, not with the package's readers
(except where a test is about those readers).
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import onnx
import pytest
import torch
import yaml
from transformers import AutoTokenizer, GenerationConfig
from transformers.vision_utils import get_vision_window_index

from qeff_evs.manifest import MANIFEST_NAME, read_manifest
from qeff_evs.specializations import check_specializations, read_specializations_json

# What the tiny checkpoint is built with (qeff_evs/models/tiny.py); stated here so a change shows.
PATCH, MERGE, TEMPORAL_PATCH, CHANNELS, WINDOW = 14, 2, 2, 3, 56
NUM_LAYERS = 2

ENCODER_SYMBOLS = ("frames_per_call", "grid_h", "grid_w", "grid_height", "grid_width", "merged_rows")
PRUNING_SYMBOLS = ("frame_bucket", "bucket_tokens")
METHODS = ("evs", "vidcom2")  # the default --video-pruning-methods, the first the default method
FRAMES_PER_CALL = 2  # the export's default

# graph -> (onnx, specializations.json, its named copy, custom IO), relative to the export folder
GRAPH_FILES = {
    "encoder": ("vision/encoder.onnx", "vision/encoder_specializations.json",
                "vision/encoder_specializations.named.json", "vision/encoder_custom_io.yaml"),
    **{f"pruning_{m}": (f"vision/pruning_{m}.onnx", f"vision/pruning_{m}_specializations.json",
                        f"vision/pruning_{m}_specializations.named.json", f"vision/pruning_{m}_custom_io.yaml")
       for m in METHODS},
    "language": ("language/language.onnx", "language/specializations.json", "language/specializations.named.json",
                 "language/custom_io.yaml"),
}


def load_json(path: Path):
    return json.loads(path.read_text())


def graph_dims(path: Path) -> dict[str, list]:
    """{io name: [dim_param or dim_value]} of a graph's inputs and outputs, read with onnx."""
    proto = onnx.load(str(path), load_external_data=False)
    weights = {init.name for init in proto.graph.initializer}
    ios = [vi for vi in proto.graph.input if vi.name not in weights] + list(proto.graph.output)
    return {vi.name: [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim] for vi in ios}


def symbols_of(dims: dict[str, list]) -> set[str]:
    return {d for shape in dims.values() for d in shape if isinstance(d, str)}


@pytest.fixture(scope="module")
def manifest_json(tiny_export):
    return load_json(tiny_export / "manifest.json")


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint):
    return AutoTokenizer.from_pretrained(tiny_checkpoint)


# --------------------------------------------------------------------------------------------------
# manifest.json


def test_manifest_names_every_file_of_the_export(tiny_export, manifest_json, tokenizer, tmp_path):
    files = manifest_json["files"]
    for role, relative in files.items():
        assert (tiny_export / relative).exists(), (role, relative)
    # The tokenizer's folder is the export's top (a model folder): its files are what save_pretrained writes.
    assert files["tokenizer"] == "."
    tokenizer_files = {Path(f).name for f in tokenizer.save_pretrained(tmp_path / "tokenizer")}
    named = [tiny_export / relative for role, relative in files.items() if role != "tokenizer"]
    for path in tiny_export.rglob("*"):
        if path.is_file() and path.name != "manifest.json":
            unnamed = path.relative_to(tiny_export)
            if path.parent == tiny_export and path.name in tokenizer_files:
                continue
            assert any(path == p or p in path.parents for p in named), f"{unnamed} is not in the manifest"
    for graph, (onnx_file, flat, named_file, custom_io) in GRAPH_FILES.items():
        assert files[graph] == onnx_file
        assert files[f"{graph}_specializations"] == flat and files[f"{graph}_specializations_named"] == named_file
        assert files[f"{graph}_custom_io"] == custom_io
    for role in ("tokenizer", "compile_script"):
        assert role in files


def test_manifest_records_family_and_export_options(manifest_json, export_options):
    m = manifest_json
    assert m["family"] == "qwen2_5_vl"
    assert m["video_pruning_rate"] == export_options.video_pruning_rate
    assert m["prefill_seq_len"] == export_options.prefill_seq_len
    assert m["ctx_len"] == export_options.ctx_len
    assert m["user_vision_size"] == export_options.user_vision_size
    assert m["version"] == 2
    assert m["sampled_frame_buckets"] == list(export_options.frames)  # --frames are the buckets
    assert m["temporal_patch_buckets"] == [f // TEMPORAL_PATCH for f in export_options.frames]
    assert m["video_pruning_methods"] == list(METHODS) and m["video_pruning_method"] == "evs"
    assert m["max_video_pruning_rate"] == 0.9
    assert [tuple(r) for r in m["resolutions"]] == list(export_options.resolutions)
    assert m["kv_precision"] == "float16"
    assert m["language_shape"]["num_layers"] == NUM_LAYERS


def test_manifest_special_tokens_are_the_tokenizers(manifest_json, tokenizer, tiny_checkpoint):
    tokens = manifest_json["special_tokens"]
    by_name = {"image_pad": "<|image_pad|>", "video_pad": "<|video_pad|>",
               "vision_start": "<|vision_start|>", "vision_end": "<|vision_end|>"}
    for key, token in by_name.items():
        assert tokens[key] == tokenizer.convert_tokens_to_ids(token), key
    config = load_json(tiny_checkpoint / "config.json")
    assert tokens["video_pad"] == config["video_token_id"]
    generation_eos = GenerationConfig.from_pretrained(tiny_checkpoint).eos_token_id
    assert set(tokens["eos"]) == {tokenizer.convert_tokens_to_ids("<|im_end|>")} | set(generation_eos)


def test_manifest_reads_back(tiny_export, manifest_json):
    manifest = read_manifest(tiny_export)
    assert manifest.user_vision_size == manifest_json["user_vision_size"]
    buckets = [(e["method"], e["height"], e["width"], e["temporal_patches"]) for e in manifest_json["pruning_entries"]]
    assert [(e.method, e.height, e.width, e.temporal_patches) for e in manifest.pruning_entries] == buckets
    assert manifest.temporal_patch_buckets == tuple(f // TEMPORAL_PATCH for f in manifest_json["sampled_frame_buckets"])
    assert [e.grid_hw for e in manifest.encoder_entries] == [tuple(e["grid_hw"]) for e in manifest_json["encoder_entries"]]
    assert manifest.frames_per_call == FRAMES_PER_CALL


def test_export_folder_is_a_vllm_model_folder_sized_to_ctx_len(tiny_export, export_options):
    # vLLM reads the top-level config.json: our interface architecture, and a context of exactly ctx_len
    # (its default max_model_len), never the checkpoint's own max_position_embeddings.
    import json

    config = json.loads((tiny_export / "config.json").read_text())
    assert config["architectures"][0].startswith("QeffEvs")
    assert config["text_config"]["max_position_embeddings"] == export_options.ctx_len


# --------------------------------------------------------------------------------------------------
# specializations.json, both layouts


@pytest.mark.parametrize("graph", list(GRAPH_FILES))
def test_specializations_json_is_named_by_default(tiny_export, graph):
    """QEfficient >= 1.22's named layout (``qeff-evs compile --specializations-layout flat`` writes the old one)."""
    _, main_file, named_file, _ = GRAPH_FILES[graph]
    main = load_json(tiny_export / main_file)["specializations"]
    named = load_json(tiny_export / named_file)["specializations"]
    assert main == named and all(set(entry) == {"name", "symbols"} for entry in main)
    for entry in main:
        assert all(isinstance(v, str) and v.isdigit() for v in entry["symbols"].values()), entry  # stringified
    assert read_specializations_json(tiny_export / main_file) == read_specializations_json(tiny_export / named_file)


def test_language_specializations_carry_user_vision_size(tiny_export, export_options):
    named = load_json(tiny_export / "language" / "specializations.named.json")["specializations"]
    assert [entry["name"] for entry in named] == ["Prefill", "Decode"]
    prefill, decode = (entry["symbols"] for entry in named)
    shared = {"batch_size": "1", "ctx_len": str(export_options.ctx_len),
              "vision_size": str(export_options.user_vision_size),
              "num_logits": "1"}  # the card always computes one logits row per call
    assert prefill == {**shared, "seq_len": str(export_options.prefill_seq_len)}
    assert decode == {**shared, "seq_len": "1"}
    assert export_options.user_vision_size != export_options.prefill_seq_len  # so the check above tells them apart


def expected_encoder_symbols(height: int, width: int) -> dict[str, str]:
    h, w = height // PATCH, width // PATCH
    _, cu_window = get_vision_window_index(torch.tensor([[1, h, w]]), spatial_merge_size=MERGE,
                                           window_size=WINDOW, patch_size=PATCH)
    window_lengths = [b - a for a, b in zip(cu_window.tolist(), cu_window.tolist()[1:])]
    symbols = {
        "frames_per_call": FRAMES_PER_CALL,
        "grid_h": h,
        "grid_w": w,
        "grid_height": FRAMES_PER_CALL * h * w,
        "grid_width": CHANNELS * TEMPORAL_PATCH * PATCH * PATCH,
        "frame_patches": h * w,
        "merged_rows": FRAMES_PER_CALL * h * w // MERGE ** 2,
        "frame_tokens": h * w // MERGE ** 2,
        "windows": len(window_lengths),
        "window_len": max(window_lengths),
    }
    return {k: str(v) for k, v in symbols.items()}


def expected_pruning_symbols(height: int, width: int, frames: int) -> dict[str, str]:
    bucket = frames // TEMPORAL_PATCH
    per_frame = (height // PATCH // MERGE) * (width // PATCH // MERGE)
    return {"frame_bucket": str(bucket), "bucket_tokens": str(bucket * per_frame)}  # no rate: K is the host's


def test_encoder_specializations_one_per_resolution(tiny_export, export_options, manifest_json):
    flat = [e["symbols"] for e in load_json(tiny_export / "vision" / "encoder_specializations.json")["specializations"]]
    assert len(flat) == len(export_options.resolutions)  # whatever the frame counts
    for entry, (height, width) in zip(flat, export_options.resolutions):
        assert set(ENCODER_SYMBOLS) <= set(entry)
        assert entry == expected_encoder_symbols(height, width), (height, width)
    served = [(e["height"], e["width"], e["frames_per_call"]) for e in manifest_json["encoder_entries"]]
    assert served == [(h, w, FRAMES_PER_CALL) for h, w in export_options.resolutions]


@pytest.mark.parametrize("method", METHODS)
def test_pruning_specializations_one_per_resolution_and_frame_bucket(tiny_export, export_options, manifest_json,
                                                                     method):
    path = tiny_export / "vision" / f"pruning_{method}_specializations.json"
    flat = [e["symbols"] for e in load_json(path)["specializations"]]
    targets = [(h, w, f) for h, w in export_options.resolutions for f in export_options.frames]
    assert len(flat) == len(targets)  # whatever the rate
    for entry, (height, width, frames) in zip(flat, targets):
        assert set(entry) == set(PRUNING_SYMBOLS)
        assert entry == expected_pruning_symbols(height, width, frames), (height, width, frames)
    served = [(e["height"], e["width"], e["frames"], e["temporal_patches"]) for e in manifest_json["pruning_entries"]
              if e["method"] == method]
    assert served == [(h, w, f, f // TEMPORAL_PATCH) for h, w, f in targets]


def test_bucket_units_agree_end_to_end(tiny_export, manifest_json):
    """Each bucket unit under its own name: the manifest's sampled-frame buckets, converted to temporal patches, are
    its temporal_patch_buckets and exactly the ``frame_bucket`` values each pruning graph's specializations file binds
    (at every resolution); a video of any length up to the largest picks the smallest of them holding it."""
    sampled = manifest_json["sampled_frame_buckets"]
    assert all(f % TEMPORAL_PATCH == 0 for f in sampled)
    converted = [f // TEMPORAL_PATCH for f in sampled]
    assert manifest_json["temporal_patch_buckets"] == converted
    manifest = read_manifest(tiny_export)
    for method in manifest.video_pruning_methods:
        path = tiny_export / "vision" / f"pruning_{method}_specializations.json"
        bound = [{k: int(v) for k, v in e["symbols"].items()} for e in load_json(path)["specializations"]]
        served = {(b["frame_bucket"], b["bucket_tokens"] // b["frame_bucket"]) for b in bound}
        tokens_per_frame = [(h // (PATCH * MERGE)) * (w // (PATCH * MERGE)) for h, w in manifest.resolutions]
        assert served == {(b, n) for b in converted for n in tokens_per_frame}
        for (height, width), t in ((r, t) for r in manifest.resolutions for t in range(1, max(converted) + 1)):
            entry = manifest.pruning_entry(method, (t, height // PATCH, width // PATCH), PATCH)
            assert int(entry.symbols["frame_bucket"]) == entry.temporal_patches == min(b for b in converted if b >= t)
            assert entry.frames == entry.temporal_patches * TEMPORAL_PATCH in sampled


def test_a_manifest_with_the_old_bucket_key_reads_the_same(tiny_export, tmp_path):
    """Manifests written before the buckets were named by their unit call the sampled-frame buckets
    ``frame_buckets`` and carry no temporal_patch_buckets: read, they give the same manifest."""
    raw = load_json(tiny_export / MANIFEST_NAME)
    raw["frame_buckets"] = raw.pop("sampled_frame_buckets")
    del raw["temporal_patch_buckets"]
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(raw))
    assert read_manifest(tmp_path) == read_manifest(tiny_export)
    raw["temporal_patch_buckets"] = [3]  # a hand edit that disagrees with the pruning entries
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"temporal_patch_buckets \[3\] but its pruning entries serve \[2, 4\]"):
        read_manifest(tmp_path)


# --------------------------------------------------------------------------------------------------
# the graphs against their specializations


@pytest.mark.parametrize("graph", list(GRAPH_FILES))
def test_every_graph_symbol_is_bound_in_every_specialization(tiny_export, graph):
    onnx_file, flat_file, _, _ = GRAPH_FILES[graph]
    dims = graph_dims(tiny_export / onnx_file)
    assert all(d != 0 for shape in dims.values() for d in shape), "a dynamic axis without a name"
    symbols = symbols_of(dims)
    assert symbols, "the graph has no dynamic symbols at all"
    for entry in load_json(tiny_export / flat_file)["specializations"]:
        assert symbols <= set(entry["symbols"]), symbols - set(entry["symbols"])


@pytest.mark.parametrize("graph, symbol", [("language", "vision_size"), ("language", "ctx_len"),
                                           ("pruning_evs", "bucket_tokens"), ("pruning_vidcom2", "frame_bucket"),
                                           ("encoder", "grid_height"),
                                           ("encoder", "window_len")])
def test_symbol_check_fails_loudly_on_the_real_graph(tiny_export, graph, symbol):
    onnx_file, flat_file, _, _ = GRAPH_FILES[graph]
    specs = [e["symbols"] for e in load_json(tiny_export / flat_file)["specializations"]]
    broken = [dict(entry) for entry in specs]
    del broken[-1][symbol]
    check_specializations(tiny_export / onnx_file, [{k: int(v) for k, v in e.items()} for e in specs])
    with pytest.raises(ValueError, match=rf"symbol '{symbol}'.*not bound"):
        check_specializations(tiny_export / onnx_file, [{k: int(v) for k, v in e.items()} for e in broken])


# --------------------------------------------------------------------------------------------------
# custom_io.yaml


def test_custom_io_names_real_graph_ios_in_fp16(tiny_export):
    entries = {graph: yaml.safe_load((tiny_export / files[3]).read_text()) for graph, files in GRAPH_FILES.items()}
    for graph, records in entries.items():
        ios = graph_dims(tiny_export / GRAPH_FILES[graph][0])
        for entry in records:
            assert set(entry) == {"IOName", "Precision"}
            assert entry["IOName"] in ios, (graph, entry)
    language, encoder = entries["language"], entries["encoder"]
    precisions = {e["IOName"]: e["Precision"] for e in language}
    expected = ["vision_embeds", "vision_embeds_RetainedState"]
    for i in range(NUM_LAYERS):
        expected += [f"past_key.{i}", f"past_value.{i}", f"past_key.{i}_RetainedState",
                     f"past_value.{i}_RetainedState"]
    assert precisions == {name: "float16" for name in expected}
    assert {e["IOName"]: e["Precision"] for e in encoder} == {"pixel_values": "float16", "vision_embeds": "float16"}
    # A pruning graph computes in fp32 (compiled without -convert-to-fp16); only its rows cross in fp16, its
    # ranking stays int64 and VidCom2's retention_ratio fp32.
    for method in METHODS:
        assert {e["IOName"]: e["Precision"] for e in entries[f"pruning_{method}"]} == {"merged_embeds": "float16"}


# --------------------------------------------------------------------------------------------------
# compile.sh


def compile_lines(script: Path) -> dict[str, list[str]]:
    """{graph: argv} of the qaic-compile lines, keyed by the -m= graph's file name."""
    commands = {}
    for line in script.read_text().splitlines():
        argv = shlex.split(line)
        if argv and argv[0] == "$QAIC_COMPILE":
            model = next(a for a in argv if a.startswith("-m="))[3:]
            commands[Path(model).stem] = argv[1:]
    return commands


def test_compile_script_has_one_qaic_compile_line_per_graph(tiny_export):
    script = tiny_export / "compile.sh"
    assert script.stat().st_mode & 0o100, "compile.sh is not executable"
    commands = compile_lines(script)
    assert list(commands) == ["encoder", *(f"pruning_{m}" for m in METHODS), "language"]
    for graph, argv in commands.items():
        options = dict(a.split("=", 1) if "=" in a else (a, None) for a in argv)
        onnx_file, flat_file, _, custom_io = GRAPH_FILES[graph]
        assert options["-m"] == onnx_file
        assert options["-network-specialization-config"] == flat_file
        assert options["-custom-IO-list-file"] == custom_io
        for key in ("-m", "-network-specialization-config", "-custom-IO-list-file"):
            assert (tiny_export / options[key]).is_file()
        assert options["-aic-hw-version"] == "ai100" and "-aic-hw" in options
        # The default split: all three programs active on one 16-core device together.
        pruning = graph.startswith("pruning_")
        assert options["-aic-num-cores"] == ("1" if pruning else {"encoder": "6", "language": "9"}[graph])
        # The EVS cosine would overflow in fp16 (docs/design.md#numerics-on-the-card): the pruning graphs alone
        # keep fp32 compute.
        assert ("-convert-to-fp16" in options) == (not pruning)
        assert options["-aic-binary-dir"] == str(Path(onnx_file).parent / ("qpc" if graph == "language" else f"{graph}_qpc"))
        assert ("-retained-state" in options) == (graph == "language")
        assert "-mxfp6-matmul" not in options


@pytest.mark.parametrize("change, message", [
    (lambda m: m.pop("version"), r"export from before frame-bucketed pruning .*re-run `qeff-evs export`"),
    (lambda m: m.update(version=3), r"manifest version 3, this qeff-evs reads version 2"),
])
def test_an_export_of_another_manifest_version_is_refused(tiny_export, tmp_path, change, message):
    """A version-1 export carried one EVS graph per (frame count, K); its graphs cannot serve a rate or a bucket."""
    folder = tmp_path / "old"
    folder.mkdir()
    raw = load_json(tiny_export / "manifest.json")
    change(raw)
    (folder / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=message):
        read_manifest(folder)
