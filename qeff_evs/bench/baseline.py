"""The EVS overhead's baseline graph, built around the production vision wrapper.

``FirstRowsVision`` runs the wrapper's tower (``tower_outputs``) and, where the wrapper runs the EVS
selection (``select``), the same final Gather of the first K rows. Both graphs take the same inputs and return the
same shapes (deepstack rows gathered alike), so their time difference is the selection's work.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn as nn


def first_rows(merged: torch.Tensor, frames: int, retained_carrier: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The first K rows and their indices; the raster index goes through ``frames`` so T stays a graph input."""
    per_frame = merged.shape[0] // frames
    first = torch.arange(retained_carrier.shape[0], device=merged.device)
    indices = (first // per_frame) * per_frame + first % per_frame
    return merged.index_select(0, indices), indices


class FirstRowsVision(nn.Module):
    """A family's vision wrapper with its EVS selection replaced by the first K rows (same graph interface)."""

    def __init__(self, wrapper: nn.Module) -> None:
        super().__init__()
        self.wrapper = wrapper

    @property
    def graph_spec(self):
        return self.wrapper.graph_spec

    def dummy_inputs(self, grid_thw: Sequence[int], retained: int) -> dict[str, torch.Tensor]:
        return self.wrapper.dummy_inputs(grid_thw, retained)

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        merged, levels, frames, retained_carrier = self.wrapper.tower_outputs(*inputs)
        rows, indices = first_rows(merged, frames, retained_carrier)
        if not levels:
            return rows, indices
        return rows, torch.stack(levels, dim=0).index_select(1, indices), indices
