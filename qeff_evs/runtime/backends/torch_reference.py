"""The PyTorch reference backend: the same modules the graphs are exported from, run eagerly (CUDA when present);
the language session keeps its retained state on that device between calls."""

from __future__ import annotations

import numpy as np

from qeff_evs.manifest import LanguageShape
from qeff_evs.models.graph_io import RETAINED_SUFFIX, state_shapes
from qeff_evs.runtime.backends.base import MergedRows, RetainedStateSession, merged_rows, ranking


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


class TorchLanguageSession(RetainedStateSession):
    """The language step module run eagerly in PyTorch, its retained state kept on the session's device.

    The retained inputs (KV caches, layer states, the vision window) are float32 tensors on ``device``, zeroed once,
    as a ``-retained-state`` program keeps them on the card: each call's ``*_RetainedState`` outputs replace them
    there, so on CUDA a call moves only its per-call inputs to the GPU and its logits back, never the cache.
    ``state`` reads them as numpy arrays: on the CPU the tensors' own memory (write into it in place to change what
    the next call reads, as on ONNX Runtime), on CUDA a copy.
    """

    def __init__(self, module, shape: LanguageShape, device=None):
        self.device = torch_device(device)
        self.module = module.to(self.device).eval()
        super().__init__(shape, list(module.io.input_names), list(module.io.output_names))

    def reset(self) -> None:
        import torch

        self.tensors = {name: torch.zeros(dims, dtype=torch.float32, device=self.device)
                        for name, dims in state_shapes(self.shape).items()}

    @property
    def state(self) -> dict[str, np.ndarray]:
        return {name: tensor.numpy() if tensor.device.type == "cpu" else tensor.cpu().numpy()
                for name, tensor in self.tensors.items()}

    def _call(self, inputs: dict[str, np.ndarray]) -> np.ndarray:
        import torch

        feeds = dict(self.tensors)
        for name, value in inputs.items():
            # A prefill chunk's window is a per-call input that becomes the retained one: float32, as the state.
            tensor = torch.as_tensor(value, dtype=torch.float32 if name in self.tensors else None)
            feeds[name] = tensor.to(self.device)
        with torch.no_grad():
            outputs = self.module.run(feeds)
        for name in self.tensors:
            self.tensors[name] = outputs[name + RETAINED_SUFFIX]
        return outputs["logits"].cpu().numpy()
