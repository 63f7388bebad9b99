"""The PyTorch reference backend: the same modules the graphs are exported from, run eagerly (CUDA when present)."""

from __future__ import annotations

import numpy as np

from qeff_evs.manifest import LanguageShape
from qeff_evs.runtime.backends.base import HostStateSession, VisionResult


def torch_device(prefer: str | None = None):
    """CUDA when present (the reference path's accelerator), else CPU."""
    import torch

    if prefer:
        return torch.device(prefer)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class TorchVisionSession:
    """The exportable vision wrapper run eagerly: same inputs as the graph, stable-sort EVS."""

    def __init__(self, wrapper, device=None):
        self.device = torch_device(device)
        self.wrapper = wrapper.to(self.device).eval()

    def run(self, pixel_values: np.ndarray, host_inputs: dict[str, np.ndarray]) -> VisionResult:
        import torch

        feeds = [torch.as_tensor(np.asarray(pixel_values, dtype=np.float32)).to(self.device)]
        feeds += [torch.from_numpy(np.asarray(a)).to(self.device) for a in host_inputs.values()]
        with torch.no_grad():
            outputs = [o.cpu().numpy() for o in self.wrapper(*feeds)]
        if len(outputs) == 3:  # embeds, deepstack, indices
            return VisionResult(outputs[0], outputs[2].astype(np.int64), outputs[1])
        return VisionResult(outputs[0], outputs[1].astype(np.int64))


class TorchLanguageSession(HostStateSession):
    """The language step module run eagerly in PyTorch, with the same retained-state handling."""

    def __init__(self, module, shape: LanguageShape, device=None):
        self.device = torch_device(device)
        self.module = module.to(self.device).eval()
        super().__init__(shape, list(module.io.input_names), list(module.io.output_names))

    def _execute(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        import torch

        with torch.no_grad():
            outputs = self.module.run({name: torch.as_tensor(feeds[name]).to(self.device) for name in self.input_names})
        return [outputs[name].cpu().numpy() for name in self.output_names]
