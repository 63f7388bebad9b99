"""An export folder is one export, whole (docs/export-compile.md, "One export per folder").

The reference is a fresh export of the same checkpoint with the same options into an empty folder: whatever the folder
held before (another checkpoint's finished export, another checkpoint's killed one, its own killed one), what an export
leaves there is that folder, byte for byte. The two checkpoints share every file name, size and modification time
(``os.utime``): only their content tells them apart. Exports are killed for real (a child process that sends itself
SIGKILL, ``helpers/killed_exports.py``), at several points; until an export finishes, every command that reads the
folder refuses it in one line. A second export into a folder being written is refused; a full disk is one line and
the folder stays resumable; a graph whose external data lies outside its folder is refused before ONNX Runtime (or
onnx, or the compiler) reads it.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
from pathlib import Path

import onnx
import pytest

from helpers.killed_exports import KILL_POINTS, differences, export_argv, folder_bytes, killed_export
from qeff_evs import cli
from qeff_evs.export import weights as export_weights
from qeff_evs.export.folder import claim_folder
from qeff_evs.manifest import read_manifest
from qeff_evs.models.tiny import save_tiny_checkpoint

FAMILY = "qwen2_5_vl"
OPTIONS = {"--frames": 2, "--height": 112, "--width": 112, "--prefill-seq-len": 16, "--ctx-len": 128,
           "--target": "cpu"}
READERS = {  # every command that reads an export (vllm serve reads it through the same read_manifest)
    "run": ["run", "{out}", "--video", "{video}", "--prompt", "hi", "--max-new-tokens", "2"],
    "encode": ["encode", "{out}", "--video", "{video}"],
    "verify": ["verify", "{out}"],
    "compile": ["compile", "{out}"],
}


def cli_run(argv, capsys) -> tuple[int, str]:
    capsys.readouterr()
    code = cli.main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.err


def error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if not line.startswith("[qeff-evs]")]


@pytest.fixture(scope="module")
def twins(tmp_path_factory):
    """Checkpoints A and B (other weights) with the same file names, sizes and modification times, and a fresh
    export of each (the references)."""
    root = tmp_path_factory.mktemp("twins")
    a = save_tiny_checkpoint(FAMILY, root / "a", seed=1)
    b = save_tiny_checkpoint(FAMILY, root / "b", seed=2)
    for path in a.iterdir():
        os.utime(path, ns=(1_700_000_000_000_000_000, 1_700_000_000_000_000_000))
        os.utime(b / path.name, ns=(1_700_000_000_000_000_000, 1_700_000_000_000_000_000))
    listing = {name: [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(folder.iterdir())]
               for name, folder in (("a", a), ("b", b))}
    assert listing["a"] == listing["b"]
    assert (a / "model.safetensors").read_bytes() != (b / "model.safetensors").read_bytes()
    references = {}
    for name, checkpoint in (("a", a), ("b", b)):
        assert cli.main(export_argv(checkpoint, root / f"fresh_{name}", OPTIONS)) == 0
        references[name] = root / f"fresh_{name}"
    assert differences(references["a"], references["b"])  # the test can tell the two apart
    return {"a": a, "b": b, "fresh": references, "root": root}


def test_a_fresh_export_is_reproducible(twins, tmp_path):
    """The reference is a reference: a second fresh export of A into another folder is the same bytes."""
    assert cli.main(export_argv(twins["a"], tmp_path / "again", OPTIONS)) == 0
    assert differences(tmp_path / "again", twins["fresh"]["a"]) == []


@pytest.mark.parametrize("before", ["finished", "killed"])
@pytest.mark.parametrize("ours, theirs", [("b", "a"), ("a", "b")])
def test_an_export_over_another_checkpoints_export_equals_a_fresh_one(twins, tmp_path, ours, theirs, before, capsys):
    out = tmp_path / "build"
    if before == "finished":
        shutil.copytree(twins["fresh"][theirs], out)
    else:
        killed_export(twins[theirs], out, OPTIONS, "weights")
    code, err = cli_run(export_argv(twins[ours], out, OPTIONS), capsys)
    assert code == 0, err
    assert "already written" not in err  # every unit came from the other checkpoint: all rewritten
    assert differences(out, twins["fresh"][ours]) == []


@pytest.mark.parametrize("point", list(KILL_POINTS))
def test_a_killed_re_export_is_refused_by_every_command_until_an_export_finishes(twins, tmp_path, point, capsys):
    """A's finished export, re-exported from B with other options (fp16 weights) and killed: the old manifest is gone
    before anything was written, so run, encode, verify and compile refuse the folder in one line naming it and the
    fix; the next export resumes and leaves the fresh export's bytes."""
    out = tmp_path / "build"
    shutil.copytree(twins["fresh"]["a"], out)
    video = twins["root"] / "clip.npy"
    if not video.exists():
        from qeff_evs.runtime.inputs.synthetic import moving_square_video
        import numpy as np

        np.save(video, moving_square_video(2, 112, 112, seed=0))
    half = {**OPTIONS, "--weight-dtype": "float16"}
    killed_export(twins["b"], out, half, point)
    for command, argv in READERS.items():
        code, err = cli_run([a.format(out=out, video=video) for a in argv], capsys)
        lines = error_lines(err)
        assert code == 2 and "Traceback" not in err, (command, err)
        assert lines == [f"qeff-evs {command}: error: the export into {out} did not finish (it has no manifest.json, "
                         "which an export writes last): run it again, it resumes"], (command, err)
    with pytest.raises(ValueError, match="did not finish"):
        read_manifest(out)  # what the vLLM platform reads first
    code, err = cli_run(export_argv(twins["b"], out, half), capsys)
    assert code == 0, err
    fresh = tmp_path / "fresh"
    assert cli.main(export_argv(twins["b"], fresh, half)) == 0
    assert differences(out, fresh) == []
    code, err = cli_run([a.format(out=out, video=video) for a in READERS["encode"]], capsys)
    assert code == 0, err


def test_a_killed_export_resumes_where_it_stopped(twins, tmp_path, capsys):
    """Killed as its second unit's index was to be written: the first unit is kept, the second (its data there, its
    index not) written again."""
    out = tmp_path / "build"
    killed_export(twins["a"], out, OPTIONS, "second unit index")
    code, err = cli_run(export_argv(twins["a"], out, OPTIONS), capsys)
    assert code == 0, err
    assert re.search(r"encoder weights: 1 of \d+ units already written, resuming at ", err), err
    assert differences(out, twins["fresh"]["a"]) == []


def test_an_unchanged_checkpoint_rewrites_nothing(twins, tmp_path, monkeypatch, capsys):
    """A second export of the same checkpoint keeps every unit: it reads the checkpoint's bytes to check them, and
    converts and writes none of them."""
    out = tmp_path / "build"
    shutil.copytree(twins["fresh"]["a"], out)
    written = []
    original = export_weights.WeightStore._write_weight
    monkeypatch.setattr(export_weights.WeightStore, "_write_weight",
                        lambda self, *args: written.append(args[1].name) or original(self, *args))
    code, err = cli_run(export_argv(twins["a"], out, OPTIONS), capsys)
    assert code == 0, err
    assert written == [] and "resuming at the end" in err
    assert differences(out, twins["fresh"]["a"]) == []


def test_a_second_export_into_a_folder_being_written_is_refused(twins, tmp_path, capsys):
    out = tmp_path / "build"
    shutil.copytree(twins["fresh"]["a"], out)
    with claim_folder(out):  # the first export, holding the folder
        code, err = cli_run(export_argv(twins["b"], out, OPTIONS), capsys)
    assert code == 2 and error_lines(err) == [
        f"qeff-evs export: error: another export is writing into {out} (it holds {out}/.qeff-evs-export.lock): wait "
        "for it to finish, or export into another folder"], err
    assert not (out / "manifest.json").exists()  # the first export's claim took it; the second wrote nothing


def test_a_folder_that_is_not_an_export_is_not_exported_into(twins, tmp_path, capsys):
    out = tmp_path / "notes"
    out.mkdir()
    (out / "thesis.tex").write_text("mine")
    code, err = cli_run(export_argv(twins["a"], out, OPTIONS), capsys)
    assert code == 2 and "holds files that are not a qeff-evs export (thesis.tex...)" in err, err
    assert [p.name for p in out.iterdir()] == ["thesis.tex"]


def test_a_full_disk_is_one_line_and_the_export_resumes(twins, tmp_path, monkeypatch, capsys):
    out = tmp_path / "build"
    original = export_weights.WeightStore._write_weight

    def fills_up(self, stream, weight, reader):
        if weight.unit == "layers.1":
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(self, stream, weight, reader)

    monkeypatch.setattr(export_weights.WeightStore, "_write_weight", fills_up)
    code, err = cli_run(export_argv(twins["a"], out, OPTIONS), capsys)
    lines = error_lines(err)
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert re.fullmatch(rf"qeff-evs export: error: the disk holding {re.escape(str(out))} is full: [\d,]+ bytes of the "
                        r"export are written there, about [\d,]+ more are needed \(\d+\.\d GiB\); free space there "
                        r"and run the export again, it resumes at the first unit not written", lines[0]), lines[0]
    assert not list(out.rglob("*.partial"))
    monkeypatch.setattr(export_weights.WeightStore, "_write_weight", original)
    code, err = cli_run(export_argv(twins["a"], out, OPTIONS), capsys)
    assert code == 0 and "resuming at layers.1" in err, err
    assert differences(out, twins["fresh"]["a"]) == []


# --------------------------------------------------------------------------------------------------
# a folder never reads outside itself


def _point_outside(export: Path, graph: str, location: str) -> str:
    """Point the first external tensor of ``graph`` at ``location``; returns the tensor's name."""
    path = export / graph
    model = onnx.load(str(path), load_external_data=False)
    tensor = next(t for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL)
    next(entry for entry in tensor.external_data if entry.key == "location").value = location
    onnx.save(model, str(path))
    return tensor.name


@pytest.mark.parametrize("where", ["parent", "absolute", "symlink"])
def test_external_data_outside_the_folder_is_refused_before_onnx_runtime(twins, tmp_path, where, monkeypatch, capsys):
    out = tmp_path / "build"
    shutil.copytree(twins["fresh"]["a"], out)
    secret = tmp_path / "secret"
    secret.write_bytes(b"\0" * (1 << 20))
    location = {"parent": "../../secret", "absolute": str(secret), "symlink": "weights/link.data"}[where]
    if where == "symlink":
        (out / "vision" / "weights" / "link.data").symlink_to(secret)
    name = _point_outside(out, "vision/encoder.onnx", location)
    import onnxruntime

    opened = []
    real = onnxruntime.InferenceSession
    monkeypatch.setattr(onnxruntime, "InferenceSession", lambda path, *a, **k: opened.append(str(path)) or real(
        path, *a, **k))
    video = tmp_path / "clip.npy"
    from qeff_evs.runtime.inputs.synthetic import moving_square_video
    import numpy as np

    np.save(video, moving_square_video(2, 112, 112, seed=0))
    for command in ("encode", "verify", "compile"):
        code, err = cli_run([a.format(out=out, video=video) for a in READERS[command]], capsys)
        lines = error_lines(err)
        assert code == 2 and len(lines) == 1 and "Traceback" not in err, (command, err)
        assert f"graph {out / 'vision' / 'encoder.onnx'}" in lines[0] and repr(location) in lines[0], lines[0]
        assert ("absolute path" if where == "absolute" else "outside the export folder") in lines[0]
        assert name in lines[0]
    assert not any("encoder.onnx" in path for path in opened)


def test_a_manifest_naming_a_file_outside_the_folder_is_refused(twins, tmp_path):
    out = tmp_path / "build"
    shutil.copytree(twins["fresh"]["a"], out)
    raw = json.loads((out / "manifest.json").read_text())
    raw["files"]["language"] = "../elsewhere/language.onnx"
    (out / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"\(file 'language'\) names '../elsewhere/language.onnx', which resolves to "
                                         r".*, outside the export folder"):
        read_manifest(out)


def test_every_file_of_the_reference_is_compared(twins):
    """The comparison covers the weights, the graphs and the manifest (not only some of the files)."""
    files = folder_bytes(twins["fresh"]["a"])
    assert {"manifest.json", "vision/encoder.onnx", "language/language.onnx", "language/weights/layers.0.data",
            "vision/weights/blocks.0.data", "tokenizer.json"} <= set(files)


# --------------------------------------------------------------------------------------------------
# a graph is taken from the earlier export only when what it is made from is unchanged


@pytest.fixture
def traced(monkeypatch):
    """The graphs an export traces (the encoder, the pruning graphs, the language graph), by kind."""
    from qeff_evs.export import language, vision

    calls = []
    for module, name, kind in ((vision, "trace_without_weights", "encoder"), (vision, "legacy_export", "pruning"),
                               (language, "stamped_language_graph", "language")):
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _original=original, _kind=kind, **k: calls.append(_kind)
                            or _original(*a, **k))
    return calls


def test_an_unchanged_export_takes_every_graph_without_tracing_it(twins, tmp_path, traced, capsys):
    out = tmp_path / "build"
    shutil.copytree(twins["fresh"]["a"], out)
    code, err = cli_run(export_argv(twins["a"], out, OPTIONS), capsys)
    assert code == 0, err
    assert traced == []
    assert "vision/encoder.onnx: the earlier export's graph" in err and "language/language.onnx: the earlier" in err
    assert differences(out, twins["fresh"]["a"]) == []


def _edited_config(checkpoint: Path, folder: Path) -> Path:
    """``checkpoint`` with another RMS norm epsilon in its text config: a constant of the language graph, no weight."""
    shutil.copytree(checkpoint, folder)
    config = json.loads((folder / "config.json").read_text())
    config["text_config"]["rms_norm_eps"] = config["text_config"]["rms_norm_eps"] * 10
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


@pytest.mark.parametrize("change", ["config", "option", "tensor", "graph file", "record"])
def test_a_graph_is_traced_again_when_what_it_is_made_from_changed(twins, tmp_path, traced, change, capsys):
    """Over A's finished export: A with another value in config.json, another --ctx-len (the language graph's RoPE
    tables), B (other tensor bytes), A's encoder.onnx edited since, a record naming another key. What depends on the
    change is traced again, and the folder is a fresh export of that checkpoint with those options, byte for byte."""
    out = tmp_path / "build"
    shutil.copytree(twins["fresh"]["a"], out)
    checkpoint, options = twins["a"], OPTIONS
    if change == "config":
        checkpoint = _edited_config(twins["a"], tmp_path / "edited")
    elif change == "option":
        options = {**OPTIONS, "--ctx-len": 256}
    elif change == "tensor":
        checkpoint = twins["b"]
    elif change == "graph file":
        path = out / "vision" / "encoder.onnx"
        model = onnx.load(str(path), load_external_data=False)
        model.doc_string = "edited"
        onnx.save(model, str(path))
    else:
        path = out / "language" / "language.graph.json"
        record = json.loads(path.read_text())
        record["key"] = "0" * 64
        path.write_text(json.dumps(record))
    code, err = cli_run(export_argv(checkpoint, out, options), capsys)
    assert code == 0, err
    expected = {"config": ["encoder", "pruning", "pruning", "language"], "option": ["language"],
                "tensor": ["encoder", "language"], "graph file": ["encoder"], "record": ["language"]}[change]
    assert traced == expected
    fresh = tmp_path / "fresh"
    assert cli.main(export_argv(checkpoint, fresh, options)) == 0
    assert differences(out, fresh) == []
    if change == "config":
        assert (fresh / "language" / "language.onnx").read_bytes() != \
            (twins["fresh"]["a"] / "language" / "language.onnx").read_bytes()  # the change reached the graph
