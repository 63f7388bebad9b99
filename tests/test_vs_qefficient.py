"""``qeff-evs bench --vs-qefficient``: the same checkpoint and frames through QEfficient's graphs and ours.

* Without QEfficient (CI): our side's pieces — bytes accounting against the feeds the engine builds, the one
  failure line when QEfficient's interpreter cannot export (the real driver run by a Python without QEfficient),
  and the whole report (JSON, Markdown, PNG) of a run that carries on with ours alone.
* With QEfficient (``$QEFF_EVS_QEFFICIENT_PYTHON``: the Python of a side environment made by
  ``install_qefficient_cpu.sh``): the comparison end to end on tiny Qwen2.5-VL and Qwen3-VL checkpoints, each
  side against transformers.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from qeff_evs.bench.vs_qefficient import (QEFFICIENT_PYTHON_ENV, VsConfig, bytes_point, failure_line,
                                          image_prompt_ids, run_comparison, run_driver, step_bytes, vision_bytes)
from qeff_evs.bench.vs_qefficient_report import summary_markdown, summary_row
from qeff_evs.models.tiny import save_tiny_checkpoint
from qeff_evs.runtime.inputs.synthetic import moving_square_video

# Per family: a frame size the tiny tower takes (multiples of patch x merge) and a clip of 8 frames at 2 fps.
SIZES = {"qwen2_5_vl": (56, 84), "qwen3_vl": (64, 96)}
FRAMES = 8
# The released checkpoints' rotary layout (head_dim 128 and their mrope sections) on tiny widths: QEfficient's
# M-RoPE code slices the rotary dimension for that layout (a tiny head_dim of 16 with sections [2, 3, 3] makes its
# Qwen3-VL interleave write past a half), so a comparison on the tiny default layout would test that instead.
ROPE = {"rope_theta": 10000.0, "rope_type": "default"}
RELEASED_ROTARY = {
    "qwen2_5_vl": {"text_config": {"hidden_size": 128, "num_attention_heads": 1, "num_key_value_heads": 1,
                                   "rope_parameters": {**ROPE, "mrope_section": [16, 24, 24]}},
                   "vision_config": {"out_hidden_size": 128}},
    "qwen3_vl": {"text_config": {"head_dim": 128, "rope_parameters": {**ROPE, "mrope_section": [24, 20, 20],
                                                                      "mrope_interleaved": True}}},
}


def clip(folder: Path, size) -> Path:
    path = folder / "clip.npy"
    np.save(path, moving_square_video(FRAMES, size[0], size[1], seed=3))
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    made = {}

    def get(family: str):
        if family not in made:
            folder = tmp_path_factory.mktemp(f"vs_{family}")
            checkpoint = save_tiny_checkpoint(family, folder / "checkpoint", seed=0, **RELEASED_ROTARY[family])
            made[family] = (checkpoint, clip(folder, SIZES[family]))
        return made[family]
    return get


def config(checkpoint, clip_path, family, python=None) -> VsConfig:
    return VsConfig(checkpoint, clip_path, python, frames=FRAMES, size=SIZES[family], prefill_seq_len=16,
                    ctx_len=256, new_tokens=6, accounting_frames=(16,))


def compare(tiny, family, tmp_path, python=None) -> dict:
    checkpoint, clip_path = tiny(family)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return run_comparison(config(checkpoint, clip_path, family, python), tmp_path / "out", tmp_path / "work",
                              lambda message: None)


# ---- our side's pieces ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen3_window(tiny, tmp_path_factory):
    """A tiny Qwen3-VL export (deepstack levels beside the rows), its ORT sessions and the clip's prompt at q 0."""
    from qeff_evs.export.pipeline import ExportOptions, export_checkpoint
    from qeff_evs.runtime.engine.single_request import Engine, EngineConfig
    from qeff_evs.runtime.export_bundle import open_export
    from qeff_evs.runtime.inputs.prompt import video_question_pieces
    from qeff_evs.runtime.media import video_from_file
    from qeff_evs.runtime.sessions import sessions_for

    checkpoint, clip_path = tiny("qwen3_vl")
    folder = tmp_path_factory.mktemp("qwen3_window_export")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        export_checkpoint(checkpoint, folder, ExportOptions(0.0, (FRAMES,), (SIZES["qwen3_vl"],), 16, 256))
    bundle = open_export(folder)
    shape = bundle.language_shape
    sessions = sessions_for(bundle, "ort")
    engine = Engine(bundle.family, *sessions, EngineConfig(16, 256, shape.vision_size, 0.0))
    prompt = engine.prepare(video_question_pieces(bundle.tokenizer, "What?", bundle.family.token_strings),
                            [video_from_file(clip_path, bundle)])
    return shape, sessions[1], prompt


def test_vision_bytes_of_one_window_are_the_rows_fed(qwen3_window):
    """The accounting (rows x hidden x levels x 4) equals the bytes of the window our engine feeds a chunk."""
    from qeff_evs.runtime.engine.steps import prefill_step

    shape, _, prompt = qwen3_window
    step = prefill_step(prompt, 0, 16, 16, shape.vision_size, shape.hidden, shape.extras)
    levels = sum(shape.extras.values())
    assert levels > 0
    vision, per_call = step_bytes(step)
    assert vision == vision_bytes(shape.vision_size, shape.hidden, levels)
    assert per_call == vision + 16 * 8 + 4 * 16 * 8 + 8  # ids, positions, image_idx: int64


def test_all_bytes_per_chunk_are_what_the_session_binds(qwen3_window):
    """Our 'all bytes per chunk' is what ``OrtLanguageSession`` (built as ``run_comparison`` builds it) hands ONNX
    Runtime per prefill call, recorded at its IOBinding: the per-call inputs and the window, no KV. The KV buffers
    are bound once and written in place: the same arrays after the prefill, holding every chunk's rows."""
    from qeff_evs.runtime.backends.ort import OrtLanguageSession
    from qeff_evs.runtime.engine.steps import prefill_step
    from qeff_evs.runtime.engine.window import prefill_chunks

    shape, language, prompt = qwen3_window
    session = OrtLanguageSession(language.session, shape)
    kv = {name: buffer for name, buffer in session.state.items() if name.startswith("past_")}
    assert kv
    bound: list[tuple[str, int]] = []
    for binding in session.bindings:
        for method in ("bind_cpu_input", "bind_ortvalue_input"):
            original = getattr(binding, method)

            def spy(name, value, original=original):
                bound.append((name, int(np.asarray(value.numpy() if hasattr(value, "numpy") else value).nbytes)))
                return original(name, value)
            setattr(binding, method, spy)
    steps = [prefill_step(prompt, c, n, 16, shape.vision_size, shape.hidden, shape.extras)
             for c, n in prefill_chunks(len(prompt.ids), 16)]
    assert len(steps) > 1
    for step in steps:
        bound.clear()
        session.run(step)
        assert not [name for name, _ in bound if name in kv], bound
        assert sum(size for _, size in bound) == step_bytes(step, shape.logits_rows)[1], bound
    for name, buffer in kv.items():  # one slot per prompt token written, into the buffer bound at the start
        assert session.state[name] is buffer
        assert int(np.any(buffer != 0, axis=(0, 1, 3)).sum()) == len(prompt.ids), name


def test_bytes_point_at_released_widths():
    """Qwen2.5-VL-3B widths, 448x448 frames (256 merged rows each), a window of 128: 16 frames -> 32x, 64 -> 128x."""
    sixteen, sixty_four = (bytes_point(f, 256, 128, 2048, 0) for f in (16, 64))
    assert (sixteen.qefficient_rows, sixteen.qefficient_bytes) == (4096, 4096 * 2048 * 4)
    assert sixteen.qeff_evs_bytes == 128 * 2048 * 4
    assert (sixteen.ratio, sixty_four.ratio) == (32.0, 128.0)
    assert bytes_point(16, 256, 128, 2048, 3).ratio == 32.0  # deepstack levels scale both sides alike


def test_image_prompt_expands_one_pad_per_frame(tiny):
    from transformers import AutoTokenizer

    from qeff_evs.models.registry import family_class

    checkpoint, _ = tiny("qwen2_5_vl")
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    tokens = family_class("qwen2_5_vl").token_strings
    ids = image_prompt_ids(tokenizer, tokens, "What?", [6, 6, 6])
    pad, start = (tokenizer.convert_tokens_to_ids(t) for t in (tokens.image, "<|vision_start|>"))
    # Independent: the template rendered by transformers, each image pad written out 6 times.
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}] * 3 + [{"type": "text", "text": "What?"}]}],
        tokenize=False, add_generation_prompt=True).replace(tokens.image, tokens.image * 6)
    assert ids.tolist() == tokenizer.encode(text, add_special_tokens=False)
    assert int((ids == pad).sum()) == 18 and int((ids == start).sum()) == 3


def test_failure_line_names_the_stage_and_qefficients_last_words():
    line = failure_line("export", "Traceback ...\n  File x\nRuntimeError: shape mismatch\n")
    assert line == "QEfficient failed at export: RuntimeError: shape mismatch (qeff-evs measured alone)"


def test_driver_without_qefficient_fails_in_one_line(tmp_path):
    """The real driver, run by a Python that has no QEfficient (this one): one line, no exception."""
    result = run_driver(Path(sys.executable), {"checkpoint": str(tmp_path), "prefill_seq_len": 16, "ctx_len": 64,
                                               "image_grid_thw": [[1, 4, 6]]},
                        tmp_path / "qefficient", np.zeros(4, dtype=np.int64), 120, lambda message: None)
    assert result.failure == ("QEfficient failed at export: ModuleNotFoundError: No module named 'QEfficient' "
                              "(qeff-evs measured alone)")
    assert result.vision_onnx is None


def test_driver_killed_fails_in_one_line(tmp_path):
    """QEfficient's interpreter killed mid-export (the kernel's out-of-memory kill is SIGKILL): one line."""
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\nkill -9 $$\n")
    python.chmod(0o755)
    (tmp_path / "qefficient").mkdir()
    (tmp_path / "qefficient" / "qefficient.json").write_text('{"vision_onnx": "stale"}')  # an earlier run's
    result = run_driver(python, {}, tmp_path / "qefficient", np.zeros(4, dtype=np.int64), 60, lambda message: None)
    assert result.failure == (
        "QEfficient failed at export: its Python exited -9 (killed by signal 9; 9 is also the kernel's out-of-memory "
        f"kill) without a result; see {tmp_path / 'qefficient' / 'qefficient.log'} (qeff-evs measured alone)")


@pytest.mark.parametrize("extra, message", [
    ([], "--vs-qefficient needs --clip: the video both sides are given"),
    (["--clip", "nowhere.npy"], "--clip nowhere.npy: not found"),
])
def test_command_refuses_a_missing_clip(tmp_path, capsys, extra, message):
    from qeff_evs.cli import main

    assert main(["bench", "--vs-qefficient", str(tmp_path), "-o", str(tmp_path / "out"), *extra]) == 2
    assert capsys.readouterr().err.strip() == f"qeff-evs bench: error: {message}"


def test_refuses_a_python_that_is_not_there(tmp_path):
    from qeff_evs.bench.vs_qefficient import qefficient_python

    with pytest.raises(ValueError, match=r"--qefficient-python .*nowhere.*QEFF_EVS_QEFFICIENT_PYTHON"):
        qefficient_python(tmp_path / "nowhere")


def test_report_without_qefficient_carries_on_with_ours(tiny, tmp_path):
    """No QEfficient Python: the report says so in one line; our rates, fidelity and accounting are all there."""
    results = compare(tiny, "qwen2_5_vl", tmp_path)
    assert results["qefficient"]["failure"].startswith("QEfficient not run: no --qefficient-python given")
    assert results["qefficient"]["cost"] is None and "qefficient" not in results["fidelity"]
    ours = results["qeff_evs"]["rates"]
    assert list(ours) == ["0", "0.5", "0.75"]
    # q = 0 against transformers on the same video and vLLM's positions: fp32 tolerance, same tokens.
    fidelity = results["fidelity"]["qeff_evs"]
    assert fidelity["max_abs_logit_diff"] <= 1e-4 and fidelity["tokens_equal"], fidelity
    # Pruning shortens the prompt; every chunk gets the same window of user_vision_size rows.
    assert ours["0"]["prompt_tokens"] > ours["0.5"]["prompt_tokens"] > ours["0.75"]["prompt_tokens"]
    assert {cost["vision_rows_per_chunk"] for cost in ours.values()} == {16}
    # The KV cache is bound in place, not fed: a chunk's bytes are its window and a few hundred of ids and positions.
    for cost in ours.values():
        assert cost["state_in_place"] and 0 < cost["all_bytes_per_chunk"] - cost["vision_bytes_per_chunk"] < 1024
    saved = json.loads((tmp_path / "out" / "vs_qefficient.json").read_text())
    assert saved["fidelity"] == results["fidelity"]
    table = (tmp_path / "out" / "vs_qefficient.md").read_text()
    assert "**QEfficient not run: no --qefficient-python given" in table and "| qeff-evs q=0.75 |" in table
    assert (tmp_path / "out" / "vs_qefficient.png").stat().st_size > 0
    # The one-table summary: no QEfficient ratios, the failure line under the table, our fidelity in its column.
    row = summary_row(results)
    assert row["qefficient_over_ours"] == {q: {"prefill_s": None, "ttft_s": None} for q in ("0", "0.75")}
    # 56x84 frames: 2x3 merged rows per image; 8 images (then 16) over a window of 16 rows.
    assert row["vision_bytes_ratio"] == {"8": 3.0, "16": 6.0}
    summary = summary_markdown([row])
    assert len(summary) == 5 and summary[2].count("| n/a ") == 6 and "tokens equal |" in summary[2]
    assert "| every state fed |" in summary[2]
    assert summary[-1] == f"qwen2_5_vl: {row['qefficient_failure']}"


# ---- end to end with QEfficient -----------------------------------------------------------------------------

QEFFICIENT = os.environ.get(QEFFICIENT_PYTHON_ENV)


@pytest.mark.skipif(not QEFFICIENT, reason=f"no QEfficient Python configured: set {QEFFICIENT_PYTHON_ENV} to the "
                    "Python of a side environment with QEfficient (how to make one: docs/performance.md#compared-with-qefficient)")
@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_comparison_end_to_end(tiny, tmp_path, family):
    results = compare(tiny, family, tmp_path, Path(QEFFICIENT))
    qe = results["qefficient"]
    assert qe["failure"] is None, qe["failure"]
    cost, ours = qe["cost"], results["qeff_evs"]["rates"]["0"]
    # Frames as images: every frame's rows (a Qwen2.5-VL image repeats its frame over the temporal patch, so
    # twice a video's rows there), and all of them with every chunk.
    assert cost["vision_rows_per_chunk"] == cost["vision_rows"] >= ours["vision_rows"]
    assert cost["vision_bytes_per_chunk"] == vision_bytes(cost["vision_rows"], results["config"]["hidden"],
                                                          results["config"]["extra_levels"])
    assert cost["chunks"] == -(-cost["prompt_tokens"] // 16)
    # Its graphs with the state bound in place: the same logits and tokens as fed through its runner's way; a chunk
    # is fed its ids, positions and image_idx only, where the fed way adds the whole KV cache and vision rows.
    in_place = qe["cost_in_place"]
    assert qe["in_place_agrees"]["tokens_equal"] and qe["in_place_agrees"]["max_abs_logit_diff"] <= 1e-5
    assert in_place["all_bytes_per_chunk"] == 16 * 8 + 4 * 16 * 8 + 8
    assert in_place["upload_bytes"] == cost["vision_bytes_per_chunk"]
    assert cost["all_bytes_per_chunk"] > in_place["all_bytes_per_chunk"] + cost["vision_bytes_per_chunk"]
    assert not cost["state_in_place"] and in_place["state_in_place"]
    for side in ("qefficient", "qeff_evs"):
        fidelity = results["fidelity"][side]
        assert len(fidelity["tokens"]) == len(fidelity["reference_tokens"]) == 6
        assert np.isfinite(fidelity["max_abs_logit_diff"])
    assert results["fidelity"]["qeff_evs"]["max_abs_logit_diff"] <= 1e-4
    assert results["fidelity"]["qeff_evs"]["tokens_equal"]
    if family == "qwen3_vl":
        # QEfficient's Qwen3-VL graphs agree with transformers: its host loop here (image_idx carried across
        # chunks, every row with every chunk, its positions) is QEfficient's. (Its Qwen2.5-VL language graph lays
        # M-RoPE out differently from transformers, reference qeff.md §13: reported, not asserted.)
        assert results["fidelity"]["qefficient"]["max_abs_logit_diff"] <= 1e-4
        assert results["fidelity"]["qefficient"]["tokens_equal"]
