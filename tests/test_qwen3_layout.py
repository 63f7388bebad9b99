"""Qwen3-VL prompt layout under EVS: lumped placeholder, real per-frame layout, timestamps, positions.

Independent references, none of them the code under test:

* transformers' ``Qwen3VLProcessor.replace_video_token`` writes the unpruned per-frame text of a
  video (its own timestamps, HF 5.x keeps the template's outer ``<|vision_start|>``/``<|vision_end|>``)
  and ``Qwen3VLProcessor._calculate_timestamps`` groups the frame times; the tokenizer encodes it;
* the pruned and the lumped layouts are derived here from those unpruned ids by rewriting each
  frame's pad run (test-side walk over the ids);
* transformers' ``Qwen3VLModel.get_rope_index`` (with ``mm_token_type_ids``, videos split per frame)
  gives the unpruned positions; the pruned ones must be them restricted to the kept tokens, the
  invariant of vLLM's ``tests/model_executor/test_qwen3_vl_mrope.py``;
* hand-worked timestamp strings.

Media are described on the host only (fake vision rows), so this file runs no vision graph.
"""

from __future__ import annotations

import functools
import types
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from transformers import Qwen3VLModel
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
from transformers.video_utils import VideoMetadata

from qeff_evs import evs
from qeff_evs.models.protocol import MediaInput
from qeff_evs.models.qwen3_vl import Qwen3_VLFamily, temporal_patch_times, timestamp_text
from qeff_evs.models.tiny import build_tokenizer, tiny_config
from qeff_evs.models.graph_io import PAD_POSITION
from qeff_evs.runtime.engine.steps import prefill_step
from qeff_evs.runtime.engine.request import EncodedMedia, PromptPiece, prepare_prompt, provisional_ids

TEXT_IDS = (20, 400)  # ordinary BPE ids, far from the special tokens
HIDDEN = 4  # width of the fake vision rows
LEVELS = 1  # fake deepstack levels
PRUNING_RATES = (0.0, 0.3, 0.5, 0.75, 0.9)
FPS_CHOICES = (1.0, 2.0, 2.5, 3.0, 29.97)
NUM_SCENARIOS = 24


# --------------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def config(tokenizer):
    return tiny_config("qwen3_vl", tokenizer)


@pytest.fixture(scope="module")
def family(config, tokenizer):
    return Qwen3_VLFamily(config, tokenizer)


@pytest.fixture(scope="module")
def hf_model(config):
    """Only ``get_rope_index`` is used (it reads the config, never the weights)."""
    return Qwen3VLModel(config).eval()


@pytest.fixture(scope="module")
def scenarios(tokenizer, config):
    return [random_scenario(seed, tokenizer, config) for seed in range(NUM_SCENARIOS)]


@pytest.fixture(scope="module")
def hf_positions(scenarios, config, hf_model):
    """Per scenario: transformers' positions of the unpruned prompt ``(3, N)`` and its rope delta."""
    out = []
    for sc in scenarios:
        ids, token_types, image_grid, video_grid = sc.hf_inputs(config)
        positions, delta = hf_model.get_rope_index(
            ids, mm_token_type_ids=token_types, image_grid_thw=image_grid, video_grid_thw=video_grid)
        out.append((positions[:, 0].numpy(), int(delta)))
    return out


# --------------------------------------------------------------------------------------------------
# transformers' own text for a video, and test-side rewrites of it


def hf_video_text(grid_thw, frame_indices: list[int], fps: float, temporal_patch_size: int = 2) -> str:
    """``Qwen3VLProcessor.replace_video_token`` on a stand-in processor (its video processor needs
    torchvision, which this environment lacks); the method reads only the attributes given here."""
    stand_in = types.SimpleNamespace(
        video_processor=types.SimpleNamespace(merge_size=2, temporal_patch_size=temporal_patch_size),
        vision_start_token="<|vision_start|>", vision_end_token="<|vision_end|>", video_token="<|video_pad|>")
    stand_in._calculate_timestamps = functools.partial(Qwen3VLProcessor._calculate_timestamps, stand_in)
    grid = torch.tensor([list(grid_thw)])
    metadata = VideoMetadata(total_num_frames=max(frame_indices) + 1, fps=fps, frames_indices=list(frame_indices))
    return Qwen3VLProcessor.replace_video_token(stand_in, {"video_grid_thw": grid, "video_metadata": [metadata]}, 0)


def hf_timestamps(frame_indices: list[int], fps: float, temporal_patch_size: int) -> list[float]:
    return Qwen3VLProcessor._calculate_timestamps(None, list(frame_indices), fps, temporal_patch_size)


def rewrite_pad_runs(ids: list[int], counts: list[int], config) -> list[int]:
    """The same frames with frame f's pad run replaced by ``counts[f]`` pads (walks VS ... VE)."""
    out, frame, inside = [], 0, False
    for token in ids:
        if token == config.video_token_id:
            continue
        if token == config.vision_end_token_id and inside:
            out += [config.video_token_id] * counts[frame]
            frame, inside = frame + 1, False
        out.append(token)
        if token == config.vision_start_token_id:
            inside = True
    assert frame == len(counts)
    return out


def pads_per_frame(ids: np.ndarray, config) -> list[int]:
    """Pad count between each inner ``<|vision_start|>`` and its ``<|vision_end|>`` (no outer markers)."""
    counts, current = [], None
    for token in ids.tolist():
        if token == config.vision_start_token_id:
            current = 0
        elif token == config.video_token_id:
            current += 1
        elif token == config.vision_end_token_id:
            counts.append(current)
    return counts


# --------------------------------------------------------------------------------------------------
# random prompts: text, videos wrapped in the template's outer markers, images


@dataclass
class Media:
    video: MediaInput
    kept: np.ndarray  # flat merged-grid indices, ascending
    hf_ids: list[int]  # unpruned ids of the item alone (a video: its frames without the outer markers)
    keep: np.ndarray  # over hf_ids
    frame_indices: list[int] = field(default_factory=list)
    fps: float = 1.0


@dataclass
class Scenario:
    pieces: list[PromptPiece]
    media: list[Media]
    hf_ids: list[int]  # the whole unpruned prompt, as transformers would build it
    keep: np.ndarray  # bool over hf_ids

    @property
    def videos(self) -> list[MediaInput]:
        return [m.video for m in self.media]

    def hf_inputs(self, config):
        ids = torch.tensor([self.hf_ids])
        token_types = torch.zeros_like(ids, dtype=torch.int32)
        token_types[ids == config.image_token_id] = 1
        token_types[ids == config.video_token_id] = 2
        grids = {kind: [list(m.video.grid_thw) for m in self.media if m.video.kind == kind]
                 for kind in ("image", "video")}
        as_tensor = lambda g: torch.tensor(g, dtype=torch.int64) if g else None  # noqa: E731
        return ids, token_types, as_tensor(grids["image"]), as_tensor(grids["video"])

    def encoded(self) -> list[EncodedMedia]:
        """Fake vision rows whose values name (item, row), so windows can be checked exactly."""
        out = []
        for i, m in enumerate(self.media):
            k = len(m.kept)
            rows = np.stack([np.full(HIDDEN, 1000.0 * (i + 1) + r, dtype=np.float32) for r in range(k)])
            out.append(EncodedMedia(rows, m.kept, {"deepstack_features": -rows[None].copy()}))
        return out


def random_kept(rng: np.random.Generator, t: int, hw: int, q: float) -> np.ndarray:
    k = evs.kept_token_count(hw, t, q)
    if rng.random() < 0.5:  # EVS-like: frame 0 whole, the rest anywhere
        rest = rng.choice(np.arange(hw, t * hw), k - hw, replace=False) if k > hw else np.zeros(0, np.int64)
        chosen = np.concatenate([np.arange(hw), rest])
    else:  # any set of K tokens: the layout must not assume EVS's choices
        chosen = rng.choice(t * hw, k, replace=False)
    return np.sort(chosen).astype(np.int64)


def random_video(rng, tokenizer, config) -> Media:
    t = int(rng.integers(1, 6))
    h, w = (int(rng.integers(1, 4)) for _ in range(2))
    num_frames = 2 * t - int(rng.random() < 0.4 and t > 1)  # sometimes odd: the last group is completed
    fps = float(rng.choice(FPS_CHOICES))
    frame_indices = sorted(int(i) for i in rng.choice(400, num_frames, replace=False))
    frame_times = tuple(i / fps for i in frame_indices)
    video = MediaInput(torch.zeros(0), (t, 2 * h, 2 * w), fps, frame_times)
    kept = random_kept(rng, t, h * w, float(rng.choice(PRUNING_RATES)))
    text = hf_video_text((t, 2 * h, 2 * w), frame_indices, fps)
    hf_ids = tokenizer.encode(text, add_special_tokens=False)
    keep = np.ones(len(hf_ids), dtype=bool)
    is_pad = np.asarray(hf_ids) == config.video_token_id
    raster_keep = np.zeros(t * h * w, dtype=bool)
    raster_keep[kept] = True
    keep[is_pad] = raster_keep  # pads appear frame by frame, row by row
    return Media(video, kept, hf_ids, keep, frame_indices, fps)


def random_image(rng, config) -> Media:
    h, w = (int(rng.integers(1, 4)) for _ in range(2))
    video = MediaInput(torch.zeros(0), (1, 2 * h, 2 * w), 1.0, (), kind="image")
    return Media(video, np.arange(h * w, dtype=np.int64), [config.image_token_id] * (h * w),
                 np.ones(h * w, dtype=bool))


def random_text(rng, low: int, high: int) -> list[int]:
    return [int(i) for i in rng.integers(*TEXT_IDS, size=int(rng.integers(low, high + 1)))]


def random_scenario(seed: int, tokenizer, config) -> Scenario:
    rng = np.random.default_rng(seed)
    kinds = ["video"] + [str(k) for k in rng.choice(["video", "image"], int(rng.integers(0, 3)))]
    rng.shuffle(kinds)
    vs, ve = config.vision_start_token_id, config.vision_end_token_id
    pieces, media, hf_ids, keep = [], [], [], []
    before = random_text(rng, 0, 6)
    for i, kind in enumerate(kinds):
        item = random_video(rng, tokenizer, config) if kind == "video" else random_image(rng, config)
        media.append(item)
        # The chat template's <|vision_start|><|video_pad|><|vision_end|>: HF 5.x expands only the pad.
        pieces += [PromptPiece(ids=tuple(before + [vs])), PromptPiece(media_item=i)]
        hf_ids += before + [vs] + item.hf_ids
        keep += [True] * (len(before) + 1) + item.keep.tolist()
        before = [ve] + random_text(rng, 0, 5)
    after = before + random_text(rng, 1, 4)
    pieces.append(PromptPiece(ids=tuple(after)))
    hf_ids += after
    keep += [True] * len(after)
    return Scenario(pieces, media, hf_ids, np.asarray(keep))


# --------------------------------------------------------------------------------------------------
# placeholder before encoding == real layout after it


def test_placeholder_length_equals_real_layout_length(scenarios, family, config):
    checked = 0
    for sc in scenarios:
        for m in sc.media:
            k = len(m.kept)
            before = family.placeholder_ids(m.video, k)
            after = family.video_layout(m.video, m.kept).ids
            assert len(before) == len(after) == int(m.keep.sum())
            if m.video.kind == "video":
                # lumped: every pad in frame 0's slot; the real one: frame f keeps its own count
                t, h, w = family.merged_grid(m.video.grid_thw)
                np.testing.assert_array_equal(before, rewrite_pad_runs(m.hf_ids, [k] + [0] * (t - 1), config))
                counts = np.bincount(m.kept // (h * w), minlength=t).tolist()
                assert pads_per_frame(after, config) == counts
                np.testing.assert_array_equal(after, rewrite_pad_runs(m.hf_ids, counts, config))
                checked += 1
        provisional = provisional_ids(sc.pieces, sc.videos, [len(m.kept) for m in sc.media], family)
        prepared = prepare_prompt(sc.pieces, sc.videos, sc.encoded(), family)
        assert len(provisional) == len(prepared.ids)
    assert checked >= NUM_SCENARIOS


def test_real_layout_is_transformers_prompt_with_pruned_pads_removed(scenarios, family, config):
    for sc in scenarios:
        prepared = prepare_prompt(sc.pieces, sc.videos, sc.encoded(), family)
        np.testing.assert_array_equal(prepared.ids, np.asarray(sc.hf_ids)[sc.keep])
        assert prepared.ids.dtype == np.int64


def test_unpruned_layout_is_transformers_replace_video_token(scenarios, family):
    for sc in scenarios:
        for m in sc.media:
            if m.video.kind != "video":
                continue
            t, h, w = family.merged_grid(m.video.grid_thw)
            everything = np.arange(t * h * w)
            np.testing.assert_array_equal(family.video_layout(m.video, everything).ids, m.hf_ids)


@pytest.mark.parametrize("q", [0.3, 0.5, 0.75, 0.9])
def test_real_pad_counts_equal_the_evs_mask_counts(family, config, q):
    """The kept indices come from the real EVS mask here (random embeddings, with frames that
    repeat so some frames keep nothing); the layout's per-frame pads equal the mask's per-frame sums."""
    gen = torch.Generator().manual_seed(int(q * 100))
    t, h, w = 6, 2, 3
    frames = torch.randn(t, h * w, 8, generator=gen)
    frames[2] = frames[1]  # a still frame: EVS drops it entirely at most rates
    mask = evs.retention_mask(frames.reshape(-1, 8), (t, 2 * h, 2 * w), 2, q)
    kept = torch.nonzero(mask).reshape(-1).numpy()
    video = MediaInput(torch.zeros(0), (t, 2 * h, 2 * w), 2.0, tuple(i / 2 for i in range(2 * t)))
    layout = family.video_layout(video, kept)
    assert pads_per_frame(layout.ids, config) == mask.reshape(t, -1).sum(-1).tolist()
    assert len(layout.ids) == len(family.placeholder_ids(video, int(mask.sum())))


# --------------------------------------------------------------------------------------------------
# timestamps


@pytest.mark.parametrize("frame_times, patch_size, expected", [
    # ties to even on the binary value: 0.25 is exact -> "0.2"; 0.35 is 0.34999... -> "0.3"
    ((0.0, 0.5), 2, ["<0.2 seconds>"]),
    ((0.3, 0.4), 2, ["<0.3 seconds>"]),
    ((0.5, 1.0, 1.5, 2.0), 2, ["<0.8 seconds>", "<1.8 seconds>"]),  # 0.75 -> 0.8, 1.75 -> 1.8
    ((1.0, 1.5, 2.0, 2.5), 2, ["<1.2 seconds>", "<2.2 seconds>"]),  # 1.25 -> 1.2, 2.25 -> 2.2
    # mean of the group's first and last frame, not of all its frames
    ((0.0, 0.1, 0.9), 3, ["<0.5 seconds>"]),  # (0.0 + 0.9) / 2 = 0.45000000000000001; the mean of all is 0.33
    # an odd frame count: the last group is completed with the last frame
    ((0.0, 0.5, 1.0), 2, ["<0.2 seconds>", "<1.0 seconds>"]),
    ((9.0, 9.5, 10.0, 10.5, 11.0), 2, ["<9.2 seconds>", "<10.2 seconds>", "<11.0 seconds>"]),
    ((0.0, 1.0, 2.0, 3.0, 4.0), 3, ["<1.0 seconds>", "<3.5 seconds>"]),  # groups (0,1,2), (3,4,4)
])
def test_timestamps_hand_worked(frame_times, patch_size, expected):
    assert [timestamp_text(s) for s in temporal_patch_times(frame_times, patch_size)] == expected


def test_timestamp_formatting_rounds_the_binary_value():
    assert [timestamp_text(s) for s in (0.25, 0.35, 0.45, 0.75, 9.25, 3.55, 0.05)] == [
        "<0.2 seconds>", "<0.3 seconds>", "<0.5 seconds>", "<0.8 seconds>", "<9.2 seconds>",
        "<3.5 seconds>", "<0.1 seconds>"]


@pytest.mark.parametrize("seed", range(6))
def test_timestamps_equal_transformers_calculate_timestamps(seed):
    rng = np.random.default_rng(seed)
    for _ in range(20):
        patch = int(rng.choice([2, 3]))
        fps = float(rng.choice(FPS_CHOICES))
        indices = sorted(int(i) for i in rng.choice(1000, int(rng.integers(1, 12)), replace=False))
        ours = temporal_patch_times([i / fps for i in indices], patch)
        assert [timestamp_text(s) for s in ours] == [f"<{s:.1f} seconds>" for s in hf_timestamps(indices, fps, patch)]


def test_timestamps_are_tokenized_one_by_one_with_split_digits(family, tokenizer):
    times = (0.0, 0.5, 9.0, 9.5, 10.0, 10.5, 123.0, 123.5)
    video = MediaInput(torch.zeros(0), (4, 2, 2), 2.0, times)
    stamps = family.timestamp_ids(video)
    texts = ["<0.2 seconds>", "<9.2 seconds>", "<10.2 seconds>", "<123.2 seconds>"]
    for ids, text in zip(stamps, texts):
        assert ids.tolist() == tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids.tolist()) == text
    # digits are single tokens, so each extra digit is one more token
    assert [len(s) for s in stamps] == [len(stamps[0]) + extra for extra in (0, 0, 1, 2)]


# --------------------------------------------------------------------------------------------------
# positions


def test_pruned_positions_are_transformers_unpruned_positions_restricted(scenarios, hf_positions, family):
    for sc, (unpruned, delta) in zip(scenarios, hf_positions):
        prepared = prepare_prompt(sc.pieces, sc.videos, sc.encoded(), family)
        assert prepared.positions.dtype == np.int64
        np.testing.assert_array_equal(prepared.positions, unpruned[:, sc.keep])
        assert prepared.decode_start == int(unpruned.max()) + 1 == len(sc.hf_ids) + delta


def test_q0_prompt_and_positions_are_transformers_own(family, config, tokenizer, hf_model):
    sc = random_scenario(7, tokenizer, config)
    for m in sc.media:  # keep everything
        t, h, w = family.merged_grid(m.video.grid_thw)
        m.kept = np.arange(t * h * w, dtype=np.int64)
        m.keep = np.ones(len(m.hf_ids), dtype=bool)
    sc.keep = np.ones(len(sc.hf_ids), dtype=bool)
    prepared = prepare_prompt(sc.pieces, sc.videos, sc.encoded(), family)
    ids, token_types, image_grid, video_grid = sc.hf_inputs(config)
    hf_positions, _ = hf_model.get_rope_index(
        ids, mm_token_type_ids=token_types, image_grid_thw=image_grid, video_grid_thw=video_grid)
    np.testing.assert_array_equal(prepared.ids, sc.hf_ids)
    np.testing.assert_array_equal(prepared.positions, hf_positions[:, 0].numpy())


def random_chunking(rng, total: int, seq_len: int) -> list[tuple[int, int]]:
    chunks, at = [], 0
    while at < total:
        n = int(rng.integers(1, min(seq_len, total - at) + 1))
        chunks.append((at, n))
        at += n
    return chunks


def rows_per_token(sc: Scenario, config) -> list[tuple[int, int] | None]:
    """Test-side map over the final prompt: ``(item, row)`` for each media pad, else None.

    Built from the scenario's own pieces (item i's pads are its rows 0, 1, ... in order)."""
    out = []
    pads = (config.image_token_id, config.video_token_id)
    for piece in sc.pieces:
        if piece.media_item is None:
            out += [None] * len(piece.ids)
            continue
        m = sc.media[piece.media_item]
        ids = np.asarray(m.hf_ids)[m.keep]
        rows = np.cumsum(np.isin(ids, pads)) - 1
        out += [(piece.media_item, int(r)) if token in pads else None for token, r in zip(ids.tolist(), rows)]
    return out


@pytest.mark.parametrize("seq_len", [1, 3, 8, 16, 64])
def test_any_chunking_feeds_exactly_the_request_positions_and_rows(scenarios, hf_positions, family, config,
                                                                  seq_len):
    """Rows 1..3 of every chunk's ``position_ids`` concatenate to transformers' positions restricted
    to the kept tokens, whatever the chunk boundaries; row 0 counts KV slots; each window carries
    exactly its own media rows."""
    rng = np.random.default_rng(seq_len)
    for sc, (unpruned, _) in list(zip(scenarios, hf_positions))[:12]:
        encoded = sc.encoded()
        prepared = prepare_prompt(sc.pieces, sc.videos, encoded, family)
        owners = rows_per_token(sc, config)
        total = len(prepared.ids)
        for _ in range(3):
            chunks = random_chunking(rng, total, seq_len)
            mrope, slots = [], []
            for computed, scheduled in chunks:
                step = prefill_step(prepared, computed, scheduled, seq_len, seq_len, HIDDEN, {"deepstack_features": LEVELS})
                assert step.position_ids.shape == (4, 1, seq_len) and step.position_ids.dtype == np.int64
                assert (step.position_ids[:, 0, scheduled:] == PAD_POSITION).all()
                assert int(step.image_idx[0, 0]) == 0
                slots.append(step.position_ids[0, 0, :scheduled])
                mrope.append(step.position_ids[1:, 0, :scheduled])
                # the window: rows of exactly this chunk's media pads, in order, then zeros
                expected = [encoded[o[0]].rows[o[1]] for o in owners[computed:computed + scheduled] if o]
                assert step.vision_rows == len(expected)
                window = step.vision_embeds[0]
                if expected:
                    np.testing.assert_array_equal(window[:len(expected)], np.stack(expected))
                    np.testing.assert_array_equal(step.extras["deepstack_features"][0, 0, :len(expected)], -np.stack(expected))
                assert not window[len(expected):].any()
            np.testing.assert_array_equal(np.concatenate(mrope, axis=1), unpruned[:, sc.keep])
            np.testing.assert_array_equal(np.concatenate(slots), np.arange(total))
