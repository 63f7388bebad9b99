"""Bad EVS inputs raise ValueError with a message that names the offending value."""

from __future__ import annotations

import math
import re

import pytest
import torch

from qeff_evs.evs import (
    merged_grid,
    kept_token_count,
    retention_mask,
    select_kept,
    tokens_per_frame_kept,
    validate_pruning_rate,
)

GRID = (4, 8, 8)  # patch grid; merged 4x4 with merge size 2 -> 64 rows
EMBEDS = torch.randn(4 * 4 * 4, 16, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize(
    "q, shown",
    [(-0.1, "-0.1"), (-1e-9, "-1e-09"), (1.0, "1.0"), (1, "1"), (1.5, "1.5"), (float("nan"), "nan"),
     (math.inf, "inf"), ("half", "'half'"), (None, "None")],
)
def test_bad_pruning_rate_is_named(q, shown):
    for call in (
        lambda: validate_pruning_rate(q),
        lambda: kept_token_count(16, 4, q),
        lambda: retention_mask(EMBEDS, GRID, 2, q),
    ):
        with pytest.raises(ValueError, match=re.escape(f"got {shown}")):
            call()


@pytest.mark.parametrize("q", [0.0, 0.5, 0.99, 0.999999])
def test_valid_pruning_rates_pass(q):
    assert validate_pruning_rate(q) == q


@pytest.mark.parametrize("grid, merge, shown", [((4, 7, 8), 2, "7x8"), ((4, 8, 9), 2, "8x9"), ((2, 6, 6), 4, "6x6")])
def test_grid_not_divisible_by_merge_size(grid, merge, shown):
    rows = grid[0] * (grid[1] // merge) * (grid[2] // merge)
    with pytest.raises(ValueError, match=re.escape(shown)) as info:
        retention_mask(torch.randn(rows, 8), grid, merge, 0.5)
    assert f"spatial_merge_size {merge}" in str(info.value)
    with pytest.raises(ValueError, match=re.escape(shown)):
        merged_grid(grid, merge)


@pytest.mark.parametrize("grid, merge, shown", [((0, 4, 4), 2, "(0, 4, 4)"), ((2, -2, 4), 2, "(2, -2, 4)")])
def test_non_positive_grid(grid, merge, shown):
    with pytest.raises(ValueError, match=re.escape(shown)):
        merged_grid(grid, merge)


def test_non_positive_merge_size():
    with pytest.raises(ValueError, match="spatial_merge_size must be >= 1, got 0"):
        merged_grid(GRID, 0)


@pytest.mark.parametrize("rows", [63, 65, 16, 128])
def test_row_count_not_t_h_w(rows):
    with pytest.raises(ValueError, match=rf"has {rows} rows but the merged grid 4x4x4 needs 64"):
        retention_mask(torch.randn(rows, 16), GRID, 2, 0.5)


@pytest.mark.parametrize("shape", [(4, 16, 16), (64,), (1, 64, 16)])
def test_embeds_not_2d(shape):
    with pytest.raises(ValueError, match=re.escape(str(shape))):
        retention_mask(torch.randn(*shape), GRID, 2, 0.5)


@pytest.mark.parametrize("tokens_per_frame, frames", [(0, 4), (16, 0), (-3, 2)])
def test_kept_count_needs_positive_sizes(tokens_per_frame, frames):
    with pytest.raises(ValueError, match=rf"got {tokens_per_frame} and {frames}"):
        kept_token_count(tokens_per_frame, frames, 0.5)


def test_select_kept_shape_errors():
    carrier = torch.zeros(20, dtype=torch.int64)
    with pytest.raises(ValueError, match=re.escape("(4, 16, 16)")):
        select_kept(torch.randn(4, 16, 16), 4, carrier)
    with pytest.raises(ValueError, match="64 embedding rows do not split into 5 frames"):
        select_kept(EMBEDS, 5, carrier)
    with pytest.raises(ValueError, match=r"kept count 65 must be in \[1, 64\]"):
        select_kept(EMBEDS, 4, torch.zeros(65, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"kept count 0 must be in \[1, 64\]"):
        select_kept(EMBEDS, 4, torch.zeros(0, dtype=torch.int64))
    with pytest.raises(ValueError, match=re.escape("(63, 16)")):
        select_kept(EMBEDS, 4, carrier, extra=torch.randn(63, 16))


@pytest.mark.parametrize("indices, shown", [([0, 5, 64], "[0, 64]"), ([-1, 3], "[-1, 3]")])
def test_tokens_per_frame_kept_out_of_range(indices, shown):
    with pytest.raises(ValueError, match=re.escape(shown)):
        tokens_per_frame_kept(indices, 4, 16)


def test_tokens_per_frame_kept_needs_positive_sizes():
    with pytest.raises(ValueError, match="got 0 and 16"):
        tokens_per_frame_kept([0, 1], 0, 16)


def test_tokens_per_frame_kept_counts_by_hand():
    # Independent of any mask: frame 0 full (0..3), frame 1 none, frame 2 two, frame 3 one.
    assert tokens_per_frame_kept([0, 1, 2, 3, 9, 10, 15], 4, 4) == [4, 0, 2, 1]
    assert tokens_per_frame_kept(torch.tensor([], dtype=torch.int64), 3, 5) == [0, 0, 0]
