"""vLLM 0.32's pruning functions as oracles, and video-like embeddings that put the cut inside ties.

``vllm_kept`` calls vLLM's own ``compute_retention_mask`` (EVS or VidCom2). VidCom2's ``torch.topk`` calls
run with CUDA's tie rule (the k-th value's ties taken in index order, ``aten/src/ATen/native/cuda/TensorTopK.cu``),
where vLLM serves; on CPU, ``torch.topk`` picks among ties by libstdc++'s selection order, which depends on
the whole row and which no static graph can reproduce (``test_vidcom2.py`` shows both facts). On values
without ties the two rules select the same set in the same order, so random embeddings see vLLM unchanged.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from unittest import mock

import numpy as np
import pytest
import torch

vllm_evs = pytest.importorskip("vllm.multimodal.video_prune.evs")
vllm_vidcom2 = pytest.importorskip("vllm.multimodal.video_prune.vidcom2")


def topk_cuda_ties(input: torch.Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True):
    """``torch.topk`` as CUDA resolves ties: among equal values the lower index is taken (and listed) first."""
    order = torch.argsort(input, dim=dim, descending=largest, stable=True).narrow(dim, 0, k)
    return torch.return_types.topk((input.gather(dim, order), order))


class _TorchWithCudaTopk(types.ModuleType):
    """``torch`` as vLLM's vidcom2 module sees it, with ``topk`` following CUDA's tie rule."""

    topk = staticmethod(topk_cuda_ties)

    def __getattr__(self, name: str):
        return getattr(torch, name)


def vllm_vidcom2_mask(embeds: torch.Tensor, grid_thw, merge: int, q: float, cuda_ties: bool = True) -> torch.Tensor:
    if not cuda_ties:
        return vllm_vidcom2.compute_retention_mask(embeds, grid_thw, merge, q)
    with mock.patch.object(vllm_vidcom2, "torch", _TorchWithCudaTopk("torch")):
        return vllm_vidcom2.compute_retention_mask(embeds, grid_thw, merge, q)


def vllm_kept(method: str, embeds: np.ndarray | torch.Tensor, frames: int, merged_hw: tuple[int, int],
              q: float, merge: int = 2) -> np.ndarray:
    """Ascending flat indices vLLM keeps of one unpadded video ``(T*h*w, D)`` (fp32)."""
    embeds = torch.as_tensor(np.asarray(embeds, dtype=np.float32))
    grid = (frames, merged_hw[0] * merge, merged_hw[1] * merge)
    if method == "evs":
        mask = vllm_evs.compute_retention_mask(embeds, grid, merge, q)
    else:
        mask = vllm_vidcom2_mask(embeds, grid, merge, q)
    return mask.nonzero().reshape(-1).numpy()


def vllm_count(method: str, tokens_per_frame: int, frames: int, q: float) -> int:
    module = vllm_evs if method == "evs" else vllm_vidcom2
    return module.compute_retained_tokens_count(tokens_per_frame, frames, q)


# --- embeddings: each kind returns (T*hw, width) float32 -------------------------------------------


def random_rows(rng: np.random.Generator, t: int, hw: int, width: int) -> np.ndarray:
    return rng.standard_normal((t * hw, width), dtype=np.float32)


def repeated_rows(rng: np.random.Generator, t: int, hw: int, width: int) -> np.ndarray:
    # Every token one of three random vectors of its frame: exact ties inside frames. (One pool for the whole
    # video would give frames that hold the same vectors in another order: their centres agree only up to the
    # order of a sum, a near-tie each runtime breaks its own way, not a tie.)
    pools = rng.standard_normal((t, 3, width), dtype=np.float32)
    return pools[np.repeat(np.arange(t), hw), rng.integers(0, 3, t * hw)]


def one_hot_rows(rng: np.random.Generator, t: int, hw: int, width: int) -> np.ndarray:
    # Hot index among three: EVS dissimilarities exactly 0 or 1; VidCom2 scores on all-zero channels (a full tie).
    return np.eye(width, dtype=np.float32)[rng.integers(0, 3, t * hw)]


def identical_frames(rng: np.random.Generator, t: int, hw: int, width: int) -> np.ndarray:
    # A frozen video: every frame scores alike (uniform VidCom2 budgets), ties across frames.
    return np.tile(rng.standard_normal((hw, width), dtype=np.float32), (t, 1))


def all_equal_rows(rng: np.random.Generator, t: int, hw: int, width: int) -> np.ndarray:
    return np.full((t * hw, width), np.float32(rng.random() + 0.1))


def exact_ternary_rows(rng: np.random.Generator, n: int, width: int) -> np.ndarray:
    # Entries in {0, +-1}, four nonzeros per row: norms 2, cosines multiples of 1/4, exact in torch and ORT
    # alike (with generic floats the last bit of 1 - cos(x, x) differs between them, reordering EVS's near-ties).
    rows = np.zeros((n, width), dtype=np.float32)
    columns = np.argsort(rng.random((n, width)), axis=1)[:, :4]
    np.put_along_axis(rows, columns, rng.choice(np.float32([-1, 1]), size=(n, 4)), axis=1)
    return rows


def repeated_rows_exact(rng: np.random.Generator, t: int, hw: int, width: int) -> np.ndarray:
    # One pool for the whole video: EVS compares only same-position tokens, with exact cosines.
    return exact_ternary_rows(rng, 3, width)[rng.integers(0, 3, t * hw)]


def identical_frames_exact(rng: np.random.Generator, t: int, hw: int, width: int) -> np.ndarray:
    return np.tile(exact_ternary_rows(rng, hw, width), (t, 1))


Kind = Callable[[np.random.Generator, int, int, int], np.ndarray]
# Ties are structural (identical vectors): every implementation scores tied tokens alike.
GENERIC_KINDS: dict[str, Kind] = {
    "random": random_rows,
    "repeated_rows": repeated_rows,
    "one_hot": one_hot_rows,
    "identical_frames": identical_frames,
    "all_equal": all_equal_rows,
}
# For EVS through ONNX Runtime: the same kinds with cosines that both runtimes compute exactly.
EXACT_COSINE_KINDS: dict[str, Kind] = {
    "random": random_rows,
    "repeated_rows": repeated_rows_exact,
    "one_hot": one_hot_rows,
    "identical_frames": identical_frames_exact,
    "all_equal": all_equal_rows,
}
