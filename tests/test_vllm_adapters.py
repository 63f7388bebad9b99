"""vLLM adapters against vLLM 0.32.0's own window arithmetic on its own types.

The oracle is the gather loop of vLLM v1's ``GPUModelRunner._gather_mm_embeddings``, driven by
vLLM's ``get_mm_features_in_window`` and ``PlaceholderRange.get_embeds_indices_in_range`` /
``get_num_embeds`` (the runner itself needs CUDA and cannot be imported here). Features are
random, sorted, non-overlapping placeholders, half of them with an ``is_embed`` mask; chunk
schedules are random cuts of the prompt, and one schedule comes from qeff-evs's scheduler.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer, Qwen2_5_VLConfig

from qeff_evs.models.protocol import MediaInput
from qeff_evs.models.pruning import VideoPruning
from qeff_evs.models.registry import family_for_config
from qeff_evs.models.tiny import tiny_config
from qeff_evs.runtime.engine.scheduler import RequestSpec, Scheduler, SchedulerConfig
from qeff_evs.runtime.engine.window import Placeholder, window_slices
from qeff_evs.vllm.processing import adapters

vllm_inputs = pytest.importorskip("vllm.multimodal.inputs")
vllm_utils = pytest.importorskip("vllm.multimodal.utils")
vllm_evs = pytest.importorskip("vllm.multimodal.video_prune.evs")
vllm_vidcom2 = pytest.importorskip("vllm.multimodal.video_prune.vidcom2")
PlaceholderRange = vllm_inputs.PlaceholderRange
MultiModalFeatureSpec = vllm_inputs.MultiModalFeatureSpec
get_mm_features_in_window = vllm_utils.get_mm_features_in_window

HIDDEN = 6


def feature(identifier: str, offset: int, length: int, is_embed: torch.Tensor | None = None):
    return MultiModalFeatureSpec(data=None, modality="video", identifier=identifier,
                                 mm_position=PlaceholderRange(offset=offset, length=length, is_embed=is_embed))


def random_features(rng: random.Random, prompt_len: int) -> list:
    features, at = [], rng.randint(0, 4)
    while len(features) < 4:
        length = rng.randint(1, 14)
        if at + length > prompt_len:
            break
        mask = None
        if rng.random() < 0.5:
            mask = torch.tensor([rng.random() < 0.5 for _ in range(length)])
            if rng.random() < 0.8:
                mask[rng.randrange(length)] = True  # else possibly a placeholder with no rows at all
        features.append(feature(f"item{len(features)}", at, length, mask))
        at += length + rng.randint(0, 4)
    return features


def encoder_outputs(features, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f.identifier: torch.randn(f.mm_position.get_num_embeds(), HIDDEN, generator=g) for f in features}


def vllm_gather(features, outputs, computed: int, scheduled: int):
    """vLLM v1's per-request gather: (rows in order, is_mm_embed over the chunk, (item, first, last))."""
    rows, taken = [], []
    is_mm_embed = torch.zeros(scheduled, dtype=torch.bool)
    lo, hi = get_mm_features_in_window(features, start=computed, end=computed + scheduled)
    for i in range(lo, hi):
        pos = features[i].mm_position
        start_idx = max(computed - pos.offset, 0)
        end_idx = min(computed - pos.offset + scheduled, pos.length)
        first, last = pos.get_embeds_indices_in_range(start_idx, end_idx)
        if first == last:
            continue
        out = outputs[features[i].identifier]
        chunk_start = pos.offset - computed
        if pos.is_embed is not None:
            rows.append(out[first:last])
            is_mm_embed[chunk_start + start_idx:chunk_start + end_idx] |= pos.is_embed[start_idx:end_idx]
        else:
            rows.append(out[start_idx:end_idx])
            is_mm_embed[chunk_start + start_idx:chunk_start + end_idx] = True
        taken.append((i, first, last))
    stacked = torch.cat(rows) if rows else torch.zeros(0, HIDDEN)
    return stacked, is_mm_embed, taken


def random_cuts(rng: random.Random, total: int, longest: int) -> list[tuple[int, int]]:
    cuts, at = [], 0
    while at < total:
        n = min(rng.randint(1, longest), total - at)
        cuts.append((at, n))
        at += n
    return cuts


def check_chunk(features, outputs, computed: int, scheduled: int, user_vision_size: int) -> int:
    expected_rows, is_mm_embed, taken = vllm_gather(features, outputs, computed, scheduled)
    slices = adapters.feature_window_slices(features, computed, scheduled)
    assert [(s.item, s.row_start, s.row_end) for s in slices] == taken
    # The same arithmetic on our own placeholders built straight from the raw fields.
    ours = [Placeholder(f.mm_position.offset, f.mm_position.length,
                        None if f.mm_position.is_embed is None else f.mm_position.is_embed.numpy())
            for f in features]
    assert [(s.item, s.row_start, s.row_end) for s in window_slices(ours, computed, scheduled)] == taken
    window = adapters.gather_feature_window(features, outputs, computed, scheduled, user_vision_size, HIDDEN)
    rows = int(is_mm_embed.sum())  # the chunk's media tokens: the k-th takes window row k
    assert window.num_rows == rows == expected_rows.shape[0]
    assert window.vision_embeds.shape == (1, user_vision_size, HIDDEN)
    np.testing.assert_array_equal(window.vision_embeds[0, :rows], expected_rows.numpy())
    assert not window.vision_embeds[0, rows:].any()
    assert window.image_idx.dtype == np.int64 and window.image_idx.tolist() == [[0]]
    return rows


def test_window_gather_equals_vllm_on_random_schedules():
    rng = random.Random(0)
    total_rows = masked = 0
    for case in range(150):
        prompt_len = rng.randint(1, 70)
        features = random_features(rng, prompt_len)
        outputs = encoder_outputs(features, case)
        masked += sum(f.mm_position.is_embed is not None for f in features)
        longest = rng.randint(1, 24)
        for computed, scheduled in random_cuts(rng, prompt_len, longest):
            total_rows += check_chunk(features, outputs, computed, scheduled, user_vision_size=longest)
    assert total_rows > 1000 and masked > 50


def test_placeholder_arithmetic_equals_vllm():
    rng = random.Random(1)
    for _ in range(200):
        length = rng.randint(1, 20)
        mask = None if rng.random() < 0.3 else torch.tensor([rng.random() < 0.5 for _ in range(length)])
        vllm_range = PlaceholderRange(offset=rng.randint(0, 9), length=length, is_embed=mask)
        ours = adapters.to_placeholder(vllm_range)
        assert ours.num_embeds == vllm_range.get_num_embeds()
        for start in range(length + 1):
            for end in range(start, length + 1):
                assert ours.embed_rows_in_range(start, end) == vllm_range.get_embeds_indices_in_range(start, end)
        assert adapters.to_placeholder_range(ours) == vllm_range


def test_deepstack_rows_follow_the_same_slices():
    features = [feature("a", 1, 5, torch.tensor([False, True, True, False, True])), feature("b", 7, 4)]
    g = torch.Generator().manual_seed(3)
    main = {"a": torch.randn(3, HIDDEN, generator=g), "b": torch.randn(4, HIDDEN, generator=g)}
    deep = {"a": torch.randn(2, 3, HIDDEN, generator=g), "b": torch.randn(2, 4, HIDDEN, generator=g)}
    window = adapters.gather_feature_window(features, main, 4, 5, 8, HIDDEN, {"deepstack_features": 2},
                                            {"deepstack_features": deep})
    deepstack = window.extras["deepstack_features"]
    # chunk [4, 9): a's positions 3..4 -> row 2; b's positions 0..1 -> rows 0..1
    np.testing.assert_array_equal(window.vision_embeds[0, :3], torch.cat([main["a"][2:3], main["b"][0:2]]).numpy())
    np.testing.assert_array_equal(deepstack[:, 0, :3],
                                  torch.cat([deep["a"][:, 2:3], deep["b"][:, 0:2]], dim=1).numpy())
    assert deepstack.shape == (2, 1, 8, HIDDEN) and not deepstack[:, :, 3:].any()


def test_gather_errors_name_the_fix():
    features = [feature("a", 0, 6)]
    with pytest.raises(ValueError, match="user_vision_size is 4"):
        adapters.gather_feature_window(features, {"a": torch.zeros(6, HIDDEN)}, 0, 6, 4, HIDDEN)
    with pytest.raises(ValueError, match=r"missing for \['a'\]"):
        adapters.gather_feature_window(features, {}, 0, 6, 8, HIDDEN)


def test_scheduler_driven_from_vllm_features_gathers_what_vllm_would():
    rng = random.Random(2)
    config = SchedulerConfig(max_num_batched_tokens=10, max_num_seqs=3, prefill_seq_len=6, ctx_len=96,
                             encoder_compute_budget=16, encoder_cache_size=28)
    s = Scheduler(config)
    requests = {}
    for n in range(6):
        prompt_len = rng.randint(20, 80)
        features = [feature(f"r{n}-{f.identifier}", f.mm_position.offset, f.mm_position.length,
                            f.mm_position.is_embed) for f in random_features(rng, prompt_len)]
        s.add_request(RequestSpec(f"r{n}", prompt_len, adapters.media_items(features), max_new_tokens=2))
        requests[f"r{n}"] = (features, encoder_outputs(features, n))
    encoded: set[str] = set()
    chunks = 0
    while s.has_unfinished_requests():
        out = s.schedule()
        encoded |= {e.content_hash for e in out.encoder_inputs}
        for p in out.prefills:
            features, outputs = requests[p.request_id]
            needed = {features[i].identifier for i, _, _ in vllm_gather(features, outputs, p.computed, p.scheduled)[2]}
            assert needed <= encoded  # the scheduler encoded every item before its rows were needed
            check_chunk(features, outputs, p.computed, p.scheduled, config.prefill_seq_len)
            chunks += 1
        s.update_from_output(out, {rid: 4 for rid in out.sampling_request_ids})
    assert chunks > 30


# --- placeholder reservations ---------------------------------------------------------------------


def media_item(grid: tuple[int, int, int], frame_times: tuple[float, ...] = ()) -> MediaInput:
    """A video as a vLLM processor knows it when it reserves the placeholder (no pixel is read)."""
    return MediaInput(torch.zeros(0), grid, fps=2.0, frame_times=frame_times)


@pytest.fixture(scope="module")
def qwen3_family(tiny_checkpoint):
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint, local_files_only=True)
    return family_for_config(tiny_config("qwen3_vl", tokenizer), tokenizer)


@pytest.mark.parametrize("grid, merge, q", [((8, 8, 12), 2, 0.5), ((1, 4, 4), 2, 0.9), ((16, 14, 10), 2, 0.75),
                                            ((5, 6, 6), 1, 0.0), ((32, 4, 8), 2, 0.99)])
@pytest.mark.parametrize("method", ["evs", "vidcom2"])
def test_qwen2_5_reservation_is_vllm_kept_count(grid, merge, q, method):
    t, h, w = grid[0], grid[1] // merge, grid[2] // merge
    module = vllm_evs if method == "evs" else vllm_vidcom2  # each method's own count rule (VidCom2: a token a frame)
    k = module.compute_retained_tokens_count(h * w, t, q)
    family = family_for_config(Qwen2_5_VLConfig(vision_config={"spatial_merge_size": merge}))
    reservation = adapters.evs_reservation(family, media_item(grid), VideoPruning(method, q))
    assert (reservation.length, reservation.num_video_rows, reservation.is_embed) == (k, k, None)
    assert reservation.placeholder_range(5) == PlaceholderRange(offset=5, length=k)


def token_layout(timestamps: list[list[int]], pads_per_frame: list[int], vs: int, ve: int, vid: int) -> list[int]:
    """Qwen3-VL's video segment spelled out token by token."""
    tokens = []
    for ts, pads in zip(timestamps, pads_per_frame):
        tokens += ts + [vs] + [vid] * pads + [ve]
    return tokens


@pytest.mark.parametrize("seed", range(12))
def test_qwen3_reservation_is_the_lumped_layout_and_fits_every_real_split(seed, qwen3_family):
    rng = random.Random(seed)
    t, h, w, merge = rng.randint(1, 9), 2 * rng.randint(1, 5), 2 * rng.randint(1, 5), 2
    q = rng.choice([0.0, 0.3, 0.5, 0.75, 0.9])
    # Two frames per temporal patch; start and rate vary the timestamps' token counts.
    start, fps = rng.choice([0.0, 7.3, 95.0]), rng.choice([0.5, 2.0, 3.7, 30.0])
    frame_times = tuple(start + i / fps for i in range(2 * t))
    tokenizer, config = qwen3_family.tokenizer, qwen3_family.config
    timestamps = [tokenizer.encode(f"<{(frame_times[2 * f] + frame_times[2 * f + 1]) / 2:.1f} seconds>",
                                   add_special_tokens=False) for f in range(t)]
    vs, ve, vid = config.vision_start_token_id, config.vision_end_token_id, config.video_token_id
    hw = (h // merge) * (w // merge)
    k = vllm_evs.compute_retained_tokens_count(hw, t, q)
    video = media_item((t, h, w), frame_times)
    reservation = adapters.evs_reservation(qwen3_family, video, VideoPruning("evs", q))
    lumped = token_layout(timestamps, [k] + [0] * (t - 1), vs, ve, vid)
    assert reservation.length == len(lumped) == sum(len(ts) + 2 for ts in timestamps) + k
    np.testing.assert_array_equal(reservation.is_embed, np.asarray(lumped) == vid)
    assert reservation.num_video_rows == k == reservation.placeholder(0).num_embeds
    assert reservation.placeholder_range(3).get_num_embeds() == k
    # Any split EVS can produce (frame 0 kept whole) has the same length and first pad position.
    later = sorted(rng.sample(range(hw, t * hw), k - hw))
    rest = [sum(1 for i in later if i // hw == f) for f in range(1, t)]
    real = token_layout(timestamps, [hw] + rest, vs, ve, vid)
    real_ids = qwen3_family.video_layout(video, np.asarray([*range(hw), *later], dtype=np.int64)).ids
    real_mask = np.isin(real_ids, qwen3_family.special_tokens().media_pads)
    np.testing.assert_array_equal(real_mask, np.asarray(real) == vid)
    assert len(real) == reservation.length and real.index(vid) == lumped.index(vid)


def test_qwen3_reservation_needs_one_timestamp_per_temporal_patch(qwen3_family):
    with pytest.raises(ValueError, match="4 temporal patches but 6 frame times"):
        adapters.evs_reservation(qwen3_family, media_item((4, 8, 8), tuple(range(6))), VideoPruning("evs", 0.5))
