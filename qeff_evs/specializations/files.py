"""``specializations.json`` in the two layouts QEfficient has written, and a reader for both.

Both layouts are one JSON object with a ``"specializations"`` list, and in both every symbol
value is a *string* of decimal digits (QEfficient stringifies them; integer values are
reported to make ``qaic-compile`` exit with status 255):

* ``flat`` (QEfficient <= 1.21, and what ``-network-specialization-config`` accepts for
  multi-device partitioned programs too)::

      {"specializations": [{"batch_size": "1", "seq_len": "128", "ctx_len": "8192", "vision_size": "128"},
                           {"batch_size": "1", "seq_len": "1", ...}]}

* ``named`` (QEfficient >= 1.22, ``to_named_specializations``)::

      {"specializations": [{"name": "Prefill", "symbols": {"batch_size": "1", "seq_len": "128", ...}},
                           {"name": "Decode", "symbols": {...}}]}

The flat layout carries no names; the reader gives its entries QEfficient's default names
(``seq_len == 1`` -> ``Decode``, the longest ``seq_len`` -> ``Prefill``, a shorter one ``Prefill<seq_len>``,
with ``_<comp_ctx_len>`` where that is bound, else ``Vision`` /
``Vision_<i>``), which is exactly what :mod:`.sets` produces, so either layout reads back to
the same entries. ``serves`` (the vision targets) lives in the manifest, not in this file.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal

from .sets import COMP_CTX_SYMBOL, DECODE_NAME, VISION_NAME, Specialization, prefill_name

SpecializationStyle = Literal["flat", "named"]
STYLES: tuple[str, ...] = ("flat", "named")
DEFAULT_STYLE: SpecializationStyle = "named"  # QEfficient >= 1.22 (asked for by the compiler team)


def _stringified(symbols: Mapping[str, int]) -> dict[str, str]:
    return {symbol: str(int(value)) for symbol, value in symbols.items()}


def specializations_document(specs: Sequence[Specialization], style: SpecializationStyle = DEFAULT_STYLE) -> dict:
    """The JSON object for ``specs`` in ``style`` (``"flat"`` or ``"named"``)."""
    if style not in STYLES:
        raise ValueError(f"specializations style must be one of {STYLES}, got {style!r}")
    if not specs:
        raise ValueError("no specializations to write; a compiled graph needs at least one")
    if style == "flat":
        entries = [_stringified(spec.symbols) for spec in specs]
    else:
        entries = [{"name": spec.name, "symbols": _stringified(spec.symbols)} for spec in specs]
    return {"specializations": entries}


def write_specializations_json(
    path: str | Path, specs: Sequence[Specialization], style: SpecializationStyle = DEFAULT_STYLE
) -> Path:
    """Write ``specs`` to ``path`` in QEfficient's ``flat`` or ``named`` layout; returns the path."""
    document = specializations_document(specs, style)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=4) + "\n")
    return path


def default_name(symbols: Mapping[str, int], index: int, count: int, prefill_seq_len: int | None = None) -> str:
    """QEfficient's name for an unnamed entry: Decode / Prefill by ``seq_len``, else Vision[_i]
    (``prefill_seq_len``: the entries' longest ``seq_len``; a shorter prefill entry is ``Prefill<seq_len>``)."""
    if "seq_len" in symbols:
        seq_len = int(symbols["seq_len"])
        name = DECODE_NAME if seq_len == 1 else prefill_name(seq_len, prefill_seq_len or seq_len)
        return f"{name}_{int(symbols[COMP_CTX_SYMBOL])}" if COMP_CTX_SYMBOL in symbols else name
    return VISION_NAME if count == 1 else f"{VISION_NAME}_{index}"


def _parse_value(raw: object, symbol: str, where: str) -> int:
    if isinstance(raw, bool):
        raise ValueError(f"{where}: symbol {symbol!r} has value {raw!r}; expected an integer or a string of digits")
    if isinstance(raw, int):
        return raw
    if isinstance(raw, str) and raw.strip().isdigit():
        return int(raw)
    raise ValueError(f"{where}: symbol {symbol!r} has value {raw!r}; expected an integer or a string of digits")


def parse_specializations(document: object, source: str = "specializations document") -> list[Specialization]:
    """Specializations from a parsed JSON object in either layout (entries may even mix them)."""
    if not isinstance(document, Mapping) or not isinstance(document.get("specializations"), list):
        raise ValueError(f"{source}: expected an object with a 'specializations' list, got {document!r:.200}")
    entries = document["specializations"]
    seq_lens = [int(e.get("symbols", e).get("seq_len", 0)) for e in entries if isinstance(e, Mapping)
                and isinstance(e.get("symbols", e), Mapping) and str(e.get("symbols", e).get("seq_len", "")).isdigit()]
    longest = max(seq_lens, default=None)
    specs = []
    for index, entry in enumerate(entries):
        where = f"{source} entry {index}"
        if not isinstance(entry, Mapping):
            raise ValueError(f"{where}: expected an object, got {entry!r}")
        is_named = "symbols" in entry
        raw_symbols = entry["symbols"] if is_named else entry
        if not isinstance(raw_symbols, Mapping):
            raise ValueError(f"{where}: 'symbols' must be an object, got {raw_symbols!r}")
        symbols = {str(k): _parse_value(v, str(k), where) for k, v in raw_symbols.items()}
        name = entry.get("name") if is_named else None
        specs.append(Specialization(name or default_name(symbols, index, len(entries), longest), symbols))
    return specs


def read_specializations_json(path: str | Path) -> list[Specialization]:
    """Read a ``specializations.json`` written in either QEfficient layout."""
    path = Path(path)
    try:
        document = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON ({error}); regenerate it with qeff-evs export") from None
    return parse_specializations(document, str(path))
