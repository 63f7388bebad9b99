"""End to end on tiny MoE checkpoints (Qwen3-VL-MoE and Qwen3.5-MoE): checkpoint folder -> ``qeff-evs export``
-> engine / ``qeff-evs run``, against transformers' own ``...MoeForConditionalGeneration``, whose sparse blocks
loop over the experts the data hit (the referee for our static expert forms).

Both families, parametrised (``FAMILIES``):

* the tiny checkpoints route: 4 experts, 2 per token, and the tokens of one video prompt spread over the
  experts in every sparse layer (the histogram is in the assertion message); Qwen3-VL-MoE keeps its last
  layer dense (``mlp_only_layers``), Qwen3.5-MoE has its gated shared expert;
* q = 0: the engine's 32 greedy tokens equal transformers' ``generate``; prefill logits within 1e-4;
* q 0 and 0.5 with EVS and VidCom2, prefill lengths 16 and 64 (each its own export; chunk boundaries fall inside
  the video placeholder): ids, int64 positions, kept indices, 32 greedy tokens and the prefill logits equal
  transformers run by hand on the real pruned layout (``helpers.qwen3_reference``);
* continuous batching: 4 requests of different lengths on 2 KV rows through the serving engine;
* the PyTorch reference backend agrees; ``qeff-evs run`` on the CLI export equals transformers;
* on the card the routers run in fp32 (``node_precision.yaml``), and ``verify --fp16``'s router probe reports them.

A prefill chunk here has ``tokens x k >= E``, so the ``hit`` expert form runs every expert; a one-row decode step
runs exactly its token's 2: both of its static shapes are exercised.
"""

from __future__ import annotations

import shutil
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
import yaml

from qeff_evs import cli
from qeff_evs.export.node_precision import router_paths
from qeff_evs.export.pipeline import ExportOptions, export_checkpoint
from qeff_evs.export.verify_routers import RouterChunk, router_comparison, video_like_router_chunks
from qeff_evs.models.graph_io import PAD_POSITION
from qeff_evs.models.registry import family_class
from qeff_evs.models.tiny import save_tiny_checkpoint
from qeff_evs.runtime.builders import stop_ids
from qeff_evs.runtime.engine.scheduler import SchedulerConfig
from qeff_evs.runtime.engine.serving import ServingEngine
from qeff_evs.runtime.engine.single_request import Engine, EngineConfig
from qeff_evs.runtime.export_bundle import open_export
from qeff_evs.runtime.sessions import sessions_for
from helpers.qwen3_reference import (add_cb_requests, assert_chunked_run_equals, hf_generate, hf_reference,
                                     our_pieces, qeff_evs_run, split_template, until_stop)
from helpers.sampled_clips import Clip, sampled_clips
from helpers.top_logits import assert_top_logits_match

FAMILIES = ("qwen3_vl_moe", "qwen3_5_moe")
TEXT_LAYERS = {"qwen3_vl_moe": 3, "qwen3_5_moe": 4}  # VL: sparse, sparse, dense; 3.5: linear, full, linear, linear
ATOL = 1e-4
DECODE_STEPS = 32
Q = 0.5
QUESTION = "What happens in this video?"
CASES = ((0.0, "evs"), (Q, "evs"), (Q, "vidcom2"))  # (rate, method)
ROUTER_CHUNKS = 3  # verify's router probe over 3 chunks of the 16-token export (verify itself runs 8)
# The vision tower's initializer: the tiny default (0.3) puts the merged rows at |x| ~ 60, where ONNX Runtime's
# and torch's fp32 encoders differ by ~1e-4 (the shared encoder graph, not the language graph: with torch's rows
# the ORT language graph is within 3e-5 of transformers), which reaches the logits past the 1e-4 tolerance.
TINY_VISION = {"initializer_range": 0.1}

RESOLUTION = (64, 96)  # 4x6 patches of 16 = 2x3 merged tokens per temporal patch
FRAMES = (8, 16)
CTX_LEN = 256
FULL_BATCH = 2
CB_EXPORT = ExportOptions(Q, FRAMES, (RESOLUTION,), prefill_seq_len=16, ctx_len=CTX_LEN, user_vision_size=16,
                          full_batch_size=FULL_BATCH)
CLI_EXPORT = ["--video-pruning-rate", str(Q), "--frames", ",".join(map(str, FRAMES)), "--height", str(RESOLUTION[0]),
              "--width", str(RESOLUTION[1]), "--prefill-seq-len", "64", "--ctx-len", str(CTX_LEN),
              "--weight-dtype", "float32"]  # compared with transformers in fp32 (the card target stores fp16)

# 16 frames at 2 fps -> all 16 (8 temporal patches); 8 frames -> 4 temporal patches.
CLIPS = (Clip("long", 16, 70, 100, seed=3, source_fps=2.0), Clip("short", 8, 64, 100, seed=5, source_fps=2.0))


# --------------------------------------------------------------------------------------------------
# fixtures: per family, one checkpoint, a 16-token CB export (Python API) and a 64-token export (the CLI)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def checkpoint(family, tmp_path_factory) -> Path:
    return save_tiny_checkpoint(family, tmp_path_factory.mktemp(f"{family}_checkpoint"), seed=0,
                                text_layers=TEXT_LAYERS[family], vision_config=TINY_VISION)


@pytest.fixture(scope="module")
def bundles(family, checkpoint, tmp_path_factory) -> dict:
    cb_folder, cli_folder = (tmp_path_factory.mktemp(f"{family}_export_{n}") for n in (16, 64))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        export_checkpoint(checkpoint, cb_folder, CB_EXPORT)
        assert cli.main(["export", str(checkpoint), "-o", str(cli_folder), *CLI_EXPORT]) == 0
    return {16: open_export(cb_folder), 64: open_export(cli_folder)}


@pytest.fixture(scope="module")
def hf_model(family, checkpoint):
    return family_class(family).model_class.from_pretrained(checkpoint, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def clips(family, tmp_path_factory, bundles):
    """``{name: (MediaInput, HF frame indices, fps)}``."""
    return sampled_clips(tmp_path_factory.mktemp(f"{family}_clips"), CLIPS, bundles[16])


@pytest.fixture(scope="module")
def sessions(bundles):
    return {(seq_len, backend, method): sessions_for(bundle, backend, method=method)
            for seq_len, bundle in bundles.items() for backend in ("ort", "torch", "openvino")
            for method in ("evs", "vidcom2") if backend == "ort" or (seq_len, method) == (16, "evs")}


@pytest.fixture(scope="module")
def references(hf_model, bundles, clips):
    tokenizer = bundles[16].tokenizer
    return {(q, method): hf_reference(hf_model, tokenizer, QUESTION, *clips["long"], q, DECODE_STEPS, method=method)
            for q, method in CASES}


# --------------------------------------------------------------------------------------------------
# the tiny checkpoints route


def sparse_blocks(hf_model) -> dict[int, torch.nn.Module]:
    return {i: layer.mlp for i, layer in enumerate(hf_model.model.language_model.layers) if hasattr(layer.mlp, "gate")}


def test_tokens_of_one_prompt_go_to_different_experts(family, hf_model, bundles, clips, references):
    """Transformers' own routers over the q = 0 prompt (its prefill): every sparse layer sends the video's tokens
    to every one of the 4 experts, none taking most of them."""
    text = hf_model.config.text_config
    assert (text.num_experts, text.num_experts_per_tok) == (4, 2)
    blocks = sparse_blocks(hf_model)
    layers = hf_model.model.language_model.layers
    if family == "qwen3_vl_moe":  # the config keeps a dense layer, which our graph must leave dense
        assert text.mlp_only_layers and set(blocks) == set(range(len(layers))) - set(text.mlp_only_layers)
    else:  # every layer sparse, each with the gated shared expert
        assert set(blocks) == set(range(len(layers))) and all(hasattr(b, "shared_expert_gate") for b in blocks.values())
    chosen: dict[int, torch.Tensor] = {}

    def record(layer: int):
        def hook(module, args, out) -> None:  # the first call is the prefill; the router returns (logits, w, ids)
            chosen.setdefault(layer, out[2])
        return hook

    hooks = [block.gate.register_forward_hook(record(i)) for i, block in blocks.items()]
    try:
        ref = hf_reference(hf_model, bundles[16].tokenizer, QUESTION, *clips["long"], 0.0, 1)
    finally:
        for hook in hooks:
            hook.remove()
    is_video = torch.tensor(ref.ids) == hf_model.config.video_token_id
    histogram = {i: Counter(experts[is_video].reshape(-1).tolist()) for i, experts in chosen.items()}
    message = f"expert histogram of the video's {int(is_video.sum())} tokens per sparse layer: " + "; ".join(
        f"layer {i}: {[histogram[i][e] for e in range(text.num_experts)]}" for i in sorted(histogram))
    print(message)
    for counts in histogram.values():
        assert len(counts) == text.num_experts, message
        assert max(counts.values()) < 0.5 * sum(counts.values()), message  # of 2 choices per token
    assert ref.tokens == references[(0.0, "evs")].tokens[:1]


# --------------------------------------------------------------------------------------------------
# single requests against transformers


def make_engine(bundles, sessions, seq_len: int, backend: str, q: float, method: str):
    m = bundles[seq_len].manifest
    vision, language = sessions[(seq_len, backend, method)]
    config = EngineConfig(m.prefill_seq_len, m.ctx_len, m.user_vision_size, q, max_new_tokens=DECODE_STEPS,
                          video_pruning_method=method)
    return Engine(bundles[seq_len].family, vision, language, config)


def test_q0_equals_transformers_generate(bundles, sessions, hf_model, clips, references):
    """Transformers' ``generate`` (its processor layout, positions, cache and looped experts) against the engine
    and the hand-run reference: they must agree before the pruned comparisons mean anything."""
    video, indices, fps = clips["long"]
    tokenizer = bundles[16].tokenizer
    ids, hf_tokens, hf_first = hf_generate(hf_model, tokenizer, QUESTION, video, indices, fps, DECODE_STEPS)
    assert references[(0.0, "evs")].ids == ids and references[(0.0, "evs")].tokens == hf_tokens
    assert len(set(hf_tokens)) > 3, "the tiny model's greedy output is too uniform to tell runs apart"
    engine = make_engine(bundles, sessions, 16, "ort", 0.0, "evs")
    prompt = engine.prepare(our_pieces(*split_template(tokenizer, QUESTION)), [video])
    assert prompt.ids.tolist() == ids
    result = engine.generate(prompt, eos_ids=())
    assert result.generated_token_ids == hf_tokens
    assert_top_logits_match(result.prefill_top_logits, hf_first, ATOL)


@pytest.mark.parametrize("seq_len", (16, 64))
@pytest.mark.parametrize("q, method", CASES)
def test_chunked_prefill_and_decode_equal_transformers(bundles, sessions, clips, references, seq_len, q, method):
    video = clips["long"][0]
    ref = references[(q, method)]
    assert_chunked_run_equals(make_engine(bundles, sessions, seq_len, "ort", q, method), video, ref,
                              bundles[seq_len].tokenizer, QUESTION, seq_len, ATOL)


@pytest.mark.parametrize("backend", ("torch", "openvino"))
def test_torch_backend_equals_transformers(bundles, sessions, clips, references, backend):
    """The PyTorch reference backend (the same language module, eager), and OpenVINO on the ONNX Runtime graphs, at
    q = 0.5 with EVS."""
    ref = references[(Q, "evs")]
    engine = make_engine(bundles, sessions, 16, backend, Q, "evs")
    prompt = engine.prepare(our_pieces(*split_template(bundles[16].tokenizer, QUESTION)), [clips["long"][0]])
    result = engine.generate(prompt, eos_ids=())
    assert result.generated_token_ids == ref.tokens
    assert_top_logits_match(result.prefill_top_logits, ref.first_logits, ATOL)


# --------------------------------------------------------------------------------------------------
# continuous batching: 4 requests on 2 rows


def test_continuous_batching_equals_transformers(bundles, sessions, hf_model, clips, references):
    """Four requests (two clips, three questions: four prompt lengths) through the serving engine over the 2-row
    export: decode steps carry 2 rows (every expert runs), rows are reused; each request's tokens equal
    transformers' on that request alone."""
    bundle = bundles[16]
    m = bundle.manifest
    vision, language = sessions[(16, "ort", "evs")]
    scheduler = SchedulerConfig(max_num_batched_tokens=2 * m.prefill_seq_len, max_num_seqs=FULL_BATCH,
                                prefill_seq_len=m.prefill_seq_len, ctx_len=m.ctx_len, encoder_compute_budget=256,
                                encoder_cache_size=256)
    engine = ServingEngine(bundle.family, vision, language, EngineConfig(m.prefill_seq_len, m.ctx_len,
                                                                         m.user_vision_size, Q), scheduler)
    expected = add_cb_requests(engine, hf_model, bundle.tokenizer, clips, {("long", QUESTION): references[(Q, "evs")]},
                               Q, DECODE_STEPS)
    outputs = engine.run_to_completion()
    for request_id, tokens in expected.items():
        assert outputs[request_id] == tokens, request_id


# --------------------------------------------------------------------------------------------------
# qeff-evs run


@pytest.mark.parametrize("method", ("evs", "vidcom2"))
def test_qeff_evs_run_equals_transformers(bundles, references, tmp_path, capsys, method):
    """``qeff-evs run`` (the CLI, its own prompt and stop ids) over the CLI's 64-token export at q = 0.5."""
    bundle = bundles[64]
    result = qeff_evs_run(bundle, CLIPS[0], QUESTION, DECODE_STEPS, tmp_path, capsys, "--video-pruning-method", method)
    ref = references[(Q, method)]
    assert result["prompt_token_ids"] == ref.ids
    assert result["generated_token_ids"] == until_stop(ref.tokens, stop_ids(bundle))


# --------------------------------------------------------------------------------------------------
# the routers on the card


def test_routers_are_kept_fp32_on_the_card(bundles, hf_model, tmp_path):
    """Every sparse layer's router path (logits MatMul to renormalised weights) is in the language graph's
    node-precision file, which compile.sh passes; verify --fp16's router probe finds the same routers, says they
    compile in fp32 and reports the top-k flips of both precisions with their margins. The probe runs on a copy
    whose language weights are external files, as torch writes a released-width graph (past 2 GB)."""
    folder = tmp_path / "export"
    shutil.copytree(bundles[16].export_dir, folder)
    language = folder / "language" / "language.onnx"
    onnx.save(onnx.load(str(language)), str(language), save_as_external_data=True, all_tensors_to_one_file=False)
    graph = onnx.load(str(folder / "language" / "language.onnx"), load_external_data=False)
    paths = router_paths(graph)
    assert len(paths) == len(sparse_blocks(hf_model))
    listed = set(yaml.safe_load((folder / "language" / "node_precision.yaml").read_text())["FP32NodeInstanceNames"])
    assert all(set(path) <= listed for path in paths)
    line = next(line for line in (folder / "compile.sh").read_text().splitlines() if "-m=language/language.onnx" in line)
    assert "-node-precision-info=language/node_precision.yaml" in line
    # verify's workload with its last chunk padded after half its tokens, as the runtime pads a prompt's last
    # chunk (pad ids, every position -1): only the real tokens count.
    workload = video_like_router_chunks(folder, ROUTER_CHUNKS)
    seq_len = bundles[16].manifest.prefill_seq_len
    last, real = workload[-1], seq_len // 2
    ids, positions = last.input_ids.copy(), last.position_ids.copy()
    ids[:, real:], positions[..., real:] = 0, PAD_POSITION
    workload[-1] = RouterChunk(ids, positions, last.vision, np.arange(seq_len) < real)
    report = router_comparison(folder, workload=workload)
    detail = report.detail
    assert detail["routers"] == len(paths) and detail["compiled_router_precision"] == "float32"
    tokens = detail["tokens_x_layers"]
    assert tokens == len(paths) * ((ROUTER_CHUNKS - 1) * seq_len + real)
    for precision in ("fp16", "fp32"):  # the tiny models' flips come from hidden states drifting in fp16
        share, margins = detail[f"flipped_share_router_{precision}"], detail[f"flipped_margins_router_{precision}"]
        assert share < 0.02 and len(margins) == round(share * tokens)
        # A flip needs two probabilities' errors to pass their margin, so every flip is within twice its error.
        assert detail[f"within_error_share_router_{precision}"] >= share
        # Rounding moves the probabilities, a broken emulation would move them far (the tiny models' largest: 1.1e-2).
        assert 0 < detail[f"prob_error_max_router_{precision}"] < 0.05
    assert 0 <= detail["router_own_error_median"] <= detail["router_own_error_max"] < 0.05

