"""The language-model ONNX graph (docs/design.md#the-three-graphs) against transformers' own text model.

One tiny random Qwen2.5-VL is exported once; every test runs that one file in ONNX Runtime (and the
same module eagerly) and compares with the transformers language model fed the merged
``inputs_embeds`` and 3-row M-RoPE positions of the whole, unpadded prompt. Decode is checked
against a full re-run of that reference over the grown sequence (no KV cache at all).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from transformers import (
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
)

from qeff_evs.export.language import export_language_graph
from qeff_evs.models.graph_io import language_io_names
from qeff_evs.models.language import ExportableLanguageGraph, LanguageGraph

IMG, VID, VS, VE = 900, 901, 902, 903
PAD = 2
HIDDEN = 64
KV_HEADS, HEAD_DIM, LAYERS = 2, 16, 2
CTX_LEN = 96  # differs from the export example (32): ctx_len must be a live symbol
DECODE_STEPS = 5
ATOL = 1e-4

TEXT = dict(
    vocab_size=1000, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=LAYERS,
    num_attention_heads=4, num_key_value_heads=KV_HEADS, max_position_embeddings=1024,
    bos_token_id=0, eos_token_id=1, pad_token_id=PAD,
)
TOKENS = dict(image_token_id=IMG, video_token_id=VID, vision_start_token_id=VS, vision_end_token_id=VE)


def tiny_qwen2_5_vl() -> Qwen2_5_VLForConditionalGeneration:
    torch.manual_seed(0)
    config = Qwen2_5_VLConfig(
        text_config=dict(
            TEXT, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
        ),
        vision_config=dict(
            depth=2, hidden_size=64, intermediate_size=128, num_heads=4, out_hidden_size=HIDDEN,
            patch_size=14, temporal_patch_size=2, spatial_merge_size=2, window_size=56,
            fullatt_block_indexes=[1], in_channels=3,
        ),
        **TOKENS,
    )
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def tiny_qwen3_vl() -> Qwen3VLForConditionalGeneration:
    torch.manual_seed(1)
    config = Qwen3VLConfig(
        text_config=dict(
            TEXT, head_dim=HEAD_DIM,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                             "mrope_interleaved": True},
        ),
        vision_config=dict(
            depth=2, hidden_size=64, intermediate_size=128, num_heads=4, out_hidden_size=HIDDEN,
            patch_size=16, temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=64,
            deepstack_visual_indexes=[0], in_channels=3,
        ),
        **TOKENS,
    )
    return Qwen3VLForConditionalGeneration(config).eval()


# --------------------------------------------------------------------------------------------------
# A prompt with an image and a pruned video, laid out by hand (positions independent of the package)


@dataclass(frozen=True)
class Prompt:
    ids: np.ndarray  # (L,) int64
    mrope: np.ndarray  # (3, L) int64 t/h/w positions
    media_rows: np.ndarray  # (num_media, hidden) vision rows in prompt order (image then video)
    deepstack_rows: np.ndarray  # (levels, num_media, hidden)

    @property
    def decode_start(self) -> int:
        return int(self.mrope.max()) + 1


def build_prompt(levels: int = 0, seed: int = 0) -> Prompt:
    """6 text, a 2x2 image, 2 text, <vs> 40 of 64 video tokens (4 frames of 4x4) <ve>, 9 text."""
    rng = np.random.default_rng(seed)
    ids, pos = [], []

    def next_free() -> int:
        return max(max(p) for p in pos) + 1 if pos else 0

    def text(n):
        start = next_free()
        for i in range(n):
            ids.append(int(rng.integers(10, 800)))
            pos.append((start + i,) * 3)

    text(6)
    start = next_free()
    for r in range(2):
        for c in range(2):
            ids.append(IMG)
            pos.append((start, start + r, start + c))
    text(2)
    ids.append(VS)
    pos.append((next_free(),) * 3)
    start = next_free()
    video = [(start + 2 * t, start + r, start + c) for t in range(4) for r in range(4) for c in range(4)]
    # EVS-like pruning: frame 0 whole, 24 more of the 48 later tokens; positions are the unpruned
    # ones restricted to the kept tokens, and text after the video starts at the unpruned max + 1.
    later = np.sort(rng.choice(np.arange(16, 64), size=24, replace=False))
    kept = list(range(16)) + later.tolist()
    unpruned_max = max(max(p) for p in video)
    for i in kept:
        ids.append(VID)
        pos.append(video[i])
    ids.append(VE)
    pos.append((unpruned_max + 1,) * 3)
    text(9)
    num_media = 4 + len(kept)
    gen = torch.Generator().manual_seed(seed + 100)
    media = torch.randn(num_media, HIDDEN, generator=gen).numpy()
    deepstack = torch.randn(levels, num_media, HIDDEN, generator=gen).numpy()
    return Prompt(np.array(ids, np.int64), np.array(pos, np.int64).T.copy(), media, deepstack)


# --------------------------------------------------------------------------------------------------
# Independent reference: transformers' text model over the whole unpadded sequence, no cache


@torch.no_grad()
def reference_logits(model, ids: np.ndarray, mrope: np.ndarray, prompt: Prompt) -> torch.Tensor:
    """Last-position logits of ``ids`` (prompt, maybe + generated tokens) from the HF text model."""
    text_model = model.model.language_model
    input_ids = torch.from_numpy(ids)[None]
    embeds = text_model.embed_tokens(input_ids).clone()
    media = torch.from_numpy(np.isin(ids, [IMG, VID]))[None]
    embeds[media] = torch.from_numpy(prompt.media_rows)
    kwargs = {}
    if prompt.deepstack_rows.shape[0]:
        kwargs = dict(visual_pos_masks=media, deepstack_visual_embeds=list(torch.from_numpy(prompt.deepstack_rows)))
    hidden = text_model(inputs_embeds=embeds, position_ids=torch.from_numpy(mrope)[:, None], **kwargs)
    return model.lm_head(hidden.last_hidden_state[:, -1]).float()[0]


@torch.no_grad()
def reference_generation(model, prompt: Prompt, steps: int) -> tuple[list[int], list[torch.Tensor]]:
    ids, mrope = prompt.ids, prompt.mrope
    tokens, logits = [], []
    for step in range(steps + 1):
        out = reference_logits(model, ids, mrope, prompt)
        logits.append(out)
        if step == steps:
            break
        token = int(out.argmax())
        tokens.append(token)
        ids = np.append(ids, token)
        mrope = np.concatenate([mrope, np.full((3, 1), prompt.decode_start + step)], axis=1)
    return tokens, logits


# --------------------------------------------------------------------------------------------------
# A minimal host: windowed chunked prefill (image_idx = 0 per chunk) then greedy decode


def ort_runner(path):
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return lambda feeds: dict(zip(names, session.run(names, feeds)))


def eager_runner(module: ExportableLanguageGraph):
    return lambda feeds: {k: v.numpy() for k, v in module.run(feeds).items()}


def empty_cache(layers=LAYERS, batch=1, ctx_len=CTX_LEN) -> dict[str, np.ndarray]:
    shape = (batch, KV_HEADS, ctx_len, HEAD_DIM)
    return {f"past_{kind}.{i}": np.zeros(shape, np.float32) for i in range(layers) for kind in ("key", "value")}


def carry_cache(outputs) -> dict[str, np.ndarray]:
    suffix = "_RetainedState"
    return {k[: -len(suffix)]: v for k, v in outputs.items() if k.startswith("past_") and k.endswith(suffix)}


@dataclass
class HostRun:
    prefill_logits: np.ndarray  # (vocab,) after the last chunk
    chunk_logits: list[np.ndarray]
    tokens: list[int]
    decode_logits: list[np.ndarray]
    image_idx_outputs: list[int]
    cache: dict[str, np.ndarray]


def chunk_feeds(prompt: Prompt, start: int, seq_len: int, vision_size: int, pad_id: int = PAD) -> dict[str, np.ndarray]:
    """Feeds of the prefill chunk starting at ``start``: tokens padded to seq_len, its own vision window."""
    length = len(prompt.ids)
    stop = min(start + seq_len, length)
    n = stop - start
    ids = np.full((1, seq_len), pad_id, np.int64)
    ids[0, :n] = prompt.ids[start:stop]
    positions = np.full((4, 1, seq_len), -1, np.int64)
    positions[0, 0, :n] = np.arange(start, stop)
    positions[1:, 0, :n] = prompt.mrope[:, start:stop]
    is_media = np.isin(prompt.ids, [IMG, VID])
    first, last = int(is_media[:start].sum()), int(is_media[:stop].sum())
    window = np.zeros((1, vision_size, HIDDEN), np.float32)
    window[0, : last - first] = prompt.media_rows[first:last]
    feeds = {"input_ids": ids, "vision_embeds": window, "position_ids": positions,
             "image_idx": np.zeros((1, 1), np.int64)}
    levels = prompt.deepstack_rows.shape[0]
    if levels:
        deep = np.zeros((levels, 1, vision_size, HIDDEN), np.float32)
        deep[:, 0, : last - first] = prompt.deepstack_rows[:, first:last]
        feeds["deepstack_features"] = deep
    return feeds


def run_host(run, prompt: Prompt, seq_len: int, steps: int = DECODE_STEPS, pad_id: int = PAD) -> HostRun:
    cache = empty_cache()
    chunk_logits, image_idx = [], []
    for start in range(0, len(prompt.ids), seq_len):
        feeds = chunk_feeds(prompt, start, seq_len, vision_size=seq_len, pad_id=pad_id)
        out = run({**feeds, **cache})
        cache = carry_cache(out)
        chunk_logits.append(out["logits"][0, 0])
        image_idx.append(int(out["image_idx_output"][0, 0]))
    logits = chunk_logits[-1]
    tokens, decode_logits = [], []
    for step in range(steps):
        token = int(np.argmax(logits))
        tokens.append(token)
        slot = len(prompt.ids) + step
        positions = np.array([slot] + [prompt.decode_start + step] * 3, np.int64).reshape(4, 1, 1)
        feeds = {"input_ids": np.array([[token]], np.int64), "position_ids": positions,
                 "vision_embeds": np.zeros((1, seq_len, HIDDEN), np.float32),
                 "image_idx": np.zeros((1, 1), np.int64)}
        if prompt.deepstack_rows.shape[0]:
            feeds["deepstack_features"] = np.zeros((prompt.deepstack_rows.shape[0], 1, seq_len, HIDDEN), np.float32)
        out = run({**feeds, **cache})
        cache = carry_cache(out)
        logits = out["logits"][0, 0]
        decode_logits.append(logits)
        image_idx.append(int(out["image_idx_output"][0, 0]))
    return HostRun(chunk_logits[-1], chunk_logits, tokens, decode_logits, image_idx, cache)


# --------------------------------------------------------------------------------------------------
# Fixtures: one export per family for the whole file


@pytest.fixture(scope="module")
def q25():
    return tiny_qwen2_5_vl()


@pytest.fixture(scope="module")
def q25_onnx(q25, tmp_path_factory):
    return export_language_graph(q25, tmp_path_factory.mktemp("lang") / "language.onnx", ctx_len_example=32)


@pytest.fixture(scope="module")
def q25_ort(q25_onnx):
    return ort_runner(q25_onnx)


@pytest.fixture(scope="module")
def prompt():
    return build_prompt()


@pytest.fixture(scope="module")
def q25_reference(q25, prompt):
    return reference_generation(q25, prompt, DECODE_STEPS)


@pytest.fixture(scope="module")
def q25_single_chunk(q25_ort, prompt):
    return run_host(q25_ort, prompt, seq_len=len(prompt.ids))


# --------------------------------------------------------------------------------------------------
# Contract


def test_io_names_and_symbols_follow_the_contract(q25_onnx):
    model = onnx.load(str(q25_onnx))
    dims = {
        v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
        for v in [*model.graph.input, *model.graph.output]
    }
    kv = ["batch_size", KV_HEADS, "ctx_len", HEAD_DIM]
    assert [v.name for v in model.graph.input] == [
        "input_ids", "vision_embeds", "position_ids", "image_idx",
        "past_key.0", "past_value.0", "past_key.1", "past_value.1",
    ]
    assert [v.name for v in model.graph.output] == [
        "logits", "vision_embeds_RetainedState", "image_idx_output",
        "past_key.0_RetainedState", "past_value.0_RetainedState",
        "past_key.1_RetainedState", "past_value.1_RetainedState",
    ]
    assert dims["input_ids"] == ["batch_size", "seq_len"]
    assert dims["vision_embeds"] == dims["vision_embeds_RetainedState"] == [1, "vision_size", HIDDEN]
    assert dims["position_ids"] == [4, "batch_size", "seq_len"]
    assert dims["image_idx"] == dims["image_idx_output"] == [1, 1]
    assert dims["logits"] == ["batch_size", 1, 1000]
    assert dims["past_key.1"] == dims["past_value.0_RetainedState"] == kv
    assert model.opset_import[0].version == 17
    assert language_io_names(LAYERS, extras=()) == (
        [v.name for v in model.graph.input], [v.name for v in model.graph.output]
    )


def test_graph_has_no_data_dependent_ops(q25_onnx):
    ops = collections.Counter(node.op_type for node in onnx.load(str(q25_onnx)).graph.node)
    assert not {"NonZero", "Compress", "Unique", "Loop", "If"} & set(ops)
    kv_ops = collections.Counter(node.op_type for node in onnx.load(str(q25_onnx)).graph.node
                                 if node.domain == "com.qualcomm.cloud")
    assert kv_ops == {"CtxScatter": 2 * LAYERS, "CtxGather": 2 * LAYERS}  # one write, one read per cache
    assert ops["ScatterElements"] == 0


# --------------------------------------------------------------------------------------------------
# Numerics against transformers


def test_single_chunk_prefill_matches_transformers(q25_single_chunk, q25_reference):
    ref_tokens, ref_logits = q25_reference
    np.testing.assert_allclose(q25_single_chunk.prefill_logits, ref_logits[0].numpy(), atol=ATOL, rtol=0)


def test_decode_after_single_chunk_matches_transformers(q25_single_chunk, q25_reference):
    ref_tokens, ref_logits = q25_reference
    assert q25_single_chunk.tokens == ref_tokens
    for ours, ref in zip(q25_single_chunk.decode_logits, ref_logits[1:]):
        np.testing.assert_allclose(ours, ref.numpy(), atol=ATOL, rtol=0)


@pytest.mark.parametrize("seq_len", [8, 32, 128])
def test_windowed_chunked_prefill_matches_single_chunk(q25_ort, prompt, q25_single_chunk, q25_reference, seq_len):
    ref_tokens, ref_logits = q25_reference
    chunked = run_host(q25_ort, prompt, seq_len=seq_len)
    assert len(prompt.ids) % seq_len != 0  # the last chunk really is padded
    np.testing.assert_allclose(chunked.prefill_logits, ref_logits[0].numpy(), atol=ATOL, rtol=0)
    np.testing.assert_allclose(chunked.prefill_logits, q25_single_chunk.prefill_logits, atol=ATOL, rtol=0)
    assert chunked.tokens == q25_single_chunk.tokens == ref_tokens
    for ours, ref in zip(chunked.decode_logits, ref_logits[1:]):
        np.testing.assert_allclose(ours, ref.numpy(), atol=ATOL, rtol=0)


def test_every_chunk_boundary_sees_the_right_prefix(q25, q25_ort, prompt):
    """Each chunk's logits equal the reference over the prompt prefix it ends at (S=8)."""
    run = run_host(q25_ort, prompt, seq_len=8, steps=0)
    for k, logits in enumerate(run.chunk_logits):
        stop = min(8 * (k + 1), len(prompt.ids))
        media_before = int(np.isin(prompt.ids[:stop], [IMG, VID]).sum())
        prefix = Prompt(prompt.ids[:stop], prompt.mrope[:, :stop], prompt.media_rows[:media_before],
                        prompt.deepstack_rows[:, :media_before])
        ref = reference_logits(q25, prefix.ids, prefix.mrope, prefix)
        np.testing.assert_allclose(logits, ref.numpy(), atol=ATOL, rtol=0)


def test_eager_module_equals_onnx_runtime(q25, q25_ort, prompt):
    module = ExportableLanguageGraph(LanguageGraph(q25)).eval()
    ort_run = run_host(q25_ort, prompt, seq_len=32)
    eager = run_host(eager_runner(module), prompt, seq_len=32)
    assert eager.tokens == ort_run.tokens
    assert eager.image_idx_outputs == ort_run.image_idx_outputs
    for ours, theirs in zip(eager.chunk_logits + eager.decode_logits, ort_run.chunk_logits + ort_run.decode_logits):
        np.testing.assert_allclose(ours, theirs, atol=ATOL, rtol=0)
    for name, cache in eager.cache.items():
        np.testing.assert_allclose(cache, ort_run.cache[name], atol=ATOL, rtol=0)


# --------------------------------------------------------------------------------------------------
# image_idx, padding, batch


def test_image_idx_output_counts_media_tokens_without_reset(q25_ort, prompt):
    run = run_host(q25_ort, prompt, seq_len=8)
    is_media = np.isin(prompt.ids, [IMG, VID])
    chunks = range(0, len(prompt.ids), 8)
    # image_idx = 0 per chunk, so the output is the chunk's media count (0 for text-only chunks).
    assert run.image_idx_outputs[: len(chunks)] == [int(is_media[s : s + 8].sum()) for s in chunks]
    assert run.image_idx_outputs[len(chunks):] == [0] * DECODE_STEPS

    # A non-zero image_idx is carried through (QEfficient would reset it on a text-only chunk).
    text_only = next(s for s in chunks if not is_media[s : s + 8].any())
    feeds = {**chunk_feeds(prompt, text_only, 8, 8), **empty_cache()}
    feeds["image_idx"] = np.array([[5]], np.int64)
    assert q25_ort(feeds)["image_idx_output"].tolist() == [[5]]
    media_chunk = next(s for s in chunks if is_media[s : s + 8].any())
    feeds = {**chunk_feeds(prompt, media_chunk, 8, 8), **empty_cache()}
    feeds["image_idx"] = np.array([[3]], np.int64)
    assert q25_ort(feeds)["image_idx_output"].tolist() == [[3 + int(is_media[media_chunk : media_chunk + 8].sum())]]


def test_image_idx_offsets_the_vision_rows(q25_ort, prompt):
    """With image_idx = 3 the k-th media token reads row 3 + k: shifting the window changes nothing."""
    start = 8  # a chunk holding image and text tokens
    feeds = {**chunk_feeds(prompt, start, 8, 8), **empty_cache()}
    assert np.isin(feeds["input_ids"], [IMG, VID]).any()
    base = q25_ort(feeds)
    shifted = dict(feeds)
    junk = np.random.default_rng(3).standard_normal((1, 3, HIDDEN)).astype(np.float32)
    shifted["vision_embeds"] = np.concatenate([junk, feeds["vision_embeds"]], axis=1)  # vision_size 11
    shifted["image_idx"] = np.array([[3]], np.int64)
    out = q25_ort(shifted)
    np.testing.assert_array_equal(out["logits"], base["logits"])
    np.testing.assert_array_equal(out["vision_embeds_RetainedState"], shifted["vision_embeds"])
    assert int(out["image_idx_output"][0, 0]) == 3 + int(base["image_idx_output"][0, 0])


def test_vision_rows_reach_only_media_tokens(q25_ort, prompt):
    """Changing the vision window changes a media chunk's logits; a text-only chunk ignores it."""
    is_media = np.isin(prompt.ids, [IMG, VID])
    for start, has_media in ((8, True), (len(prompt.ids) - 8, False)):
        assert bool(is_media[start : start + 8].any()) == has_media
        feeds = {**chunk_feeds(prompt, start, 8, 8), **empty_cache()}
        other = dict(feeds, vision_embeds=feeds["vision_embeds"] + 1.0)
        changed = not np.allclose(q25_ort(feeds)["logits"], q25_ort(other)["logits"], atol=ATOL)
        assert changed == has_media


@pytest.mark.parametrize("pad_id", [PAD, VID])
def test_padding_changes_nothing(q25_ort, prompt, pad_id):
    """A chunk padded to 16 (even with the video pad id and junk vision rows) equals it unpadded."""
    start, n = 40, 11  # video tokens, then <ve> and text
    history = run_host(q25_ort, Prompt(prompt.ids[:start], prompt.mrope[:, :start], prompt.media_rows,
                                       prompt.deepstack_rows), seq_len=8, steps=0).cache
    exact = chunk_feeds(prompt, start, n, vision_size=16)
    exact = {k: v[..., :n] if k in ("input_ids", "position_ids") else v for k, v in exact.items()}
    padded = chunk_feeds(prompt, start, 16, vision_size=16, pad_id=pad_id)
    padded["input_ids"][0, n:] = pad_id
    padded["position_ids"][:, 0, n:] = -1
    media = int(np.isin(exact["input_ids"], [IMG, VID]).sum())
    padded["vision_embeds"][0, media:] = 7.0  # rows no real token may read
    a, b = q25_ort({**exact, **history}), q25_ort({**padded, **history})
    np.testing.assert_allclose(b["logits"], a["logits"], atol=ATOL, rtol=0)
    assert a["image_idx_output"].tolist() == b["image_idx_output"].tolist() == [[media]]
    for name in [k for k in a if k.startswith("past_")]:
        assert np.isfinite(b[name]).all()
        # Padding writes only to the last slot, which no real token of this request occupies yet.
        np.testing.assert_allclose(b[name][:, :, :-1], a[name][:, :, :-1], atol=ATOL, rtol=0)


def test_batch_rows_are_independent(q25_ort):
    """Batch 2 (one row padded) gives each row the logits of its own batch-1 run."""
    rng = np.random.default_rng(7)
    lengths = (10, 6)
    ids = np.full((2, 10), PAD, np.int64)
    positions = np.full((4, 2, 10), -1, np.int64)
    for row, n in enumerate(lengths):
        ids[row, :n] = rng.integers(10, 800, n)
        positions[:, row, :n] = np.arange(n) + 3 * row  # rows use different M-RoPE offsets
        positions[0, row, :n] = np.arange(n)
    common = {"vision_embeds": np.zeros((1, 4, HIDDEN), np.float32), "image_idx": np.zeros((1, 1), np.int64)}
    both = q25_ort({"input_ids": ids, "position_ids": positions, **common, **empty_cache(batch=2)})
    for row, n in enumerate(lengths):
        alone = q25_ort({"input_ids": ids[row : row + 1, :n], "position_ids": positions[:, row : row + 1, :n],
                         **common, **empty_cache(batch=1)})
        np.testing.assert_allclose(both["logits"][row], alone["logits"][0], atol=ATOL, rtol=0)


def test_bad_position_ids_are_rejected(q25):
    module = LanguageGraph(q25)
    with pytest.raises(ValueError, match="position_ids"):
        module(torch.zeros(1, 4, dtype=torch.int64), torch.zeros(1, 4, HIDDEN), torch.zeros(3, 1, 4, dtype=torch.int64),
               torch.zeros(1, 1, dtype=torch.int64), [torch.zeros(1, KV_HEADS, 8, HEAD_DIM)] * LAYERS,
               [torch.zeros(1, KV_HEADS, 8, HEAD_DIM)] * LAYERS)


# --------------------------------------------------------------------------------------------------
# Qwen3-VL: deepstack features and interleaved M-RoPE through the same module


@pytest.fixture(scope="module")
def q3():
    return tiny_qwen3_vl()


@pytest.fixture(scope="module")
def q3_ort(q3, tmp_path_factory):
    return ort_runner(export_language_graph(q3, tmp_path_factory.mktemp("lang3") / "language.onnx"))


def test_qwen3_vl_io_names():
    inputs, outputs = language_io_names(1, extras=("deepstack_features",))
    assert inputs == ["input_ids", "vision_embeds", "deepstack_features", "position_ids", "image_idx",
                      "past_key.0", "past_value.0"]
    assert outputs == ["logits", "vision_embeds_RetainedState", "deepstack_features_RetainedState",
                       "image_idx_output", "past_key.0_RetainedState", "past_value.0_RetainedState"]


@pytest.mark.parametrize("seq_len", [8, 128])
def test_qwen3_vl_chunked_prefill_and_decode_match_transformers(q3, q3_ort, seq_len):
    prompt = build_prompt(levels=1, seed=4)
    ref_tokens, ref_logits = reference_generation(q3, prompt, DECODE_STEPS)
    run = run_host(q3_ort, prompt, seq_len=seq_len)
    np.testing.assert_allclose(run.prefill_logits, ref_logits[0].numpy(), atol=ATOL, rtol=0)
    assert run.tokens == ref_tokens
    for ours, ref in zip(run.decode_logits, ref_logits[1:]):
        np.testing.assert_allclose(ours, ref.numpy(), atol=ATOL, rtol=0)


def test_qwen3_vl_deepstack_rows_matter(q3_ort):
    prompt = build_prompt(levels=1, seed=4)
    feeds = {**chunk_feeds(prompt, 8, 8, 8), **empty_cache()}
    other = dict(feeds, deepstack_features=feeds["deepstack_features"] + 1.0)
    out, out_other = q3_ort(feeds), q3_ort(other)
    assert not np.allclose(out["logits"], out_other["logits"], atol=ATOL)
    np.testing.assert_array_equal(out_other["deepstack_features_RetainedState"], other["deepstack_features"])
