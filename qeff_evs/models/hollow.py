"""A family's model built from its config without its weights: what a streamed export traces.

The model is constructed on the meta device (no memory), then each parameter gets a stand-in that costs nothing
whatever its shape: one element broadcast to it (``torch.full((), k).expand(shape)``), with ``k`` distinct per
parameter, so that no pass comparing tensor values (the ONNX exporter merges equal initializers) can take two of them
for one. Tied parameters stay one object. A buffer the checkpoint holds (a persistent one, in the state dict:
Nemotron-H's MoE ``e_score_correction_bias``, RADIO's ``summary_idxs``) is data like a parameter: it becomes a
stand-in parameter of the same name (its own dtype if an integer one), so a trace takes it as an input and the
streamed export writes it from the checkpoint, as it writes the weights. The buffers a checkpoint does not hold (the
rotary embeddings' ``inv_freq``) are computed by transformers' own initialisation of their modules, as
``from_pretrained`` computes them, so what a traced graph bakes in from them (the RoPE tables) is exact.

Running the hollow model computes garbage at a real model's cost for the example sizes (a matrix product may copy
one stand-in into a dense matrix for as long as the product runs); nothing holds more than one such copy at a time.
"""

from __future__ import annotations

import torch
from torch import nn


def _stand_in(tensor: torch.Tensor, value: int, dtype: torch.dtype) -> nn.Parameter:
    dtype = dtype if tensor.is_floating_point() else tensor.dtype  # an index buffer keeps its integer dtype
    return nn.Parameter(torch.full((), value, dtype=dtype).expand(tensor.shape), requires_grad=False)


def hollow_model(model_class: type, config, dtype: torch.dtype = torch.float32) -> nn.Module:
    """``model_class(config)`` in eval mode with zero-cost stand-ins (``dtype``) for its parameters and the buffers
    its checkpoint holds, and its computed buffers real."""
    with torch.device("meta"):
        model = model_class(config)
    stand_ins: dict[int, nn.Parameter] = {}
    rebuilt: list[nn.Module] = []
    for module in model.modules():
        for name in [name for name, buffer in module._buffers.items()
                     if buffer is not None and name not in module._non_persistent_buffers_set]:
            held = module._buffers.pop(name)  # held by the checkpoint: a stand-in parameter (module docstring)
            module._parameters[name] = _stand_in(held, len(stand_ins) + 1, dtype)
            stand_ins[id(module._parameters[name])] = module._parameters[name]
        for name, parameter in list(module._parameters.items()):
            if parameter is None:
                continue
            if id(parameter) not in stand_ins:
                stand_ins[id(parameter)] = _stand_in(parameter, len(stand_ins) + 1, dtype)
            module._parameters[name] = stand_ins[id(parameter)]
        meta = [name for name, buffer in module._buffers.items() if buffer is not None and buffer.is_meta]
        if meta:
            if any(True for _ in module.parameters(recurse=False)):
                raise ValueError(f"{type(module).__name__} holds both parameters and computed buffers {meta}; "
                                 "qeff-evs cannot rebuild its buffers without its weights")
            for name in meta:  # NaN until transformers' init fills it, so a buffer it skips is caught below
                buffer = torch.empty_like(module._buffers[name], device="cpu")
                module._buffers[name] = buffer.fill_(float("nan")) if buffer.is_floating_point() else buffer
            rebuilt.append(module)
    owners = _innermost_pretrained(model)
    for module in rebuilt:
        owners[id(module)]._init_weights(module)  # transformers' own init of the buffers it does not save
        left = [name for name, buffer in module._buffers.items()
                if buffer is not None and (buffer.is_meta or (buffer.is_floating_point() and buffer.isnan().any()))]
        if left:
            raise ValueError(f"transformers' init left {type(module).__name__}'s buffers {left} unset; qeff-evs "
                             "cannot export this checkpoint streamed (export it with --in-memory)")
    return model.eval()


def _innermost_pretrained(model: nn.Module) -> dict[int, nn.Module]:
    """``id(module) -> the innermost model holding it that has ``_init_weights``: a composite model's own init
    does not know its sub-models' modules (Nemotron-H Omni's knows no Parakeet positional encoding)."""
    owners: dict[int, nn.Module] = {}

    def walk(module: nn.Module, owner: nn.Module) -> None:
        owner = module if hasattr(module, "_init_weights") else owner
        owners[id(module)] = owner
        for child in module.children():
            walk(child, owner)

    walk(model, model)
    return owners


def parameter_names(model: nn.Module) -> dict[int, str]:
    """``id(parameter) -> name`` in ``model``'s ``state_dict`` (a tied parameter: its first name)."""
    names: dict[int, str] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), name)
    return names
