"""A damaged checkpoint is refused by ``qeff-evs export`` in one line naming the file, with no traceback, before the
export folder is touched: a safetensors header whose length field exceeds the file (2^60 bytes: checked before
anything is allocated), a header that is not JSON, an unknown dtype, byte ranges outside the file or overlapping,
a truncated shard, a config.json or shard index that is not JSON (with its line and column), a shard the index names
that is missing. Each case damages a copy of the session's tiny checkpoint one way.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from qeff_evs import cli

OPTIONS = ["--frames", "2", "--height", "112", "--width", "112", "--prefill-seq-len", "16", "--ctx-len", "128",
           "--target", "cpu"]


def _header(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + length]), raw[8 + length:]


def _write(path: Path, header: dict, data: bytes) -> None:
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + data)


def _damage(kind: str, folder: Path) -> Path:
    """Damage the checkpoint copy ``folder`` one way; returns the file the error must name."""
    shard = folder / "model.safetensors"
    header, data = _header(shard)
    names = [n for n in header if n != "__metadata__"]
    if kind == "header length 2^60":
        raw = shard.read_bytes()
        shard.write_bytes((1 << 60).to_bytes(8, "little") + raw[8:])
    elif kind == "header not JSON":
        raw = shard.read_bytes()
        length = int.from_bytes(raw[:8], "little")
        shard.write_bytes(raw[:8] + b"{" + b"x" * (length - 1) + raw[8 + length:])
    elif kind == "unknown dtype":
        header[names[0]]["dtype"] = "F12"
        _write(shard, header, data)
    elif kind == "offsets outside the file":
        last = max(names, key=lambda n: header[n]["data_offsets"][1])
        begin, end = header[last]["data_offsets"]
        header[last]["data_offsets"] = [begin + 4096, end + 4096]
        _write(shard, header, data)
    elif kind == "offsets overlapping":
        first, second = sorted(names, key=lambda n: header[n]["data_offsets"][0])[:2]
        size = header[second]["data_offsets"][1] - header[second]["data_offsets"][0]
        begin = header[first]["data_offsets"][0]
        header[second]["data_offsets"] = [begin, begin + size]
        _write(shard, header, data)
    elif kind == "truncated shard":
        shard.write_bytes(shard.read_bytes()[:-100])
    elif kind == "config.json not JSON":
        (folder / "config.json").write_text('{"model_type": "qwen2_5_vl",\n  "vision_config": {\n')
        return folder / "config.json"
    elif kind == "shard named by the index missing":
        index = folder / "model.safetensors.index.json"
        index.write_text(json.dumps({"weight_map": {names[0]: "model-00002-of-00002.safetensors",
                                                    **{n: "model.safetensors" for n in names[1:]}}}))
        return index
    elif kind == "index not JSON":
        (folder / "model.safetensors.index.json").write_text("{weight_map:")
        return folder / "model.safetensors.index.json"
    return shard


BROKEN = {
    "header length 2^60": r"its header length says 1152921504606846976 bytes, the file holds \d+",
    "header not JSON": r"'s safetensors header is not valid JSON at line 1, column 2",
    "unknown dtype": r"has dtype F12, which qeff-evs does not read",
    "offsets outside the file": r"ends at byte \d+, inside tensor .* the file is truncated",
    "offsets overlapping": r"the bytes of tensors .* and .* overlap in its header",
    "truncated shard": r"ends at byte \d+, inside tensor .* the file is truncated",
    "config.json not JSON": r"is not valid JSON at line 3, column 1",
    "shard named by the index missing": r"names model-00002-of-00002.safetensors, missing from",
    "index not JSON": r"is not valid JSON at line 1, column 2",
}


@pytest.mark.parametrize("kind", list(BROKEN))
def test_a_broken_checkpoint_is_one_line_naming_the_file(tiny_checkpoint, tmp_path, kind, capsys):
    folder = tmp_path / "checkpoint"
    shutil.copytree(tiny_checkpoint, folder)
    named = _damage(kind, folder)
    capsys.readouterr()
    code = cli.main(["export", str(folder), "-o", str(tmp_path / "out"), *OPTIONS])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if not line.startswith("[qeff-evs]")]
    assert code == 2 and "Traceback" not in err and len(lines) == 1, err
    assert lines[0].startswith("qeff-evs export: error: ") and str(named) in lines[0], lines[0]
    assert re.search(BROKEN[kind], lines[0]), lines[0]
    assert not (tmp_path / "out").exists()  # refused before the folder is touched
