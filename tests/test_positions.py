"""M-RoPE positions of pruned prompts (docs/design.md#positions, #prompt-layouts).

Independent references: a token-by-token walk written here, transformers' ``get_rope_index``
(Qwen3-VL all media, Qwen2.5-VL images), vLLM's ``compute_mrope_for_media`` and numpy float64
(what vLLM's ``get_mrope_input_positions`` uses), and hand-worked numbers.
"""

from __future__ import annotations

import random
import warnings
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from helpers.pruned_prompts import (
    MediaItem,
    keep_mask,
    mrope_delta,
    prune_prompt,
    qwen2_5_vl_blocks,
    qwen3_vl_blocks,
    qwen3_vl_kept_per_block,
    split_kept_by_frame,
)
from qeff_evs.evs import retention_mask
from qeff_evs.positions import (
    MediaBlock,
    block_positions,
    decode_start,
    media_runs,
    pruned_positions,
    unpruned_positions,
)

IMG, VID, VS, VE = 900, 901, 902, 903
MEDIA = (IMG, VID)
MERGE = 2


# --------------------------------------------------------------------------- brute-force reference


@dataclass
class RefBlock:
    """Test-side geometry of one media run (merged grid), built without the code under test."""

    t: int
    h: int
    w: int
    f: float = 1.0
    kept: set[int] | None = None  # local flat indices; None = all


def reference_walk(ids: list[int], blocks: list[RefBlock]) -> tuple[list[tuple[int, int, int]], list[bool], int]:
    """Walk the unpruned prompt one token at a time: positions, keep flags, next free index."""
    positions: list[tuple[int, int, int]] = []
    kept: list[bool] = []
    free = 0
    i = 0
    pending = iter(blocks)
    while i < len(ids):
        if ids[i] not in MEDIA:
            positions.append((free, free, free))
            kept.append(True)
            free += 1
            i += 1
            continue
        block = next(pending)
        top = free
        local = 0
        for ti in range(block.t):
            for r in range(block.h):
                for c in range(block.w):
                    assert ids[i] in MEDIA, "generator bug: block shorter than its grid"
                    p = (free + int(ti * block.f), free + r, free + c)
                    positions.append(p)
                    kept.append(block.kept is None or local in block.kept)
                    top = max(top, *p)
                    local += 1
                    i += 1
        free = top + 1
    assert next(pending, None) is None, "generator bug: unused blocks"
    return positions, kept, free


# --------------------------------------------------------------------------- prompt generator


@dataclass
class Prompt:
    ids: list[int] = field(default_factory=list)
    items: list[MediaItem] = field(default_factory=list)
    kept_per_item: list[torch.Tensor | None] = field(default_factory=list)
    ref_blocks: list[RefBlock] = field(default_factory=list)
    qs: list[float] = field(default_factory=list)
    tokens_per_second: int = 2


def _text(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, IMG) for _ in range(n)]


def _video_kept(rng: random.Random, seed: int, t: int, h: int, w: int) -> tuple[torch.Tensor, float]:
    """Flat kept indices of one video: EVS on random embeddings (some frames repeated), or a random subset."""
    gen = torch.Generator().manual_seed(seed)
    if rng.random() < 0.25:  # arbitrary subset, frame 0 may vanish too
        k = rng.randrange(0, t * h * w + 1)
        return torch.sort(torch.randperm(t * h * w, generator=gen)[:k]).values, float("nan")
    q = rng.choice([0.0, 0.5, 0.9, 0.99, rng.uniform(0.0, 0.99)])
    frames = torch.randn(t, h * w, 8, generator=gen)
    for f in range(1, t):
        if rng.random() < 0.4:  # a static frame: dissimilarity 0 everywhere, likely to keep nothing
            frames[f] = frames[f - 1]
    mask = retention_mask(frames.reshape(t * h * w, 8), (t, h * MERGE, w * MERGE), MERGE, q)
    return torch.nonzero(mask).flatten(), q


TOKENS_PER_SECOND = [1, 2, 4, 25]
SECONDS_PER_GRID = [1.0, 0.5, 2 / 3, 15 / 11, 0.28, 7 / 3, 2.0]  # fractional ones probe truncation


def random_prompt(seed: int, family: str, long_text: bool = False) -> Prompt:
    rng = random.Random(seed)
    p = Prompt(tokens_per_second=rng.choice(TOKENS_PER_SECOND))
    text_len = (lambda: rng.randrange(150, 320)) if long_text else (lambda: rng.randrange(0, 12))
    for item_no in range(rng.randint(1, 4)):
        p.ids += _text(rng, text_len())
        kind = rng.choice(["image", "video", "video"])
        t = 1 if kind == "image" else rng.randint(1, 9)
        h, w = rng.randint(1, 5), rng.randint(1, 5)
        if kind == "image":
            p.items.append(MediaItem("image", (1, h * MERGE, w * MERGE)))
            p.kept_per_item.append(None)
            p.qs.append(0.0)
        else:
            spg = rng.choice(SECONDS_PER_GRID)
            p.items.append(MediaItem("video", (t, h * MERGE, w * MERGE), second_per_grid=spg))
            indices, q = _video_kept(rng, seed * 100 + item_no, t, h, w)
            p.kept_per_item.append(indices)
            p.qs.append(q)
        flat_kept = None if p.kept_per_item[-1] is None else set(p.kept_per_item[-1].tolist())
        pad = IMG if kind == "image" else VID
        if family == "qwen2_5" or kind == "image":
            # vLLM: t_factor = second_per_grid_ts * tokens_per_second, a Python double
            f = spg * p.tokens_per_second if (family == "qwen2_5" and kind == "video") else 1.0
            p.ids += [VS] + [pad] * (t * h * w) + [VE]
            p.ref_blocks.append(RefBlock(t, h, w, f, flat_kept))
        else:  # Qwen3-VL video, HF 5.x layout: per frame <ts> VS pads VE, maybe wrapped in an outer VS/VE
            outer = rng.random() < 0.5
            p.ids += [VS] if outer else []
            for frame in range(t):
                p.ids += _text(rng, rng.randint(1, 4)) + [VS] + [pad] * (h * w) + [VE]
                kept = None if flat_kept is None else {j for j in range(h * w) if frame * h * w + j in flat_kept}
                p.ref_blocks.append(RefBlock(1, h, w, 1.0, kept))
            p.ids += [VE] if outer else []
    p.ids += _text(rng, text_len())
    return p


def api_blocks_and_kept(p: Prompt, family: str, kept_per_item: list) -> tuple[list[MediaBlock], list]:
    """What the family code would pass: one block per item (Qwen2.5-VL) or per frame (Qwen3-VL)."""
    if family == "qwen2_5":
        return qwen2_5_vl_blocks(p.items, MERGE, p.tokens_per_second), list(kept_per_item)
    return qwen3_vl_blocks(p.items, MERGE), qwen3_vl_kept_per_block(p.items, MERGE, kept_per_item)


# --------------------------------------------------------------------------- random prompts vs the walk


@pytest.mark.parametrize("family", ["qwen2_5", "qwen3"])
@pytest.mark.parametrize("seed", range(25))
def test_pruned_positions_are_unpruned_positions_restricted(seed, family):
    p = random_prompt(seed, family, long_text=seed % 5 == 0)
    blocks, kept = api_blocks_and_kept(p, family, p.kept_per_item)
    ref_pos, ref_keep, ref_next = reference_walk(p.ids, p.ref_blocks)

    unpruned = unpruned_positions(p.ids, MEDIA, blocks)
    assert unpruned.dtype == torch.int64
    assert unpruned.T.tolist() == [list(x) for x in ref_pos]
    assert decode_start(unpruned) == ref_next

    pruned = prune_prompt(p.ids, MEDIA, blocks, kept)
    want_ids = [tok for tok, k in zip(p.ids, ref_keep) if k]
    want_pos = [list(x) for x, k in zip(ref_pos, ref_keep) if k]
    assert pruned.input_ids.tolist() == want_ids
    assert pruned.positions.dtype == torch.int64
    assert pruned.positions.T.tolist() == want_pos
    assert pruned.next_position == ref_next
    assert pruned.rope_delta == ref_next - len(want_ids)
    assert mrope_delta(unpruned, len(want_ids)) == pruned.rope_delta


def test_random_prompts_cover_the_hard_cases():
    """The generator really produces empty frames, all q ranges and positions above 256."""
    empty_frames = high_q = above_256 = 0
    for family in ("qwen2_5", "qwen3"):
        for seed in range(25):
            p = random_prompt(seed, family, long_text=seed % 5 == 0)
            for item, kept in zip(p.items, p.kept_per_item):
                if kept is not None:
                    t, hh, ww = item.grid_thw
                    per_frame = torch.bincount(kept // (hh * ww // MERGE**2), minlength=t)
                    empty_frames += int((per_frame == 0).sum())
            high_q += sum(q >= 0.9 for q in p.qs)
            _, _, nxt = reference_walk(p.ids, p.ref_blocks)
            above_256 += nxt > 257
    assert empty_frames >= 10 and high_q >= 5 and above_256 >= 5, (empty_frames, high_q, above_256)


@pytest.mark.parametrize("family", ["qwen2_5", "qwen3"])
@pytest.mark.parametrize("seed", range(6))
def test_q0_equals_unpruned(seed, family):
    p = random_prompt(seed, family, long_text=True)
    kept = []
    for item in p.items:  # EVS with q = 0 on fresh embeddings keeps every token
        t, hh, ww = item.grid_thw
        n = t * (hh // MERGE) * (ww // MERGE)
        keep = retention_mask(torch.randn(n, 8), item.grid_thw, MERGE, 0.0) if item.kind == "video" else None
        kept.append(None if keep is None else torch.nonzero(keep).flatten())
    blocks, per_block = api_blocks_and_kept(p, family, kept)
    unpruned = unpruned_positions(p.ids, MEDIA, blocks)
    pruned = prune_prompt(p.ids, MEDIA, blocks, per_block)
    assert torch.equal(pruned.input_ids, torch.tensor(p.ids))
    assert torch.equal(pruned.positions, unpruned)
    assert pruned.rope_delta == decode_start(unpruned) - len(p.ids)


def test_positions_far_above_256_stay_exact():
    # 600 text tokens, VS at 600, a (40, 2, 3) block from s = 601 with f = 2 * 15/11: the last frame's
    # t offset is int(39 * 2.727...) = 106, so the block max is 707, VE sits at 708, then 301 text tokens.
    ids = [5] * 600 + [VS] + [VID] * (40 * 2 * 3) + [VE] + [6] * 301
    unpruned = unpruned_positions(ids, MEDIA, [MediaBlock(40, 2, 3, 2 * (15 / 11))])
    ref, _, nxt = reference_walk(ids, [RefBlock(40, 2, 3, 2 * (15 / 11))])
    assert unpruned.T.tolist() == [list(x) for x in ref]
    assert nxt == 1010 and decode_start(unpruned) == 1010
    assert unpruned[:, -1].tolist() == [1009, 1009, 1009]  # odd and > 512: bf16 would have rounded it
    keep = keep_mask(ids, MEDIA, [torch.tensor([5, 6 * 39 + 5])])  # frame 0 and frame 39, row 1 col 2
    pruned = pruned_positions(unpruned, keep)
    assert pruned.shape == (3, 600 + 1 + 2 + 1 + 301)
    assert pruned[:, 600:604].T.tolist() == [[600, 600, 600], [601, 602, 603], [707, 602, 603], [708, 708, 708]]


# --------------------------------------------------------------------------- hand-worked Qwen2.5-VL cases


def test_qwen2_5_video_hand_worked_max_plus_one():
    # text, text, VS | video merged grid (4, 2, 3), f = tokens_per_second 2 * second_per_grid 1.0 | VE, text
    ids = [10, 11, VS] + [VID] * 24 + [VE, 12]
    blocks = qwen2_5_vl_blocks([MediaItem("video", (4, 4, 6), second_per_grid=1.0)], MERGE, tokens_per_second=2)
    got = unpruned_positions(ids, MEDIA, blocks)
    frame_t = [3] * 6, [5] * 6, [7] * 6, [9] * 6
    want_t = [0, 1, 2, *frame_t[0], *frame_t[1], *frame_t[2], *frame_t[3], 10, 11]
    want_h = [0, 1, 2] + [3, 3, 3, 4, 4, 4] * 4 + [10, 11]
    want_w = [0, 1, 2] + [3, 4, 5, 3, 4, 5] * 4 + [10, 11]
    assert got.tolist() == [want_t, want_h, want_w]
    assert decode_start(got) == 12 and mrope_delta(got, len(ids)) == 12 - 29
    # HF >= 5 would put VE at s + max(h, w) = 6 and vLLM's EVS path at s + w = 6: we keep max + 1 = 10.

    pruned = prune_prompt(ids, MEDIA, blocks, [torch.tensor([0, 7, 14, 23])])
    assert pruned.input_ids.tolist() == [10, 11, VS, VID, VID, VID, VID, VE, 12]
    assert pruned.positions.tolist() == [
        [0, 1, 2, 3, 5, 7, 9, 10, 11],
        [0, 1, 2, 3, 3, 3, 4, 10, 11],
        [0, 1, 2, 3, 4, 5, 5, 10, 11],
    ]
    assert pruned.next_position == 12 and pruned.rope_delta == 12 - 9


def test_qwen2_5_fractional_second_per_grid_truncates():
    # tokens_per_second 2, second_per_grid 2/3 (fps 3): f = 4/3, offsets int(ti * 4/3). Truncating the
    # seconds to an integer first (vLLM's EVS path) would give all zeros; rounding would give 0,1,3,4,5,7,8.
    ids = [VS] + [VID] * 7 + [VE]
    blocks = qwen2_5_vl_blocks([MediaItem("video", (7, 2, 2), second_per_grid=2 / 3)], MERGE, tokens_per_second=2)
    got = unpruned_positions(ids, MEDIA, blocks)
    assert got.tolist() == [
        [0, 1, 2, 3, 5, 6, 7, 9, 10],
        [0, 1, 1, 1, 1, 1, 1, 1, 10],
        [0, 1, 1, 1, 1, 1, 1, 1, 10],
    ]


def test_qwen2_5_time_factor_is_a_double_product():
    # f = 2 * 15/11 = 2.727272727272727 in double; 11 * f = 29.999999999999996 truncates to 29
    # (exact arithmetic and float32 both give 30). vLLM's get_mrope_input_positions uses numpy float64.
    f = 2 * (15 / 11)
    got = block_positions(0, MediaBlock(12, 1, 1, f))[0].tolist()
    assert got == [0, 2, 5, 8, 10, 13, 16, 19, 21, 24, 27, 29]
    assert got == (np.arange(12) * f).astype(np.int64).tolist()


def test_block_offsets_match_vllm_compute_mrope_for_media():
    evs = pytest.importorskip("vllm.multimodal.video_prune.evs")
    # factors exact in float32 too (compute_mrope_for_media multiplies in float32)
    for (t, hh, ww), tps, spg in [((4, 8, 6), 2.0, 1.0), ((5, 4, 10), 2.0, 0.5), ((3, 6, 6), 25.0, 0.5), ((1, 4, 4), 1.0, 1.0)]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            theirs = evs.compute_mrope_for_media(torch.tensor([t, hh, ww]), MERGE, tps, spg)
        ours = block_positions(0, MediaBlock(t, hh // MERGE, ww // MERGE, tps * spg))
        assert torch.equal(ours, theirs[:, :3].T.to(torch.int64)), (t, hh, ww, tps, spg)


# --------------------------------------------------------------------------- transformers' get_rope_index


def _qwen3_model():
    from transformers import Qwen3VLConfig, Qwen3VLModel

    cfg = Qwen3VLConfig(
        text_config=dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                          "mrope_section": [2, 3, 3], "mrope_interleaved": True},
                         pad_token_id=2),
        vision_config=dict(depth=1, hidden_size=64, intermediate_size=128, num_heads=4, out_hidden_size=64,
                           patch_size=16, temporal_patch_size=2, spatial_merge_size=MERGE,
                           num_position_embeddings=64, deepstack_visual_indexes=[0], in_channels=3),
        image_token_id=IMG, video_token_id=VID, vision_start_token_id=VS, vision_end_token_id=VE,
    )
    return Qwen3VLModel(cfg).eval()


def _qwen2_5_model(tokens_per_second: int):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLModel

    cfg = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
                         bos_token_id=0, eos_token_id=1, pad_token_id=2),
        vision_config=dict(depth=1, hidden_size=64, intermediate_size=128, num_heads=4, out_hidden_size=64,
                           patch_size=14, temporal_patch_size=2, spatial_merge_size=MERGE, window_size=56,
                           fullatt_block_indexes=[0], in_channels=3, tokens_per_second=tokens_per_second),
        image_token_id=IMG, video_token_id=VID, vision_start_token_id=VS, vision_end_token_id=VE,
    )
    return Qwen2_5_VLModel(cfg).eval()


def _hf_inputs(ids: list[int], items: list[MediaItem]):
    ids_t = torch.tensor([ids])
    types = torch.zeros_like(ids_t, dtype=torch.int32)
    types[ids_t == IMG] = 1
    types[ids_t == VID] = 2
    grids = {k: [list(i.grid_thw) for i in items if i.kind == k] for k in ("image", "video")}
    as_tensor = lambda g: torch.tensor(g, dtype=torch.int64) if g else None  # noqa: E731
    return ids_t, types, as_tensor(grids["image"]), as_tensor(grids["video"])


@pytest.mark.parametrize("seed", range(8))
def test_qwen3_unpruned_equals_transformers_get_rope_index(seed):
    p = random_prompt(seed, "qwen3", long_text=seed % 2 == 0)
    ids_t, types, image_grid, video_grid = _hf_inputs(p.ids, p.items)
    hf_pos, hf_delta = _qwen3_model().get_rope_index(
        ids_t, mm_token_type_ids=types, image_grid_thw=image_grid, video_grid_thw=video_grid
    )
    ours = unpruned_positions(p.ids, MEDIA, qwen3_vl_blocks(p.items, MERGE))
    assert torch.equal(ours, hf_pos[:, 0])
    assert mrope_delta(ours, len(p.ids)) == int(hf_delta)


def test_qwen2_5_images_equal_transformers_get_rope_index():
    items = [MediaItem("image", (1, 4, 10)), MediaItem("image", (1, 12, 2)), MediaItem("image", (1, 6, 6))]
    rng = random.Random(7)
    ids: list[int] = _text(rng, 280)
    for item in items:
        ids += [VS] + [IMG] * (item.grid_thw[1] * item.grid_thw[2] // MERGE**2) + [VE] + _text(rng, 3)
    ids_t, types, image_grid, _ = _hf_inputs(ids, items)
    hf_pos, hf_delta = _qwen2_5_model(2).get_rope_index(ids_t, mm_token_type_ids=types, image_grid_thw=image_grid)
    ours = unpruned_positions(ids, MEDIA, qwen2_5_vl_blocks(items, MERGE, tokens_per_second=2))
    assert torch.equal(ours, hf_pos[:, 0])
    assert mrope_delta(ours, len(ids)) == int(hf_delta)


def test_qwen2_5_video_block_matches_transformers_but_not_its_post_video_rule():
    items = [MediaItem("video", (4, 4, 6), second_per_grid=1.0)]
    ids = [10, 11, VS] + [VID] * 24 + [VE, 12]
    ids_t, types, _, video_grid = _hf_inputs(ids, items)
    hf_pos, _ = _qwen2_5_model(2).get_rope_index(
        ids_t, mm_token_type_ids=types, video_grid_thw=video_grid, second_per_grid_ts=torch.tensor([1.0])
    )
    ours = unpruned_positions(ids, MEDIA, qwen2_5_vl_blocks(items, MERGE, tokens_per_second=2))
    assert torch.equal(ours[:, :27], hf_pos[0:3, 0, :27])  # text before and the block itself agree
    assert hf_pos[:, 0, 27].tolist() == [6, 6, 6]  # HF 5.x: s + max(h, w) = 3 + 3
    assert ours[:, 27].tolist() == [10, 10, 10]  # vLLM: block max (9) + 1


# --------------------------------------------------------------------------- helpers and bad input


def test_split_kept_by_frame_and_runs():
    parts = split_kept_by_frame(torch.tensor([13, 0, 5, 6, 2]), num_frames=3, tokens_per_frame=6)
    assert [x.tolist() for x in parts] == [[0, 2, 5], [0], [1]]
    assert all(x.dtype == torch.int64 for x in parts)
    assert [x.tolist() for x in split_kept_by_frame([], 2, 4)] == [[], []]
    assert media_runs([1, IMG, IMG, 2, VID, 3, VID, VID], MEDIA) == [(1, 3), (4, 5), (6, 8)]


def test_runs_and_blocks_must_agree():
    ids = [1, VS, VID, VID, VID, VID, VE, 2, VS, IMG, VE]
    with pytest.raises(ValueError, match="2 runs .* but 1 media blocks"):
        unpruned_positions(ids, MEDIA, [MediaBlock(1, 2, 2)])
    with pytest.raises(ValueError, match=r"media run 0 at tokens \[2, 6\) has 4 pad tokens .* \(2, 2, 2\) needs 8"):
        unpruned_positions(ids, MEDIA, [MediaBlock(2, 2, 2), MediaBlock(1, 1, 1)])
    with pytest.raises(ValueError, match="2 runs .* for 1 blocks"):
        keep_mask(ids, MEDIA, [None])


@pytest.mark.parametrize(
    "bad, message",
    [
        ([0, 4], r"media block 0 \(4 tokens\).*\[0, 4\), got range \[0, 4\]"),
        ([-1, 2], r"\[0, 4\), got range \[-1, 2\]"),
        ([1, 1], "must be unique"),
        (torch.tensor([0.0, 1.0]), "must be integers"),
    ],
)
def test_kept_indices_are_checked(bad, message):
    ids = [1, VS, VID, VID, VID, VID, VE]
    with pytest.raises(ValueError, match=message):
        keep_mask(ids, MEDIA, [bad])


def test_other_bad_inputs():
    with pytest.raises(ValueError, match=r"\[0, 12\), got range \[3, 12\]"):
        split_kept_by_frame([3, 12], num_frames=3, tokens_per_frame=4)
    with pytest.raises(ValueError, match=r"positive ints .* \(0, 2, 2\)"):
        MediaBlock(0, 2, 2)
    with pytest.raises(ValueError, match=r"positive ints .* \(1.5, 2, 2\)"):
        MediaBlock(1.5, 2, 2)
    with pytest.raises(ValueError, match="time_factor .* got nan"):
        MediaBlock(2, 2, 2, float("nan"))
    with pytest.raises(ValueError, match=r"1-D .* \(2, 3\)"):
        unpruned_positions(torch.zeros(2, 3, dtype=torch.int64), MEDIA, [])
    with pytest.raises(ValueError, match="one temporal patch"):
        MediaItem("image", (2, 4, 4))
    with pytest.raises(ValueError, match="not divisible by spatial_merge_size 2"):
        qwen3_vl_blocks([MediaItem("video", (2, 5, 4))], MERGE)
    with pytest.raises(ValueError, match=r"keep must be a bool tensor of shape \(3,\)"):
        pruned_positions(torch.zeros(3, 3, dtype=torch.int64), torch.ones(2, dtype=torch.bool))
    with pytest.raises(ValueError, match="2 media items but 1"):
        qwen3_vl_kept_per_block([MediaItem("image", (1, 2, 2))] * 2, MERGE, [None])


def test_media_block_normalises_numeric_types():
    block = MediaBlock(np.int64(2), torch.tensor(3), 4, np.float32(2 / 3))
    assert (block.grid_t, block.grid_h, block.grid_w) == (2, 3, 4) and type(block.grid_h) is int
    assert block.time_factor == float(np.float32(2 / 3)) and block.num_tokens == 24
