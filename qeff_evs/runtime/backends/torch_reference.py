"""The PyTorch reference backend: the same modules the graphs are exported from, run eagerly (CUDA when present)."""

from __future__ import annotations

import numpy as np

from qeff_evs.manifest import LanguageShape
from qeff_evs.runtime.backends.base import HostStateSession, MergedRows, merged_rows, ranking


def torch_device(prefer: str | None = None):
    """CUDA when present (the reference path's accelerator), else CPU."""
    import torch

    if prefer:
        return torch.device(prefer)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class TorchEncoderSession:
    """The exportable encoder wrapper run eagerly: same inputs as the graph."""

    def __init__(self, wrapper, device=None):
        self.device = torch_device(device)
        self.wrapper = wrapper.to(self.device).eval()

    def encode(self, pixel_values: np.ndarray, host_inputs: dict[str, np.ndarray]) -> MergedRows:
        import torch

        pixels = torch.as_tensor(np.asarray(pixel_values, dtype=np.float32)).to(self.device)
        outputs = self.wrapper.run(pixels, host_inputs)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        return merged_rows({name: o.cpu().numpy() for name, o in zip(self.wrapper.graph_spec.output_names, outputs)})


class TorchPruningSession:
    """A pruning module (``family.pruning_ranking(method)``) run eagerly: same inputs as its graph."""

    def __init__(self, ranking, device=None):
        self.device = torch_device(device)
        self.ranking = ranking.to(self.device).eval()

    def rank(self, feeds: dict[str, np.ndarray]) -> np.ndarray:
        import torch

        spec = self.ranking.graph_spec
        with torch.no_grad():
            order = self.ranking(*(torch.from_numpy(np.asarray(feeds[name])).to(self.device)
                                   for name in spec.input_names))
        return ranking({spec.output_names[0]: order.cpu().numpy()})


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
