"""The checkpoint reader's interface (``open_weights(model_dir)``'s ``ModuleWeights``) over a model in memory: the
tests' reference for the streamed export (its tensors are the loaded model's own, exactly)."""

from __future__ import annotations

import torch


class StateDictWeights:
    """``names`` / ``shape`` / ``tensor`` / ``quantization`` / ``close`` over ``model.state_dict()``."""

    quantization = None

    def __init__(self, model: torch.nn.Module):
        self._tensors = model.state_dict()
        self.reads: list[str] = []  # every name read, in order (a test may check what was read)

    def names(self) -> tuple[str, ...]:
        return tuple(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._tensors[name].shape)

    def tensor(self, name: str) -> torch.Tensor:
        self.reads.append(name)
        return self._tensors[name].detach().to(torch.float32).clone()

    def close(self) -> None:
        self._tensors = {}
