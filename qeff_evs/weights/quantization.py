"""A checkpoint folder's quantization record, and the ``LinearFormat`` of each method we read.

Where a record may be (vLLM and transformers read the same places): ``config.json``'s ``quantization_config`` (at its
top or in its ``text_config``), its ``compression_config`` (older compressed-tensors releases), or a file beside it:
``quantize_config.json`` (older GPTQ releases), ``quant_config.json`` (older AWQ releases), ``hf_quant_config.json``
(NVIDIA ModelOpt). We read ``fp8`` (fine-grained, block-wise), ``compressed-tensors`` (its FP8 formats), ``awq``
(4-bit GEMM) and ``gptq``; any other method is refused in one line naming it and these.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qeff_evs.weights import awq, compressed_tensors, fp8, gptq
from qeff_evs.weights.json_file import read_json
from qeff_evs.weights.linear_format import LinearFormat

# quant_method -> the format module reading it (each has ``linear_format(config) -> LinearFormat``).
FORMATS = {"fp8": fp8, "compressed-tensors": compressed_tensors, "awq": awq, "gptq": gptq}
READ_METHODS = tuple(FORMATS)
RECORD_FILES = ("quantize_config.json", "quant_config.json", "hf_quant_config.json")
# Config keys naming the modules a release left unquantized (the method's own name for the list).
UNCONVERTED_KEYS = ("modules_to_not_convert", "ignored_layers", "ignore")


@dataclass(frozen=True)
class QuantizationRecord:
    """What a checkpoint says of its quantization: the method, the config as written, and where it was found."""

    method: str  # quant_method, lower case, as vLLM normalises it ("compressed_tensors" -> "compressed-tensors")
    config: Mapping[str, Any] = field(default_factory=dict)
    source: str = "config.json"  # the file (and key) it came from

    @property
    def unconverted(self) -> tuple[str, ...]:
        """The modules the release left unquantized, as its config lists them."""
        for key in UNCONVERTED_KEYS:
            if self.config.get(key):
                return tuple(self.config[key])
        return ()

    def to_json(self) -> dict[str, Any]:
        return {"method": self.method, "source": self.source, "config": dict(self.config)}


def _method(config: Mapping[str, Any]) -> str:
    if "quant_method" in config:
        return str(config["quant_method"]).lower().replace("compressed_tensors", "compressed-tensors")
    if "quantization" in config and "producer" in config:  # ModelOpt's hf_quant_config.json
        return "modelopt"
    if "config_groups" in config:  # an older compressed-tensors compression_config
        return "compressed-tensors"
    return "unknown"


def read_record(model_dir: Path) -> QuantizationRecord | None:
    """The folder's quantization record, or None for a float checkpoint."""
    config_path = Path(model_dir) / "config.json"
    config = read_json(config_path) if config_path.is_file() else {}
    for where, holder in (("", config), ("text_config.", config.get("text_config") or {})):
        for key in ("quantization_config", "compression_config"):
            if holder.get(key):
                return QuantizationRecord(_method(holder[key]), dict(holder[key]), f"config.json {where}{key}")
    for name in RECORD_FILES:
        path = Path(model_dir) / name
        if path.is_file():
            record = read_json(path)
            method = _method(record)
            if method == "unknown" and name == "quantize_config.json":
                method = "gptq"  # AutoGPTQ's file names no method
            elif method == "unknown" and name == "quant_config.json":
                method = "awq"  # AutoAWQ's neither
            return QuantizationRecord(method, record, name)
    return None


def linear_format(record: QuantizationRecord, where: str = "the checkpoint") -> LinearFormat:
    """The format reading ``record``'s linears; a method we do not read is refused in one line."""
    module = FORMATS.get(record.method)
    if module is None:
        raise ValueError(f"{where} is quantized with quant_method {record.method!r} ({record.source}), which qeff-evs "
                         f"does not read; it reads {', '.join(READ_METHODS)}: use one of those releases or the "
                         "unquantized (bf16) one")
    try:
        return module.linear_format(record.config)
    except ValueError as error:  # a variant of the method we do not read: say whose
        raise ValueError(f"{where} ({record.source}): {error}") from None
