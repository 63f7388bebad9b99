"""From a checkpoint's stored names to a module's state-dict names, as a model family declares it (data, not code).

A family's ``NameMap`` says how its released (or ``save_pretrained``) names differ from the names its transformers
module holds: ``Rename`` rules (regular expressions, applied in order to every stored name); ``FusedExperts``:
a module's 3-D expert tensor ``<prefix>.<fused>`` of shape ``(experts, out, in)`` that a checkpoint stores either
fused (possibly as ``(experts, in, out)``) or per expert, expert ``e``'s ``parts`` concatenated along ``out``; and
``SplitTensors``: module tensors that a checkpoint stores as one, concatenated along the first axis in equal chunks
(RADIO's fused ``qkv`` projection, which transformers' module holds as ``q_proj``, ``k_proj``, ``v_proj``).
``plan`` turns the map, the module's names and shapes and the stored names and shapes into one ``Source`` per module
name, checking every shape from headers alone.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

EXPERT = "{expert}"  # where a per-expert part's name holds the expert's index


@dataclass(frozen=True)
class Rename:
    """Every stored name matching ``pattern`` (``re.sub``) becomes ``replacement``."""

    pattern: str
    replacement: str


@dataclass(frozen=True)
class FusedExperts:
    """A module tensor ``<prefix>.<fused>``, ``(experts, out, in)``, that a checkpoint may store per expert.

    Example (Qwen3.5-MoE): ``fused="mlp.experts.gate_up_proj"``, ``parts=("mlp.experts.{expert}.gate_proj.weight",
    "mlp.experts.{expert}.up_proj.weight")``: expert ``e``'s rows are its gate projection's, then its up projection's.
    """

    fused: str
    parts: tuple[str, ...]
    # A stored fused tensor may hold (experts, in, out) (Qwen3-VL-MoE's bf16 release): it is transposed when its shape
    # is that and not the module's (transformers' rule: a shape equal to the module's is taken as it is).
    stored_transposed: bool = False


@dataclass(frozen=True)
class SplitTensors:
    """Module tensors ``<prefix><part>.<tail>``, one per ``parts``, that a checkpoint stores as the one tensor
    ``<prefix><fused>.<tail>`` (its name after the renames): the parts in order along its first axis, equal chunks (as
    transformers' ``Chunk(dim=0)`` splits them). ``tail`` is anything (``weight``, ``bias``).

    Example (RADIO): ``fused="attn.qkv"``, ``parts=("attention.q_proj", "attention.k_proj", "attention.v_proj")``:
    the module's ``encoder.layer.0.attention.k_proj.bias`` is the second third of the stored
    ``encoder.layer.0.attn.qkv.bias``.
    """

    fused: str
    parts: tuple[str, ...]


@dataclass(frozen=True)
class NameMap:
    """How a family's checkpoints name its module's tensors (empty: stored names are the module's)."""

    renames: tuple[Rename, ...] = ()
    experts: tuple[FusedExperts, ...] = ()
    splits: tuple[SplitTensors, ...] = ()

    def rename(self, stored: str) -> str:
        for rule in self.renames:
            stored = re.sub(rule.pattern, rule.replacement, stored)
        return stored


# Where a module tensor's data comes from.
@dataclass(frozen=True)
class Stored:
    """A stored tensor, as it is."""

    name: str


@dataclass(frozen=True)
class Transposed:
    """A stored fused expert tensor ``(experts, in, out)``, swapped to ``(experts, out, in)``."""

    name: str


@dataclass(frozen=True)
class PerExpert:
    """Expert ``e``'s stored tensors ``names[e]`` concatenated along their first axis, stacked over experts."""

    names: tuple[tuple[str, ...], ...]


@dataclass(frozen=True)
class Chunk:
    """Chunk ``index`` of ``count`` equal chunks of a stored tensor along its first axis."""

    name: str
    index: int
    count: int


Source = Stored | Transposed | PerExpert | Chunk


def _swap(shape: Sequence[int]) -> tuple[int, ...]:
    return (shape[0], shape[2], shape[1], *shape[3:])


def _fused_rule(name_map: NameMap, name: str) -> tuple[FusedExperts, str] | None:
    """``(rule, prefix)`` of the ``FusedExperts`` rule whose tensor ``name`` is, if one is."""
    for rule in name_map.experts:
        if name == rule.fused or name.endswith("." + rule.fused):
            return rule, name[: len(name) - len(rule.fused)]
    return None


def _split_rule(name_map: NameMap, name: str) -> tuple[SplitTensors, int, str] | None:
    """``(rule, part index, the stored tensor's name after the renames)`` of the ``SplitTensors`` rule one of whose
    parts ``name`` is, if one is."""
    for rule in name_map.splits:
        for index, part in enumerate(rule.parts):
            at = 0 if name.startswith(part + ".") else name.find("." + part + ".") + 1  # also 0 when not found
            if at or name.startswith(part + "."):
                return rule, index, f"{name[:at]}{rule.fused}.{name[at + len(part) + 1:]}"
    return None


def plan(name_map: NameMap, module_shapes: Mapping[str, tuple[int, ...]], tied: Mapping[str, Sequence[str]],
         stored_shapes: Mapping[str, tuple[int, ...]], where: str = "the checkpoint") -> dict[str, Source]:
    """One ``Source`` per module name, every shape checked against the module's.

    Args:
        name_map: the family's ``NameMap``.
        module_shapes: the module's state-dict names -> shapes.
        tied: a module name -> the other names of the same tensor (tied embeddings): it may be stored under any.
        stored_shapes: the checkpoint's (float, dequantized) tensor names -> shapes.
        where: how errors name the checkpoint.
    Returns:
        module name -> ``Stored`` | ``Transposed`` | ``PerExpert`` | ``Chunk``. Stored names no module name reads
        are ignored (as transformers ignores them: a release's multi-token-prediction head, say).
    Raises:
        ValueError naming the module tensors the checkpoint lacks, or a shape that differs from the module's.
    """
    renamed: dict[str, str] = {}
    for name in stored_shapes:
        target = name_map.rename(name)
        if target in renamed:
            raise ValueError(f"{where} stores both {renamed[target]} and {name}, which are the same module tensor "
                             f"{target}; remove one")
        renamed[target] = name
    sources: dict[str, Source] = {}
    missing = []
    for name, shape in module_shapes.items():
        shape = tuple(shape)
        fused = _fused_rule(name_map, name)
        split = _split_rule(name_map, name)
        stored = next((renamed[n] for n in (name, *tied.get(name, ())) if n in renamed), None)
        if stored is not None:
            found = tuple(stored_shapes[stored])
            if found == shape:
                sources[name] = Stored(stored)
            elif fused is not None and fused[0].stored_transposed and len(shape) == 3 and found == _swap(shape):
                sources[name] = Transposed(stored)
            else:
                raise ValueError(f"{where} stores {stored} as {list(found)}, but the model's {name} is {list(shape)}; "
                                 "the checkpoint does not match its config.json")
        elif fused is not None:
            rule, prefix = fused
            per_expert = []
            for expert in range(shape[0]):
                names = tuple(prefix + part.replace(EXPERT, str(expert)) for part in rule.parts)
                absent = [n for n in names if n not in renamed]
                if absent:
                    break
                per_expert.append(tuple(renamed[n] for n in names))
            if len(per_expert) < shape[0]:
                missing.append(name)
                continue
            for names in per_expert:
                rows = [stored_shapes[n] for n in names]
                if any(len(r) != 2 or r[1] != shape[2] for r in rows) or sum(r[0] for r in rows) != shape[1]:
                    raise ValueError(f"{where} stores {', '.join(names)} as {[list(r) for r in rows]}; together they "
                                     f"do not make one expert of the model's {name} {list(shape)}")
            sources[name] = PerExpert(tuple(per_expert))
        elif split is not None and split[2] in renamed:
            rule, index, target = split
            whole = renamed[target]
            found = tuple(stored_shapes[whole])
            if not shape or found != (len(rule.parts) * shape[0], *shape[1:]):
                raise ValueError(f"{where} stores {whole} as {list(found)}, but the model's {name} is {list(shape)}, "
                                 f"one of {len(rule.parts)} equal parts of it along its first axis; the checkpoint "
                                 "does not match its config.json")
            sources[name] = Chunk(whole, index, len(rule.parts))
        else:
            missing.append(name)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ValueError(f"{where} lacks {len(missing)} of the model's tensors ({shown}); the checkpoint is "
                         "incomplete or of another model than its config.json says")
    return sources


def source_shape(source: Source, stored_shapes: Mapping[str, tuple[int, ...]]) -> tuple[int, ...]:
    """The module-layout shape ``source`` gives, from stored shapes alone."""
    if isinstance(source, Stored):
        return tuple(stored_shapes[source.name])
    if isinstance(source, Transposed):
        return _swap(stored_shapes[source.name])
    if isinstance(source, Chunk):
        whole = stored_shapes[source.name]
        return (whole[0] // source.count, *whole[1:])
    first = [stored_shapes[n] for n in source.names[0]]
    return (len(source.names), sum(r[0] for r in first), first[0][1])
