"""A custom vLLM logits processor for the settings tests (``--logits-processors helpers.logits_processors:ForceToken``).

vLLM's documented contract (``vllm.v1.sample.logits_processor.LogitsProcessor``): built once per engine,
told about the batch's changes, applied to the batch's logits before sampling. This one reads
``extra_args={"force_token": t}`` per request and leaves only token ``t`` possible for that request, so a
test can tell it ran on the export's logits from the output alone.
"""

from __future__ import annotations

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.interface import MoveDirectionality


class ForceToken(LogitsProcessor):
    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        self.forced: dict[int, int] = {}  # batch row -> token

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        token = (sampling_params.extra_args or {}).get("force_token")
        if token is not None and not isinstance(token, int):
            raise ValueError(f"force_token must be an integer token id, got {token!r}")

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index, params, _, _ in batch_update.added:
            token = (params.extra_args or {}).get("force_token") if params is not None else None
            if token is None:
                self.forced.pop(index, None)
            else:
                self.forced[index] = int(token)
        for index in batch_update.removed:
            self.forced.pop(index, None)
        for a, b, direction in batch_update.moved:
            ta, tb = self.forced.pop(a, None), self.forced.pop(b, None)
            if ta is not None:
                self.forced[b] = ta
            if tb is not None and direction == MoveDirectionality.SWAP:
                self.forced[a] = tb

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for row, token in self.forced.items():
            keep = logits[row, token].clone()
            logits[row] = float("-inf")
            logits[row, token] = keep
        return logits
