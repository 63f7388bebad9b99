"""A family's model built from its config without its weights: what a streamed export traces.

The model is constructed on the meta device (no memory), then each parameter gets a stand-in that costs nothing
whatever its shape: one element broadcast to it (``torch.full((), k).expand(shape)``), with ``k`` distinct per
parameter, so that no pass comparing tensor values (the ONNX exporter merges equal initializers) can take two of them
for one. Tied parameters stay one object. The buffers a checkpoint does not hold (the rotary embeddings'
``inv_freq``) are computed by transformers' own initialisation of their modules, as ``from_pretrained`` computes
them, so what a traced graph bakes in from them (the RoPE tables) is exact.

Running the hollow model computes garbage at a real model's cost for the example sizes (a matrix product may copy
one stand-in into a dense matrix for as long as the product runs); nothing holds more than one such copy at a time.
"""

from __future__ import annotations

import torch
from torch import nn


def _stand_in(parameter: nn.Parameter, value: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.full((), float(value), dtype=dtype).expand(parameter.shape), requires_grad=False)


def hollow_model(model_class: type, config, dtype: torch.dtype = torch.float32) -> nn.Module:
    """``model_class(config)`` in eval mode with zero-cost parameter stand-ins (``dtype``) and real buffers."""
    with torch.device("meta"):
        model = model_class(config)
    stand_ins: dict[int, nn.Parameter] = {}
    rebuilt: list[nn.Module] = []
    for module in model.modules():
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
            for name in meta:
                module._buffers[name] = torch.empty_like(module._buffers[name], device="cpu")
            rebuilt.append(module)
    for module in rebuilt:
        model._init_weights(module)  # transformers' own init of the buffers it does not save (rotary inv_freq)
        left = [name for name, buffer in module._buffers.items() if buffer is not None and buffer.is_meta]
        if left:
            raise ValueError(f"transformers' init left {type(module).__name__}'s buffers {left} empty")
    return model.eval()


def parameter_names(model: nn.Module) -> dict[int, str]:
    """``id(parameter) -> name`` in ``model``'s ``state_dict`` (a tied parameter: its first name)."""
    names: dict[int, str] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), name)
    return names
