"""What the Qwen2.5-VL and Qwen3-VL vision(+EVS) wrappers share.

Both wrap a weight-sharing copy of the transformers tower whose own config selects the block-mask
attention, take every grid-derived index tensor from the host, and read T and K from the shapes of
two carrier inputs (``video_grid_thw``, ``retained_carrier``) whose values are never used.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn as nn
from transformers.vision_utils import get_vision_cu_seqlens, get_vision_position_ids

from qeff_evs import evs
from qeff_evs.models.attention import register_block_mask_attention


def grid_tensor(grid_thw: Sequence[int] | torch.Tensor) -> torch.Tensor:
    return torch.tensor([[int(v) for v in grid_thw]], dtype=torch.int64)


def check_retained(vision_config, grid_thw: Sequence[int] | torch.Tensor, retained: int) -> tuple[int, int, int]:
    """The merged grid ``(t, h, w)``; raises unless ``1 <= retained <= t*h*w``."""
    t, h, w = evs.merged_grid(grid_thw, vision_config.spatial_merge_size)
    if not 1 <= int(retained) <= t * h * w:
        raise ValueError(
            f"retained count {retained} is outside [1, {t * h * w}] for grid {tuple(int(v) for v in grid_thw)}; "
            "compute it with evs.retained_token_count(h*w, T, q)"
        )
    return t, h, w


def leading_host_inputs(vision_config, grid_thw: Sequence[int]) -> dict[str, np.ndarray]:
    """The inputs both graphs take first: the T carrier, rotary (row, col) ids, per-frame attention bounds."""
    grid = grid_tensor(grid_thw)
    merge = vision_config.spatial_merge_size
    return {
        "video_grid_thw": np.zeros(tuple(grid[0].tolist()), dtype=np.int64),
        "rotary_position_ids": get_vision_position_ids(grid, merge).numpy().astype(np.int64),
        "cu_seqlens": get_vision_cu_seqlens(grid).numpy().astype(np.int32),
    }


def retained_carrier(retained: int) -> np.ndarray:
    """Shape-only input: its length is K."""
    return np.zeros(int(retained), dtype=np.int64)


def grid_symbols(vision_config, grid_thw: Sequence[int], retained: int) -> dict[str, int]:
    """The symbols every vision specialization binds (DESIGN §7 names), for one grid and K."""
    t, h, w = check_retained(vision_config, grid_thw, retained)
    big_t, big_h, big_w = (int(v) for v in grid_thw)
    patch = vision_config.patch_size
    return {
        "grid_height": big_t * big_h * big_w,
        "grid_width": vision_config.in_channels * vision_config.temporal_patch_size * patch * patch,
        "time": big_t,
        "grid_h": big_h,
        "grid_w": big_w,
        "frame_bounds": big_t + 1,
        "vision_size": t * h * w,
        "retained_size": int(retained),
    }


def share_weights_copy(module: nn.Module) -> nn.Module:
    """A structural copy of ``module`` (own config objects) that shares every parameter and buffer."""
    shared = {id(t): t for t in itertools.chain(module.parameters(), module.buffers())}
    return copy.deepcopy(module, memo=shared)


class VisionEVSWrapper(nn.Module):
    """Shared plumbing of the exportable towers: the graph is the tower (``encode``), then the selection.

    Subclasses declare ``graph_spec`` and define ``encode`` (every graph input but the K carrier, by name)
    and ``select`` (the EVS selection of the tower's rows), plus the host inputs.
    """

    family_label = "Qwen-VL"
    # The family's module-level functions (grid, K) -> graph inputs / symbol values.
    host_inputs_fn = staticmethod(lambda vision_config, grid_thw, retained: {})
    symbols_fn = staticmethod(grid_symbols)

    def __init__(self, visual: nn.Module) -> None:
        super().__init__()
        self.visual = share_weights_copy(visual)
        self.visual.config._attn_implementation = register_block_mask_attention()

    @classmethod
    def from_model(cls, model: nn.Module):
        """Wrap the vision tower of a ``...ForConditionalGeneration`` model (or its inner model)."""
        inner = getattr(model, "model", model)
        visual = getattr(inner, "visual", None)
        if visual is None:
            raise ValueError(
                f"{type(model).__name__} has no .visual tower; pass a {cls.family_label} model or its .visual")
        return cls(visual)

    @property
    def vision_config(self):
        return self.visual.config

    def encode(self, **inputs: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The tower alone: every merged row ``(T*h*w, D)`` and each deepstack level's rows (same shape)."""
        raise NotImplementedError

    def select(self, merged: torch.Tensor, levels: list[torch.Tensor], frames: int,
               retained_carrier: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The K kept rows [, the same rows of every deepstack level] and their flat indices."""
        raise NotImplementedError

    def tower_outputs(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor], int, torch.Tensor]:
        """Graph inputs in ``graph_spec`` order -> ``(merged rows, deepstack levels, T, the K carrier)``."""
        named = dict(zip(self.graph_spec.input_names, inputs))
        retained_carrier = named.pop("retained_carrier")
        merged, levels = self.encode(**named)
        # T from a shape, so the EVS reshape stays symbolic in the graph.
        return merged, levels, named["video_grid_thw"].shape[0], retained_carrier

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.select(*self.tower_outputs(*inputs))

    def host_inputs(self, grid_thw: Sequence[int], retained: int) -> dict[str, np.ndarray]:
        return self.host_inputs_fn(self.vision_config, grid_thw, retained)

    def symbols(self, grid_thw: Sequence[int], retained: int) -> dict[str, int]:
        return self.symbols_fn(self.vision_config, grid_thw, retained)

    def dummy_inputs(self, grid_thw: Sequence[int], retained: int, seed: int = 0) -> dict[str, torch.Tensor]:
        """Random ``pixel_values`` plus the host inputs, as tensors in graph order (export examples)."""
        symbols = self.symbols(grid_thw, retained)
        dtype = next(self.visual.parameters()).dtype
        generator = torch.Generator().manual_seed(seed)
        pixels = torch.randn(symbols["grid_height"], symbols["grid_width"], generator=generator).to(dtype)
        host = {name: torch.from_numpy(array) for name, array in self.host_inputs(grid_thw, retained).items()}
        return {"pixel_values": pixels, **host}

    def run(self, pixel_values: torch.Tensor, grid_thw: Sequence[int], retained: int):
        """Eager forward for one video, host inputs built here (the PyTorch reference backend's call)."""
        device = pixel_values.device
        host = [torch.from_numpy(array).to(device) for array in self.host_inputs(grid_thw, retained).values()]
        with torch.no_grad():
            return self(pixel_values, *host)
