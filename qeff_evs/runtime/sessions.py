"""Backends behind one interface: ONNX Runtime (default), the PyTorch reference, and QAIC.

A language session owns its retained state (KV cache, last vision window) the way a QAIC
program does with ``-retained-state``: the engine sends only the per-call inputs, and the session
feeds each ``*_RetainedState`` output back as the next call's input.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from qeff_evs.runtime.chunks import LanguageStep

RETAINED_SUFFIX = "_RetainedState"


@dataclass(frozen=True)
class VisionResult:
    rows: np.ndarray  # (K, hidden)
    retained_indices: np.ndarray  # (K,) int64
    deepstack: np.ndarray | None = None  # (levels, K, hidden)


@dataclass(frozen=True)
class LanguageShape:
    """Static facts of a compiled/exported language graph the host must honour."""

    num_layers: int
    kv_heads: int
    head_dim: int
    hidden: int
    ctx_len: int
    vision_size: int  # user_vision_size
    deepstack_levels: int = 0


class VisionSession(Protocol):
    def run(self, pixel_values: np.ndarray, host_inputs: dict[str, np.ndarray]) -> VisionResult: ...


class LanguageSession(Protocol):
    shape: LanguageShape

    def reset(self) -> None: ...

    def run(self, step: LanguageStep) -> np.ndarray:
        """Logits ``(1, 1, vocab)`` of the step's last valid position."""


def _ort_session(path: Path):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


class OrtVisionSession:
    def __init__(self, path: Path):
        self.session = _ort_session(path)
        self.input_names = {i.name for i in self.session.get_inputs()}
        self.output_names = [o.name for o in self.session.get_outputs()]

    def run(self, pixel_values: np.ndarray, host_inputs: dict[str, np.ndarray]) -> VisionResult:
        feeds = {"pixel_values": np.asarray(pixel_values, dtype=np.float32), **host_inputs}
        missing = self.input_names - feeds.keys()
        if missing:
            raise ValueError(f"vision graph inputs {sorted(missing)} were not provided")
        out = dict(zip(self.output_names, self.session.run(None, {k: feeds[k] for k in self.input_names})))
        return VisionResult(out["vision_embeds"], out["retained_indices"].astype(np.int64),
                            out.get("deepstack_features"))


class OrtLanguageSession:
    """ONNX Runtime language graph; KV and the vision window are kept as retained state."""

    def __init__(self, path: Path, shape: LanguageShape):
        self.session = _ort_session(path)
        self.shape = shape
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.output_names = [o.name for o in self.session.get_outputs()]
        self.state: dict[str, np.ndarray] = {}
        self.reset()

    def reset(self) -> None:
        s = self.shape
        kv = (1, s.kv_heads, s.ctx_len, s.head_dim)
        self.state = {}
        for i in range(s.num_layers):
            self.state[f"past_key.{i}"] = np.zeros(kv, dtype=np.float32)
            self.state[f"past_value.{i}"] = np.zeros(kv, dtype=np.float32)
        self.state["vision_embeds"] = np.zeros((1, s.vision_size, s.hidden), dtype=np.float32)
        if s.deepstack_levels:
            self.state["deepstack_features"] = np.zeros(
                (s.deepstack_levels, 1, s.vision_size, s.hidden), dtype=np.float32)

    def run(self, step: LanguageStep) -> np.ndarray:
        feeds = dict(self.state)
        feeds.update(input_ids=step.input_ids, position_ids=step.position_ids, image_idx=step.image_idx)
        if step.vision_embeds is not None:
            feeds["vision_embeds"] = step.vision_embeds.astype(np.float32)
        if step.deepstack is not None:
            feeds["deepstack_features"] = step.deepstack.astype(np.float32)
        outputs = dict(zip(self.output_names, self._execute(feeds)))
        for name, value in outputs.items():
            if name.endswith(RETAINED_SUFFIX):
                self.state[name[: -len(RETAINED_SUFFIX)]] = value
        return outputs["logits"]

    def _execute(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        return self.session.run(None, {name: feeds[name] for name in self.input_names})


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


class TorchLanguageSession(OrtLanguageSession):
    """The language step module run eagerly in PyTorch, with the same retained-state handling."""

    def __init__(self, module, shape: LanguageShape, device=None):
        self.device = torch_device(device)
        self.module = module.to(self.device).eval()
        self.shape = shape
        self.input_names = list(module.io.input_names)
        self.output_names = list(module.io.output_names)
        self.state = {}
        self.reset()

    def _execute(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        import torch

        with torch.no_grad():
            outputs = self.module.run({name: torch.as_tensor(feeds[name]).to(self.device) for name in self.input_names})
        return [outputs[name].cpu().numpy() for name in self.output_names]
