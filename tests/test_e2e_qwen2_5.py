"""End to end on a tiny Qwen2.5-VL: checkpoint folder -> export -> engine, against transformers.

* q = 0: the engine's greedy tokens equal transformers' own ``generate`` on the same ids and
  pixel values, and its prefill top logits match HF's first-step logits.
* q > 0: the reference is the HF model run by hand (``inputs_embeds`` + ``position_ids`` + HF's
  ``DynamicCache``, greedy) on the PRUNED prompt: stock HF vision tower output masked by
  ``evs.retention_mask``, merged at the pruned prompt's video pads, with HF ``get_rope_index``
  positions of the unpruned prompt restricted to the kept tokens.
* ONNX Runtime and the PyTorch reference backend give the same tokens.
* Chunking: prefill lengths 8, 32, 128 over the same graphs give identical tokens and logits.

The prompt ids the references use are built here from the tokenizer's chat template, not by the
package. Everything runs on the session's one export (tests/conftest.py).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoTokenizer, DynamicCache, Qwen2_5_VLForConditionalGeneration

from qeff_evs import evs
from qeff_evs.models.pruning import VideoPruning
from qeff_evs.runtime.engine.single_request import Engine, EngineConfig
from qeff_evs.runtime.inputs.prompt import video_question_pieces
from qeff_evs.runtime.builders import answer, stop_ids
from qeff_evs.runtime.export_bundle import open_export
from qeff_evs.runtime.media import video_from_file
from qeff_evs.runtime.sessions import sessions_for
from qeff_evs.runtime.backends.ort import OrtLanguageSession

ATOL = 1e-4
DECODE_STEPS = 10
BACKENDS = ("ort", "torch", "openvino")  # openvino: the same graphs as ort, on OpenVINO
# 0.75 keeps exactly one frame's worth (the floor): later frames keep nothing.
PRUNING_RATES = (0.3, 0.5, 0.75)


# --------------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="module")
def bundle(tiny_export):
    return open_export(tiny_export)


@pytest.fixture(scope="module")
def hf_model(tiny_checkpoint):
    """The checkpoint loaded by transformers itself (its default sdpa attention), fp32, eval."""
    return Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_checkpoint):
    return AutoTokenizer.from_pretrained(tiny_checkpoint)


@pytest.fixture(scope="module")
def video(bundle, video_npy):
    return video_from_file(video_npy, bundle)


@pytest.fixture(scope="module")
def sessions(bundle):
    """Vision and language sessions per backend, built once; engines over them differ only in config."""
    return {backend: sessions_for(bundle, backend) for backend in BACKENDS}


def make_engine(bundle, sessions, backend: str, q: float, max_new_tokens: int = DECODE_STEPS) -> Engine:
    m = bundle.manifest
    config = EngineConfig(m.prefill_seq_len, m.ctx_len, m.user_vision_size, q, max_new_tokens=max_new_tokens)
    vision, language = sessions[backend]
    return Engine(bundle.family, vision, language, config)


# --------------------------------------------------------------------------------------------------
# independent references


def chat_ids(tokenizer, question: str, num_video_tokens: int) -> torch.Tensor:
    """(1, N) ids: the chat template with its one video pad expanded to ``num_video_tokens`` pads."""
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": question}]}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    text = text.replace("<|video_pad|>", "<|video_pad|>" * num_video_tokens)
    return tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids


def video_token_types(ids: torch.Tensor, config) -> torch.Tensor:
    """transformers 5's ``mm_token_type_ids``: 2 on video pads, 0 on text."""
    return (ids == config.video_token_id).to(torch.int32) * 2


def second_per_grid(video, config) -> float:
    return config.vision_config.temporal_patch_size / video.fps


def merged_grid(video, config) -> tuple[int, int, int]:
    t, h, w = video.grid_thw
    m = config.vision_config.spatial_merge_size
    return t, h // m, w // m


def assert_hf_post_video_rule_agrees(video, config) -> None:
    """transformers 5 puts the text after a Qwen2.5-VL video at ``s + max(h, w)``, vLLM (and we) at
    ``max(block) + 1``. They agree only when the largest temporal offset ``int((T-1) * f)`` is below
    ``max(h, w)`` (merged); the clip here (T=4, f = tokens_per_second * 2/fps = 2, offsets up to 6,
    max(h, w) = 7) is chosen so, which makes HF's positions a valid reference. The disagreement
    itself is pinned in tests/test_positions.py."""
    t, h, w = merged_grid(video, config)
    factor = config.vision_config.tokens_per_second * second_per_grid(video, config)
    assert int((t - 1) * factor) < max(h, w), (t, h, w, factor)


def hf_greedy_from_embeds(model, embeds, positions, decode_start: int, steps: int):
    """Manual greedy loop over HF's language model: prefill on ``inputs_embeds`` at 3-row M-RoPE
    ``positions``, then one token at a time at ``decode_start + j`` with HF's DynamicCache.
    Returns (tokens, first-step logits)."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        out = model(inputs_embeds=embeds, position_ids=positions, past_key_values=cache, use_cache=True)
        first_logits = out.logits[0, -1].clone()
        tokens = [int(first_logits.argmax())]
        for j in range(1, steps):
            step_embeds = model.get_input_embeddings()(torch.tensor([[tokens[-1]]]))
            step_positions = torch.full((3, 1, 1), decode_start + j - 1, dtype=torch.int64)
            out = model(inputs_embeds=step_embeds, position_ids=step_positions, past_key_values=cache,
                        use_cache=True)
            tokens.append(int(out.logits[0, -1].argmax()))
    return tokens, first_logits


@dataclasses.dataclass
class PrunedReference:
    ids: torch.Tensor  # (1, N) pruned prompt
    positions: torch.Tensor  # (3, 1, N) HF positions of the unpruned prompt, restricted
    kept_indices: torch.Tensor  # (K,)
    tokens: list[int]
    first_logits: torch.Tensor  # (vocab,)


def pruned_reference(model, tokenizer, video, question: str, q: float, steps: int,
                     kept: torch.Tensor | None = None) -> PrunedReference:
    """transformers on the pruned prompt: EVS's kept tokens of HF's own tower rows, or ``kept`` (indices another
    path's rows chose, checked against vLLM's EVS on those rows by its test)."""
    config = model.config
    grid = torch.tensor([video.grid_thw])
    t, h, w = merged_grid(video, config)
    with torch.no_grad():
        merged = model.model.visual(video.pixel_values, grid_thw=grid).pooler_output  # stock HF tower
    if kept is None:
        mask = evs.retention_mask(merged, video.grid_thw, config.vision_config.spatial_merge_size, q)
        k = int(mask.sum())

        # The TopK cut must not sit on a near-tie, or float noise between the exported tower and HF's
        # sdpa could swap a token in or out; the clip (VIDEO_SEED) is chosen with a clear margin.
        frames = merged.reshape(t, h * w, -1)
        dissimilarity = torch.cat([torch.full((1, h * w), 255.0),
                                   1 - F.cosine_similarity(frames[1:], frames[:-1], dim=-1)])
        ranked = dissimilarity.reshape(-1).sort(descending=True).values
        if k < ranked.numel():
            assert ranked[k - 1] - ranked[k] > 1e-4, "EVS cut on a near-tie: pick another clip seed"
    else:
        mask = torch.zeros(t * h * w, dtype=torch.bool)
        mask[torch.as_tensor(kept, dtype=torch.int64)] = True

    unpruned_ids = chat_ids(tokenizer, question, t * h * w)
    unpruned_positions, _ = model.model.get_rope_index(
        unpruned_ids, mm_token_type_ids=video_token_types(unpruned_ids, config), video_grid_thw=grid,
        second_per_grid_ts=torch.tensor([second_per_grid(video, config)]))
    keep = torch.ones(unpruned_ids.shape[1], dtype=torch.bool)
    keep[unpruned_ids[0] == config.video_token_id] = mask
    ids = unpruned_ids[:, keep]
    positions = unpruned_positions[:, :, keep]

    with torch.no_grad():
        embeds = model.get_input_embeddings()(ids).clone()
        embeds[0, ids[0] == config.video_token_id] = merged[mask]
    tokens, first_logits = hf_greedy_from_embeds(model, embeds, positions, int(unpruned_positions.max()) + 1, steps)
    return PrunedReference(ids, positions, torch.nonzero(mask).reshape(-1), tokens, first_logits)


def assert_top_logits_match(ours: list[list[float]], reference: torch.Tensor) -> None:
    """Our 10 [token_id, value] pairs against the reference's full logits."""
    assert len(ours) == 10
    ids = [int(i) for i, _ in ours]
    assert ids[0] == int(reference.argmax())
    assert set(ids) == set(reference.topk(10).indices.tolist())
    for token_id, value in ours:
        assert abs(value - float(reference[int(token_id)])) <= ATOL, (token_id, value, float(reference[int(token_id)]))


# --------------------------------------------------------------------------------------------------
# q = 0: transformers' generate


@pytest.fixture(scope="module")
def hf_generate_q0(hf_model, hf_tokenizer, video, question):
    """HF generate with the checkpoint's own generation config (greedy, its eos ids)."""
    config = hf_model.config
    assert_hf_post_video_rule_agrees(video, config)
    t, h, w = merged_grid(video, config)
    ids = chat_ids(hf_tokenizer, question, t * h * w)
    with torch.no_grad():
        out = hf_model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values_videos=video.pixel_values,
            video_grid_thw=torch.tensor([video.grid_thw]),
            second_per_grid_ts=torch.tensor([second_per_grid(video, config)]),
            mm_token_type_ids=video_token_types(ids, config), max_new_tokens=DECODE_STEPS, do_sample=False,
            output_logits=True, return_dict_in_generate=True)
    return ids[0].tolist(), out.sequences[0, ids.shape[1]:].tolist(), out.logits[0][0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_q0_greedy_tokens_equal_transformers_generate(bundle, sessions, video, question, hf_generate_q0, backend):
    ids, hf_tokens, hf_first_logits = hf_generate_q0
    assert len(hf_tokens) >= 4, "the reference stops too early to compare anything"
    engine = make_engine(bundle, sessions, backend, q=0.0)
    result = answer(bundle, engine, video, question)
    assert result.prompt_token_ids == ids
    assert result.generated_token_ids == hf_tokens
    assert_top_logits_match(result.prefill_top_logits, hf_first_logits)
    t, h, w = merged_grid(video, bundle.family.config)
    assert result.kept_tokens_per_frame == [[h * w] * t]


def test_stop_ids_are_the_checkpoints_generation_eos(bundle, hf_model):
    """HF generate stops on generation_config.json's eos list; the export carries the same ids."""
    generation_eos = hf_model.generation_config.eos_token_id
    generation_eos = {generation_eos} if isinstance(generation_eos, int) else set(generation_eos)
    assert generation_eos <= set(stop_ids(bundle))
    assert hf_model.config.text_config.eos_token_id in stop_ids(bundle)


# --------------------------------------------------------------------------------------------------
# q > 0: HF model on the pruned embeddings and restricted positions


@pytest.fixture(scope="module")
def pruned_references(hf_model, hf_tokenizer, video, question):
    assert_hf_post_video_rule_agrees(video, hf_model.config)
    return {q: pruned_reference(hf_model, hf_tokenizer, video, question, q, DECODE_STEPS) for q in PRUNING_RATES}


@pytest.mark.parametrize("q", PRUNING_RATES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_pruned_greedy_tokens_equal_hf_on_pruned_inputs(bundle, sessions, video, question, pruned_references,
                                                        backend, q):
    ref = pruned_references[q]
    engine = make_engine(bundle, sessions, backend, q)
    prompt = engine.prepare(video_question_pieces(bundle.tokenizer, question, bundle.family.token_strings), [video])
    # The pieces the language graph sees, each against the reference's own construction.
    np.testing.assert_array_equal(prompt.encoded[0].kept_indices, ref.kept_indices.numpy())
    np.testing.assert_array_equal(prompt.ids, ref.ids[0].numpy())
    np.testing.assert_array_equal(prompt.positions, ref.positions[:, 0].numpy())
    assert prompt.positions.dtype == np.int64

    result = engine.generate(prompt, eos_ids=())
    assert result.generated_token_ids == ref.tokens
    assert_top_logits_match(result.prefill_top_logits, ref.first_logits)
    t, h, w = merged_grid(video, bundle.family.config)
    kept = ref.kept_indices // (h * w)
    assert result.kept_tokens_per_frame == [np.bincount(kept.numpy(), minlength=t).tolist()]
    assert sum(result.kept_tokens_per_frame[0]) == max(h * w, int(t * h * w * (1 - q)))


def test_ort_and_torch_backends_agree(bundle, sessions, video, question):
    q = bundle.manifest.video_pruning_rate
    results = {}
    for backend in BACKENDS:
        engine = make_engine(bundle, sessions, backend, q)
        results[backend] = engine.generate(engine.prepare(video_question_pieces(bundle.tokenizer, question, bundle.family.token_strings), [video]))
    ort, torch_ = results["ort"], results["torch"]
    assert ort.prompt_token_ids == torch_.prompt_token_ids
    assert ort.generated_token_ids == torch_.generated_token_ids
    assert ort.kept_tokens_per_frame == torch_.kept_tokens_per_frame
    assert [i for i, _ in ort.prefill_top_logits] == [i for i, _ in torch_.prefill_top_logits]
    np.testing.assert_allclose([v for _, v in ort.prefill_top_logits], [v for _, v in torch_.prefill_top_logits],
                               atol=ATOL, rtol=0)


# --------------------------------------------------------------------------------------------------
# --backend openvino-bf16: bf16 compute, against transformers in fp32 at bf16's tolerance

# bf16 keeps 8 significant bits (a relative step of 2**-8): the logits may move by a few steps of the largest
# logit's size; greedy tokens are asserted only where fp32's lead over the runner-up is past twice that.
BF16_TOLERANCE = 0.05  # of the largest |logit|


@pytest.fixture(scope="module")
def bf16_sessions(bundle):
    openvino = pytest.importorskip("openvino")
    if "BF16" not in openvino.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES"):
        pytest.skip("this CPU has no bf16 instructions: --backend openvino-bf16 refuses it")
    return {"openvino-bf16": sessions_for(bundle, "openvino-bf16")}


def assert_bf16_logits_close(ours: list[list[float]], reference: torch.Tensor) -> None:
    tolerance = BF16_TOLERANCE * float(reference.abs().max())
    for token_id, value in ours:
        assert abs(value - float(reference[int(token_id)])) <= tolerance, (token_id, value, tolerance)
    top2 = reference.topk(2).values
    if float(top2[0] - top2[1]) > 2 * tolerance:
        assert int(ours[0][0]) == int(reference.argmax())


@pytest.mark.parametrize("q", (0.0, *PRUNING_RATES))
def test_openvino_bf16_within_bf16_tolerance_of_transformers(bundle, bf16_sessions, video, question, hf_generate_q0,
                                                             pruned_references, hf_model, hf_tokenizer, q):
    """The kept rows are vLLM's EVS on the rows the bf16 encoder gave (the pruning graph ranks them in fp32; where
    bf16's rounding reorders two near rows, as on CPUs with AMX, that set differs from the fp32 path's), the prompt
    is transformers' for that set, and the first step's logits are within bf16's tolerance of transformers' on it."""
    engine = make_engine(bundle, bf16_sessions, "openvino-bf16", q)
    prompt = engine.prepare(video_question_pieces(bundle.tokenizer, question, bundle.family.token_strings), [video])
    result = engine.generate(prompt, eos_ids=())
    if q == 0:
        ids, _, reference = hf_generate_q0
        assert result.prompt_token_ids == ids
    else:
        vllm_evs = pytest.importorskip("vllm.multimodal.video_prune.evs")
        vision, _ = bf16_sessions["openvino-bf16"]
        rows = torch.from_numpy(np.asarray(vision.encode(video, VideoPruning("evs", 0.0)).rows, dtype=np.float32))
        merge = bundle.family.config.vision_config.spatial_merge_size
        vllm_kept = torch.nonzero(vllm_evs.compute_retention_mask(rows, video.grid_thw, merge, q)).reshape(-1)
        kept = prompt.encoded[0].kept_indices
        np.testing.assert_array_equal(kept, vllm_kept.numpy())
        ref = pruned_references[q]
        if not np.array_equal(kept, ref.kept_indices.numpy()):
            ref = pruned_reference(hf_model, hf_tokenizer, video, question, q, DECODE_STEPS, torch.from_numpy(kept))
        np.testing.assert_array_equal(prompt.ids, ref.ids[0].numpy())
        reference = ref.first_logits
    assert len(result.generated_token_ids) == DECODE_STEPS
    assert_bf16_logits_close(result.prefill_top_logits, reference)


# --------------------------------------------------------------------------------------------------
# chunking: one language graph serves every prefill length


class RecordingLanguageSession:
    """Wraps a language session and keeps every call's logits."""

    def __init__(self, inner):
        self.inner = inner
        self.shape = inner.shape
        self.logits: list[np.ndarray] = []

    def reset(self) -> None:
        self.inner.reset()
        self.logits = []

    def run(self, step):
        logits = self.inner.run(step)
        self.logits.append(np.array(logits, copy=True))
        return logits


# (prefill_seq_len, user_vision_size): U = S is the smallest window allowed.
CHUNKINGS = [(8, 8), (32, 48), (128, 128)]


@pytest.fixture(scope="module")
def chunked_runs(bundle, sessions, video, question):
    q = bundle.manifest.video_pruning_rate
    runs = {}
    for seq_len, vision_size in CHUNKINGS:
        # The ORT graph takes any chunk length; this engine sends chunks of seq_len, the one length it states.
        shape = dataclasses.replace(bundle.language_shape, vision_size=vision_size, prefill_lens=(seq_len,))
        language = RecordingLanguageSession(OrtLanguageSession(bundle.manifest.path(bundle.export_dir, "language"),
                                                               shape))
        config = EngineConfig(seq_len, bundle.manifest.ctx_len, vision_size, q, max_new_tokens=DECODE_STEPS)
        engine = Engine(bundle.family, sessions["ort"][0], language, config)
        prompt = engine.prepare(video_question_pieces(bundle.tokenizer, question, bundle.family.token_strings), [video])
        result = engine.generate(prompt, eos_ids=())
        runs[seq_len] = (prompt, result, language.logits[result.num_prefill_chunks - 1])
    return runs


def test_chunk_lengths_give_identical_tokens_and_logits(chunked_runs):
    _, single, single_logits = chunked_runs[128]
    assert single.num_prefill_chunks == 1  # the unchunked prefill is the reference
    for seq_len, _ in CHUNKINGS[:-1]:
        _, result, logits = chunked_runs[seq_len]
        assert result.num_prefill_chunks > 1
        assert result.prompt_token_ids == single.prompt_token_ids
        assert result.generated_token_ids == single.generated_token_ids
        np.testing.assert_allclose(logits, single_logits, atol=ATOL, rtol=0)


@pytest.mark.parametrize("seq_len, vision_size", CHUNKINGS)
def test_each_chunk_gets_only_its_own_window_of_vision_rows(chunked_runs, bundle, seq_len, vision_size):
    prompt, result, _ = chunked_runs[seq_len]
    ids = np.asarray(result.prompt_token_ids)
    video_pad = bundle.manifest.special_tokens.video_pad
    assert result.num_prefill_chunks == math.ceil(len(ids) / seq_len)
    pads_per_chunk = [int((ids[c:c + seq_len] == video_pad).sum()) for c in range(0, len(ids), seq_len)]
    assert result.vision_rows_per_chunk == pads_per_chunk
    assert max(result.vision_rows_per_chunk) <= vision_size
    assert sum(result.vision_rows_per_chunk) == len(prompt.encoded[0].kept_indices)


def test_engine_rejects_a_window_below_the_prefill_length(bundle, sessions):
    m = bundle.manifest
    with pytest.raises(ValueError, match=r"user_vision_size 16 is below prefill_seq_len 32"):
        EngineConfig(32, m.ctx_len, 16, 0.5)


def test_engine_rejects_a_prompt_that_does_not_fit_ctx_len(bundle, sessions, video, question):
    m = bundle.manifest
    vision, language = sessions["ort"]
    small = EngineConfig(m.prefill_seq_len, 64, m.user_vision_size, 0.0, max_new_tokens=4)
    engine = Engine(bundle.family, vision, language, small)
    with pytest.raises(ValueError, match=r"the prompt \(\d+ tokens\) plus max_new_tokens \(4\).*ctx_len is 64"):
        engine.prepare(video_question_pieces(bundle.tokenizer, question, bundle.family.token_strings), [video])
