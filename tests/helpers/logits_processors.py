"""A custom vLLM logits processor for the settings tests (``--logits-processors helpers.logits_processors:ForceToken``).

vLLM 0.34's documented contract for custom processors (``vllm.v1.worker.gpu.sample.logits_processor``): built once
per engine with the request states, told of each request entering the batch (``add_request`` with its slot), applied
to the batch's logits with the step's layout (``LogitsContext``: a row's slot is ``expanded_idx_mapping[row]``). This
one reads ``extra_args={"force_token": t}`` per request and leaves only token ``t`` possible for that request, so a
test can tell it ran on the export's logits from the output alone.
"""

from __future__ import annotations

import torch
from vllm.v1.worker.gpu.sample.logits_processor import LogitsContext, LogitsProcessor


class ForceToken(LogitsProcessor):
    def __init__(self, vllm_config, req_states) -> None:
        self.forced: dict[int, int] = {}  # request slot -> token

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        token = (sampling_params.extra_args or {}).get("force_token")
        if token is not None and not isinstance(token, int):
            raise ValueError(f"force_token must be an integer token id, got {token!r}")

    def add_request(self, req_idx: int, sampling_params) -> bool:
        token = (sampling_params.extra_args or {}).get("force_token")
        if token is None:
            self.forced.pop(req_idx, None)
            return False
        self.forced[req_idx] = int(token)
        return True

    def apply(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        for row, slot in enumerate(ctx.expanded_idx_mapping.tolist()):
            token = self.forced.get(slot)
            if token is not None:
                keep = logits[row, token].clone()
                logits[row] = float("-inf")
                logits[row, token] = keep
        return logits
