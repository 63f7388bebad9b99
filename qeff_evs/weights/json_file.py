"""A checkpoint's JSON files (config.json, the shard index, a quantization record, a safetensors header), read so that
a file that is not JSON is refused in one line naming it and where it stops being JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def parse_json(text: str | bytes, where: str, expect: type = dict) -> Any:
    """``text`` parsed as JSON of type ``expect``; ``where`` names it in the ValueError (file, line and column)."""
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        at = f" at line {error.lineno}, column {error.colno}" if isinstance(error, json.JSONDecodeError) else ""
        reason = error.msg if isinstance(error, json.JSONDecodeError) else "not UTF-8 text"
        raise ValueError(f"{where} is not valid JSON{at} ({reason}); restore the file from the checkpoint's "
                         "release") from None
    if not isinstance(value, expect):
        raise ValueError(f"{where} holds a JSON {type(value).__name__}, not the {expect.__name__} it should; restore "
                         "the file from the checkpoint's release")
    return value


def read_json(path: Path, expect: type = dict) -> Any:
    """The JSON file at ``path`` (``parse_json``)."""
    return parse_json(Path(path).read_bytes(), str(path), expect)
