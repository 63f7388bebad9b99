"""Specialization sets, specializations.json, custom_io.yaml, qaic-compile commands, symbol checks.

Expected values are written out literally from docs/design.md#specializations and QEfficient's file
formats, never computed with the code under test.
"""

from __future__ import annotations

import io
import json
import os
import stat
import subprocess
import warnings
from pathlib import Path

import onnx
import pytest
import torch
import yaml

from qeff_evs.manifest import LayerState
from qeff_evs.specializations import (
    CompileCommand,
    Specialization,
    PruningTarget,
    default_sampled_frame_buckets,
    check_specializations,
    graph_symbols,
    language_custom_io,
    language_specializations,
    manifest_entries,
    prepare_graph_compile,
    qaic_compile_command,
    read_custom_io_yaml,
    read_specializations_json,
    run_compile,
    specialization_for_target,
    vision_custom_io,
    vision_specializations,
    write_compile_script,
    write_custom_io_yaml,
    write_specializations_json,
)
from qeff_evs.specializations.compile_command import SDK_COMPILER_PATH

# ---------------------------------------------------------------------------- fixtures


class TinyLanguageLike(torch.nn.Module):
    """Same IO names and symbol layout as the language graph contract, trivial math."""

    def forward(self, input_ids, vision_embeds, past_key, past_value):
        logits = (input_ids.to(torch.float32).sum(1, keepdim=True)[..., None] + vision_embeds.sum()).expand(-1, 1, 8)
        return logits, vision_embeds * 1.0, past_key + 1.0, past_value + 1.0


LANG_INPUTS = ["input_ids", "vision_embeds", "past_key.0", "past_value.0"]
LANG_OUTPUTS = ["logits", "vision_embeds_RetainedState", "past_key.0_RetainedState", "past_value.0_RetainedState"]
LANG_AXES = {
    "input_ids": {0: "batch_size", 1: "seq_len"},
    "vision_embeds": {1: "vision_size"},
    "past_key.0": {0: "batch_size", 2: "ctx_len"},
    "past_value.0": {0: "batch_size", 2: "ctx_len"},
    "logits": {0: "batch_size"},
    "vision_embeds_RetainedState": {1: "vision_size"},
    "past_key.0_RetainedState": {0: "batch_size", 2: "ctx_len"},
    "past_value.0_RetainedState": {0: "batch_size", 2: "ctx_len"},
}


def _export(path: Path, dynamic_axes: dict) -> Path:
    example = (
        torch.zeros(1, 4, dtype=torch.int64),
        torch.zeros(1, 6, 8),
        torch.zeros(1, 2, 16, 4),
        torch.zeros(1, 2, 16, 4),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the legacy exporter's DeprecationWarning
        torch.onnx.export(
            TinyLanguageLike(), example, str(path), dynamo=False, opset_version=17,
            input_names=LANG_INPUTS, output_names=LANG_OUTPUTS, dynamic_axes=dynamic_axes,
        )
    return path


@pytest.fixture(scope="module")
def lang_onnx(tmp_path_factory) -> Path:
    return _export(tmp_path_factory.mktemp("onnx") / "language.onnx", LANG_AXES)


@pytest.fixture(scope="module")
def lang_onnx_unnamed_output_axis(tmp_path_factory) -> Path:
    axes = {k: v for k, v in LANG_AXES.items() if k != "logits"}  # logits batch axis left to the exporter
    return _export(tmp_path_factory.mktemp("onnx") / "language_unnamed.onnx", axes)


def _fake_compiler(bin_dir: Path, exit_code: int = 0) -> Path:
    """A ``qaic-compile`` stand-in that appends its cwd and argv (one per line) to $RECORD."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    script = bin_dir / "qaic-compile"
    script.write_text(
        "#!/bin/sh\n"
        'echo "CWD=$(pwd)" >> "$RECORD"\n'
        'for a in "$@"; do echo "$a" >> "$RECORD"; done\n'
        'echo "--END--" >> "$RECORD"\n'
        f"exit {exit_code}\n"
    )
    script.chmod(0o755)
    return script


def _recorded_calls(record: Path) -> list[tuple[str, list[str]]]:
    calls, current = [], []
    for line in record.read_text().splitlines():
        if line == "--END--":
            calls.append((current[0].removeprefix("CWD="), current[1:]))
            current = []
        else:
            current.append(line)
    return calls


# ------------------------------------------------------------------ language sets


def test_language_specs_bind_user_vision_size():
    prefill, decode = language_specializations(prefill_seq_len=128, ctx_len=8192, user_vision_size=256)
    assert (prefill.name, prefill.symbols) == (
        "Prefill", {"batch_size": 1, "seq_len": 128, "ctx_len": 8192, "vision_size": 256})
    assert (decode.name, decode.symbols) == (
        "Decode", {"batch_size": 1, "seq_len": 1, "ctx_len": 8192, "vision_size": 256})


def test_language_vision_size_defaults_to_prefill_seq_len():
    specs = language_specializations(64, 1024, batch_size=2)
    assert [s.symbols for s in specs] == [
        {"batch_size": 2, "seq_len": 64, "ctx_len": 1024, "vision_size": 64},
        {"batch_size": 2, "seq_len": 1, "ctx_len": 1024, "vision_size": 64},
    ]


def test_language_prefill_of_one_token_is_just_decode():
    specs = language_specializations(1, 16)
    assert [(s.name, s.symbols) for s in specs] == [
        ("Decode", {"batch_size": 1, "seq_len": 1, "ctx_len": 16, "vision_size": 1})]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(prefill_seq_len=128, ctx_len=8192, user_vision_size=127), "at most seq_len media tokens"),
        (dict(prefill_seq_len=128, ctx_len=8192, user_vision_size=8192), "user_vision_size=8192"),
        (dict(prefill_seq_len=128, ctx_len=8192, user_vision_size=9000), "ctx_len=8192"),
        (dict(prefill_seq_len=128, ctx_len=128), "prefill_seq_len=128 must be smaller than ctx_len=128"),
        (dict(prefill_seq_len=0, ctx_len=128), "prefill_seq_len"),
        (dict(prefill_seq_len=16, ctx_len=128, user_vision_size=32.0), "user_vision_size"),
        (dict(prefill_seq_len=16, ctx_len=128, batch_size=True), "batch_size"),
    ],
)
def test_language_bad_values_raise_naming_them(kwargs, message):
    with pytest.raises(ValueError, match=message):
        language_specializations(**kwargs)


def test_user_vision_size_error_names_both_values():
    with pytest.raises(ValueError) as caught:
        language_specializations(128, 8192, user_vision_size=100)
    assert "user_vision_size=100" in str(caught.value) and "prefill_seq_len=128" in str(caught.value)


def test_continuous_batching_specs_follow_qeff_layout():
    """QEfficient CB: prefill batch 1, decode batch full_batch_size, both bind full_batch_size."""
    prefill, decode = language_specializations(128, 8192, 256, full_batch_size=4)
    assert (prefill.name, prefill.symbols) == (
        "Prefill", {"batch_size": 1, "seq_len": 128, "ctx_len": 8192, "vision_size": 256, "full_batch_size": 4})
    assert (decode.name, decode.symbols) == (
        "Decode", {"batch_size": 4, "seq_len": 1, "ctx_len": 8192, "vision_size": 256, "full_batch_size": 4})


def test_continuous_batching_decode_batch_can_be_smaller():
    specs = language_specializations(64, 1024, full_batch_size=8, decode_batch_size=2)
    assert [s.symbols for s in specs] == [
        {"batch_size": 1, "seq_len": 64, "ctx_len": 1024, "vision_size": 64, "full_batch_size": 8},
        {"batch_size": 2, "seq_len": 1, "ctx_len": 1024, "vision_size": 64, "full_batch_size": 8},
    ]


def test_continuous_batching_one_token_prefill_keeps_its_batch_1_entry():
    specs = language_specializations(1, 16, full_batch_size=3)
    assert [(s.name, s.symbols["batch_size"], s.symbols["seq_len"]) for s in specs] == [
        ("Prefill", 1, 1), ("Decode", 3, 1)]
    (only,) = language_specializations(1, 16, full_batch_size=3, decode_batch_size=1)
    assert (only.name, only.symbols) == (
        "Decode", {"batch_size": 1, "seq_len": 1, "ctx_len": 16, "vision_size": 1, "full_batch_size": 3})


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(full_batch_size=4, batch_size=2), "batch_size=2 with full_batch_size=4"),
        (dict(full_batch_size=4, decode_batch_size=5), "decode_batch_size=5 exceeds full_batch_size=4"),
        (dict(decode_batch_size=2), "decode_batch_size=2 needs continuous batching"),
        (dict(full_batch_size=0), "full_batch_size"),
        (dict(full_batch_size=4, decode_batch_size=0), "decode_batch_size"),
    ],
)
def test_continuous_batching_bad_values_raise_naming_them(kwargs, message):
    with pytest.raises(ValueError, match=message):
        language_specializations(16, 128, **kwargs)


def test_continuous_batching_specs_round_trip_through_json(tmp_path):
    specs = language_specializations(8, 64, full_batch_size=4)
    for style in ("flat", "named"):
        path = write_specializations_json(tmp_path / f"{style}.json", specs, style=style)
        assert [dict(s.symbols) for s in read_specializations_json(path)] == [dict(s.symbols) for s in specs]


# -------------------------------------------------------------------- vision sets

# Literal per-target symbols as a family would compute them: pruning graphs bind the bucket in temporal
# patches and its merged rows (448x448, patch 14, merge 2 -> 16x16 merged tokens per frame; 16 frames, temporal
# patch 2 -> bucket 8 -> 2048 rows; 32 frames -> 16 -> 4096; 336x336 -> 12x12 -> 1152 rows at 16 frames).
SYM_448_F16 = {"frame_bucket": 8, "bucket_tokens": 2048}
SYM_448_F32 = {"frame_bucket": 16, "bucket_tokens": 4096}
SYM_336_F16 = {"frame_bucket": 8, "bucket_tokens": 1152}
T_448_F16 = PruningTarget(448, 448, 16)
T_448_F32 = PruningTarget(448, 448, 32)
T_336_F16 = PruningTarget(336, 336, 16)


def test_vision_specs_dedupe_identical_bindings_and_remember_targets():
    same_as_448 = PruningTarget(224, 896, 16)  # 8x32 merged tokens per frame: the same 2048 rows at bucket 8
    specs = vision_specializations([
        (T_448_F16, SYM_448_F16),
        (T_448_F32, SYM_448_F32),
        (same_as_448, dict(reversed(list(SYM_448_F16.items())))),  # symbol order does not matter
        (T_336_F16, SYM_336_F16),
        (T_448_F16, SYM_448_F16),  # a repeated request adds nothing
    ])
    assert [s.name for s in specs] == ["Vision_0", "Vision_1", "Vision_2"]
    assert [s.symbols for s in specs] == [SYM_448_F16, SYM_448_F32, SYM_336_F16]
    assert [s.serves for s in specs] == [(T_448_F16, same_as_448), (T_448_F32,), (T_336_F16,)]
    assert specialization_for_target(specs, same_as_448) is specs[0]
    assert specialization_for_target(specs, T_336_F16) is specs[2]
    with pytest.raises(ValueError, match="no vision specialization serves"):
        specialization_for_target(specs, PruningTarget(224, 224, 16))
    manifest = json.loads(json.dumps(manifest_entries(specs)))
    assert manifest[0]["serves"] == [
        {"height": 448, "width": 448, "frames": 16},
        {"height": 224, "width": 896, "frames": 16},
    ]


def test_single_vision_spec_is_named_vision():
    (spec,) = vision_specializations([(T_448_F16, SYM_448_F16)])
    assert spec.name == "Vision" and spec.symbols == SYM_448_F16


@pytest.mark.parametrize(
    "entries, message",
    [
        ([], "no vision targets"),
        ([(T_448_F16, SYM_448_F16), (T_336_F16, {"frame_bucket": 8})], "same symbols in every specialization"),
        ([(T_448_F16, {**SYM_448_F16, "bucket_tokens": 0})], "bucket_tokens"),
        ([((448, 448, 16), SYM_448_F16)], "PruningTarget"),
    ],
)
def test_vision_bad_entries_raise(entries, message):
    with pytest.raises(ValueError, match=message):
        vision_specializations(entries)


def test_pruning_target_rejects_bad_frames():
    with pytest.raises(ValueError, match="frames"):
        PruningTarget(448, 448, 0)


@pytest.mark.parametrize("max_frames, temporal_patch, expected", [
    (48, 2, (2, 4, 8, 16, 32, 48)),  # powers of two temporal patches, then the maximum
    (64, 2, (2, 4, 8, 16, 32, 64)),
    (2, 2, (2,)),
    (6, 2, (2, 4, 6)),
])
def test_default_sampled_frame_buckets(max_frames, temporal_patch, expected):
    assert default_sampled_frame_buckets(max_frames, temporal_patch) == expected


def test_default_sampled_frame_buckets_refuse_a_maximum_off_the_temporal_patch():
    with pytest.raises(ValueError, match="multiple of temporal_patch_size"):
        default_sampled_frame_buckets(7, 2)


# ------------------------------------------------------------- specializations.json


@pytest.mark.parametrize("make_specs", [
    lambda: language_specializations(128, 8192, 256),
    lambda: vision_specializations([(T_448_F16, SYM_448_F16), (T_448_F32, SYM_448_F32)]),
    lambda: vision_specializations([(T_448_F16, SYM_448_F16)]),
], ids=["language", "vision-2", "vision-1"])
def test_both_json_layouts_read_back_to_the_same_entries(tmp_path, make_specs):
    specs = make_specs()
    flat = write_specializations_json(tmp_path / "flat.json", specs, style="flat")
    named = write_specializations_json(tmp_path / "named.json", specs, style="named")
    expected = [(s.name, dict(s.symbols)) for s in specs]
    assert [(s.name, dict(s.symbols)) for s in read_specializations_json(flat)] == expected
    assert [(s.name, dict(s.symbols)) for s in read_specializations_json(named)] == expected


def test_json_layouts_match_qefficient_shapes(tmp_path):
    specs = language_specializations(128, 8192)
    flat = json.loads(write_specializations_json(tmp_path / "f.json", specs, "flat").read_text())
    named = json.loads(write_specializations_json(tmp_path / "n.json", specs, "named").read_text())
    # Values are strings in both layouts, as QEfficient writes them.
    assert flat == {"specializations": [
        {"batch_size": "1", "ctx_len": "8192", "vision_size": "128", "seq_len": "128"},
        {"batch_size": "1", "ctx_len": "8192", "vision_size": "128", "seq_len": "1"},
    ]}
    assert named == {"specializations": [
        {"name": "Prefill", "symbols": {"batch_size": "1", "ctx_len": "8192", "vision_size": "128", "seq_len": "128"}},
        {"name": "Decode", "symbols": {"batch_size": "1", "ctx_len": "8192", "vision_size": "128", "seq_len": "1"}},
    ]}


def test_reader_accepts_integer_values_and_rejects_garbage(tmp_path):
    path = tmp_path / "ints.json"
    path.write_text(json.dumps({"specializations": [{"batch_size": 1, "seq_len": 32, "ctx_len": 64}]}))
    (spec,) = read_specializations_json(path)
    assert (spec.name, spec.symbols) == ("Prefill", {"batch_size": 1, "seq_len": 32, "ctx_len": 64})
    path.write_text(json.dumps({"specializations": [{"seq_len": "3.5"}]}))
    with pytest.raises(ValueError, match="seq_len"):
        read_specializations_json(path)
    path.write_text(json.dumps([{"seq_len": "3"}]))
    with pytest.raises(ValueError, match="'specializations' list"):
        read_specializations_json(path)


def test_unknown_style_raises(tmp_path):
    with pytest.raises(ValueError, match="style"):
        write_specializations_json(tmp_path / "x.json", language_specializations(8, 64), style="nested")


# ------------------------------------------------------------------ custom_io.yaml


def test_language_custom_io_yaml_lists_kv_and_vision_precisions(tmp_path):
    path = write_custom_io_yaml(tmp_path / "custom_io.yaml", language_custom_io(2, ["deepstack_features"], "mxint8"))
    records = yaml.safe_load(path.read_text())
    assert all(set(r) == {"IOName", "Precision"} for r in records)
    assert {r["IOName"]: r["Precision"] for r in records} == {
        "vision_embeds": "float16", "vision_embeds_RetainedState": "float16",
        "deepstack_features": "float16", "deepstack_features_RetainedState": "float16",
        "past_key.0": "mxint8", "past_key.0_RetainedState": "mxint8",
        "past_value.0": "mxint8", "past_value.0_RetainedState": "mxint8",
        "past_key.1": "mxint8", "past_key.1_RetainedState": "mxint8",
        "past_value.1": "mxint8", "past_value.1_RetainedState": "mxint8",
    }
    assert len(records) == 12


def test_language_custom_io_defaults_to_fp16_kv_without_deepstack():
    assert language_custom_io(1) == {
        "vision_embeds": "float16", "vision_embeds_RetainedState": "float16",
        "past_key.0": "float16", "past_key.0_RetainedState": "float16",
        "past_value.0": "float16", "past_value.0_RetainedState": "float16",
    }


def test_language_custom_io_of_a_hybrid_model_lists_states_by_their_precision():
    """KV only in the cached layers (even with mxint8 KV); an fp16 layer state listed, an fp32 one left out."""
    states = (LayerState("conv_state", (0, 2), (96, 3), "float16"), LayerState("recurrent_state", (0, 2), (4, 16, 8),
                                                                                "float32"))
    assert language_custom_io(3, (), "mxint8", kv_layers=(1,), layer_states=states) == {
        "vision_embeds": "float16", "vision_embeds_RetainedState": "float16",
        "past_key.1": "mxint8", "past_key.1_RetainedState": "mxint8",
        "past_value.1": "mxint8", "past_value.1_RetainedState": "mxint8",
        "conv_state.0": "float16", "conv_state.0_RetainedState": "float16",
        "conv_state.2": "float16", "conv_state.2_RetainedState": "float16",
    }
    with pytest.raises(ValueError, match=r"precision 'bfloat16'"):
        LayerState("conv_state", (0,), (96, 3), "bfloat16")


def test_vision_custom_io_is_fp16_embeds():
    assert vision_custom_io(["deepstack_features"]) == {
        "pixel_values": "float16", "vision_embeds": "float16", "deepstack_features": "float16"}
    assert vision_custom_io((), pixel_values_fp16=False) == {"vision_embeds": "float16"}


def test_bad_kv_precision_raises():
    with pytest.raises(ValueError, match="int4"):
        language_custom_io(1, (), "int4")


# ----------------------------------------------------------------- compile commands


def test_language_command_has_the_qefficient_flags():
    command = qaic_compile_command("language.onnx", "lang/specializations.json", "lang/custom_io.yaml", "lang/qpc",
                                   graph="language", num_cores=14, mxfp6_matmul=True)
    args = command.arguments
    assert args[:3] == ("-aic-hw", "-aic-hw-version=ai100", "-m=language.onnx")
    for flag in ("-network-specialization-config=lang/specializations.json",
                 "-custom-IO-list-file=lang/custom_io.yaml", "-retained-state", "-convert-to-fp16",
                 "-aic-num-cores=14", "-mxfp6-matmul"):
        assert flag in args
    assert args[-1] == "-aic-binary-dir=lang/qpc"
    assert "-compile-only" not in args and command.graph == "language"


def test_vision_command_never_uses_mxfp6():
    command = qaic_compile_command("vision.onnx", "v/s.json", "v/c.yaml", "v/qpc", graph="encoder",
                                   mxfp6_matmul=True, extra_flags=("-mos=1",))
    assert "-mxfp6-matmul" not in command.arguments
    assert "-retained-state" not in command.arguments  # nothing to retain in the vision graph
    assert {"-aic-hw", "-convert-to-fp16", "-aic-num-cores=16", "-mos=1", "-m=vision.onnx",
            "-network-specialization-config=v/s.json", "-custom-IO-list-file=v/c.yaml",
            "-aic-binary-dir=v/qpc"} <= set(command.arguments)


def test_pruning_command_keeps_fp32_compute():
    """docs/design.md#numerics-on-the-card: the EVS cosine overflows in fp16, so the pruning graphs compile without
    -convert-to-fp16."""
    command = qaic_compile_command("pruning_evs.onnx", "v/s.json", "v/c.yaml", "v/pruning_evs_qpc", graph="pruning",
                                   mxfp6_matmul=True)
    assert "-convert-to-fp16" not in command.arguments
    assert "-mxfp6-matmul" not in command.arguments and "-retained-state" not in command.arguments
    assert "-custom-IO-list-file=v/c.yaml" in command.arguments  # fp16 I/O all the same


@pytest.mark.parametrize("kwargs, message", [
    (dict(graph="audio"), "graph"), (dict(graph="encoder", num_cores=0), "num_cores"),
    (dict(graph="encoder", extra_flags=("mos=1",)), "start with '-'"),
])
def test_bad_command_options_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        qaic_compile_command("a.onnx", "s.json", "c.yaml", "qpc", **kwargs)


def _commands() -> list[CompileCommand]:
    return [
        qaic_compile_command("vision.onnx", "vision/specializations.json", "vision/custom_io.yaml", "vision/qpc",
                             graph="encoder"),
        qaic_compile_command("language.onnx", "language/specializations.json", "language/custom_io.yaml",
                             "language/qpc", graph="language", mxfp6_matmul=True),
    ]


def test_run_compile_without_sdk_prints_commands_and_succeeds(tmp_path, monkeypatch):
    if SDK_COMPILER_PATH.exists():
        pytest.skip("the Cloud AI 100 SDK is installed here")
    empty = tmp_path / "empty_bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    printed = io.StringIO()
    assert run_compile(_commands(), out=printed) == 0
    text = printed.getvalue()
    assert "not found" in text and "SDK" in text
    assert "qaic-compile -aic-hw -aic-hw-version=ai100 -m=vision.onnx" in text
    assert "-aic-binary-dir=language/qpc" in text and "-mxfp6-matmul" in text


def test_run_compile_invokes_qaic_compile_from_path_with_the_arguments(tmp_path, monkeypatch):
    _fake_compiler(tmp_path / "bin")
    record = tmp_path / "calls.txt"
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("RECORD", str(record))
    build = tmp_path / "build"
    build.mkdir()
    commands = _commands()
    assert run_compile(commands, cwd=build, out=io.StringIO()) == 0
    calls = _recorded_calls(record)
    assert [args for _, args in calls] == [list(c.arguments) for c in commands]
    assert all(Path(cwd) == build for cwd, _ in calls)


def test_run_compile_stops_at_the_first_failure(tmp_path, monkeypatch):
    fake = _fake_compiler(tmp_path / "bin", exit_code=3)
    record = tmp_path / "calls.txt"
    monkeypatch.setenv("RECORD", str(record))
    assert run_compile(_commands(), compiler=str(fake), out=io.StringIO()) == 3
    assert len(_recorded_calls(record)) == 1


def test_compile_script_is_executable_and_runs_from_its_folder(tmp_path):
    _fake_compiler(tmp_path / "bin")
    record = tmp_path / "calls.txt"
    script = write_compile_script(tmp_path / "build" / "compile.sh", _commands())
    assert script.stat().st_mode & stat.S_IXUSR
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}", "RECORD": str(record)}
    subprocess.run([str(script)], cwd=tmp_path, env=env, check=True, capture_output=True)
    calls = _recorded_calls(record)
    assert [args for _, args in calls] == [list(c.arguments) for c in _commands()]
    assert all(Path(cwd) == tmp_path / "build" for cwd, _ in calls)


# -------------------------------------------------------------------- symbol checks


def test_graph_symbols_reads_named_axes(lang_onnx):
    shapes = graph_symbols(lang_onnx)
    assert shapes["input_ids"] == ["batch_size", "seq_len"]
    assert shapes["vision_embeds"] == [1, "vision_size", 8]
    assert shapes["past_key.0"] == ["batch_size", 2, "ctx_len", 4]
    assert shapes["past_value.0_RetainedState"] == ["batch_size", 2, "ctx_len", 4]
    assert list(shapes) == LANG_INPUTS + LANG_OUTPUTS
    assert graph_symbols(onnx.load(str(lang_onnx))) == shapes


def test_symbol_check_passes_when_every_symbol_is_bound(lang_onnx):
    check_specializations(lang_onnx, language_specializations(4, 16, 6))


def test_symbol_check_fails_loudly_on_an_unbound_symbol(lang_onnx):
    prefill, decode = language_specializations(4, 16, 6)
    no_ctx = Specialization("Decode", {k: v for k, v in decode.symbols.items() if k != "ctx_len"})
    with pytest.raises(ValueError) as caught:
        check_specializations(lang_onnx, [prefill, no_ctx])
    message = str(caught.value)
    assert "'ctx_len'" in message and "'Decode'" in message and str(lang_onnx) in message
    assert "past_key.0" in message
    with pytest.raises(ValueError, match="'seq_len'.*#0"):
        check_specializations(lang_onnx, [{"batch_size": 1, "ctx_len": 16, "vision_size": 6}])
    with pytest.raises(ValueError, match="no specializations"):
        check_specializations(lang_onnx, [])


def test_symbol_check_flags_exporter_invented_output_axes(lang_onnx_unnamed_output_axis):
    with pytest.raises(ValueError, match="invented by the TorchScript exporter") as caught:
        check_specializations(lang_onnx_unnamed_output_axis, language_specializations(4, 16, 6))
    assert "logits" in str(caught.value)


def test_symbol_check_rejects_an_unnamed_dynamic_axis():
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [None, 3])
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [None, 3])
    graph = onnx.helper.make_graph([onnx.helper.make_node("Identity", ["x"], ["y"])], "g", [x], [y])
    model = onnx.helper.make_model(graph)
    with pytest.raises(ValueError, match="'x' axis 0 is dynamic but has no symbol name"):
        check_specializations(model, [{"batch_size": 1}])


# -------------------------------------------------------------- one graph's artifacts


def test_prepare_graph_compile_writes_checked_files(lang_onnx, tmp_path):
    build = tmp_path / "build"
    command = prepare_graph_compile(lang_onnx, build / "language", language_specializations(4, 16, 6),
                                    graph="language", kv_precision="mxint8", style="named",
                                    mxfp6_matmul=True, relative_to=build)
    specs = read_specializations_json(build / "language" / "specializations.json")
    assert [(s.name, s.symbols["seq_len"], s.symbols["vision_size"]) for s in specs] == [
        ("Prefill", 4, 6), ("Decode", 1, 6)]
    assert read_custom_io_yaml(build / "language" / "custom_io.yaml") == {
        "vision_embeds": "float16", "past_key.0": "mxint8", "past_value.0": "mxint8",
        "vision_embeds_RetainedState": "float16", "past_key.0_RetainedState": "mxint8",
        "past_value.0_RetainedState": "mxint8",
    }
    assert "-network-specialization-config=language/specializations.json" in command.arguments
    assert "-custom-IO-list-file=language/custom_io.yaml" in command.arguments
    assert command.arguments[-1] == "-aic-binary-dir=language/qpc"
    assert f"-m={os.path.relpath(lang_onnx, build)}" in command.arguments


def test_prepare_graph_compile_checks_before_writing(lang_onnx, tmp_path):
    bad = [Specialization("Prefill", {"batch_size": 1, "seq_len": 4, "ctx_len": 16})]
    with pytest.raises(ValueError, match="vision_size"):
        prepare_graph_compile(lang_onnx, tmp_path / "language", bad, graph="language")
    assert not (tmp_path / "language").exists()
