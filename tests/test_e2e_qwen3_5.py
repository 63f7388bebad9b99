"""End to end on a tiny Qwen3.5 (hybrid: Gated DeltaNet + gated full attention): checkpoint folder ->
export -> engine, against transformers' own ``Qwen3_5ForConditionalGeneration``.

* q = 0: the engine's greedy tokens (32 decoded) equal transformers' ``generate`` on the same prompt
  ids and pixel values; prefill logits within 1e-4.
* q = 0.5 (EVS): the reference is transformers run by hand on the REAL pruned layout: the stock
  vision tower (no deepstack), ``evs.retention_mask`` over its merged rows, the kept rows at the
  pruned prompt's pads, explicit 3-row positions (``get_rope_index`` of the unpruned prompt
  restricted to the kept tokens), greedy with transformers' ``DynamicCache`` (its linear-attention
  layers carry their state in it).
* Prefill lengths 16 and 64, each its own export (the chunked rule is unrolled for the compiled
  length): the prompt is longer than 64, so chunk boundaries fall inside the video placeholder and
  the linear layers' state must pass from chunk to chunk through the retained buffers.
* Continuous batching: 4 requests of different lengths on 2 KV rows (so each row is reused by a
  new request, whose linear state must start clean) through the serving engine; each request's
  tokens equal transformers' on that request alone.
* ONNX Runtime and the PyTorch reference backend agree.

The reference prompt ids and model runs are ``helpers.qwen3_reference``'s: from the tokenizer, transformers'
``replace_video_token`` (Qwen3.5 uses Qwen3-VL's processor) and the HF frame sampler's indices, not by the package.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
import yaml
from transformers import Qwen3_5ForConditionalGeneration

from qeff_evs.export.pipeline import ExportOptions
from qeff_evs.export.verify import verify_export
from qeff_evs.models.tiny import save_tiny_checkpoint
from qeff_evs.runtime.engine.scheduler import SchedulerConfig
from qeff_evs.runtime.engine.serving import ServingEngine
from qeff_evs.runtime.engine.single_request import Engine, EngineConfig
from qeff_evs.specializations import read_custom_io_yaml
from qeff_evs.models.pruning import VideoPruning
from qeff_evs.runtime.builders import build_engine, stop_ids
from qeff_evs.runtime.export_bundle import open_export
from qeff_evs.runtime.sessions import sessions_for
from helpers.qwen3_reference import (add_cb_requests, assert_chunked_run_equals, hf_generate, hf_reference,
                                     our_pieces, qeff_evs_run, split_template, until_stop)
from helpers.exports import export_quietly
from helpers.sampled_clips import Clip, sampled_clips
from helpers.top_logits import assert_top_logits_match

ATOL = 1e-4
DECODE_STEPS = 32
Q = 0.5
QUESTION = "What happens in this video?"
TEXT_LAYERS = 4  # linear, full, linear, linear (tiny_layer_types)

# 64x96 px = 4x6 patches of 16 = 2x3 merged tokens per temporal patch.
RESOLUTIONS = ((64, 96),)
FRAMES = (8, 16)
CTX_LEN = 256
FULL_BATCH = 2
EXPORTS = {
    16: ExportOptions(Q, FRAMES, RESOLUTIONS, prefill_seq_len=16, ctx_len=CTX_LEN, user_vision_size=16,
                      full_batch_size=FULL_BATCH),
    64: ExportOptions(Q, FRAMES, RESOLUTIONS, prefill_seq_len=64, ctx_len=CTX_LEN, user_vision_size=64),
}


# 16 frames at 2 fps -> all 16 (8 temporal patches); 8 frames -> 4 temporal patches.
CLIPS = (Clip("long", 16, 70, 100, seed=3, source_fps=2.0), Clip("short", 8, 64, 100, seed=5, source_fps=2.0))


# --------------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return save_tiny_checkpoint("qwen3_5", tmp_path_factory.mktemp("q35_checkpoint"), seed=0,
                                text_layers=TEXT_LAYERS)


@pytest.fixture(scope="module")
def bundles(checkpoint, tmp_path_factory) -> dict:
    return {seq_len: open_export(export_quietly(checkpoint, tmp_path_factory.mktemp(f"q35_export_{seq_len}"), options))
            for seq_len, options in EXPORTS.items()}


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    return Qwen3_5ForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def clips(tmp_path_factory, bundles):
    """``{name: (MediaInput, HF frame indices, fps)}``."""
    return sampled_clips(tmp_path_factory.mktemp("q35_clips"), CLIPS, bundles[16])


@pytest.fixture(scope="module")
def sessions(bundles):
    return {(seq_len, backend): sessions_for(bundle, backend)
            for seq_len, bundle in bundles.items() for backend in ("ort", "torch", "openvino")}


def make_engine(bundles, sessions, seq_len: int, backend: str, q: float) -> Engine:
    m = bundles[seq_len].manifest
    vision, language = sessions[(seq_len, backend)]
    config = EngineConfig(m.prefill_seq_len, m.ctx_len, m.user_vision_size, q, max_new_tokens=DECODE_STEPS)
    return Engine(bundles[seq_len].family, vision, language, config)


# --------------------------------------------------------------------------------------------------
# the reference model runs (helpers.qwen3_reference)


@pytest.fixture(scope="module")
def references(hf_model, bundles, clips):
    tokenizer = bundles[16].tokenizer
    return {(name, q): hf_reference(hf_model, tokenizer, QUESTION, *clips[name], q, DECODE_STEPS)
            for name in ("long", "short") for q in (0.0, Q)}


# --------------------------------------------------------------------------------------------------
# single requests


def test_q0_equals_transformers_generate(bundles, sessions, hf_model, clips, references):
    """Transformers' ``generate`` (its own processor layout, positions, cache) against the engine and the
    hand-run reference: they must agree before the pruned comparisons mean anything."""
    video, indices, fps = clips["long"]
    tokenizer = bundles[16].tokenizer
    ids, hf_tokens, hf_first = hf_generate(hf_model, tokenizer, QUESTION, video, indices, fps, DECODE_STEPS)
    assert references[("long", 0.0)].ids == ids and references[("long", 0.0)].tokens == hf_tokens
    assert len(set(hf_tokens)) > 3, "the tiny model's greedy output is too uniform to tell runs apart"
    before, after = split_template(tokenizer, QUESTION)
    engine = make_engine(bundles, sessions, 16, "ort", 0.0)
    prompt = engine.prepare(our_pieces(before, after), [video])
    assert prompt.ids.tolist() == ids
    result = engine.generate(prompt, eos_ids=())
    assert result.num_prefill_chunks == -(-len(ids) // 16)
    assert result.generated_token_ids == hf_tokens
    assert_top_logits_match(result.prefill_top_logits, hf_first, ATOL)


@pytest.mark.parametrize("backend", ("ort", "torch", "openvino"))
@pytest.mark.parametrize("seq_len", sorted(EXPORTS))
@pytest.mark.parametrize("q", (0.0, Q))
def test_chunked_prefill_and_decode_equal_transformers(bundles, sessions, clips, references, seq_len, backend, q):
    video = clips["long"][0]
    ref = references[("long", q)]
    tokenizer = bundles[seq_len].tokenizer
    assert_chunked_run_equals(make_engine(bundles, sessions, seq_len, backend, q), video, ref, tokenizer, QUESTION,
                              seq_len, ATOL)


# --------------------------------------------------------------------------------------------------
# continuous batching: 4 requests on 2 rows, each row reused


class RecordingLanguage:
    """Delegates to a language session and logs each prefill call's (cache row, first KV slot)."""

    def __init__(self, inner):
        self.inner = inner
        self.prefills: list[tuple[int, int]] = []

    @property
    def shape(self):
        return self.inner.shape

    def close(self) -> None:
        self.inner.close()

    def prefill(self, cache_row: int, step):
        self.prefills.append((cache_row, int(step.position_ids[0, 0, 0])))
        return self.inner.prefill(cache_row, step)

    def decode(self, rows, pad_token_id: int = 0):
        return self.inner.decode(rows, pad_token_id)


def test_continuous_batching_reused_rows_equal_transformers(bundles, sessions, hf_model, clips, references):
    """Four requests (two clips, three questions: four prompt lengths) through the serving engine over
    a 2-row export, after the single-request tests used row 0: the third and fourth request start in
    rows whose linear-attention state holds a finished request's. Each request's tokens equal
    transformers' on that request alone."""
    bundle = bundles[16]
    m = bundle.manifest
    vision, language = sessions[(16, "ort")]
    recording = RecordingLanguage(language)
    scheduler = SchedulerConfig(max_num_batched_tokens=2 * m.prefill_seq_len, max_num_seqs=FULL_BATCH,
                                prefill_seq_len=m.prefill_seq_len, ctx_len=m.ctx_len, encoder_compute_budget=256,
                                encoder_cache_size=256)
    config = EngineConfig(m.prefill_seq_len, m.ctx_len, m.user_vision_size, Q)
    engine = ServingEngine(bundle.family, vision, recording, config, scheduler)
    known = {(clip, QUESTION): references[(clip, Q)] for clip in ("long", "short")}
    expected = add_cb_requests(engine, hf_model, bundle.tokenizer, clips, known, Q, DECODE_STEPS)
    outputs = engine.run_to_completion()
    first_chunks = [row for row, slot in recording.prefills if slot == 0]
    assert len(first_chunks) == 4 and sorted(set(first_chunks)) == list(range(FULL_BATCH)), recording.prefills
    for request_id, tokens in expected.items():
        assert outputs[request_id] == tokens, request_id


# --------------------------------------------------------------------------------------------------
# what the export folder tells the compiler and the runtime about the state buffers


def test_export_describes_the_state_buffers(bundles, hf_model):
    """Manifest, custom IO, node precision and compile line of the CB export, against the checkpoint's
    own layer types and widths (read from transformers' config, not from the package)."""
    bundle = bundles[16]
    folder = bundle.export_dir
    text = hf_model.config.text_config
    linear = [i for i, kind in enumerate(text.layer_types) if kind == "linear_attention"]
    full = [i for i, kind in enumerate(text.layer_types) if kind == "full_attention"]
    assert linear and full
    conv_dim = 2 * text.linear_num_key_heads * text.linear_key_head_dim + \
        text.linear_num_value_heads * text.linear_value_head_dim
    shape = bundle.manifest.language_shape
    assert shape.kv_layers == tuple(full)
    states = {state.name: state for state in shape.layer_states}
    assert states["conv_state"].layers == states["recurrent_state"].layers == tuple(linear)
    assert states["conv_state"].row_shape == (conv_dim, text.linear_conv_kernel_dim - 1)
    assert states["recurrent_state"].row_shape == (text.linear_num_value_heads, text.linear_key_head_dim,
                                                   text.linear_value_head_dim)
    assert (states["conv_state"].precision, states["recurrent_state"].precision) == ("float16", "float32")

    graph = onnx.load(str(folder / "language" / "language.onnx"), load_external_data=False)
    inputs = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in graph.graph.input}
    outputs = {o.name for o in graph.graph.output}
    for i in linear:
        assert f"past_key.{i}" not in inputs
        assert inputs[f"conv_state.{i}"] == ["full_batch_size", conv_dim, text.linear_conv_kernel_dim - 1]
        assert inputs[f"recurrent_state.{i}"][1:] == list(states["recurrent_state"].row_shape)
        assert {f"conv_state.{i}_RetainedState", f"recurrent_state.{i}_RetainedState"} <= outputs
    for i in full:
        assert inputs[f"past_key.{i}"] == ["full_batch_size", text.num_key_value_heads, "ctx_len", text.head_dim]

    custom_io = read_custom_io_yaml(folder / "language" / "custom_io.yaml")
    for i in linear:  # fp16 conv state on the card; the recurrent state stays an fp32 buffer
        assert custom_io[f"conv_state.{i}"] == custom_io[f"conv_state.{i}_RetainedState"] == "float16"
        assert f"recurrent_state.{i}" not in custom_io and f"recurrent_state.{i}_RetainedState" not in custom_io
    listed = yaml.safe_load((folder / "language" / "node_precision.yaml").read_text())["FP32NodeInstanceNames"]
    produced = {name for node in graph.graph.node for name in node.output}
    assert listed and set(listed) <= produced
    assert {f"recurrent_state.{i}_RetainedState" for i in linear} <= set(listed)
    language_line = next(line for line in (folder / "compile.sh").read_text().splitlines()
                         if "-m=language/language.onnx" in line)
    assert "-node-precision-info=language/node_precision.yaml" in language_line and "-retained-state" in language_line
    assert bundle.manifest.files["language_node_precision"] == "language/node_precision.yaml"


def test_verify_fp16_follows_the_state_over_many_chunks(bundles):
    """``qeff-evs verify --fp16``: the state workload runs chunk after chunk then decodes, with the fp32
    state path kept as the node-precision file says; the state stays close to fp32's."""
    report = verify_export(bundles[16].export_dir, fp16=True)
    assert not report.problems
    state = next(c for c in report.comparisons if c.name == "layer_states")
    assert state.detail["chunks"] >= 8 and state.detail["decode_steps"] >= 32
    assert state.detail["recurrent_state_relative_error"] < 5e-2
    assert state.detail["conv_state_relative_error"] < 5e-2
    assert state.greedy_agreement >= 0.9


def test_qeff_evs_run_equals_transformers(bundles, references, tmp_path, capsys):
    """``qeff-evs run`` (the CLI, its own prompt and stop ids) over the 64-token export at its q = 0.5."""
    bundle = bundles[64]
    result = qeff_evs_run(bundle, CLIPS[0], QUESTION, DECODE_STEPS, tmp_path, capsys)
    ref = references[("long", Q)]
    assert result["prompt_token_ids"] == ref.ids
    assert result["generated_token_ids"] == until_stop(ref.tokens, stop_ids(bundle))


def test_vidcom2_equals_transformers(bundles, hf_model, clips):
    """VidCom2 (vLLM's scores, its own pruning graph) at q = 0.5 over the 16-token export, chunked and decoded."""
    video, indices, fps = clips["long"]
    bundle = bundles[16]
    ref = hf_reference(hf_model, bundle.tokenizer, QUESTION, video, indices, fps, Q, DECODE_STEPS, method="vidcom2")
    engine = build_engine(bundle, "ort", max_new_tokens=DECODE_STEPS, pruning=VideoPruning("vidcom2", Q))
    prompt = engine.prepare(our_pieces(*split_template(bundle.tokenizer, QUESTION)), [video])
    assert prompt.ids.tolist() == ref.ids
    np.testing.assert_array_equal(prompt.encoded[0].kept_indices, ref.kept)
    result = engine.generate(prompt, eos_ids=())
    assert result.generated_token_ids == ref.tokens
    assert_top_logits_match(result.prefill_top_logits, ref.first_logits, ATOL)
