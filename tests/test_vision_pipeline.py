"""The vision side end to end, both families: encoder calls of F temporal patches, then a pruning graph once.

Every result is checked against the stock transformers forward over the whole video + the EVS mask
(``reference_vision_evs``), whose mask is vLLM's own (VidCom2: vLLM's ``compute_retention_mask`` on the stock
rows): kept indices exactly, rows (and Qwen3-VL deepstack) within 1e-4 in fp32. Cases cover odd T,
non-square grids, images, T not a multiple of F, videos padded to a frame bucket and q in {0, 0.5, 0.75}; one
encoder specialization (fixed F and resolution) serves 4 to 128 frames.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.pruning_oracles import vllm_kept
from vision_cases import (
    BUCKETS,
    RecordingEncoder,
    RecordingPruning,
    assert_matches_reference,
    evs_at,
    export_family,
    media,
    random_video,
)

from qeff_evs.models.qwen2_5_vl import reference_vision_evs as reference_qwen2_5
from qeff_evs.models.qwen3_vl import reference_vision_evs as reference_qwen3
from qeff_evs.models.pruning import VideoPruning
from qeff_evs.runtime.backends.torch_reference import TorchEncoderSession, TorchPruningSession
from qeff_evs.runtime.backends.vision import VisionPipeline

FAMILIES = ("qwen2_5_vl", "qwen3_vl")
REFERENCE = {"qwen2_5_vl": reference_qwen2_5, "qwen3_vl": reference_qwen3}
# (grid, frames per call): square, non-square, odd T, T not a multiple of F, F larger than T.
GRIDS = [((4, 8, 8), 2), ((5, 12, 8), 2), ((3, 4, 16), 2), ((7, 8, 12), 3), ((2, 8, 8), 4)]
RATES = [0.0, 0.5, 0.75]


@pytest.fixture(scope="module", params=FAMILIES)
def exported(request, tmp_path_factory):
    return export_family(request.param, tmp_path_factory.mktemp(request.param))


def reference(exported, pixels, grid, q):
    return REFERENCE[exported.family.name](exported.visual, pixels, grid, q)


@pytest.mark.parametrize("grid,frames_per_call", GRIDS, ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else f"F{v}")
@pytest.mark.parametrize("q", RATES)
def test_onnx_pipeline_matches_stock_tower_and_evs(exported, grid, frames_per_call, q):
    pixels = random_video(exported.model, grid, seed=sum(grid) + int(100 * q))
    result = exported.ort_pipeline(frames_per_call).encode(media(pixels, grid), evs_at(q))
    assert_matches_reference(result, reference(exported, pixels, grid, q))


@pytest.mark.parametrize("grid,frames_per_call,q", [((5, 12, 8), 2, 0.5), ((3, 4, 16), 2, 0.75)])
def test_torch_pipeline_matches_stock_tower_and_evs(exported, grid, frames_per_call, q):
    pixels = random_video(exported.model, grid, seed=7 * sum(grid))
    pipeline = VisionPipeline(exported.family, TorchEncoderSession(exported.encoder, device="cpu"),
                              {"evs": TorchPruningSession(exported.family.pruning_ranking("evs"), device="cpu")},
                              frames_per_call, BUCKETS)
    result = pipeline.encode(media(pixels, grid), evs_at(q))
    assert_matches_reference(result, reference(exported, pixels, grid, q))


@pytest.mark.parametrize("grid", [(1, 8, 8), (1, 12, 8)])
@pytest.mark.parametrize("method", ["evs", "vidcom2"])
def test_image_skips_pruning_and_keeps_every_row(exported, grid, method):
    pixels = random_video(exported.model, grid, seed=5)
    pipeline = exported.ort_pipeline(2)
    spy = RecordingPruning(pipeline.pruning[method])
    pipeline.pruning = {method: spy}
    result = pipeline.encode(media(pixels, grid, kind="image"), VideoPruning(method, 0.75))
    assert spy.seen == []
    assert_matches_reference(result, reference(exported, pixels, grid, 0.0))


def test_padding_frames_never_reach_pruning(exported):
    """T = 5 at F = 2: the last call carries one zero frame whose rows are dropped before pruning; the pruning
    graph gets the video's rows zero-padded to its frame bucket (8) and the real frame count."""
    grid, q = (5, 8, 8), 0.5
    pixels = random_video(exported.model, grid, seed=9)
    pipeline = exported.ort_pipeline(2)
    pipeline.encoder = RecordingEncoder(pipeline.encoder)
    pipeline.pruning = {"evs": RecordingPruning(pipeline.pruning["evs"])}
    pipeline.encode(media(pixels, grid), evs_at(q))
    assert pipeline.encoder.calls == [(2 * 64, pixels.shape[1])] * 3  # every call has F frames
    (feeds,) = pipeline.pruning["evs"].seen
    with torch.no_grad():
        stock = exported.visual(pixels, grid_thw=torch.tensor([grid]))
    rows = 5 * 16
    assert feeds["merged_embeds"].shape[0] == 8 * 16 and feeds["bucket_carrier"].shape == (8,)
    assert feeds["frame_count"].tolist() == [5]
    np.testing.assert_allclose(feeds["merged_embeds"][:rows], stock.pooler_output.numpy(), rtol=0, atol=1e-4)
    assert not feeds["merged_embeds"][rows:].any()


@pytest.mark.parametrize("frames", [4, 8, 16, 32, 64, 128])
def test_one_encoder_specialization_serves_4_to_128_frames(exported, frames):
    """F = 2 at one small resolution: every call has the same shapes, whatever the video's length."""
    grid = (frames // 2, 4, 4)
    pixels = random_video(exported.model, grid, seed=frames)
    pipeline = exported.ort_pipeline(2)
    pipeline.encoder = RecordingEncoder(pipeline.encoder)
    result = pipeline.encode(media(pixels, grid), evs_at(0.5))
    assert set(pipeline.encoder.calls) == {(2 * 16, pixels.shape[1])}
    assert len(pipeline.encoder.calls) == frames // 4
    assert_matches_reference(result, reference(exported, pixels, grid, 0.5))


class HostRecordingEncoder(RecordingEncoder):
    """... and the host index inputs it was handed, by identity."""

    def __init__(self, inner):
        super().__init__(inner)
        self.hosts: list[dict] = []

    def encode(self, pixel_values, host_inputs):
        self.hosts.append(host_inputs)
        return super().encode(pixel_values, host_inputs)


def test_host_inputs_are_built_once_per_resolution(exported):
    """Videos of two resolutions in turn through one pipeline: each matches its reference, and a
    resolution seen before gets the very host inputs it had (built once, not per video)."""
    pipeline = exported.ort_pipeline(2)
    pipeline.encoder = HostRecordingEncoder(pipeline.encoder)
    hosts = []
    for grid in [(4, 8, 8), (3, 4, 16), (4, 8, 8)]:
        pixels = random_video(exported.model, grid, seed=sum(grid))
        del pipeline.encoder.hosts[:]
        result = pipeline.encode(media(pixels, grid), evs_at(0.5))
        assert_matches_reference(result, reference(exported, pixels, grid, 0.5))
        assert all(h is pipeline.encoder.hosts[0] for h in pipeline.encoder.hosts)
        hosts.append(pipeline.encoder.hosts[0])
    assert hosts[2] is hosts[0] and hosts[1] is not hosts[0]
    assert hosts[1]["video_grid_thw"].shape != hosts[0]["video_grid_thw"].shape


def test_pipeline_rejects_bad_inputs(exported):
    with pytest.raises(ValueError, match="frames_per_call must be a positive integer"):
        exported.ort_pipeline(0)
    with pytest.raises(ValueError, match="buckets must be positive temporal patch counts"):
        exported.ort_pipeline(2, buckets=())
    pipeline = exported.ort_pipeline(2)
    pixels = random_video(exported.model, (2, 8, 8), seed=0)
    with pytest.raises(ValueError, match="do not hold the 192 patches"):
        pipeline.encode(media(pixels, (3, 8, 8)), evs_at(0.5))
    short = exported.ort_pipeline(2, buckets=(1, 2))
    pixels = random_video(exported.model, (3, 4, 4), seed=0)
    with pytest.raises(ValueError, match="longer than the largest frame bucket"):
        short.encode(media(pixels, (3, 4, 4)), evs_at(0.5))
    pipeline.pruning = {"evs": pipeline.pruning["evs"]}
    with pytest.raises(ValueError, match="not 'vidcom2'"):
        pipeline.encode(media(pixels, (3, 4, 4)), VideoPruning("vidcom2", 0.5))


@pytest.mark.parametrize("grid", [(5, 12, 8), (3, 4, 16), (8, 8, 8)])
@pytest.mark.parametrize("q", [0.5, 0.75])
def test_vidcom2_pipeline_matches_vllm_on_the_stock_tower(exported, grid, q):
    """VidCom2 through the ONNX pipeline (padded to a bucket) keeps vLLM's set on the stock tower's rows (Qwen3-VL:
    scored over ``[merger | deepstack]``); rows and deepstack are the stock ones at those indices."""
    pixels = random_video(exported.model, grid, seed=3 * sum(grid) + int(10 * q))
    result = exported.ort_pipeline(2).encode(media(pixels, grid), VideoPruning("vidcom2", q))
    with torch.no_grad():
        stock = exported.visual(pixels, grid_thw=torch.tensor([grid]))
    merged, levels = stock.pooler_output, list(getattr(stock, "deepstack_features", None) or [])
    t, h, w = exported.family.merged_grid(grid)
    kept = vllm_kept("vidcom2", torch.cat([merged, *levels], dim=-1), t, (h, w), q)
    np.testing.assert_array_equal(result.kept_indices, kept)
    np.testing.assert_allclose(result.rows, merged.numpy()[kept], rtol=0, atol=1e-4)
    for level, rows in zip(levels, result.extras.get("deepstack_features", [])):
        np.testing.assert_allclose(rows, level.numpy()[kept], rtol=0, atol=1e-4)


def test_export_reports_progress(exported):
    assert any("encoder graph" in m for m in exported.messages)
    assert any("evs pruning graph" in m for m in exported.messages)
    assert any("vidcom2 pruning graph" in m for m in exported.messages)
