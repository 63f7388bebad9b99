"""A checkpoint folder rewritten as a release stores it, by the test itself (safetensors' own writer, not qeff-evs's
reader): other dtypes, shards with an index, renamed tensors, experts per expert or fused and transposed.

``rewrite(src, dst, transform)`` copies a ``save_pretrained`` folder and rewrites its tensors: ``transform`` maps the
``{name: tensor}`` of the whole checkpoint to the new one. The transforms below are the layouts releases use.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

Tensors = dict[str, torch.Tensor]


def read_all(folder: Path) -> Tensors:
    tensors: Tensors = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def write_shards(tensors: Tensors, folder: Path, shards: int = 1) -> None:
    """``tensors`` as ``model.safetensors``, or as ``shards`` files and their index (names in order, split evenly)."""
    for old in list(folder.glob("*.safetensors")) + list(folder.glob("*.safetensors.index.json")):
        old.unlink()
    names = list(tensors)
    if shards == 1:
        save_file({n: tensors[n].contiguous() for n in names}, folder / "model.safetensors")
        return
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = names[i::shards]
        save_file({n: tensors[n].contiguous() for n in part}, folder / file)
        weight_map.update({n: file for n in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def rewrite(src: Path, dst: Path, transform: Callable[[Tensors], Tensors], shards: int = 1,
            config: Callable[[dict], dict] | None = None) -> Path:
    """A copy of checkpoint folder ``src`` at ``dst`` with its tensors ``transform``ed (and config.json, if given)."""
    shutil.copytree(src, dst)
    write_shards(transform(read_all(src)), dst, shards)
    if config is not None:
        path = dst / "config.json"
        path.write_text(json.dumps(config(json.loads(path.read_text())), indent=2))
    return dst


def to_dtype(dtype: torch.dtype) -> Callable[[Tensors], Tensors]:
    return lambda tensors: {n: t.to(dtype) if t.is_floating_point() else t for n, t in tensors.items()}


def module_names_qwen2_5(tensors: Tensors) -> Tensors:
    """Qwen2.5-VL's release names (``visual.*``, ``model.layers.*``) written as transformers' module names."""
    def name(n: str) -> str:
        if n.startswith("visual."):
            return "model." + n
        if n.startswith("model.") and not n.startswith("model.visual."):
            return "model.language_model." + n[len("model."):]
        return n
    return {name(n): t for n, t in tensors.items()}


def rename(pattern: str, replacement: str) -> Callable[[Tensors], Tensors]:
    """Every name matching ``pattern`` (``re.sub``) written as ``replacement``."""
    return lambda tensors: {re.sub(pattern, replacement, n): t for n, t in tensors.items()}


FUSED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def experts_transposed(tensors: Tensors) -> Tensors:
    """Fused experts as Qwen3-VL-MoE's bf16 release stores them: (experts, in, out)."""
    return {n: t.transpose(1, 2).contiguous() if FUSED.match(n) else t for n, t in tensors.items()}


def experts_split(tensors: Tensors) -> Tensors:
    """Fused experts stored per expert (Qwen3-VL-MoE's FP8 release, every Qwen3.5-MoE release):
    ``experts.<e>.{gate,up,down}_proj.weight``, gate rows first in the fused ``gate_up_proj``."""
    out: Tensors = {}
    for name, tensor in tensors.items():
        match = FUSED.match(name)
        if not match:
            out[name] = tensor
            continue
        prefix, kind = match.groups()
        for e in range(tensor.shape[0]):
            if kind == "down_proj":
                out[f"{prefix}.{e}.down_proj.weight"] = tensor[e].clone()
            else:
                gate, up = tensor[e].chunk(2, dim=0)
                out[f"{prefix}.{e}.gate_proj.weight"] = gate.clone()
                out[f"{prefix}.{e}.up_proj.weight"] = up.clone()
    return out
