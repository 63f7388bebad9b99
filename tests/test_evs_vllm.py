"""EVS count and mask against vLLM 0.32.0's own functions (the oracle), bit for bit.

Cases are generated deterministically (seeded) over frame counts 1..32, merged grids up to
24x24 (square and not), merge sizes 1 and 2, pruning rates from 0 to 0.99, three dtypes,
and embedding kinds chosen to put the top-K cut inside exact ties.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

import pytest
import torch

from qeff_evs.evs import kept_token_count, retention_mask, select_kept, tokens_per_frame_kept

vllm_evs = pytest.importorskip("vllm.multimodal.video_prune.evs")
vllm_count = vllm_evs.compute_retained_tokens_count
vllm_mask = vllm_evs.compute_retention_mask

PRUNING_RATES = (0.0, 0.25, 0.5, 0.75, 0.8, 0.9, 0.99)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MERGE_SIZES = (1, 2)
MAX_FRAMES = 32
MAX_MERGED_SIDE = 24


# --- embedding kinds: each returns (T*h*w, D) float32, cast to the case dtype later ---------


def _random(g: torch.Generator, t: int, hw: int, d: int) -> torch.Tensor:
    return torch.randn(t * hw, d, generator=g)


def _identical_frames(g: torch.Generator, t: int, hw: int, d: int) -> torch.Tensor:
    # A frozen video: every later token equals its predecessor, so all non-first
    # dissimilarities are 1 - cos(x, x): ties wherever the rounding agrees.
    return torch.randn(1, hw, d, generator=g).expand(t, hw, d).reshape(t * hw, d).clone()


def _static_background(g: torch.Generator, t: int, hw: int, d: int) -> torch.Tensor:
    # A realistic clip: each frame repeats the previous one except ~30% of positions.
    frames = [torch.randn(hw, d, generator=g)]
    for _ in range(1, t):
        moved = torch.rand(hw, generator=g) < 0.3
        frames.append(torch.where(moved[:, None], torch.randn(hw, d, generator=g), frames[-1]))
    return torch.cat(frames)


def _one_hot(g: torch.Generator, t: int, hw: int, d: int) -> torch.Tensor:
    # Hot index drawn from 3 values: dissimilarities are exactly 0 or 1, heavily tied.
    hot = torch.randint(0, 3, (t * hw,), generator=g)
    return torch.nn.functional.one_hot(hot, d).float()


def _constant(g: torch.Generator, t: int, hw: int, d: int) -> torch.Tensor:
    # Every row identical: every non-first dissimilarity is the same value.
    value = float(torch.rand((), generator=g)) + 0.1
    return torch.full((t * hw, d), value)


def _ternary(g: torch.Generator, t: int, hw: int, d: int) -> torch.Tensor:
    # Entries in {-1, 0, 1}: a handful of distinct cosines, many exact ties.
    return torch.randint(-1, 2, (t * hw, d), generator=g).float()


def _with_zero_rows(g: torch.Generator, t: int, hw: int, d: int) -> torch.Tensor:
    # Zero vectors exercise the eps clamp of the cosine (cos = 0, dissimilarity = 1).
    x = torch.randn(t * hw, d, generator=g)
    return x * (torch.rand(t * hw, 1, generator=g) > 0.25)


EMBEDDING_KINDS = {
    "random": _random,
    "identical_frames": _identical_frames,
    "static_background": _static_background,
    "one_hot": _one_hot,
    "constant": _constant,
    "ternary": _ternary,
    "zero_rows": _with_zero_rows,
}


@dataclass(frozen=True)
class EvsCase:
    kind: str
    frames: int
    merged_h: int
    merged_w: int
    merge: int
    q: float
    dtype: torch.dtype
    dim: int
    seed: int

    @property
    def patch_grid(self) -> tuple[int, int, int]:
        return (self.frames, self.merged_h * self.merge, self.merged_w * self.merge)

    @property
    def tokens_per_frame(self) -> int:
        return self.merged_h * self.merged_w

    def embeds(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed)
        make = EMBEDDING_KINDS[self.kind]
        return make(g, self.frames, self.tokens_per_frame, self.dim).to(self.dtype)

    def __str__(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return (
            f"{self.kind}-T{self.frames}-{self.merged_h}x{self.merged_w}-m{self.merge}"
            f"-q{self.q}-{dtype}-D{self.dim}-s{self.seed}"
        )


def _generate_cases() -> list[EvsCase]:
    rng = random.Random(20250917)
    cases = []
    # Every kind x rate x dtype x merge size, with random sizes.
    for kind, q, dtype, merge in itertools.product(EMBEDDING_KINDS, PRUNING_RATES, DTYPES, MERGE_SIZES):
        cases.append(
            EvsCase(
                kind=kind,
                frames=rng.randint(1, MAX_FRAMES),
                merged_h=rng.randint(1, MAX_MERGED_SIDE),
                merged_w=rng.randint(1, MAX_MERGED_SIDE),
                merge=merge,
                q=q,
                dtype=dtype,
                dim=rng.randint(8, 32),
                seed=rng.randrange(2**31),
            )
        )
    # Corners: single frame, the largest clip, thin grids, 1x1 frames.
    corners = [(1, 7, 5), (MAX_FRAMES, MAX_MERGED_SIDE, MAX_MERGED_SIDE), (16, 1, 24), (16, 24, 1), (32, 1, 1), (2, 3, 17)]
    for (t, h, w), kind, dtype in itertools.product(corners, ("random", "one_hot", "static_background"), DTYPES):
        cases.append(
            EvsCase(kind, t, h, w, merge=rng.choice(MERGE_SIZES), q=rng.choice(PRUNING_RATES[1:]),
                    dtype=dtype, dim=rng.randint(8, 32), seed=rng.randrange(2**31))
        )
    return cases


CASES = _generate_cases()


def test_case_generator_covers_the_brief():
    """The grid of cases is as wide as promised (guards against an accidental shrink)."""
    assert len(CASES) >= 300
    assert {c.frames for c in CASES} >= {1, MAX_FRAMES}
    assert {c.q for c in CASES} == set(PRUNING_RATES)
    assert {c.dtype for c in CASES} == set(DTYPES)
    assert {c.merge for c in CASES} == set(MERGE_SIZES)
    assert any(c.merged_h != c.merged_w for c in CASES)
    assert any(c.merged_h == c.merged_w == MAX_MERGED_SIDE for c in CASES)
    assert len({str(c) for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_retention_mask_equals_vllm(case: EvsCase):
    embeds = case.embeds()
    grid = case.patch_grid
    expected = vllm_mask(embeds, grid, case.merge, case.q)
    got = retention_mask(embeds, grid, case.merge, case.q)
    assert got.dtype == torch.bool and got.shape == expected.shape, case
    if not torch.equal(got, expected):
        diff = (got != expected).nonzero().flatten()[:10].tolist()
        pytest.fail(f"{case}: masks differ at flat indices {diff}")
    # The mask holds exactly the count both sides computed for the prompt.
    assert int(got.sum()) == vllm_count(case.tokens_per_frame, case.frames, case.q), case


@pytest.mark.parametrize("case", CASES[::7], ids=str)
def test_grid_as_long_tensor_equals_vllm(case: EvsCase):
    """vLLM also takes ``video_size_thw`` as a LongTensor (what the processor stores)."""
    embeds = case.embeds()
    grid = torch.tensor(case.patch_grid, dtype=torch.long)
    assert torch.equal(retention_mask(embeds, grid, case.merge, case.q), vllm_mask(embeds, grid, case.merge, case.q))


def _count_cases():
    rng = random.Random(7)
    rates = list(PRUNING_RATES) + [0.1, 0.2, 0.3, 0.375, 0.4, 0.6, 0.7, 0.95] + [rng.random() for _ in range(12)]
    tokens = sorted({1, 2, 3, 4, 5, 7, 10, 16, 25, 49, 64, 100, 144, 196, 256, 400, 576} | {
        h * w for h in range(1, MAX_MERGED_SIDE + 1) for w in (h, rng.randint(1, MAX_MERGED_SIDE))})
    return [(tpf, t, q) for tpf in tokens for t in range(1, MAX_FRAMES + 1) for q in rates]


def test_kept_count_equals_vllm():
    cases = _count_cases()
    assert len(cases) > 10_000
    failures = [(tpf, t, q, kept_token_count(tpf, t, q), vllm_count(tpf, t, q))
                for tpf, t, q in cases if kept_token_count(tpf, t, q) != vllm_count(tpf, t, q)]
    assert not failures, f"(tokens_per_frame, T, q, ours, vllm) first mismatches: {failures[:5]}"


@pytest.mark.parametrize(
    "tokens_per_frame, frames, q, expected",
    [
        (4, 25, 0.9, 9),  # 100 * 0.09999999999999998 = 9.999999999999998 -> 9, not 10
        (5, 2, 0.8, 5),  # 10 * 0.19999999999999996 -> 1, floored to one frame
        (10, 100, 0.8, 199),  # 1000 -> 199
        (256, 10, 0.9, 256),  # 2560 -> 255, floored to one frame (256)
        (1, 10, 0.7, 3),  # 3.0000000000000004 -> 3
        (16, 4, 0.75, 16),  # T <= 1/(1-q): only frame 0 survives
        (196, 1, 0.99, 196),  # T = 1 prunes nothing
        (196, 16, 0.0, 3136),  # q = 0: EVS off, everything kept
    ],
)
def test_kept_count_pinned_values(tokens_per_frame, frames, q, expected):
    """Hand-checked values of the double-precision rule (docs/design.md#pruning-semantics), also vLLM's."""
    assert kept_token_count(tokens_per_frame, frames, q) == expected
    assert vllm_count(tokens_per_frame, frames, q) == expected


@pytest.mark.parametrize("case", [c for c in CASES if c.dtype == torch.float32][::3], ids=str)
def test_eager_select_kept_equals_vllm(case: EvsCase):
    """The eager form of the exportable selection means the same as vLLM's mask."""
    embeds = case.embeds()
    mask = vllm_mask(embeds, case.patch_grid, case.merge, case.q)
    carrier = torch.zeros(int(mask.sum()), dtype=torch.int64)
    rows, indices = select_kept(embeds, case.frames, carrier)
    assert torch.equal(indices, mask.nonzero().flatten()), case
    assert torch.equal(rows, embeds[mask]), case


@pytest.mark.parametrize("case", [c for c in CASES if c.kind in ("random", "static_background")][::4], ids=str)
def test_extra_features_enter_the_dissimilarity(case: EvsCase):
    """Qwen3-VL: the cosine runs over [merger | deepstack], as vLLM does on the concatenation."""
    embeds = case.embeds()
    g = torch.Generator().manual_seed(case.seed + 1)
    # Deepstack levels that disagree with the merger output, so the concatenation matters.
    extra = torch.randn(embeds.shape[0], 3 * case.dim, generator=g).to(case.dtype)
    mask = vllm_mask(torch.cat([embeds, extra], dim=-1), case.patch_grid, case.merge, case.q)
    carrier = torch.zeros(int(mask.sum()), dtype=torch.int64)
    rows, indices = select_kept(embeds, case.frames, carrier, extra=extra)
    assert torch.equal(indices, mask.nonzero().flatten()), case
    assert torch.equal(rows, embeds[mask]), case


@pytest.mark.parametrize("case", CASES[::5], ids=str)
def test_tokens_per_frame_kept_equals_mask_rows(case: EvsCase):
    mask = vllm_mask(case.embeds(), case.patch_grid, case.merge, case.q)
    expected = mask.reshape(case.frames, case.tokens_per_frame).sum(1).tolist()
    got = tokens_per_frame_kept(mask.nonzero().flatten(), case.frames, case.tokens_per_frame)
    assert got == expected, case
    # Frame 0 survives in full (other frames may keep nothing) -- unless fp16 NaNs outrank
    # the sentinel, see test_fp16_zero_vectors_rank_nan_first_like_vllm.
    if not (case.dtype == torch.float16 and case.kind == "zero_rows"):
        assert got[0] == case.tokens_per_frame, case


def test_fp16_zero_vectors_rank_nan_first_like_vllm():
    """In float16 the cosine's eps (1e-8) rounds to 0, so a zero token gives 0/0 = NaN, and a
    descending sort puts NaN above the 255 sentinel: frame 0 loses tokens. vLLM does the
    same; bit parity means we keep the quirk (bf16 and fp32 represent 1e-8 and are immune)."""
    t, h, w, d = 4, 2, 2, 8
    embeds = torch.randn(t * h * w, d, generator=torch.Generator().manual_seed(3))
    embeds[-3:] = 0  # three zero tokens in the last frame
    for dtype, frame0_kept in ((torch.float16, 1), (torch.bfloat16, 4), (torch.float32, 4)):
        x = embeds.to(dtype)
        expected = vllm_mask(x, (t, h, w), 1, 0.75)
        got = retention_mask(x, (t, h, w), 1, 0.75)
        assert torch.equal(got, expected), dtype
        assert int(got[: h * w].sum()) == frame0_kept, dtype
