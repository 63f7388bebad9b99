"""End to end on a tiny Nemotron-H vision-language checkpoint (RADIO tower, Mamba2 / attention / MoE / MLP layers),
saved with transformers' own ``NemotronH_Omni_Reasoning_V3`` and read back as a user's checkpoint is.

Against vLLM 0.32's own code for this model (``helpers.nemotron_reference``: its processor's and model's functions,
read out of the installed files):

* the pixels of a clip equal ``video_to_pixel_values``'s (aspect-kept tile, torch's antialiased bicubic);
* the prompt before encoding equals vLLM's: the chat template tokenized whole, ``<video>`` (four text tokens here,
  as the released tokenizer has no such token) replaced by ``_get_prompt_repl_video``'s ids, lumped at q > 0;
* on our encoder's rows, ``_process_video_input`` keeps the same rows (its EVS over the tubelets, merge 1 after the
  shuffle), counts the same per tubelet, lays out the same ids and builds the same input embeddings as ours.

Against transformers: the encoder's rows equal ``get_video_features`` (1e-4); at q = 0 our greedy tokens equal
``generate`` on the pixels (its own merge), prefill logits within 1e-4; at q = 0.75 they equal transformers' language
model run by hand on vLLM's kept rows in vLLM's layout, chunked by 32 and by 64 (each its own export: the Mamba2
chunk loop is unrolled for the compiled length), on ONNX Runtime and the torch backend, the chunk boundaries inside
the video; transformers' own EVS (its forward with a pruning rate, square grids only) gives the same first logits;
four requests on two rows (each row reused, its Mamba2 state started clean) equal transformers request by request.
"""

from __future__ import annotations

import copy
import itertools
import json
import re
import warnings

import numpy as np
import pytest
import torch
from PIL import Image

from qeff_evs.bench.realistic import realistic_config
from qeff_evs.export.pipeline import ExportOptions, check_pruning_options
from qeff_evs.models.nemotron_h_omni import DEFAULT_MAX_TILES, NemotronHOmniFamily, patches_to_frames
from qeff_evs.models.pruning import VideoPruning
from qeff_evs.models.tiny import save_tiny_checkpoint
from qeff_evs.runtime.engine.executor import kept_count
from qeff_evs.runtime.engine.request import plan_prompt
from qeff_evs.runtime.engine.scheduler import SchedulerConfig
from qeff_evs.runtime.engine.serving import ServeRequest, ServingEngine
from qeff_evs.runtime.engine.single_request import Engine, EngineConfig
from qeff_evs.runtime.export_bundle import open_export
from qeff_evs.runtime.inputs.prompt import video_question_pieces
from qeff_evs.runtime.inputs.synthetic import moving_square_video
from qeff_evs.runtime.builders import answer_media
from qeff_evs.runtime.inputs.audio_features import audio_input
from qeff_evs.runtime.inputs.image_tiles import candidate_grids, choose_grid, tile_pixels
from qeff_evs.runtime.media import image_from_array, video_from_frames
from qeff_evs.runtime.sessions import sessions_for
from helpers.exports import export_quietly
from helpers.top_logits import assert_top_logits_match

nemotron = pytest.importorskip("helpers.nemotron_reference")

ATOL = 1e-4
Q = 0.75
STEPS = 16
QUESTION = "What happens in this video?"
TEXT_LAYERS = 6  # Mamba2, MoE, attention, Mamba2, MLP, MoE (tiny_layer_kinds)
RESOLUTIONS = ((64, 96), (64, 64))  # the tiny tile rule's sizes for 64x96 and square clips: 2x3 and 2x2 rows
CTX_LEN = 512
EXPORTS = {32: ExportOptions(Q, (8, 16), RESOLUTIONS, prefill_seq_len=32, ctx_len=CTX_LEN, full_batch_size=2),
           64: ExportOptions(Q, (8, 16), RESOLUTIONS, prefill_seq_len=64, ctx_len=CTX_LEN)}
# (frames, height, width, seed, source rate, source step): vLLM's loader metadata, int(1000 / fps) ms per frame.
CLIPS = {"long": (16, 64, 96, 3, 30.0, 15), "odd": (7, 64, 64, 5, 24.0, 12)}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_checkpoint("nemotron_h_omni", tmp_path_factory.mktemp("nemotron_checkpoint"),
                                text_layers=TEXT_LAYERS)


@pytest.fixture(scope="module")
def bundles(checkpoint, tmp_path_factory) -> dict:
    return {n: open_export(export_quietly(checkpoint, tmp_path_factory.mktemp(f"nemotron_export_{n}"), options))
            for n, options in EXPORTS.items()}


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    return NemotronHOmniFamily.model_class.from_pretrained(checkpoint, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def settings(checkpoint, hf_model):
    return nemotron.VllmSettings.of(hf_model.config, json.loads((checkpoint / "preprocessor_config.json").read_text()))


@pytest.fixture(scope="module")
def clips(bundles) -> dict:
    """``{name: (frames, vLLM metadata, MediaInput)}``."""
    out = {}
    for name, (count, height, width, seed, fps, step) in CLIPS.items():
        frames = moving_square_video(count, height, width, seed=seed)
        metadata = {"total_num_frames": count * step, "fps": fps, "frames_indices": list(range(0, count * step, step))}
        out[name] = (frames, metadata, video_from_frames(frames, metadata, bundles[32]))
    return out


@pytest.fixture(scope="module")
def sessions(bundles):
    return {(n, backend): sessions_for(bundle, backend) for n, bundle in bundles.items()
            for backend in ("ort", "torch", "openvino")}


@pytest.fixture(scope="module")
def references(hf_model, bundles, clips):
    tokenizer = bundles[32].tokenizer
    return {(name, q): nemotron.hf_reference(hf_model, tokenizer, QUESTION, clips[name][2], q, STEPS)
            for name in CLIPS for q in (0.0, Q)}


def make_engine(bundles, sessions, seq_len: int, backend: str, q: float) -> Engine:
    m = bundles[seq_len].manifest
    vision, language = sessions[(seq_len, backend)]
    config = EngineConfig(m.prefill_seq_len, m.ctx_len, m.user_vision_size, q, max_new_tokens=STEPS)
    return Engine(bundles[seq_len].family, vision, language, config)


# --------------------------------------------------------------------------------------------------
# the checkpoints: the tiny one saved and read back, the bench's realistic widths


def test_tiny_checkpoint_folder_and_realistic_widths(checkpoint, hf_model, bundles):
    for name in ("config.json", "model.safetensors", "tokenizer.json", "preprocessor_config.json",
                 "generation_config.json"):
        assert (checkpoint / name).is_file(), name
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["model_type"] == "nemotron_h_omni" and config["architectures"] == ["NemotronH_Omni_Reasoning_V3"]
    tokenizer = bundles[32].tokenizer
    assert config["image_token_id"] == tokenizer.convert_tokens_to_ids("<image>")
    assert len(tokenizer.encode("<video>", add_special_tokens=False)) > 1  # as in the released tokenizer: text
    assert hf_model.config.text_config.layers_block_type == [
        "linear_attention", "moe", "full_attention", "linear_attention", "mlp", "moe"]
    realistic = realistic_config("nemotron_h_omni", text_layers=3, vision_layers=2)
    text = realistic.text_config
    assert text.layers_block_type == ["linear_attention", "moe", "full_attention"]
    assert (text.hidden_size, text.mamba_num_heads, text.mamba_head_dim, text.n_groups, text.ssm_state_size) == (
        2688, 64, 64, 8, 128)
    assert (text.n_routed_experts, text.num_experts_per_tok, text.moe_intermediate_size,
            text.moe_shared_expert_intermediate_size, text.routed_scaling_factor) == (128, 6, 1856, 3712, 2.5)
    with torch.device("meta"):  # the real class builds (no memory)
        model = NemotronHOmniFamily.model_class(realistic)
    assert model.language_model.lm_head.weight.shape == (131072, 2688)


def test_realistic_widths_with_an_audio_encoder():
    """The bench's sound track: a Parakeet encoder at transformers' ParakeetEncoderConfig widths, as deep as asked;
    none unless asked; a family without audio refuses one."""
    from transformers import ParakeetEncoderConfig

    defaults = ParakeetEncoderConfig()
    realistic = realistic_config("nemotron_h_omni", text_layers=3, vision_layers=2, audio_layers=2)
    audio = realistic.audio_config
    assert (audio.hidden_size, audio.num_attention_heads, audio.intermediate_size, audio.num_mel_bins,
            audio.subsampling_conv_channels, audio.num_hidden_layers) == (
        defaults.hidden_size, defaults.num_attention_heads, defaults.intermediate_size, defaults.num_mel_bins,
        defaults.subsampling_conv_channels, 2)
    assert realistic.audio_token_id == NemotronHOmniFamily.tiny_tokenizer().convert_tokens_to_ids("<so_embedding>")
    assert realistic_config("nemotron_h_omni", text_layers=3, vision_layers=2).audio_config is None
    with pytest.raises(ValueError, match="qwen2_5_vl has no audio encoder"):
        realistic_config("qwen2_5_vl", audio_layers=2)


def test_the_checkpoints_own_pruning_rate_is_named_not_applied(checkpoint, tmp_path):
    """vLLM 0.34 takes the rate from --video-pruning-rate and the request, never from the config's
    video_pruning_rate (the released Omni config ships one): the export's default stays the flag's, and the export
    says so in one line."""
    import shutil

    from qeff_evs.export.pipeline import export_checkpoint

    shipped = tmp_path / "shipped"
    shutil.copytree(checkpoint, shipped)
    config = json.loads((shipped / "config.json").read_text())
    config["video_pruning_rate"] = 0.25
    (shipped / "config.json").write_text(json.dumps(config))
    said = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        export_checkpoint(shipped, tmp_path / "export", ExportOptions(Q, (8,), ((64, 64),), 32, CTX_LEN),
                          progress=said.append)
    assert [line for line in said if "video_pruning_rate" in line] == [
        f"the checkpoint's config ships video_pruning_rate 0.25; as in vLLM, the export's default is "
        f"--video-pruning-rate ({Q:g}) and a request may ask its own: pass --video-pruning-rate 0.25 to serve the "
        "checkpoint's"]
    assert open_export(tmp_path / "export").manifest.video_pruning_rate == Q


# --------------------------------------------------------------------------------------------------
# the export: the family's pruning, states and positions


def test_export_carries_evs_only_and_no_rope_table(bundles):
    m = bundles[32].manifest
    assert m.video_pruning_methods == ("evs",) and m.language_shape.rope_positions is None
    states = {state.name: state for state in m.language_shape.layer_states}
    assert states["conv_state"].layers == states["ssm_state"].layers == (0, 3)
    assert states["ssm_state"].precision == "float32" and states["conv_state"].precision == "float16"
    assert m.language_shape.kv_layers == (2,)
    node_precision = (bundles[32].export_dir / m.files["language_node_precision"]).read_text()
    assert "ssm_state" in node_precision  # the SSM state's path, and each MoE router's (sigmoid, bias, top-k)
    # each MoE layer's router (stamped graphs name a layer's nodes layers.N/, traced whole ones moe.N/)
    assert all(re.search(rf"(layers|moe)\.{i}/.*Sigmoid", node_precision)
               and re.search(rf"(layers|moe)\.{i}/.*GatherElements", node_precision) for i in (1, 5))
    with pytest.raises(ValueError, match="vLLM prunes nemotron_h_omni videos with evs only"):
        check_pruning_options(ExportOptions(Q, (8,), RESOLUTIONS, 32, CTX_LEN, video_pruning_methods=("vidcom2",)),
                              NemotronHOmniFamily.pruning_methods, "nemotron_h_omni")
    with pytest.raises(ValueError, match="evs only"):
        bundles[32].family.pruning_ranking("vidcom2")


# --------------------------------------------------------------------------------------------------
# vLLM's processor and model code on the same clip


@pytest.mark.parametrize("name", CLIPS)
def test_pixels_equal_vllm(clips, settings, name):
    frames, _, video = clips[name]
    ours = patches_to_frames(torch.as_tensor(video.pixel_values), video.grid_thw, 2, 16)
    theirs = nemotron.vllm_pixels(frames, settings)
    assert torch.equal(ours[:len(frames)], theirs)
    assert torch.equal(ours[len(frames):], theirs[-1:].expand(len(ours) - len(frames), -1, -1, -1))


@pytest.mark.parametrize("q", (0.0, Q))
@pytest.mark.parametrize("name", CLIPS)
def test_prompt_before_encoding_equals_vllm(bundles, clips, settings, name, q):
    frames, metadata, video = clips[name]
    bundle = bundles[32]
    pieces = video_question_pieces(bundle.tokenizer, QUESTION, bundle.family.token_strings)
    ours = plan_prompt(pieces, [video], [kept_count(bundle.family, video, VideoPruning("evs", q))], bundle.family)
    before, after = nemotron.prompt_with_video(bundle.tokenizer, QUESTION)
    placeholder = nemotron.vllm_placeholder_ids(bundle.tokenizer, frames, metadata, settings, q)
    assert ours.ids.tolist() == before + placeholder + after


@pytest.mark.parametrize("q", (0.0, Q))
@pytest.mark.parametrize("name", CLIPS)
def test_kept_rows_layout_and_embeddings_equal_vllm(bundles, sessions, hf_model, clips, settings, name, q):
    frames, metadata, video = clips[name]
    bundle = bundles[32]
    vision, _ = sessions[(32, "ort")]
    merged = vision.merged_rows(video)
    kept = vision.prune(video, merged, VideoPruning("evs", q))
    theirs = nemotron.vllm_video(hf_model, bundle.tokenizer, torch.from_numpy(merged.rows),
                                 nemotron.vllm_pixels(frames, settings), metadata, settings, q)
    np.testing.assert_array_equal(kept.kept_indices, torch.nonzero(theirs.mask).reshape(-1).numpy())
    layout = bundle.family.video_layout(video, kept.kept_indices)
    assert layout.ids.tolist() == theirs.ids
    t, h, w = bundle.family.merged_grid(video.grid_thw)
    assert np.bincount(kept.kept_indices // (h * w), minlength=t).tolist() == theirs.tokens_per_tubelet
    ids = torch.as_tensor(layout.ids)
    with torch.no_grad():
        embeddings = hf_model.get_input_embeddings()(ids)
    embeddings[ids == hf_model.config.image_token_id] = torch.from_numpy(kept.rows)
    assert torch.equal(embeddings, theirs.embeddings)
    if q and name == "long":  # (the odd clip's 4 tubelets keep one frame's rows: its floor)
        assert len(kept.kept_indices) < t * h * w and sum(c > 0 for c in theirs.tokens_per_tubelet) > 1


# --------------------------------------------------------------------------------------------------
# transformers


@pytest.mark.parametrize("name", CLIPS)
def test_encoder_rows_equal_transformers(sessions, hf_model, clips, name):
    _, _, video = clips[name]
    vision, _ = sessions[(32, "ort")]
    frames = patches_to_frames(torch.as_tensor(video.pixel_values), video.grid_thw, 2, 16)
    with torch.no_grad():
        reference = hf_model.get_video_features(frames).pooler_output
    np.testing.assert_allclose(vision.merged_rows(video).rows, reference.reshape(-1, reference.shape[-1]).numpy(),
                               rtol=0, atol=ATOL)


def transformers_video(hf_model, family, ids, video) -> dict:
    """transformers' video keyword arguments: its own tower's output as ``mm_encoder_outputs``. (Its forward fails
    on ``pixel_values_videos`` itself in 5.19: ``torch.cat`` of the one tensor ``get_video_features`` returns; it
    takes the same features through ``mm_encoder_outputs``, then merges and prunes them itself.)"""
    frames = family.hf_video_inputs(ids, video)["pixel_values_videos"]
    with torch.no_grad():
        features = hf_model.get_video_features(frames)
    return {"mm_encoder_outputs": {"video": type(features)(pooler_output=(features.pooler_output,))}}


def test_q0_equals_transformers_generate(bundles, sessions, hf_model, clips, references):
    """transformers' ``generate`` on the video (its own tower and merge) against the engine and the hand-run
    reference at q = 0."""
    _, _, video = clips["long"]
    ref = references[("long", 0.0)]
    family = bundles[32].family
    ids = torch.tensor([ref.ids])
    out = hf_model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                            **transformers_video(hf_model, family, ids, video), max_new_tokens=STEPS,
                            min_new_tokens=STEPS, do_sample=False, output_logits=True, return_dict_in_generate=True)
    hf_tokens = out.sequences[0, ids.shape[1]:].tolist()
    assert hf_tokens == ref.tokens and len(set(hf_tokens)) > 3
    # argmaxes that do not hinge on float noise: the tiny model's greedy steps are well separated
    assert min(float(step[0].topk(2).values.diff().abs()) for step in out.logits) > 1e-3
    engine = make_engine(bundles, sessions, 32, "ort", 0.0)
    prompt = engine.prepare(video_question_pieces(bundles[32].tokenizer, QUESTION, family.token_strings), [video])
    result = engine.generate(prompt, eos_ids=())
    assert result.generated_token_ids == hf_tokens
    assert_top_logits_match(result.prefill_top_logits, out.logits[0][0], ATOL)


@pytest.mark.parametrize("backend", ("ort", "torch", "openvino"))
@pytest.mark.parametrize("seq_len", sorted(EXPORTS))
@pytest.mark.parametrize("q", (0.0, Q))
def test_chunked_prefill_and_decode_equal_transformers(bundles, sessions, clips, references, seq_len, backend, q):
    _, _, video = clips["long"]
    ref = references[("long", q)]
    engine = make_engine(bundles, sessions, seq_len, backend, q)
    prompt = engine.prepare(video_question_pieces(bundles[seq_len].tokenizer, QUESTION,
                                                  bundles[seq_len].family.token_strings), [video])
    assert prompt.ids.tolist() == ref.ids
    np.testing.assert_array_equal(prompt.encoded[0].kept_indices, ref.kept)
    placeholder = prompt.placeholders[0]
    assert any(placeholder.offset < cut < placeholder.offset + placeholder.length
               for cut in range(seq_len, len(ref.ids), seq_len))
    result = engine.generate(prompt, eos_ids=())
    assert result.num_prefill_chunks == -(-len(ref.ids) // seq_len) >= 2
    assert result.generated_token_ids == ref.tokens
    assert_top_logits_match(result.prefill_top_logits, ref.first_logits, ATOL)


def test_transformers_own_evs_gives_the_same_first_logits(hf_model, bundles, clips, references):
    """transformers' forward prunes by itself when its model has a rate (square grids only): on the unpruned layout
    it drops the pruned ``<image>`` tokens, which leaves vLLM's layout; its last logits equal the hand-run
    reference's on vLLM's choice."""
    _, _, video = clips["odd"]
    unpruned = references[("odd", 0.0)].ids
    family = bundles[32].family
    ids = torch.tensor([unpruned])
    hf_model.video_pruning_rate = Q
    try:
        with torch.no_grad():
            logits = hf_model(input_ids=ids, **transformers_video(hf_model, family, ids, video)).logits[0, -1]
    finally:
        hf_model.video_pruning_rate = 0.0
    torch.testing.assert_close(logits, references[("odd", Q)].first_logits, rtol=0, atol=ATOL)


def test_continuous_batching_reused_rows_equal_transformers(bundles, sessions, hf_model, clips, references):
    """Four requests (two clips, two questions) through the serving engine over a 2-row export: the third and
    fourth start in rows whose Mamba2 states hold a finished request's. Each equals transformers alone."""
    bundle = bundles[32]
    m = bundle.manifest
    vision, language = sessions[(32, "ort")]
    starts: list[int] = []  # the row of each prefill chunk that holds a request's first token

    class Recording:
        shape = language.shape

        def prefill(self, cache_row, step):
            if int(step.position_ids[0, 0, 0]) == 0:
                starts.append(cache_row)
            return language.prefill(cache_row, step)

        def decode(self, rows, pad_token_id: int = 0):
            return language.decode(rows, pad_token_id)

    scheduler = SchedulerConfig(max_num_batched_tokens=2 * m.prefill_seq_len, max_num_seqs=2,
                                prefill_seq_len=m.prefill_seq_len, ctx_len=m.ctx_len, encoder_compute_budget=512,
                                encoder_cache_size=512)
    engine = ServingEngine(bundle.family, vision, Recording(), EngineConfig(m.prefill_seq_len, m.ctx_len,
                                                                            m.user_vision_size, Q), scheduler)
    requests = {"a": ("long", QUESTION), "b": ("odd", QUESTION), "c": ("odd", "Describe the video in detail."),
                "d": ("long", "Where")}
    expected = {}
    for request_id, (clip, question) in requests.items():
        video = clips[clip][2]
        ref = references.get((clip, Q)) if question == QUESTION else \
            nemotron.hf_reference(hf_model, bundle.tokenizer, question, video, Q, STEPS)
        expected[request_id] = ref.tokens
        engine.add_request(ServeRequest(request_id, video_question_pieces(bundle.tokenizer, question,
                                                                          bundle.family.token_strings),
                                        [video], max_new_tokens=STEPS))
    outputs = engine.run_to_completion()
    assert len(starts) == 4 and sorted(set(starts)) == [0, 1], starts
    for request_id, tokens in expected.items():
        assert outputs[request_id] == tokens, request_id


# --------------------------------------------------------------------------------------------------
# images, as vLLM 0.34 tiles them (its tiler mode: force_image_size tiles, a thumbnail)

# (height, width): wide, tall, small (upscaled to many tiles), one tile, exact aspect ties between grids of
# different sizes (5:4 lies halfway between 1:1 and 3:2; 3:4 between 1:2 and 1:1), a large photo's shape.
IMAGE_SIZES = ((100, 150), (300, 30), (50, 40), (64, 64), (100, 125), (1000, 1250), (120, 90), (90, 160),
               (1080, 1920), (7, 300))
MAX_TILES = (1, 2, 6, DEFAULT_MAX_TILES)


def random_image(height: int, width: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)


def test_tile_grids_equal_vllms_tiler(bundles):
    tiling = bundles[32].family.image_tiling()
    ratios, targets = nemotron.TILER["get_internvl_target_ratios"], nemotron.TILER["calculate_internvl_targets"]
    for limit in range(1, 25):
        assert candidate_grids(limit) == ratios(1, limit)
    sizes = [*IMAGE_SIZES, *((h, w) for h in range(1, 200, 7) for w in range(1, 200, 11))]
    for (height, width), limit in itertools.product(sizes, MAX_TILES):
        grid = choose_grid(width, height, tiling, limit)
        blocks, target_width, target_height = targets(orig_width=width, orig_height=height,
                                                      target_ratios=ratios(1, limit), image_size=tiling.tile_size,
                                                      use_thumbnail=True)
        assert (grid.tiles, grid.columns * tiling.tile_size, grid.rows * tiling.tile_size) == \
            (blocks, target_width, target_height), (height, width, limit)


@pytest.mark.parametrize("limit", MAX_TILES)
def test_image_pixels_and_prompt_equal_vllms_processor(bundles, settings, limit):
    """Tiles (raster, the thumbnail last) equal vLLM's ``dynamic_preprocess``; the ``<image>`` replacement equals
    ``get_image_repl`` of ``get_num_image_tokens`` (one ``<img>``, every tile's pads, ``</img>``)."""
    bundle = bundles[32]
    tiling = bundle.family.image_tiling()
    for seed, (height, width) in enumerate(IMAGE_SIZES[:6]):
        image = random_image(height, width, seed)
        tiles, grid = tile_pixels(image, tiling, bundle.preprocess, limit)
        theirs = nemotron.vllm_image_pixels(Image.fromarray(image), tiling.tile_size, limit, settings)
        np.testing.assert_allclose(tiles, theirs.numpy(), rtol=0, atol=1e-6)
        media = image_from_array(image, bundle, {"max_num_tiles": limit})
        assert media.grid_thw == (grid.tiles, 4, 4)
        ids = bundle.family.placeholder_ids(media, kept_count(bundle.family, media, VideoPruning("evs", Q)))
        assert ids.tolist() == nemotron.vllm_image_ids(bundle.tokenizer, width, height, tiling.tile_size, limit,
                                                       settings)


def test_image_rows_equal_transformers(sessions, hf_model, bundles):
    """The image encoder's rows equal transformers' tower on each tile (its image patch projection) and its
    projector, 1e-4; the video encoder's would not (another first layer)."""
    image = random_image(100, 150, 1)
    media = image_from_array(image, bundles[32])
    tiles, _ = tile_pixels(image, bundles[32].family.image_tiling(), bundles[32].preprocess)
    with torch.no_grad():
        reference = nemotron.hf_image_rows(hf_model, torch.from_numpy(tiles)).numpy()
    for backend in ("ort", "torch", "openvino"):
        vision, _ = sessions[(32, backend)]
        np.testing.assert_allclose(vision.merged_rows(media).rows, reference, rtol=0, atol=ATOL)


def assert_generate_equals(hf_model, result, **media) -> None:
    """transformers' greedy ``generate`` of STEPS tokens on ``result``'s prompt ids with ``media`` (its own media
    inputs) gives ``result``'s tokens (not one repeated) and, within ATOL, its first logits."""
    ids = torch.tensor([result.prompt_token_ids])
    out = hf_model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **media, max_new_tokens=STEPS,
                            min_new_tokens=STEPS, do_sample=False, output_logits=True, return_dict_in_generate=True)
    hf_tokens = out.sequences[0, ids.shape[1]:].tolist()
    assert result.generated_token_ids == hf_tokens and len(set(hf_tokens)) > 3
    assert_top_logits_match(result.prefill_top_logits, out.logits[0][0], ATOL)


def test_an_image_equals_transformers_generate(bundles, sessions, hf_model):
    """transformers' ``generate`` on an image's tiles (its packed image path: each tile an image of its own grid,
    its own merge) equals the engine's tokens and first logits."""
    bundle = bundles[32]
    image = random_image(100, 150, 1)
    media = image_from_array(image, bundle)
    tiles, _ = tile_pixels(image, bundle.family.image_tiling(), bundle.preprocess)
    engine = make_engine(bundles, sessions, 32, "ort", 0.0)
    result = answer_media(bundle, engine, [media], QUESTION)
    assert_generate_equals(hf_model, result, pixel_values=torch.as_tensor(media.pixel_values),
                           image_grid_hw=torch.tensor([[4, 4]] * len(tiles)))


@pytest.fixture(scope="module")
def image_requests(bundles, hf_model, settings, clips):
    """Two images and the odd clip in one turn, with transformers' answers at q 0 and Q."""
    bundle = bundles[32]
    tiling = bundle.family.image_tiling()
    images = [random_image(100, 150, 1), random_image(50, 40, 2)]
    media = [image_from_array(image, bundle) for image in images] + [clips["long"][2]]
    tiles = [(torch.from_numpy(tile_pixels(image, tiling, bundle.preprocess)[0]),
              nemotron.vllm_image_ids(bundle.tokenizer, image.shape[1], image.shape[0], tiling.tile_size,
                                      DEFAULT_MAX_TILES, settings)) for image in images]
    references = {q: nemotron.hf_reference_images(hf_model, bundle.tokenizer, QUESTION, tiles, media[-1], q, STEPS)
                  for q in (0.0, Q)}
    return media, references


@pytest.mark.parametrize("backend", ("ort", "torch"))
@pytest.mark.parametrize("seq_len", sorted(EXPORTS))
@pytest.mark.parametrize("q", (0.0, Q))
def test_images_and_a_video_chunked_equal_transformers(bundles, sessions, image_requests, seq_len, backend, q):
    """Two images then a video in one turn, chunked by 32 and by 64 (cuts inside the images' rows): the prompt is
    vLLM's (the video pruned at q, the images never), tokens and first logits transformers'."""
    media, references = image_requests
    ref = references[q]
    engine = make_engine(bundles, sessions, seq_len, backend, q)
    result = answer_media(bundles[seq_len], engine, media, QUESTION)
    assert result.prompt_token_ids == ref.ids
    image_pads = sum(int(np.prod(m.grid_thw)) // 4 for m in media[:2])
    assert sum(map(sum, result.kept_tokens_per_frame)) == image_pads + len(ref.kept)
    assert result.num_prefill_chunks == -(-len(ref.ids) // seq_len) >= 3
    assert result.generated_token_ids == ref.tokens
    assert_top_logits_match(result.prefill_top_logits, ref.first_logits, ATOL)


def test_image_refusals(bundles, tmp_path, checkpoint):
    bundle = bundles[32]
    with pytest.raises(ValueError, match=r"max_num_tiles must be a positive int, got 0"):
        image_from_array(random_image(20, 20, 0), bundle, {"max_num_tiles": 0})
    family = NemotronHOmniFamily(bundle.family.config, bundle.tokenizer)
    dynamic = copy.deepcopy(bundle.family.config)
    dynamic.vision_config.args = {"min_num_patches": 1024, "max_num_patches": 13312}
    with pytest.raises(ValueError, match="dynamic resolution"):
        NemotronHOmniFamily(dynamic, bundle.tokenizer).image_tiling()
    untiled = copy.deepcopy(bundle.family.config)
    del untiled.force_image_size
    untiled.force_image_size = None
    with pytest.raises(ValueError, match="no force_image_size"):
        NemotronHOmniFamily(untiled, bundle.tokenizer).image_tiling()
    assert family.image_tiling().grid_hw == (4, 4)


# --------------------------------------------------------------------------------------------------
# audio: vLLM 0.34's Parakeet extractor and prompt, transformers' audio tower; the sound of a video

# Below vLLM's 0.1 s floor, 96 frames (transformers' own count: one row more), 100, 230, two clips (30 s + 1.2 s).
AUDIO_SECONDS = (0.05, 0.96, 1.0, 2.3, 31.2)


def waveform(seconds: float, seed: int) -> np.ndarray:
    """A tone under noise at 16 kHz, float32 in about [-1, 1]."""
    t = np.arange(int(round(16000 * seconds))) / 16000
    noise = np.random.default_rng(seed).standard_normal(t.shape)
    return (0.4 * np.sin(2 * np.pi * (220 + 40 * seed) * t) + 0.1 * noise).astype(np.float32)


@pytest.fixture(scope="module")
def extractor(hf_model):
    return nemotron.vllm_extractor(hf_model.config.audio_config)


@pytest.mark.parametrize("seconds", AUDIO_SECONDS)
def test_audio_features_and_prompt_equal_vllms_extractor(bundles, extractor, seconds):
    """Clips, each clip's frames and normalised log-mel features (1e-5) equal ``ParakeetExtractor``'s; the
    ``<so_embedding>`` replacement equals ``get_audio_repl`` (``<so_start>``, vLLM's count of pads, ``<so_end>``)."""
    bundle = bundles[32]
    wave = waveform(seconds, 1)
    media = audio_input(wave, bundle.family.audio_features())
    theirs = extractor([wave])
    frames = theirs["feature_attention_mask"].sum(dim=1).tolist()
    assert theirs["audio_num_clips"] == [len(media.clip_frames)] and list(media.clip_frames) == frames
    ours = np.split(np.asarray(media.pixel_values), np.cumsum(frames)[:-1])
    for clip, features, count in zip(ours, theirs["input_audio_features"], frames):
        np.testing.assert_allclose(clip, features[:count].numpy(), rtol=0, atol=1e-5)
        assert not features[count:].any()  # vLLM's padding is zeros, as the graph's
    ids = bundle.family.placeholder_ids(media, kept_count(bundle.family, media, VideoPruning("evs", Q)))
    assert ids.tolist() == nemotron.vllm_audio_ids(bundle.tokenizer, extractor, wave)
    assert len(ids) - 2 == extractor.audio_token_count(len(wave))


def test_audio_rows_equal_transformers(sessions, hf_model, bundles, extractor):
    """The audio encoder's rows (each clip padded to its frame bucket) equal transformers' audio tower and projector
    on vLLM's features, cut to vLLM's counts, 1e-4: at 0.96 s (96 frames; transformers' ``get_audio_features``
    would keep 13 rows, vLLM 12) and for two clips."""
    for seconds in (0.96, 31.2):
        wave = waveform(seconds, 2)
        media = audio_input(wave, bundles[32].family.audio_features())
        with torch.no_grad():
            reference = nemotron.hf_audio_rows(hf_model, extractor, wave).numpy()
        assert reference.shape[0] == extractor.audio_token_count(len(wave))
        for backend in ("ort", "torch", "openvino"):
            vision, _ = sessions[(32, backend)]
            np.testing.assert_allclose(vision.merged_rows(media).rows, reference, rtol=0, atol=ATOL)


def test_an_audio_clip_equals_transformers_generate(bundles, sessions, hf_model):
    """transformers' ``generate`` on the clip's features (230 frames: its count and vLLM's agree) equals the
    engine's tokens and first logits."""
    bundle = bundles[32]
    wave = waveform(2.3, 3)
    media = audio_input(wave, bundle.family.audio_features())
    engine = make_engine(bundles, sessions, 32, "ort", 0.0)
    result = answer_media(bundle, engine, [media], QUESTION)
    features = torch.as_tensor(media.pixel_values)[None]
    assert_generate_equals(hf_model, result, input_features=features,
                           input_features_mask=torch.ones(features.shape[:2], dtype=torch.int64))


@pytest.fixture(scope="module")
def audio_requests(bundles, hf_model, extractor, clips):
    """An audio clip alone (0.96 s), and the long clip with its sound (2.3 s, ``use_audio_in_video``) after an
    audio clip: their media and transformers' answers at q 0 and Q."""
    bundle = bundles[32]
    features = bundle.family.audio_features()
    speech, sound = waveform(0.96, 4), waveform(2.3, 5)
    video = clips["long"][2]
    requests = {
        "audio": ([audio_input(speech, features)], False, [("audio", speech)], None),
        "video_with_sound": ([audio_input(speech, features), video, audio_input(sound, features)], True,
                             [("audio", speech), ("video", video)], sound),
    }
    return {name: (media, in_video, {q: nemotron.hf_reference_turn(hf_model, bundle.tokenizer, extractor, QUESTION,
                                                                   parts, q, STEPS, sound_after_video=after)
                                     for q in (0.0, Q)})
            for name, (media, in_video, parts, after) in requests.items()}


@pytest.mark.parametrize("backend", ("ort", "torch"))
@pytest.mark.parametrize("seq_len", sorted(EXPORTS))
@pytest.mark.parametrize("q", (0.0, Q))
@pytest.mark.parametrize("name", ("audio", "video_with_sound"))
def test_audio_and_video_sound_chunked_equal_transformers(bundles, sessions, audio_requests, name, seq_len,
                                                          backend, q):
    """An audio clip, and an audio clip then a video with its sound (vLLM's layout: the video block, then the
    sound's), chunked by 32 and by 64: the prompt is vLLM's (the video pruned at q, audio never), tokens and first
    logits transformers'."""
    media, in_video, references = audio_requests[name]
    ref = references[q]
    engine = make_engine(bundles, sessions, seq_len, backend, q)
    result = answer_media(bundles[seq_len], engine, media, QUESTION, use_audio_in_video=in_video)
    assert result.prompt_token_ids == ref.ids
    assert result.num_prefill_chunks == -(-len(ref.ids) // seq_len)
    assert result.generated_token_ids == ref.tokens
    assert_top_logits_match(result.prefill_top_logits, ref.first_logits, ATOL)


def test_audio_refusals(bundles, clips, tmp_path):
    from qeff_evs.runtime.inputs.audio_features import audio_from_file, use_audio_in_video, waveform_at_rate

    features = bundles[32].family.audio_features()
    with pytest.raises(ValueError, match=r"sampled at 44100 Hz; .* takes 16000 Hz .* ffmpeg -i IN -ar 16000"):
        waveform_at_rate(np.zeros(441, dtype=np.float32), 44100, features, "clip.wav")
    with pytest.raises(ValueError, match="finite mono waveform"):
        audio_input(np.full(1600, np.nan, dtype=np.float32), features)
    (tmp_path / "not.wav").write_text("hello")
    with pytest.raises(ValueError, match="not.wav: no audio can be read from it"):
        audio_from_file(tmp_path / "not.wav", features)
    with pytest.raises(ValueError, match="use_audio_in_video must be true or false, got 'yes'"):
        use_audio_in_video({"use_audio_in_video": "yes"})
    with pytest.raises(ValueError, match="each video needs its sound"):
        answer_media(bundles[32], None, [clips["odd"][2], audio_input(waveform(1.0, 0), features),
                                         clips["long"][2]], QUESTION, use_audio_in_video=True)


def test_a_checkpoint_without_sound_config_serves_no_audio(hf_model, bundles):
    """As in vLLM, an Omni config without a sound config has no audio: no features, no audio graph asked for, and an
    audio item refused in one line (the video and image paths unchanged)."""
    from qeff_evs.export.pipeline import _audio_features

    config = copy.deepcopy(hf_model.config)
    config.audio_config = None
    family = NemotronHOmniFamily(config, bundles[32].tokenizer)
    assert family.audio_features() is None
    said = []
    assert _audio_features(family, said.append) is None
    assert said == ["no audio encoder graph: this checkpoint's config has no sound_config (it serves no audio)"]
    with pytest.raises(ValueError, match="no sound_config: it serves no audio, as in vLLM"):
        family._audio_ids(audio_input(waveform(1.0, 0), bundles[32].family.audio_features()))


def test_run_takes_images_audio_and_a_videos_sound(bundles, tmp_path, capsys):
    """``qeff-evs run --image --audio --video`` with ``use_audio_in_video`` equals ``answer_media`` on the same
    files (images, audio, the video, its soundtrack); refusals are one line."""
    import wave

    from qeff_evs.bench.serving import write_video
    from qeff_evs.cli import main
    from qeff_evs.runtime.inputs.audio_features import audio_from_file, video_sound
    from qeff_evs.runtime.media import video_from_file

    bundle = bundles[32]
    image = tmp_path / "image.png"
    Image.fromarray(random_image(50, 70, 3)).save(image)
    speech = tmp_path / "speech.wav"
    with wave.open(str(speech), "wb") as out:
        out.setnchannels(1), out.setsampwidth(2), out.setframerate(16000)
        out.writeframes(np.round(waveform(0.7, 6) * 32767).astype("<i2").tobytes())
    clip = write_video(tmp_path / "clip.mkv", moving_square_video(6, 64, 96, seed=2), 2, sound=waveform(1.5, 7))
    argv = ["run", bundle.export_dir, "--backend", "ort", "--max-new-tokens", "4", "--prompt", QUESTION, "--json",
            "--image", image, "--audio", speech, "--video", clip,
            "--mm-processor-kwargs", json.dumps({"use_audio_in_video": True})]
    capsys.readouterr()
    assert main([str(a) for a in argv]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    features = bundle.family.audio_features()
    media = [image_from_array(np.asarray(Image.open(image).convert("RGB")), bundle),
             audio_from_file(speech, features), video_from_file(clip, bundle), video_sound(clip, features)]
    engine = Engine(bundle.family, *sessions_for(bundle, "ort"),
                    EngineConfig(bundle.manifest.prefill_seq_len, bundle.manifest.ctx_len,
                                 bundle.manifest.user_vision_size, Q, max_new_tokens=4))
    expected = answer_media(bundle, engine, media, QUESTION, use_audio_in_video=True)
    assert got["prompt_token_ids"] == expected.prompt_token_ids
    assert got["generated_token_ids"] == expected.generated_token_ids
    sound = bundle.family.special_tokens().audio_pad
    assert expected.prompt_token_ids.count(sound) == 9 + 19  # 0.7 s and 1.5 s: vLLM's counts

    def refused(*extra) -> tuple[int, str]:
        code = main([str(a) for a in ["run", bundle.export_dir, "--prompt", QUESTION, *extra]])
        return code, capsys.readouterr().err

    code, err = refused("--image", image, "--mm-processor-kwargs", json.dumps({"use_audio_in_video": True}))
    assert code != 0 and "use_audio_in_video reads the --video file's soundtrack; give --video" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
