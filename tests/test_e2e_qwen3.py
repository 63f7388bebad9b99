"""End to end on a tiny Qwen3-VL: checkpoint folder -> export -> engine, against transformers.

* q = 0: the engine's greedy tokens equal transformers' own ``generate`` on the same prompt ids
  (the chat template with HF 5.x's per-frame expansion inside the outer vision markers) and the
  same pixel values, with ``mm_token_type_ids``; one video, and two videos plus an image.
* q > 0: the reference is transformers run by hand on the REAL pruned layout: the stock HF vision
  tower, ``evs.retention_mask`` over ``[merger | deepstack]``, merged rows and deepstack rows at the
  pruned prompt's pads (HF's text model with ``visual_pos_masks`` / ``deepstack_visual_embeds`` and
  explicit 3-row positions: ``get_rope_index`` of the unpruned prompt restricted to the kept
  tokens), greedy with HF's ``DynamicCache``.
* Chunked prefill: S in {8, 16, 64}, and chunk boundaries forced inside a timestamp, right after a
  ``<|vision_start|>``, between two frames, and one chunk holding two videos and an image, all give
  the single-chunk tokens (and the reference's).
* ONNX Runtime and the PyTorch reference backend agree.

The reference prompt ids are built here (and by ``helpers.qwen3_reference``) from the tokenizer,
transformers' ``replace_video_token`` and the HF frame sampler's indices, not by the package.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3VLForConditionalGeneration

from qeff_evs import evs
from qeff_evs.bench.hf_reference import greedy_by_hand
from qeff_evs.export.pipeline import ExportOptions
from qeff_evs.models.tiny import save_tiny_checkpoint
from qeff_evs.runtime.engine.single_request import Engine, EngineConfig
from qeff_evs.runtime.inputs.prompt import video_question_pieces
from qeff_evs.runtime.engine.request import PromptPiece
from qeff_evs.runtime.builders import answer, stop_ids
from qeff_evs.runtime.export_bundle import open_export
from qeff_evs.runtime.media import image_from_array
from qeff_evs.runtime.sessions import sessions_for
from qeff_evs.runtime.backends.openvino import OpenVinoLanguageSession
from qeff_evs.runtime.backends.ort import OrtLanguageSession
from qeff_evs.runtime.backends.torch_reference import TorchLanguageSession
from helpers.exports import export_quietly
from helpers.qwen3_reference import hf_video_ids
from helpers.sampled_clips import Clip, sampled_clips
from helpers.top_logits import assert_top_logits_match

ATOL = 1e-4
DECODE_STEPS = 10
BACKENDS = ("ort", "torch", "openvino")  # openvino: the same graphs as ort, on OpenVINO
PRUNING_RATES = (0.3, 0.5, 0.75)  # 0.75 keeps exactly one frame's worth: later frames keep nothing
QUESTION = "What happens in this video?"

# 64x96 px = 4x6 patches of 16 = 2x3 merged tokens per temporal patch; 96x96 = 3x3 merged.
EXPORT_OPTIONS = ExportOptions(video_pruning_rate=0.5, frames=(4, 8), resolutions=((64, 96), (96, 96)),
                               prefill_seq_len=32, ctx_len=512, user_vision_size=48)


# A: 8 frames at 2 fps -> all 8, times 0.0, 0.5, ...; B: 12 frames at 3 fps -> 8 of them, uneven times.
CLIP_A = Clip("a", 8, 70, 100, seed=3, source_fps=2.0)
CLIP_B = Clip("b", 12, 100, 100, seed=5, source_fps=3.0)
IMAGE_SEED = 11


# --------------------------------------------------------------------------------------------------
# fixtures: one checkpoint, one export, for the whole module


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return save_tiny_checkpoint("qwen3_vl", tmp_path_factory.mktemp("q3_checkpoint"), seed=0)


@pytest.fixture(scope="module")
def export_dir(checkpoint, tmp_path_factory) -> Path:
    return export_quietly(checkpoint, tmp_path_factory.mktemp("q3_export"), EXPORT_OPTIONS)


@pytest.fixture(scope="module")
def bundle(export_dir):
    return open_export(export_dir)


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    return Qwen3VLForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(bundle):
    return bundle.tokenizer


@pytest.fixture(scope="module")
def sessions(bundle):
    return {backend: sessions_for(bundle, backend) for backend in BACKENDS}


@pytest.fixture(scope="module")
def clips(tmp_path_factory, bundle):
    """``{name: (MediaInput, HF frame indices, source fps)}`` for both clips."""
    return sampled_clips(tmp_path_factory.mktemp("q3_clips"), (CLIP_A, CLIP_B), bundle)


@pytest.fixture(scope="module")
def image(bundle):
    rng = np.random.default_rng(IMAGE_SEED)
    return image_from_array(rng.integers(0, 256, size=(90, 100, 3), dtype=np.uint8), bundle)


def make_engine(bundle, sessions, backend: str, q: float, seq_len: int | None = None,
                vision_size: int | None = None) -> Engine:
    """An engine over the module's sessions; another window size or chunk length gets its own language session
    over the same graph (``vision_size`` and ``seq_len`` are symbols of the language graph), whose shape states the
    one chunk length this engine sends."""
    m = bundle.manifest
    seq_len = seq_len or m.prefill_seq_len
    vision_size = vision_size or max(seq_len, m.user_vision_size)
    config = EngineConfig(seq_len, m.ctx_len, vision_size, q, max_new_tokens=DECODE_STEPS)
    vision, language = sessions[backend]
    if vision_size != language.shape.vision_size or seq_len not in language.shape.prefill_lens:
        shape = dataclasses.replace(language.shape, vision_size=vision_size, prefill_lens=(seq_len,))
        if backend == "ort":
            language = OrtLanguageSession(m.path(bundle.export_dir, "language"), shape)
        elif backend == "openvino":
            language = OpenVinoLanguageSession(m.path(bundle.export_dir, "language"), shape)
        else:
            language = TorchLanguageSession(language.module, shape)
    return Engine(bundle.family, vision, language, config)


# --------------------------------------------------------------------------------------------------
# the reference prompt, as transformers builds it


@dataclasses.dataclass
class HFMedia:
    kind: str  # "video" | "image"
    pixel_values: torch.Tensor
    grid_thw: tuple[int, int, int]
    frame_indices: list[int] = dataclasses.field(default_factory=list)
    fps: float = 1.0


def hf_media_ids(media: HFMedia, tokenizer, config) -> list[int]:
    """The unpruned token ids transformers puts where the template's media pad was."""
    merge = config.vision_config.spatial_merge_size
    if media.kind == "image":
        t, h, w = media.grid_thw
        return [config.image_token_id] * (t * h * w // merge**2)
    return hf_video_ids(tokenizer, config, media.grid_thw, media.frame_indices, media.fps)


def split_template(tokenizer, content: list[dict]) -> list[list[int] | int]:
    """The chat template rendered for ``content``, split at its media pads: text ids and media slots."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)
    parts, slot = [], 0
    for piece in text.replace("<|image_pad|>", "<|video_pad|>").split("<|video_pad|>"):
        parts.append(tokenizer.encode(piece, add_special_tokens=False) if piece else [])
        parts.append(slot)
        slot += 1
    return parts[:-1]


def our_pieces(template: list[list[int] | int]) -> list[PromptPiece]:
    return [PromptPiece(media_item=p) if isinstance(p, int) else PromptPiece(ids=tuple(p)) for p in template]


# --------------------------------------------------------------------------------------------------
# the reference model run


@dataclasses.dataclass
class Reference:
    ids: list[int]  # the prompt transformers sees (pruned layout when q > 0)
    positions: np.ndarray  # (3, N)
    kept: list[np.ndarray]  # per video
    tokens: list[int]
    first_logits: torch.Tensor


def evs_cut_margin(scored: torch.Tensor, grid_thw, merge: int, k: int) -> float:
    """Gap between the K-th and (K+1)-th dissimilarity (test-side), to rule out float-noise flips."""
    t, h, w = grid_thw[0], grid_thw[1] // merge, grid_thw[2] // merge
    frames = scored.reshape(t, h * w, -1)
    dissimilarity = torch.cat([torch.full((1, h * w), 255.0), 1 - F.cosine_similarity(frames[1:], frames[:-1], dim=-1)])
    ranked = dissimilarity.reshape(-1).sort(descending=True).values
    return float("inf") if k >= ranked.numel() else float(ranked[k - 1] - ranked[k])


def hf_reference(model, tokenizer, template, media: list[HFMedia], q: float, steps: int) -> Reference:
    config = model.config
    merge = config.vision_config.spatial_merge_size
    pads = (config.image_token_id, config.video_token_id)
    unpruned_ids, keep, rows, deep_rows, kept = [], [], [], [], []
    for part in template:
        if not isinstance(part, int):
            unpruned_ids += part
            keep += [True] * len(part)
            continue
        item = media[part]
        with torch.no_grad():
            out = model.model.visual(item.pixel_values, grid_thw=torch.tensor([item.grid_thw]))
        merged, levels = out.pooler_output, list(out.deepstack_features)
        mask = torch.ones(merged.shape[0], dtype=torch.bool)
        if item.kind == "video":
            scored = torch.cat([merged, *levels], dim=-1)  # vLLM scores [merger | deepstack]
            mask = evs.retention_mask(scored, item.grid_thw, merge, q)
            assert evs_cut_margin(scored, item.grid_thw, merge, int(mask.sum())) > 1e-4, "EVS cut on a near-tie"
            kept.append(torch.nonzero(mask).reshape(-1).numpy())
        ids = hf_media_ids(item, tokenizer, config)
        item_keep = np.ones(len(ids), dtype=bool)
        item_keep[np.isin(ids, pads)] = mask.numpy()
        unpruned_ids += ids
        keep += item_keep.tolist()
        rows.append(merged[mask])
        deep_rows.append(torch.stack([level[mask] for level in levels]))

    ids_t = torch.tensor([unpruned_ids])
    token_types = torch.zeros_like(ids_t, dtype=torch.int32)
    token_types[ids_t == config.image_token_id] = 1
    token_types[ids_t == config.video_token_id] = 2
    grids = {kind: [list(m.grid_thw) for m in media if m.kind == kind] for kind in ("image", "video")}
    unpruned_positions, _ = model.model.get_rope_index(
        ids_t, mm_token_type_ids=token_types,
        image_grid_thw=torch.tensor(grids["image"]) if grids["image"] else None,
        video_grid_thw=torch.tensor(grids["video"]) if grids["video"] else None)
    keep_t = torch.tensor(keep)
    ids = ids_t[:, keep_t]
    positions = unpruned_positions[:, :, keep_t]

    is_media = torch.isin(ids, torch.tensor(pads))
    with torch.no_grad():
        embeds = model.model.language_model.embed_tokens(ids).clone()
        embeds[is_media] = torch.cat(rows)  # media rows in prompt order
        deepstack = list(torch.cat(deep_rows, dim=1))  # per level: (num media tokens, hidden)
    first_logits, tokens = greedy_by_hand(model, embeds, positions, int(unpruned_positions.max()) + 1, steps,
                                          visual_pos_masks=is_media, deepstack_visual_embeds=deepstack)
    return Reference(ids[0].tolist(), positions[:, 0].numpy(), kept, tokens, first_logits)


def hf_generate(model, tokenizer, template, media: list[HFMedia], steps: int):
    """Transformers' own ``generate`` (greedy, the checkpoint's eos ids) on the unpruned prompt."""
    config = model.config
    ids = []
    for part in template:
        ids += hf_media_ids(media[part], tokenizer, config) if isinstance(part, int) else part
    ids_t = torch.tensor([ids])
    token_types = torch.zeros_like(ids_t, dtype=torch.int32)
    token_types[ids_t == config.image_token_id] = 1
    token_types[ids_t == config.video_token_id] = 2
    kwargs = {}
    videos = [m for m in media if m.kind == "video"]
    images = [m for m in media if m.kind == "image"]
    if videos:
        kwargs.update(pixel_values_videos=torch.cat([m.pixel_values for m in videos]),
                      video_grid_thw=torch.tensor([list(m.grid_thw) for m in videos]))
    if images:
        kwargs.update(pixel_values=torch.cat([m.pixel_values for m in images]),
                      image_grid_thw=torch.tensor([list(m.grid_thw) for m in images]))
    with torch.no_grad():
        out = model.generate(input_ids=ids_t, attention_mask=torch.ones_like(ids_t), mm_token_type_ids=token_types,
                             max_new_tokens=steps, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, **kwargs)
    return ids, out.sequences[0, ids_t.shape[1]:].tolist(), out.logits[0][0]


# --------------------------------------------------------------------------------------------------
# prompts: one video with the question; two videos and an image


def as_hf(video, indices=(), fps=1.0) -> HFMedia:
    return HFMedia(video.kind, video.pixel_values, tuple(video.grid_thw), list(indices), fps)


@pytest.fixture(scope="module")
def single(clips, tokenizer):
    video, indices, fps = clips["a"]
    template = split_template(tokenizer, [{"type": "video"}, {"type": "text", "text": QUESTION}])
    return template, [video], [as_hf(video, indices, fps)]


@pytest.fixture(scope="module")
def multi(clips, image, tokenizer):
    (a, ia, fa), (b, ib, fb) = clips["a"], clips["b"]
    content = [{"type": "text", "text": "First"}, {"type": "video"}, {"type": "text", "text": "then"},
               {"type": "video"}, {"type": "image"}, {"type": "text", "text": "What moves?"}]
    template = split_template(tokenizer, content)
    return template, [a, b, image], [as_hf(a, ia, fa), as_hf(b, ib, fb), as_hf(image)]


def test_the_template_keeps_the_outer_vision_markers(single, tokenizer, bundle):
    """HF 5.x and vLLM >= 0.26 keep the template's <|vision_start|>/<|vision_end|> around the
    per-frame expansion; our pieces (runtime/prompt.py) split at the same place."""
    template, _, _ = single
    vs, ve = bundle.family.config.vision_start_token_id, bundle.family.config.vision_end_token_id
    assert template[0][-1] == vs and template[2][0] == ve
    assert our_pieces(template) == video_question_pieces(tokenizer, QUESTION, bundle.family.token_strings)


# --------------------------------------------------------------------------------------------------
# q = 0: transformers' generate


@pytest.mark.parametrize("backend", BACKENDS)
def test_q0_single_video_equals_transformers_generate(bundle, sessions, hf_model, tokenizer, single, backend):
    template, videos, media = single
    ids, hf_tokens, hf_first = hf_generate(hf_model, tokenizer, template, media, DECODE_STEPS)
    assert len(hf_tokens) >= 4, "the reference stops too early to compare anything"
    result = answer(bundle, make_engine(bundle, sessions, backend, 0.0), videos[0], QUESTION)
    assert result.prompt_token_ids == ids
    assert result.generated_token_ids == hf_tokens
    assert_top_logits_match(result.prefill_top_logits, hf_first, ATOL)
    t, h, w = bundle.family.merged_grid(videos[0].grid_thw)
    assert result.kept_tokens_per_frame == [[h * w] * t]


def test_q0_two_videos_and_an_image_equal_transformers_generate(bundle, sessions, hf_model, tokenizer, multi):
    template, videos, media = multi
    ids, hf_tokens, hf_first = hf_generate(hf_model, tokenizer, template, media, DECODE_STEPS)
    assert len(hf_tokens) >= 4, "the reference stops too early to compare anything"
    engine = make_engine(bundle, sessions, "ort", 0.0)
    prompt = engine.prepare(our_pieces(template), videos)
    assert prompt.ids.tolist() == ids
    result = engine.generate(prompt, eos_ids=stop_ids(bundle))
    assert result.generated_token_ids == hf_tokens
    assert_top_logits_match(result.prefill_top_logits, hf_first, ATOL)


# --------------------------------------------------------------------------------------------------
# q > 0: transformers on the real pruned layout


@pytest.fixture(scope="module")
def single_references(hf_model, tokenizer, single):
    template, _, media = single
    return {q: hf_reference(hf_model, tokenizer, template, media, q, DECODE_STEPS) for q in PRUNING_RATES}


def assert_prompt_matches(prompt, ref: Reference, video_items: tuple[int, ...]) -> None:
    """Ids, int64 positions and every video's kept indices, against the reference's own."""
    assert prompt.ids.tolist() == ref.ids
    assert prompt.positions.dtype == np.int64
    np.testing.assert_array_equal(prompt.positions, ref.positions)
    assert len(video_items) == len(ref.kept)
    for item, kept in zip(video_items, ref.kept):
        np.testing.assert_array_equal(prompt.encoded[item].kept_indices, kept)


@pytest.mark.parametrize("q", PRUNING_RATES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_pruned_single_video_equals_hf_on_the_real_layout(bundle, sessions, single, single_references, backend, q):
    template, videos, _ = single
    ref = single_references[q]
    engine = make_engine(bundle, sessions, backend, q)
    prompt = engine.prepare(our_pieces(template), videos)
    assert_prompt_matches(prompt, ref, (0,))
    t, h, w = bundle.family.merged_grid(videos[0].grid_thw)
    assert len(ref.kept[0]) == evs.kept_token_count(h * w, t, q)
    result = engine.generate(prompt, eos_ids=())
    assert result.generated_token_ids == ref.tokens
    assert_top_logits_match(result.prefill_top_logits, ref.first_logits, ATOL)
    assert result.kept_tokens_per_frame == [np.bincount(ref.kept[0] // (h * w), minlength=t).tolist()]


@pytest.fixture(scope="module")
def multi_reference(hf_model, tokenizer, multi, bundle):
    template, _, media = multi
    return hf_reference(hf_model, tokenizer, template, media, bundle.manifest.video_pruning_rate, DECODE_STEPS)


@pytest.mark.parametrize("backend", BACKENDS)
def test_pruned_two_videos_and_an_image_equal_hf_on_the_real_layout(bundle, sessions, multi, multi_reference,
                                                                      backend):
    template, videos, _ = multi
    engine = make_engine(bundle, sessions, backend, bundle.manifest.video_pruning_rate)
    prompt = engine.prepare(our_pieces(template), videos)
    assert_prompt_matches(prompt, multi_reference, (0, 1))
    result = engine.generate(prompt, eos_ids=())
    assert result.generated_token_ids == multi_reference.tokens
    assert_top_logits_match(result.prefill_top_logits, multi_reference.first_logits, ATOL)


# --------------------------------------------------------------------------------------------------
# chunked prefill: any boundary, same tokens


def named_cuts(prompt, config) -> dict[str, list[int]]:
    """Chunk boundaries placed by looking at the prompt's ids (test-side): a cut at ``i`` starts a chunk there."""
    ids = prompt.ids.tolist()
    a, b, img = prompt.placeholders  # video A, video B, the image
    vs, ve = config.vision_start_token_id, config.vision_end_token_id

    def inner(placeholder, token):
        segment = ids[placeholder.offset:placeholder.offset + placeholder.length]
        return [placeholder.offset + i for i, t in enumerate(segment) if t == token]

    a_vs, a_ve, b_ve = inner(a, vs), inner(a, ve), inner(b, ve)
    assert ids[a.offset - 1] == vs and ids[b.offset - 1] == vs and ids[a.offset + a.length] == ve
    assert ids[img.offset - 1] == vs and ids[img.offset + img.length] == ve
    return {
        "inside a timestamp": [a.offset + 2, a_ve[0] + 3],  # "<0" | ".2 seconds>", "<1" | ".2 seconds>"
        "right after an inner vision_start": [a_vs[0] + 1, a_vs[1] + 1],
        "right after the outer vision_start": [a.offset, b.offset],
        "between two frames": [a_ve[0] + 1, b_ve[1] + 1],
        "the first timestamp token alone": [a.offset, a.offset + 1, a_vs[0]],
        "two videos and an image in one chunk": [a.offset - 1, img.offset + img.length + 1],
    }


def chunks_from_cuts(cuts: list[int], total: int) -> list[tuple[int, int]]:
    edges = [0, *sorted(set(cuts)), total]
    return [(start, stop - start) for start, stop in zip(edges, edges[1:])]


@pytest.fixture(scope="module")
def one_chunk(bundle, sessions, multi, multi_reference):
    template, videos, _ = multi
    engine = make_engine(bundle, sessions, "ort", bundle.manifest.video_pruning_rate, seq_len=256)
    prompt = engine.prepare(our_pieces(template), videos)
    result = engine.generate(prompt, eos_ids=())
    assert result.num_prefill_chunks == 1
    assert result.generated_token_ids == multi_reference.tokens
    return engine, prompt, result


@pytest.mark.parametrize("seq_len", [8, 16, 64])
def test_prefill_lengths_give_the_single_chunk_tokens(bundle, sessions, multi, one_chunk, seq_len):
    template, videos, _ = multi
    _, _, single_result = one_chunk
    engine = make_engine(bundle, sessions, "ort", bundle.manifest.video_pruning_rate, seq_len=seq_len,
                         vision_size=seq_len)
    prompt = engine.prepare(our_pieces(template), videos)
    result = engine.generate(prompt, eos_ids=())
    assert result.num_prefill_chunks == -(-len(prompt.ids) // seq_len) > 1
    assert result.generated_token_ids == single_result.generated_token_ids
    np.testing.assert_allclose(np.asarray(result.prefill_top_logits), np.asarray(single_result.prefill_top_logits),
                               atol=ATOL, rtol=0)


def test_forced_chunk_boundaries_give_the_single_chunk_tokens(bundle, one_chunk):
    engine, prompt, single_result = one_chunk
    pads = bundle.family.special_tokens().media_pads
    for name, cuts in named_cuts(prompt, bundle.family.config).items():
        chunks = chunks_from_cuts(cuts, len(prompt.ids))
        result = engine.generate(prompt, eos_ids=(), chunks=chunks)
        assert result.num_prefill_chunks == len(chunks), name
        assert result.generated_token_ids == single_result.generated_token_ids, name
        np.testing.assert_allclose(np.asarray(result.prefill_top_logits),
                                   np.asarray(single_result.prefill_top_logits), atol=ATOL, rtol=0, err_msg=name)
        expected_rows = [int(np.isin(prompt.ids[c:c + n], pads).sum()) for c, n in chunks]
        assert result.vision_rows_per_chunk == expected_rows, name
        if name == "two videos and an image in one chunk":
            assert len(chunks) == 3 and expected_rows[1] == sum(expected_rows)


# --------------------------------------------------------------------------------------------------
# backends


def test_ort_and_torch_backends_agree(bundle, sessions, multi):
    template, videos, _ = multi
    q = bundle.manifest.video_pruning_rate
    results, prompts = {}, {}
    for backend in BACKENDS:
        engine = make_engine(bundle, sessions, backend, q, seq_len=16, vision_size=48)
        prompts[backend] = engine.prepare(our_pieces(template), videos)
        results[backend] = engine.generate(prompts[backend], eos_ids=())
    ort, torch_ = results["ort"], results["torch"]
    assert ort.prompt_token_ids == torch_.prompt_token_ids
    np.testing.assert_array_equal(prompts["ort"].positions, prompts["torch"].positions)
    for e_ort, e_torch in zip(prompts["ort"].encoded, prompts["torch"].encoded):
        np.testing.assert_array_equal(e_ort.kept_indices, e_torch.kept_indices)
        # The tiny checkpoint's vision rows reach |x| ~ 30 (initializer 0.3), where fp32 op-order
        # noise alone is ~1e-5 relative; the 1e-4 tolerance applies per unit of magnitude.
        for ours, theirs in ((e_ort.rows, e_torch.rows), (e_ort.extras["deepstack_features"], e_torch.extras["deepstack_features"])):
            scale = max(1.0, float(np.abs(theirs).max()))
            np.testing.assert_allclose(ours, theirs, atol=ATOL * scale, rtol=0)
    assert ort.generated_token_ids == torch_.generated_token_ids
    assert ort.kept_tokens_per_frame == torch_.kept_tokens_per_frame
    np.testing.assert_allclose(np.asarray(ort.prefill_top_logits), np.asarray(torch_.prefill_top_logits),
                               atol=ATOL, rtol=0)
