"""``qeff-evs compile`` options: hardware version, multi-device partitioning, pass-through flags,
specializations layout, and the removal of a stale qpc folder -- all visible in ``compile.sh``.

The Apps SDK is not installed here: a stand-in ``qaic-compile`` (a shell script that records its
arguments and creates the binary folder) and ``qaic-util`` play the SDK's tools.
"""

from __future__ import annotations

import json
import shutil
import stat
from pathlib import Path

import pytest

from qeff_evs.cli import main
from qeff_evs.specializations import CompileOptions, detect_aic_hw_version, read_specializations_json
from qeff_evs.specializations.compile_command import mdp_partition_config


def tool(path: Path, body: str) -> Path:
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.fixture
def build(tiny_export, tmp_path) -> Path:
    folder = tmp_path / "build"
    shutil.copytree(tiny_export, folder)  # compile rewrites compile.sh and the compile inputs
    return folder


def compile_lines(build: Path) -> list[str]:
    return [line for line in (build / "compile.sh").read_text().splitlines() if "$QAIC_COMPILE" in line
            and not line.startswith("QAIC_COMPILE=")]


def test_flags_reach_compile_sh(build, capsys):
    code = main(["compile", str(build), "--aic-hw-version", "ai200", "--num-devices", "2", "--num-cores", "14",
                 "--extra-flags", "-mos=1 -aic-enable-depth-first -node-precision-info=fp32_nodes.yaml"])
    assert code == 0, capsys.readouterr().err
    encoder, evs, vidcom2, language = compile_lines(build)
    for line in (encoder, evs, vidcom2, language):
        assert "-aic-hw-version=ai200" in line and "-aic-num-cores=14" in line
        assert "-mos=1" in line and "-aic-enable-depth-first" in line
    for graph, vision in (("encoder", encoder), ("pruning_evs", evs), ("pruning_vidcom2", vidcom2)):  # each its own
        assert f"-mdp-load-partition-config=vision/{graph}_mdp_ts_2.json" in vision
        assert "node-precision" not in vision
    assert "-mdp-load-partition-config=language/mdp_ts_2.json" in language
    assert "-node-precision-info=fp32_nodes.yaml" in language
    assert "-allow-mxint8-mdp-io" not in language  # fp16 KV
    assert json.loads((build / "language" / "mdp_ts_2.json").read_text()) == {
        "connections": [{"devices": [0, 1], "type": "p2p"}],
        "partitions": [{"name": "Partition0", "devices": [{"deviceId": 0, "numCores": 14},
                                                          {"deviceId": 1, "numCores": 14}]}]}
    script = (build / "compile.sh").read_text()
    assert script.index("rm -rf vision/encoder_qpc") < script.index("-m=vision/encoder.onnx")
    assert script.index("rm -rf vision/pruning_evs_qpc") < script.index("-m=vision/pruning_evs.onnx")
    assert script.index("rm -rf vision/pruning_vidcom2_qpc") < script.index("-m=vision/pruning_vidcom2.onnx")
    assert script.index("rm -rf language/qpc") < script.index("-m=language/language.onnx")


def test_mxint8_kv_on_several_devices_allows_mxint8_mdp_io(build, capsys):
    manifest = json.loads((build / "manifest.json").read_text())
    manifest["kv_precision"] = "mxint8"
    (build / "manifest.json").write_text(json.dumps(manifest))
    assert main(["compile", str(build), "--num-devices", "4"]) == 0
    *vision, language = compile_lines(build)
    assert "-allow-mxint8-mdp-io" in language and not any("-allow-mxint8-mdp-io" in line for line in vision)
    assert main(["compile", str(build)]) == 0  # one device: no partition config, no mxint8 MDP I/O
    assert not any("mdp" in line for line in compile_lines(build))


def test_specializations_layout_named_by_default_flat_on_request(build):
    assert main(["compile", str(build)]) == 0
    document = json.loads((build / "language" / "specializations.json").read_text())
    assert [entry["name"] for entry in document["specializations"]] == ["Prefill", "Decode"]
    named = read_specializations_json(build / "language" / "specializations.json")
    assert main(["compile", str(build), "--specializations-layout", "flat"]) == 0
    document = json.loads((build / "language" / "specializations.json").read_text())
    assert all("name" not in entry for entry in document["specializations"])
    assert read_specializations_json(build / "language" / "specializations.json") == named


def test_compile_removes_a_stale_qpc_folder_before_compiling(build, tmp_path, monkeypatch, capsys):
    calls = tmp_path / "calls.txt"
    (tmp_path / "bin").mkdir()
    compiler = tool(tmp_path / "bin" / "qaic-compile", f"""
for arg in "$@"; do case "$arg" in -aic-binary-dir=*) dir="${{arg#-aic-binary-dir=}}";; esac; done
ls "$dir" >> {calls} 2>/dev/null; echo "--" >> {calls}
mkdir -p "$dir" && touch "$dir/programqpc.bin"
""")
    monkeypatch.setenv("PATH", f"{compiler.parent}:/usr/bin:/bin")
    stale = build / "language" / "qpc"
    stale.mkdir()
    (stale / "half_written.bin").write_text("left over by a failed compile")
    assert main(["compile", str(build)]) == 0, capsys.readouterr().err
    assert "half_written.bin" not in calls.read_text()  # removed before the compiler ran
    assert (stale / "programqpc.bin").is_file() and not (stale / "half_written.bin").exists()


def test_hw_version_detection(tmp_path):
    assert detect_aic_hw_version(tmp_path / "absent") == "ai100"
    ai200 = tool(tmp_path / "util200", "echo 'QID 0'; echo '        FW IMAGE_VARIANT:AIC200_X'\n")
    ai100 = tool(tmp_path / "util100", "echo 'QID 0'; echo '        FW IMAGE_VARIANT:AIC100'\n")
    assert detect_aic_hw_version(ai200) == "ai200"
    assert detect_aic_hw_version(ai100) == "ai100"


def test_bad_compile_options_exit_2(build, capsys):
    assert main(["compile", str(build), "--num-devices", "0"]) == 2
    assert "--num-devices must be a positive integer, got 0" in capsys.readouterr().err
    assert main(["compile", str(build), "--extra-flags", "mos=1"]) == 2
    assert "must start with '-'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="aic_hw_version"):
        CompileOptions(aic_hw_version="ai300")
    assert mdp_partition_config(1, 16)["partitions"][0]["devices"] == [{"deviceId": 0, "numCores": 16}]


def test_each_side_of_prefill_decode_disaggregation_compiles_its_own_language_program(build, capsys):
    """``--programs prefill``: the vision graphs and a language program of the prefill specializations only;
    ``--programs decode``: a language program of the decode specialization alone, no vision graph (QEfficient's
    ``prefill_only``). Each side has its own specializations file, qpc folder and script; compile.sh is untouched."""
    both = (build / "compile.sh").read_text()
    all_specs = read_specializations_json(build / "language" / "specializations.json")
    for programs, graphs in (("prefill", 4), ("decode", 1)):
        assert main(["compile", str(build), "--programs", programs]) == 0, capsys.readouterr().err
        script = (build / f"compile_{programs}.sh").read_text()
        lines = [line for line in script.splitlines() if "$QAIC_COMPILE" in line and not line.startswith("QAIC_")]
        assert len(lines) == graphs
        assert f"-network-specialization-config=language/{programs}_specializations.json" in lines[-1]
        assert f"-aic-binary-dir=language/{programs}_qpc" in lines[-1]
        specs = read_specializations_json(build / "language" / f"{programs}_specializations.json")
        expected = [s for s in all_specs if (s.symbols["seq_len"] == 1) == (programs == "decode")]
        assert [s.symbols for s in specs] == [s.symbols for s in expected] and specs
    assert (build / "compile.sh").read_text() == both
    assert read_specializations_json(build / "language" / "specializations.json") == all_specs
