"""Video preprocessing against Hugging Face's own Qwen-VL processors.

References (all transformers code, none of ours):
* ``Qwen2VLImageProcessorPil`` (resize with PIL, rescale, normalise, patchify) for one frame;
* ``Qwen3VLVideoProcessor.patchify`` (the video patch order, frames distinct within a temporal patch)
  and ``.sample_frames`` / ``VideoMetadata.sampled_fps`` for frame sampling;
* the ``smart_resize`` functions of both processors.
HF's video processors resize with torchvision, which does not exist here, so a frame's
resize+normalise is checked through the PIL image processor: it is fed the original frame with
pixel limits for which HF's own ``smart_resize`` lands on the target size, so HF's resize runs too.
"""

from __future__ import annotations

import json
import math
import warnings

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import Qwen2_5_VLConfig, Qwen3VLConfig
from transformers.image_transforms import normalize as hf_normalize
from transformers.image_transforms import rescale as hf_rescale
from transformers.image_transforms import resize as hf_resize
from transformers.image_utils import ChannelDimension, PILImageResampling
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_smart_resize
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize as hf_smart_resize_video
from transformers.video_utils import VideoMetadata

from qeff_evs.models.qwen2_5_vl import CLIP_MEAN, CLIP_STD
from qeff_evs.runtime.inputs.frame_sizes import choose_resolution, smart_resize, smart_resize_video
from qeff_evs.runtime.inputs.preprocess_spec import VisionPreprocessSpec
from qeff_evs.runtime.inputs.processor import preprocess_image, preprocess_video, sample_frame_indices
from qeff_evs.runtime.inputs.synthetic import moving_square_video

SPECS = {family: VisionPreprocessSpec.for_family(family) for family in ("qwen2_5_vl", "qwen3_vl")}


def hf_image_processor(spec: VisionPreprocessSpec, min_pixels: int, max_pixels: int) -> Qwen2VLImageProcessorPil:
    return Qwen2VLImageProcessorPil(
        patch_size=spec.patch_size,
        temporal_patch_size=spec.temporal_patch_size,
        merge_size=spec.merge_size,
        image_mean=list(spec.image_mean),
        image_std=list(spec.image_std),
        size={"shortest_edge": min_pixels, "longest_edge": max_pixels},
    )


def hf_image_pixels(processor, images: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    out = processor(images=images, return_tensors="np")
    return out["pixel_values"], out["image_grid_thw"]


def random_frames(count: int, height: int, width: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(count, height, width, 3), dtype=np.uint8)


# ------------------------------------------------------------------------------------------------
# smart_resize


def _sizes(seed: int, count: int) -> list[tuple[int, int]]:
    rng = np.random.default_rng(seed)
    sizes = [(int(h), int(w)) for h, w in rng.integers(1, 4000, size=(count, 2))]
    sizes += [(int(h), int(w)) for h, w in rng.integers(10, 200, size=(count, 2))]
    # Half-way sides exercise round-half-to-even; tiny, square and extreme shapes the branches.
    sizes += [(42, 70), (14, 14), (1, 1), (1, 150), (28, 5600), (5601, 28), (1080, 1920), (720, 1280), (3, 601)]
    return sizes


@pytest.mark.parametrize(
    "factor, min_pixels, max_pixels",
    [(28, 56 * 56, 28 * 28 * 1280), (28, 128 * 28 * 28, 768 * 28 * 28), (32, 65536, 16777216), (32, 4096, 4096 * 4)],
)
def test_smart_resize_equals_transformers(factor, min_pixels, max_pixels):
    for height, width in _sizes(factor + min_pixels, 600):
        try:
            expected = hf_smart_resize(height, width, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)
        except ValueError:
            with pytest.raises(ValueError, match="aspect ratio"):
                smart_resize(height, width, factor, min_pixels, max_pixels)
            continue
        assert smart_resize(height, width, factor, min_pixels, max_pixels) == expected, (height, width)


@pytest.mark.parametrize("num_frames", [2, 3, 16, 61])
def test_smart_resize_video_equals_transformers_qwen3(num_frames):
    for height, width in _sizes(num_frames, 300):
        kwargs = dict(temporal_factor=2, factor=32, min_pixels=128 * 32 * 32, max_pixels=768 * 32 * 32 * 4)
        try:
            expected = hf_smart_resize_video(num_frames, height, width, **kwargs)
        except ValueError:
            with pytest.raises(ValueError):
                smart_resize_video(num_frames, height, width, **kwargs)
            continue
        assert smart_resize_video(num_frames, height, width, **kwargs) == expected, (height, width)
    with pytest.raises(ValueError, match="temporal_factor"):
        smart_resize_video(1, 64, 64, temporal_factor=2, factor=32, min_pixels=1, max_pixels=10**9)


def test_spec_natural_size_uses_the_family_rule():
    q25, q3 = SPECS["qwen2_5_vl"], SPECS["qwen3_vl"]
    assert q25.natural_size(1080, 1920) == hf_smart_resize(1080, 1920, 28, q25.min_pixels, q25.max_pixels)
    assert q3.natural_size(1080, 1920, num_frames=16) == hf_smart_resize_video(
        16, 1080, 1920, temporal_factor=2, factor=32, min_pixels=q3.min_pixels, max_pixels=q3.max_pixels
    )
    with pytest.raises(ValueError, match="num_frames"):
        q3.natural_size(1080, 1920)


# ------------------------------------------------------------------------------------------------
# per-frame pixels vs the PIL image processor

# (source h, w, min_pixels, max_pixels): upscale, downscale, round-only, no-op, odd shapes.
FRAME_CASES = [
    (60, 80, 200 * 200, 10**7),
    (300, 200, 56 * 56, 112 * 112),
    (57, 113, 56 * 56, 10**7),
    (64, 96, 32 * 32, 10**7),
    (101, 37, 64 * 64, 10**7),
    (224, 448, 56 * 56, 10**7),
]


@pytest.mark.parametrize("family", sorted(SPECS))
@pytest.mark.parametrize("height, width, min_pixels, max_pixels", FRAME_CASES)
def test_frame_pixels_equal_hf_image_processor(family, height, width, min_pixels, max_pixels):
    spec = SPECS[family]
    frame = random_frames(1, height, width, seed=height * width)[0]
    # HF decides the size with its own rule; our processor is told that size.
    target = hf_smart_resize(height, width, factor=spec.factor, min_pixels=min_pixels, max_pixels=max_pixels)
    expected, expected_grid = hf_image_pixels(hf_image_processor(spec, min_pixels, max_pixels), [frame])

    ours = preprocess_image(frame, target, spec)
    assert ours.pixel_values.dtype == torch.float32
    assert ours.pixel_values.shape == expected.shape
    assert list(ours.grid_thw) == expected_grid[0].tolist()
    assert (ours.pixel_values.numpy() - expected).__abs__().max() <= 1e-5

    video = preprocess_video(frame[None], target, spec)  # one frame: padded like an image
    torch.testing.assert_close(video.pixel_values, ours.pixel_values, rtol=0, atol=0)


@pytest.mark.parametrize("family", sorted(SPECS))
def test_video_of_repeated_frames_equals_concatenated_images(family):
    spec = SPECS[family]
    height, width, min_pixels, max_pixels = 90, 150, 56 * 56, 128 * 128
    target = hf_smart_resize(height, width, factor=spec.factor, min_pixels=min_pixels, max_pixels=max_pixels)
    stills = random_frames(3, height, width, seed=7)
    expected, expected_grid = hf_image_pixels(hf_image_processor(spec, min_pixels, max_pixels), list(stills))

    doubled = np.repeat(stills, 2, axis=0)  # f0 f0 f1 f1 f2 f2
    ours = preprocess_video(doubled, target, spec)
    gh, gw = target[0] // spec.patch_size, target[1] // spec.patch_size
    assert ours.grid_thw == (3, gh, gw)
    assert expected_grid.tolist() == [[1, gh, gw]] * 3
    assert np.abs(ours.pixel_values.numpy() - expected).max() <= 1e-5

    # Odd count: the last frame is repeated to fill the temporal patch, as the image path does.
    odd = preprocess_video(doubled[:5], target, spec)  # f0 f0 f1 f1 f2 -> pad f2
    assert odd.grid_thw == (3, gh, gw)
    assert np.abs(odd.pixel_values.numpy() - expected).max() <= 1e-5


def hf_normalized_clip(frames: np.ndarray, size: tuple[int, int], spec: VisionPreprocessSpec) -> torch.Tensor:
    """(1, T, C, h, w) float32 built only from transformers' numpy transforms."""
    out = []
    for frame in frames:
        chw = np.transpose(frame, (2, 0, 1))
        resized = hf_resize(chw, size, resample=PILImageResampling.BICUBIC, input_data_format=ChannelDimension.FIRST)
        scaled = hf_rescale(resized, 1 / 255, input_data_format=ChannelDimension.FIRST)
        out.append(hf_normalize(scaled, spec.image_mean, spec.image_std, input_data_format=ChannelDimension.FIRST))
    return torch.from_numpy(np.stack(out))[None]


@pytest.mark.parametrize("family", sorted(SPECS))
@pytest.mark.parametrize("num_frames", [4, 5])
def test_video_patch_order_equals_hf_video_processor(family, num_frames):
    # Distinct frames inside a temporal patch: the image-based checks cannot see that axis.
    spec = SPECS[family]
    size = (2 * spec.factor, 3 * spec.factor)
    frames = moving_square_video(num_frames, 70, 110, square=20, speed=11, seed=1)
    video_processor = Qwen3VLVideoProcessor()
    expected, *grid = video_processor.patchify(
        hf_normalized_clip(frames, size, spec),
        patch_size=spec.patch_size,
        merge_size=spec.merge_size,
        temporal_patch_size=spec.temporal_patch_size,
    )
    ours = preprocess_video(frames, size, spec)
    assert ours.grid_thw == tuple(grid) == (math.ceil(num_frames / 2), 4, 6)
    assert ours.pixel_values.shape == expected[0].shape == (3 * 4 * 6 if num_frames == 5 else 2 * 4 * 6, spec.patch_dim)
    assert (ours.pixel_values - expected[0]).abs().max().item() <= 1e-5
    assert ours.grid_thw_tensor.tolist() == [list(grid)]


def test_preprocess_rejects_bad_input():
    spec = SPECS["qwen2_5_vl"]
    frames = random_frames(2, 56, 56, seed=0)
    with pytest.raises(ValueError, match="multiples of patch_size\\*merge_size=28"):
        preprocess_video(frames, (56, 60), spec)
    with pytest.raises(ValueError, match="uint8"):
        preprocess_video(frames.astype(np.float32), (56, 56), spec)
    with pytest.raises(ValueError, match=r"\(T, H, W, 3\)"):
        preprocess_video(frames[..., 0], (56, 56), spec)
    with pytest.raises(ValueError, match="preprocess_video"):
        preprocess_image(frames, (56, 56), spec)


# ------------------------------------------------------------------------------------------------
# frame sampling


@pytest.mark.parametrize(
    "total, video_fps, target_fps",
    [(300, 30.0, 2.0), (301, 29.97, 2.0), (97, 24.0, 1.0), (1000, 60.0, 4.0), (40, 8.0, 2.0), (17, 2.0, 2.0)],
)
def test_sampling_matches_hf_qwen3_when_its_count_is_exported(total, video_fps, target_fps):
    processor = Qwen3VLVideoProcessor(fps=target_fps)
    metadata = VideoMetadata(total_num_frames=total, fps=video_fps)
    hf_indices = np.asarray(processor.sample_frames(metadata))
    count = len(hf_indices)
    sampled = sample_frame_indices(total, video_fps, target_fps, [count, count + 1, count + 2, 2])
    assert sampled.num_frames == count
    np.testing.assert_array_equal(sampled.indices, hf_indices)
    metadata.frames_indices = hf_indices.tolist()
    assert sampled.fps == pytest.approx(metadata.sampled_fps, rel=1e-12)
    np.testing.assert_allclose(sampled.timestamps, metadata.timestamps, rtol=0, atol=1e-12)


def test_sampling_picks_largest_exported_count_that_fits():
    # 10 s at 30 fps -> 20 frames at 2 fps.
    sampled = sample_frame_indices(300, 30.0, 2.0, [32, 4, 16, 8])
    assert sampled.num_frames == 16
    assert sampled.indices[0] == 0 and sampled.indices[-1] == 299
    assert (np.diff(sampled.indices) > 0).all()
    assert sampled.fps == pytest.approx(16 / 10)
    np.testing.assert_allclose(sampled.timestamps, sampled.indices / 30.0)
    # Exactly available.
    assert sample_frame_indices(300, 30.0, 2.0, [20]).num_frames == 20


def test_sampling_caps_at_source_frames_and_native_rate():
    # 10 frames at 1 fps offer 20 at 2 fps, but only 10 exist: never duplicate.
    sampled = sample_frame_indices(10, 1.0, 2.0, [8, 16])
    assert sampled.num_frames == 8 and len(set(sampled.indices.tolist())) == 8
    every = sample_frame_indices(10, 1.0, None, [10, 4])
    np.testing.assert_array_equal(every.indices, np.arange(10))
    assert every.fps == 1.0
    single = sample_frame_indices(7, 3.0, 2.0, [1])
    assert single.indices.tolist() == [0] and single.timestamps.tolist() == [0.0]


def test_sampling_too_short_names_the_sizes():
    with pytest.raises(ValueError, match=r"gives only 2 frames.*\[4, 8\]"):
        sample_frame_indices(30, 30.0, 2.0, [8, 4])


@pytest.mark.parametrize(
    "args",
    [(0, 30.0, 2.0, [4]), (10, 0.0, 2.0, [4]), (10, 30.0, -1.0, [4]), (10, 30.0, 2.0, []),
     (10, 30.0, 2.0, [0]), (10, 30.0, 2.0, [2.5]), (10, float("inf"), 2.0, [4])],
)
def test_sampling_rejects_bad_arguments(args):
    with pytest.raises(ValueError):
        sample_frame_indices(*args)


# ------------------------------------------------------------------------------------------------
# resolution choice


def test_choose_resolution_prefers_aspect_then_area_then_order():
    exported = [(448, 448), (336, 672), (672, 336), (224, 448)]
    # 16:9 is closest to 1:2; of the two 1:2 sizes the larger is nearer the video's 1920x1080 pixels.
    assert choose_resolution(1080, 1920, exported, 28) == (336, 672)
    assert choose_resolution(1920, 1080, exported, 28) == (672, 336)  # tall
    assert choose_resolution(500, 510, exported, 28) == (448, 448)
    # Same aspect: the pixel count closest to the video's wins.
    assert choose_resolution(200, 400, [(336, 672), (224, 448)], 28) == (224, 448)
    assert choose_resolution(400, 800, [(224, 448), (336, 672)], 28) == (336, 672)
    # Full tie (same size listed twice, or mirror-equal distances): the earlier entry.
    assert choose_resolution(100, 100, [(56, 112), (112, 56)], 28) == (56, 112)
    assert choose_resolution(100, 100, [(112, 56), (56, 112)], 28) == (112, 56)


def test_choose_resolution_minimises_aspect_distance_on_random_inputs():
    rng = np.random.default_rng(0)
    exported = [(h * 32, w * 32) for h, w in rng.integers(1, 30, size=(12, 2))]
    for height, width in rng.integers(16, 2000, size=(300, 2)):
        chosen = choose_resolution(int(height), int(width), exported, 32)
        best = min(abs(math.log(h / w) - math.log(height / width)) for h, w in exported)
        assert abs(math.log(chosen[0] / chosen[1]) - math.log(height / width)) <= best + 1e-12


def test_choose_resolution_errors():
    with pytest.raises(ValueError, match="multiples of patch_size\\*merge_size=28"):
        choose_resolution(100, 100, [(448, 448), (450, 448)], 28)
    with pytest.raises(ValueError, match="no exported resolutions"):
        choose_resolution(100, 100, [], 28)
    with pytest.raises(ValueError, match="positive"):
        choose_resolution(0, 100, [(28, 28)], 28)


# ------------------------------------------------------------------------------------------------
# spec from a checkpoint directory


def tiny_qwen25_config(**vision) -> Qwen2_5_VLConfig:
    vision_config = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=32,
                         patch_size=14, temporal_patch_size=2, spatial_merge_size=2)
    vision_config.update(vision)
    return Qwen2_5_VLConfig(
        text_config=dict(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1),
        vision_config=vision_config,
    )


def write_json(path, data):
    path.write_text(json.dumps(data))


def test_from_pretrained_dir_qwen25_matches_hf_reading(tmp_path):
    config = {
        "min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
        "image_mean": list(CLIP_MEAN), "image_std": list(CLIP_STD), "resample": 3, "rescale_factor": 1 / 255,
        "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor",
    }
    write_json(tmp_path / "preprocessor_config.json", config)
    spec = VisionPreprocessSpec.from_pretrained_dir(tmp_path, tiny_qwen25_config())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = Qwen2VLImageProcessorPil.from_pretrained(tmp_path, local_files_only=True)
    assert spec.family == "qwen2_5_vl"
    assert (spec.min_pixels, spec.max_pixels) == (hf.size["shortest_edge"], hf.size["longest_edge"])
    assert spec.image_mean == tuple(hf.image_mean) and spec.image_std == tuple(hf.image_std)
    assert (spec.patch_size, spec.temporal_patch_size, spec.merge_size) == (hf.patch_size, hf.temporal_patch_size,
                                                                            hf.merge_size)
    assert spec.resample == int(hf.resample) and spec.rescale_factor == hf.rescale_factor
    # Same pixels as HF's processor loaded from that directory.
    frame = random_frames(1, 64, 80, seed=5)[0]
    expected, _ = hf_image_pixels(hf, [frame])
    target = smart_resize(64, 80, spec.factor, spec.min_pixels, spec.max_pixels)
    assert np.abs(preprocess_image(frame, target, spec).pixel_values.numpy() - expected).max() <= 1e-5


def test_from_pretrained_dir_video_config_overrides_image_config(tmp_path):
    write_json(tmp_path / "preprocessor_config.json", {
        "size": {"shortest_edge": 65536, "longest_edge": 16777216}, "patch_size": 16,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "processor_class": "Qwen3VLProcessor"})
    write_json(tmp_path / "video_preprocessor_config.json", {
        "size": {"shortest_edge": 4096, "longest_edge": 25165824}, "fps": 1.5,
        "video_processor_type": "Qwen3VLVideoProcessor"})
    spec = VisionPreprocessSpec.from_pretrained_dir(tmp_path, {"model_type": "qwen3_vl", "vision_config": {}})
    assert spec.family == "qwen3_vl" and spec.pixel_limits_per_video
    assert (spec.min_pixels, spec.max_pixels, spec.target_fps) == (4096, 25165824, 1.5)
    assert (spec.patch_size, spec.image_mean) == (16, (0.5, 0.5, 0.5))


def test_from_pretrained_dir_falls_back_to_vision_config_and_config_json(tmp_path):
    q3 = Qwen3VLConfig(vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                                          out_hidden_size=32, patch_size=8, temporal_patch_size=3,
                                          spatial_merge_size=2, deepstack_visual_indexes=[0]),
                       text_config=dict(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, head_dim=16))
    spec = VisionPreprocessSpec.from_pretrained_dir(tmp_path, q3)  # no processor files at all
    assert (spec.family, spec.patch_size, spec.temporal_patch_size, spec.merge_size) == ("qwen3_vl", 8, 3, 2)
    assert spec == VisionPreprocessSpec.for_family("qwen3_vl", patch_size=8, temporal_patch_size=3)
    q3.save_pretrained(tmp_path)  # config.json only: read when no model config is passed
    assert VisionPreprocessSpec.from_pretrained_dir(tmp_path) == spec


def test_from_pretrained_dir_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        VisionPreprocessSpec.from_pretrained_dir(tmp_path / "nope", None)
    with pytest.raises(ValueError, match="model family"):
        VisionPreprocessSpec.from_pretrained_dir(tmp_path, {"model_type": "llava"})
    write_json(tmp_path / "preprocessor_config.json", {"patch_size": 16, "processor_class": "Qwen2_5_VLProcessor"})
    with pytest.raises(ValueError, match="contradicts vision_config.patch_size=14"):
        VisionPreprocessSpec.from_pretrained_dir(tmp_path, tiny_qwen25_config())
    (tmp_path / "preprocessor_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read processor config"):
        VisionPreprocessSpec.from_pretrained_dir(tmp_path, tiny_qwen25_config())


def test_disabled_rescale_and_normalize_become_identity(tmp_path):
    write_json(tmp_path / "preprocessor_config.json", {"do_rescale": False, "do_normalize": False})
    spec = VisionPreprocessSpec.from_pretrained_dir(tmp_path, {"model_type": "qwen2_5_vl"})
    frame = random_frames(1, 28, 28, seed=2)[0]
    pixels = preprocess_image(frame, (28, 28), spec).pixel_values
    assert sorted(set(pixels.flatten().tolist())) == sorted(set(frame.flatten().astype(float).tolist()))


@pytest.mark.parametrize(
    "overrides, message",
    [(dict(patch_size=0), "patch_size"), (dict(image_mean=(0.5, 0.5)), "image_mean"),
     (dict(image_std=(0.5, 0.0, 0.5)), "image_std"), (dict(min_pixels=10, max_pixels=5), "min_pixels"),
     (dict(resample=99), "resample"), (dict(family="llava"), "family")],
)
def test_spec_validation(overrides, message):
    with pytest.raises(ValueError, match=message):
        VisionPreprocessSpec.for_family("qwen2_5_vl", **overrides)


def test_resample_setting_is_used():
    spec = VisionPreprocessSpec.for_family("qwen2_5_vl", resample=int(Image.Resampling.NEAREST))
    frame = random_frames(1, 56, 56, seed=9)[0]
    nearest = preprocess_image(frame, (28, 28), spec).pixel_values
    bicubic = preprocess_image(frame, (28, 28), SPECS["qwen2_5_vl"]).pixel_values
    assert not torch.equal(nearest, bicubic)
