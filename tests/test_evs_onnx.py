"""The exportable EVS selection, exported once to ONNX and run in ONNX Runtime, equals vLLM's mask.

One graph (legacy TorchScript exporter, opset 17) with named dynamic axes for the rows, the
features, the frames carrier and the kept carrier serves every case below: different T,
merged grids, K and tie structures. The oracle is vLLM 0.32.0's ``compute_retention_mask``.
"""

from __future__ import annotations

import itertools
import random
import warnings
from dataclasses import dataclass

import numpy as np
import onnx
import pytest
import torch

from qeff_evs.evs import select_kept

ort = pytest.importorskip("onnxruntime")
vllm_evs = pytest.importorskip("vllm.multimodal.video_prune.evs")

PRUNING_RATES = (0.0, 0.25, 0.5, 0.75, 0.8, 0.9, 0.99)
INPUT_NAMES = ["embeds", "frames_carrier", "kept_carrier"]
OUTPUT_NAMES = ["kept_embeds", "kept_indices"]
DYNAMIC_AXES = {
    "embeds": {0: "num_tokens", 1: "hidden"},
    "frames_carrier": {0: "time"},
    "kept_carrier": {0: "kept_size"},
    "kept_embeds": {0: "kept_size", 1: "hidden"},
    "kept_indices": {0: "kept_size"},
}


class EvsSelection(torch.nn.Module):
    """Export wrapper: T and K reach the graph only as the lengths of shape-only inputs."""

    def forward(self, embeds, frames_carrier, kept_carrier):
        return select_kept(embeds, frames_carrier.shape[0], kept_carrier)


@pytest.fixture(scope="module")
def evs_onnx_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("evs_onnx") / "evs_selection.onnx"
    # Traced at a tie-free size unrelated to the cases, so nothing can be specialised to them.
    t, hw, d, k = 3, 6, 16, 10
    example = (torch.randn(t * hw, d), torch.zeros(t, dtype=torch.int64), torch.zeros(k, dtype=torch.int64))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the legacy exporter announces itself
        torch.onnx.export(
            EvsSelection(), example, str(path), dynamo=False, opset_version=17,
            input_names=INPUT_NAMES, output_names=OUTPUT_NAMES, dynamic_axes=DYNAMIC_AXES,
        )
    return path


@pytest.fixture(scope="module")
def evs_session(evs_onnx_path):
    return ort.InferenceSession(str(evs_onnx_path), providers=["CPUExecutionProvider"])


# --- float32 embedding kinds ---------------------------------------------------------------


def _random(rng: np.random.Generator, t: int, hw: int, d: int) -> np.ndarray:
    return rng.standard_normal((t * hw, d), dtype=np.float32)


def _exact_ternary_rows(rng: np.random.Generator, n: int, d: int) -> np.ndarray:
    # Entries in {0, +-1} with exactly 4 nonzeros per row: every norm is 2 and every product
    # and partial sum is a small integer or quarter, so torch's cosine (x/|x| . y/|y|) and the
    # exported one (x.y / sqrt(|x|^2 |y|^2)) are both exact and agree bit for bit.
    rows = np.zeros((n, d), dtype=np.float32)
    cols = np.argsort(rng.random((n, d)), axis=1)[:, :4]
    np.put_along_axis(rows, cols, rng.choice(np.float32([-1, 1]), size=(n, 4)), axis=1)
    return rows


def _identical_frames_exact(rng: np.random.Generator, t: int, hw: int, d: int) -> np.ndarray:
    # A frozen video. Built from exact rows (see above): with generic floats the last bit of
    # 1 - cos(x, x) differs between torch and ORT, which reorders the all-tied selection.
    frame = _exact_ternary_rows(rng, hw, d)
    return np.tile(frame, (t, 1))


def _static_background_exact(rng: np.random.Generator, t: int, hw: int, d: int) -> np.ndarray:
    # Each frame repeats the previous one except ~30% of positions: ties at 0 plus a few
    # distinct exact cosines (multiples of 1/4) for the moved tokens.
    frames = [_exact_ternary_rows(rng, hw, d)]
    for _ in range(1, t):
        moved = rng.random(hw) < 0.3
        frames.append(np.where(moved[:, None], _exact_ternary_rows(rng, hw, d), frames[-1]))
    return np.concatenate(frames)


def _one_hot(rng: np.random.Generator, t: int, hw: int, d: int) -> np.ndarray:
    # Dissimilarities exactly 0 or 1 in both runtimes, heavily tied.
    return np.eye(d, dtype=np.float32)[rng.integers(0, 3, t * hw)]


def _constant(rng: np.random.Generator, t: int, hw: int, d: int) -> np.ndarray:
    # Every row the same vector: each runtime gives every token the same dissimilarity.
    return np.full((t * hw, d), np.float32(rng.random() + 0.1))


EMBEDDING_KINDS = {
    "random": _random,
    "identical_frames_exact": _identical_frames_exact,
    "static_background_exact": _static_background_exact,
    "one_hot": _one_hot,
    "constant": _constant,
}


@dataclass(frozen=True)
class OrtCase:
    kind: str
    frames: int
    merged_h: int
    merged_w: int
    merge: int
    q: float
    dim: int
    seed: int

    @property
    def tokens_per_frame(self) -> int:
        return self.merged_h * self.merged_w

    def embeds(self) -> np.ndarray:
        rng = np.random.default_rng(self.seed)
        return EMBEDDING_KINDS[self.kind](rng, self.frames, self.tokens_per_frame, self.dim)

    def __str__(self) -> str:
        return f"{self.kind}-T{self.frames}-{self.merged_h}x{self.merged_w}-m{self.merge}-q{self.q}-D{self.dim}"


def _generate_cases() -> list[OrtCase]:
    rng = random.Random(4242)
    cases = [
        OrtCase(kind, rng.randint(1, 32), rng.randint(1, 24), rng.randint(1, 24), rng.choice((1, 2)), q,
                rng.randint(8, 32), rng.randrange(2**31))
        for kind, q, _ in itertools.product(EMBEDDING_KINDS, PRUNING_RATES, range(2))
    ]
    corners = [(1, 5, 9), (32, 24, 24), (16, 1, 24), (12, 24, 1), (32, 1, 1)]
    cases += [
        OrtCase(kind, t, h, w, rng.choice((1, 2)), rng.choice(PRUNING_RATES[1:]), rng.randint(8, 32),
                rng.randrange(2**31))
        for (t, h, w), kind in itertools.product(corners, EMBEDDING_KINDS)
    ]
    return cases


CASES = _generate_cases()


def _run(session, embeds: np.ndarray, frames: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    rows, indices = session.run(
        OUTPUT_NAMES,
        {
            "embeds": embeds,
            "frames_carrier": np.zeros(frames, dtype=np.int64),
            "kept_carrier": np.zeros(k, dtype=np.int64),
        },
    )
    return rows, indices


def _dissimilarity_at_cut(embeds: np.ndarray, case: OrtCase, k: int) -> str:
    """Diagnostic for a mismatch: vLLM's sorted dissimilarities around position K."""
    x = torch.from_numpy(embeds).reshape(case.frames, case.tokens_per_frame, -1)
    dis = torch.cat([torch.full_like(x[:1, :, 0], 255.0), 1 - torch.cosine_similarity(x[1:], x[:-1], dim=-1)])
    values, order = torch.sort(dis.flatten(), descending=True, stable=True)
    lo, hi = max(k - 3, 0), k + 3
    return f"sorted dissimilarities [{lo}:{hi}] = {values[lo:hi].tolist()} at indices {order[lo:hi].tolist()}"


@pytest.mark.parametrize("case", CASES, ids=str)
def test_onnx_selection_equals_vllm(evs_session, case: OrtCase):
    embeds = case.embeds()
    grid = (case.frames, case.merged_h * case.merge, case.merged_w * case.merge)
    mask = vllm_evs.compute_retention_mask(torch.from_numpy(embeds), grid, case.merge, case.q)
    k = vllm_evs.compute_retained_tokens_count(case.tokens_per_frame, case.frames, case.q)
    expected = mask.nonzero().flatten().numpy()

    rows, indices = _run(evs_session, embeds, case.frames, k)

    assert indices.dtype == np.int64 and indices.shape == (k,), case
    if not np.array_equal(indices, expected):
        pytest.fail(
            f"{case}: ORT kept {np.setdiff1d(indices, expected)[:8]} instead of "
            f"{np.setdiff1d(expected, indices)[:8]}; {_dissimilarity_at_cut(embeds, case, k)}"
        )
    assert np.array_equal(rows, embeds[expected]), case


def test_one_graph_serves_different_k_for_the_same_video(evs_session):
    """Only the kept carrier changes: K = all, K = one frame, and a K that cuts inside ties."""
    case = OrtCase("one_hot", frames=6, merged_h=3, merged_w=5, merge=2, q=0.0, dim=8, seed=11)
    embeds = case.embeds()
    hw = case.tokens_per_frame
    for k in (hw, hw + 7, 3 * hw, 6 * hw):
        ranks = torch.argsort(torch.from_numpy(_dissim(embeds, case)), descending=True, stable=True)
        expected = np.sort(ranks[:k].numpy())
        _, indices = _run(evs_session, embeds, case.frames, k)
        assert np.array_equal(indices, expected), k


def _dissim(embeds: np.ndarray, case: OrtCase) -> np.ndarray:
    # One-hot rows: the dissimilarity is 0 (same hot index) or 1, written out independently.
    hot = embeds.argmax(1).reshape(case.frames, -1)
    changed = (hot[1:] != hot[:-1]).astype(np.float32)
    return np.concatenate([np.full((1, hot.shape[1]), 255, np.float32), changed]).reshape(-1)


def test_graph_has_topk_and_no_data_dependent_ops(evs_onnx_path):
    model = onnx.load(str(evs_onnx_path))
    onnx.checker.check_model(model)
    ops = {node.op_type for node in model.graph.node}
    assert "TopK" in ops
    assert not ops & {"NonZero", "Compress", "Where", "Loop", "If", "Unique"}, ops
    assert model.opset_import[0].version == 17


def test_graph_dynamic_dims_are_named(evs_onnx_path):
    model = onnx.load(str(evs_onnx_path))
    dims = {
        value.name: [dim.dim_param or dim.dim_value for dim in value.type.tensor_type.shape.dim]
        for value in [*model.graph.input, *model.graph.output]
    }
    assert dims == {
        "embeds": ["num_tokens", "hidden"],
        "frames_carrier": ["time"],
        "kept_carrier": ["kept_size"],
        "kept_embeds": ["kept_size", "hidden"],
        "kept_indices": ["kept_size"],
    }
