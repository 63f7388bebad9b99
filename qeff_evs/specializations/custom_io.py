"""``custom_io.yaml``: the device-side precision of selected graph inputs/outputs.

``qaic-compile -custom-IO-list-file=`` takes a YAML list of ``{IOName, Precision}`` records;
any IO not listed keeps the ONNX dtype (fp32 here). QEfficient lists:

* vision graph: ``pixel_values`` and ``vision_embeds`` (+ a family's extra rows) as
  ``float16`` -- halves the transfer of the largest buffers; here the encoder graph, and the pruning
  graphs' ``merged_embeds`` and ``score_extras`` in (a pruning graph computes in fp32: the compiler
  converts fp16 I/O at the graph's edge; its ``retention_ratio`` stays fp32 and its ranking is int64);
* language graph: ``vision_embeds`` (+ extra rows) and their ``_RetainedState``
  twins as ``float16``; every ``past_key.{i}`` / ``past_value.{i}`` and its
  ``_RetainedState`` as ``float16`` or ``mxint8`` (``mxint8`` is not a compiler flag, only
  this precision). A retained-state output must have the same precision as its input.
  A family's other per-row layer states (``LayerState``: e.g. linear attention's conv and recurrent
  state) get the precision they declare: ``float16`` is listed, ``float32`` is left out, so the
  buffer keeps the ONNX graph's fp32 on the card (the ops it flows through are kept fp32 by the
  node-precision file written beside it).

The builders read the IO names from the exported graph itself, so the list can never name
an IO the graph lacks or miss one it has; which of them are embeddings the caller says
(``embedding_names``: ``EMBEDDING_NAMES`` plus the family's extra rows).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import yaml

from qeff_evs.manifest import LayerState

FLOAT16 = "float16"
MXINT8 = "mxint8"
KV_PRECISIONS: tuple[str, ...] = (FLOAT16, MXINT8)
RETAINED_SUFFIX = "_RetainedState"

# Embedding-like IOs every export has, kept in fp16 (a family's extra rows are added to these).
EMBEDDING_NAMES: tuple[str, ...] = ("vision_embeds", "merged_embeds", "score_extras")
_KV_NAME = re.compile(r"^past_(key|value)\.\d+$")


def _base_name(io_name: str) -> str:
    return io_name[: -len(RETAINED_SUFFIX)] if io_name.endswith(RETAINED_SUFFIX) else io_name


def custom_io_precisions(
    io_names: Iterable[str], kv_precision: str = FLOAT16, pixel_values_fp16: bool = True,
    embedding_names: Sequence[str] = EMBEDDING_NAMES, state_precisions: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """``{io name: precision}`` for the IOs among ``io_names`` that get a custom precision.

    Works for every graph: ``embedding_names`` (and their retained twins) -> float16, KV cache (and
    retained twins) -> ``kv_precision``, ``pixel_values`` -> float16 when ``pixel_values_fp16``, a layer
    state named in ``state_precisions`` (input name -> its declared precision) -> float16, or left out
    when it stays float32. Other names (ids, positions, index tensors, logits, kept_indices) are
    left out.
    """
    if kv_precision not in KV_PRECISIONS:
        raise ValueError(f"kv_precision must be one of {KV_PRECISIONS}, got {kv_precision!r}; use --mxint8 for mxint8")
    states = dict(state_precisions or {})
    precisions: dict[str, str] = {}
    for name in io_names:
        base = _base_name(name)
        if base in embedding_names or (pixel_values_fp16 and name == "pixel_values"):
            precisions[name] = FLOAT16
        elif base in states:
            if states[base] == FLOAT16:
                precisions[name] = FLOAT16
        elif _KV_NAME.match(base):
            precisions[name] = kv_precision
    return precisions


def state_precisions(layer_states: Iterable[LayerState]) -> dict[str, str]:
    """``{input name: precision}`` of every layer state's inputs (what ``custom_io_precisions`` takes)."""
    return {name: state.precision for state in layer_states for name in state.input_names}


def vision_custom_io(extras: Sequence[str] = (), pixel_values_fp16: bool = True) -> dict[str, str]:
    """Custom IO of the encoder graph (pixels in, merged rows and the family's ``extras`` out), from the
    names the design fixes (§5)."""
    names = ["pixel_values", "vision_embeds", *extras]
    return custom_io_precisions(names, pixel_values_fp16=pixel_values_fp16, embedding_names=(*EMBEDDING_NAMES, *extras))


def pruning_custom_io(score_extras: bool = False) -> dict[str, str]:
    """Custom IO of a pruning graph (§5): a video's merged rows (and, for a family with extra rows, its
    ``score_extras``) in; the ranking out stays int64, ``retention_ratio`` fp32."""
    names = ["merged_embeds", *(["score_extras"] if score_extras else []), "bucket_carrier", "frame_count",
             "retention_ratio", "ranking"]
    return custom_io_precisions(names, pixel_values_fp16=False)


def language_custom_io(num_layers: int, extras: Sequence[str] = (), kv_precision: str = FLOAT16,
                       kv_layers: Sequence[int] | None = None,
                       layer_states: Sequence[LayerState] = ()) -> dict[str, str]:
    """Custom IO of the language graph, from the names the design fixes (§6); ``extras``: the family's extra
    rows; ``kv_layers`` / ``layer_states``: a hybrid family's cached layers and other per-row state."""
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"num_layers must be a positive integer, got {num_layers!r}")
    inputs = ["vision_embeds", *extras]
    inputs += [f"past_{kind}.{i}" for i in (range(num_layers) if kv_layers is None else kv_layers)
               for kind in ("key", "value")]
    inputs += [name for state in layer_states for name in state.input_names]
    names = [n for name in inputs for n in (name, name + RETAINED_SUFFIX)]
    return custom_io_precisions(names, kv_precision=kv_precision, embedding_names=(*EMBEDDING_NAMES, *extras),
                                state_precisions=state_precisions(layer_states))


def check_retained_pairs(precisions: Mapping[str, str], io_names: Iterable[str]) -> None:
    """Each ``X_RetainedState`` must share ``X``'s precision (they alias one device buffer)."""
    names = set(io_names)
    for name in names:
        if not name.endswith(RETAINED_SUFFIX) or _base_name(name) not in names:
            continue
        base = _base_name(name)
        if precisions.get(name) != precisions.get(base):
            raise ValueError(
                f"{name} has precision {precisions.get(name)!r} but its input {base} has {precisions.get(base)!r}; "
                "a retained-state output and its input must share one precision"
            )


def write_custom_io_yaml(path: str | Path, precisions: Mapping[str, str]) -> Path:
    """Write ``[{IOName, Precision}, ...]`` to ``path`` (the -custom-IO-list-file format)."""
    if not precisions:
        raise ValueError("no custom IO entries to write; pass at least one {io name: precision}")
    records = [{"IOName": name, "Precision": precision} for name, precision in precisions.items()]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(records, sort_keys=False, default_flow_style=False))
    return path


def read_custom_io_yaml(path: str | Path) -> dict[str, str]:
    """``{IOName: Precision}`` from a custom IO list file."""
    records = yaml.safe_load(Path(path).read_text())
    if not isinstance(records, list) or not all(
        isinstance(r, Mapping) and {"IOName", "Precision"} <= set(r) for r in records
    ):
        raise ValueError(f"{path}: expected a YAML list of {{IOName, Precision}} records, got {records!r:.200}")
    return {str(r["IOName"]): str(r["Precision"]) for r in records}
