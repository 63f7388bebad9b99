"""The ``qeff-evs`` command: export, run (--video and --pixel-values-videos), encode (the vision side
alone), compile without the SDK, demo, and bad input (exit status 2 with a message that names the bad
value).

Commands run in-process through ``qeff_evs.cli.main`` to save interpreter start-ups; one test runs
the installed console script in a subprocess. ``run`` uses the session's export (conftest.py);
one test makes its own export through the CLI.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

from qeff_evs.cli import main
from qeff_evs.models.tiny import build_tokenizer
from qeff_evs.runtime.export_bundle import open_export
from qeff_evs.runtime.media import video_from_file
from qeff_evs.runtime.inputs.synthetic import moving_square_video
from qeff_evs.specializations import compile_command

MAX_NEW_TOKENS = 6
# The session clip: 8 frames -> grid (4, 8, 14) patches, (4, 4, 7) merged; q = 0.5 keeps 56 of 112.
GRID = (4, 8, 14)
TOKENS_PER_FRAME, KEPT = 28, 56
RESULT_KEYS = {"prompt_token_ids", "generated_token_ids", "prefill_top_logits", "kept_tokens_per_frame",
               "num_prefill_chunks", "vision_rows_per_chunk"}


def cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """Run the command in-process: (exit status, stdout, stderr). argparse's own errors exit too."""
    capsys.readouterr()
    try:
        code = main([str(a) for a in argv])
    except SystemExit as stop:
        code = stop.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def expected_prompt_ids(tokenizer, question: str, num_video_tokens: int) -> list[int]:
    """The chat template with its video pad expanded, tokenized here (not by the package)."""
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": question}]}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    text = text.replace("<|video_pad|>", "<|video_pad|>" * num_video_tokens)
    return tokenizer(text, add_special_tokens=False).input_ids


def assert_same_result(ours: dict, reference: dict) -> None:
    """Ids, counts and tokens exactly equal; logits within fp32 tolerance (another process may sum differently);
    the timings are the same phases (their seconds differ run to run)."""
    assert set(ours) == set(reference)
    assert set(ours["seconds"]) == set(reference["seconds"])
    for key in reference:
        if key not in ("prefill_top_logits", "seconds"):
            assert ours[key] == reference[key], key
    assert [i for i, _ in ours["prefill_top_logits"]] == [i for i, _ in reference["prefill_top_logits"]]
    np.testing.assert_allclose([v for _, v in ours["prefill_top_logits"]],
                               [v for _, v in reference["prefill_top_logits"]], atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint):
    return AutoTokenizer.from_pretrained(tiny_checkpoint)


def run_argv(export_dir, *source: str, question: str) -> list[str]:
    return ["run", export_dir, *source, "--prompt", question, "--json", "--max-new-tokens", MAX_NEW_TOKENS]


@pytest.fixture(scope="module")
def run_json(tiny_export, video_npy, question):
    """``qeff-evs run EXPORT --video X.npy --json`` in-process, parsed (module-scoped: reused below)."""
    out = io.StringIO()  # capsys is function-scoped
    with contextlib.redirect_stdout(out):
        code = main([str(a) for a in run_argv(tiny_export, "--video", str(video_npy), question=question)])
    assert code == 0
    return json.loads(out.getvalue())


# --------------------------------------------------------------------------------------------------
# run


def test_run_json_has_the_documented_fields(run_json, tokenizer, question, export_options):
    result = run_json
    assert RESULT_KEYS <= set(result)
    ids = result["prompt_token_ids"]
    assert ids == expected_prompt_ids(tokenizer, question, KEPT)
    assert 1 <= len(result["generated_token_ids"]) <= MAX_NEW_TOKENS
    top = result["prefill_top_logits"]
    assert len(top) == 10 and all(len(pair) == 2 and isinstance(pair[0], int) for pair in top)
    assert top[0][0] == result["generated_token_ids"][0]
    values = [v for _, v in top]
    assert values == sorted(values, reverse=True)
    per_frame = result["kept_tokens_per_frame"]
    assert len(per_frame) == 1 and len(per_frame[0]) == GRID[0]
    assert per_frame[0][0] == TOKENS_PER_FRAME and sum(per_frame[0]) == KEPT
    seq_len, vision_size = export_options.prefill_seq_len, export_options.user_vision_size
    assert result["num_prefill_chunks"] == math.ceil(len(ids) / seq_len)
    video_pad = tokenizer.convert_tokens_to_ids("<|video_pad|>")
    pads = [sum(t == video_pad for t in ids[c:c + seq_len]) for c in range(0, len(ids), seq_len)]
    assert result["vision_rows_per_chunk"] == pads
    assert max(result["vision_rows_per_chunk"]) <= vision_size


def test_run_json_reports_each_phases_time_and_the_token_counts(run_json):
    """What a user measuring time to first token reads: the video read and cut into patches, the vision side
    (encoder and pruning), the prefill up to the first token, the decode; TTFT is vision + prefill."""
    seconds = run_json["seconds"]
    assert set(seconds) == {"preprocess", "vision", "prefill", "ttft", "decode"}
    assert all(value >= 0.0 for value in seconds.values())
    assert seconds["ttft"] == pytest.approx(seconds["vision"] + seconds["prefill"], abs=1e-9)
    assert seconds["vision"] > 0.0 and seconds["prefill"] > 0.0
    assert run_json["num_prompt_tokens"] == len(run_json["prompt_token_ids"])
    assert run_json["num_kept_vision_tokens"] == KEPT


def test_pixel_values_videos_path_gives_the_same_answer(run_json, tiny_export, video_npy, question, tmp_path, capsys):
    """The same clip, already patchified (as transformers' processor hands it over), at the same fps."""
    video = video_from_file(video_npy, open_export(tiny_export))
    assert video.grid_thw == GRID
    pixels = tmp_path / "pixel_values_videos.npy"
    np.save(pixels, video.pixel_values.numpy())
    code, out, err = cli(run_argv(tiny_export, "--pixel-values-videos", pixels, "--video-grid-thw", "4,8,14",
                                  "--fps", video.fps, question=question), capsys)
    assert code == 0, err
    assert_same_result(json.loads(out), run_json)


def test_video_file_gives_the_same_answer_as_its_frames(run_json, tiny_export, video_npy, question, tmp_path, capsys):
    """A real container (lossless ffv1 in Matroska, at the .npy default of 2 fps) decodes to the same frames,
    so ``--video clip.mkv`` must answer exactly as ``--video clip.npy``."""
    from qeff_evs.bench.serving import write_video

    path = write_video(tmp_path / "clip.mkv", np.load(video_npy), fps=2)
    code, out, err = cli(run_argv(tiny_export, "--video", path, question=question), capsys)
    assert code == 0, err
    assert_same_result(json.loads(out), run_json)


def test_console_script_runs_in_a_subprocess(run_json, tiny_export, video_npy, question):
    script = Path(sys.executable).with_name("qeff-evs")
    assert script.is_file(), f"console script missing at {script}; pip install -e ."
    argv = [str(a) for a in run_argv(tiny_export, "--video", str(video_npy), question=question)]
    completed = subprocess.run([str(script), *argv], capture_output=True, text=True, timeout=300, check=False)
    assert completed.returncode == 0, completed.stderr
    assert_same_result(json.loads(completed.stdout), run_json)


def test_run_prints_text_without_json(tiny_export, video_npy, question, capsys):
    code, out, _ = cli(["run", tiny_export, "--video", video_npy, "--prompt", question, "--max-new-tokens", 2], capsys)
    assert code == 0
    assert "generated token ids:" in out and "kept tokens per frame:" in out


# --------------------------------------------------------------------------------------------------
# export through the CLI, then run on it


# --------------------------------------------------------------------------------------------------
# encode


def stock_tower_rows(checkpoint, export, video_npy):
    """The stock transformers tower's merged rows of the clip as the export processes it (the reference)."""
    import torch

    from qeff_evs.models.checkpoint import load_checkpoint

    video = video_from_file(video_npy, open_export(export))
    visual = load_checkpoint(checkpoint).model.model.visual
    with torch.no_grad():
        return visual(video.pixel_values, grid_thw=torch.tensor([GRID])).pooler_output


def test_encode_json_equals_the_stock_tower_and_the_run(run_json, tiny_checkpoint, tiny_export, video_npy,
                                                        export_options, capsys):
    """The kept indices are the stock transformers tower + vLLM's mask on the same processed clip."""
    import torch
    from vllm.multimodal.video_prune.evs import compute_retention_mask

    code, out, err = cli(["encode", tiny_export, "--video", video_npy, "--json"], capsys)
    assert code == 0, err
    result = json.loads(out)
    merged = stock_tower_rows(tiny_checkpoint, tiny_export, video_npy)
    mask = compute_retention_mask(merged, GRID, spatial_merge_size=2, q=export_options.video_pruning_rate)
    assert result["kept_indices"] == torch.nonzero(mask).reshape(-1).tolist()
    assert result["kept_tokens_per_frame"] == run_json["kept_tokens_per_frame"][0]
    assert result["kept_tokens"] == KEPT and result["merged_grid"] == [GRID[0], 4, 7]
    assert result["frames"] == 8 and result["resolution"] == [112, 196] and result["frames_per_call"] == 2
    assert set(result["seconds"]) == {"encoder", "pruning", "total"} and result["seconds"]["total"] > 0
    assert result["video_pruning_method"] == "evs" and result["video_pruning_rate"] == export_options.video_pruning_rate


@pytest.mark.parametrize("method, q", [("vidcom2", 0.75), ("evs", 0.25), ("vidcom2", 0.0)])
def test_run_and_encode_take_the_rate_and_method(tiny_checkpoint, tiny_export, video_npy, question, method, q, capsys):
    """One export, another rate and method at run time: encode keeps vLLM's own set for that method and rate on
    the stock tower's rows, and run's per-frame counts and prompt follow it."""
    from helpers.pruning_oracles import vllm_count, vllm_kept

    flags = ["--video-pruning-rate", q, "--video-pruning-method", method]
    code, out, err = cli(["encode", tiny_export, "--video", video_npy, "--json", *flags], capsys)
    assert code == 0, err
    result = json.loads(out)
    merged = stock_tower_rows(tiny_checkpoint, tiny_export, video_npy)
    kept = vllm_kept(method, merged, GRID[0], (4, 7), q)
    assert len(kept) == vllm_count(method, TOKENS_PER_FRAME, GRID[0], q)
    assert result["kept_indices"] == kept.tolist()
    assert result["video_pruning_method"] == method and result["video_pruning_rate"] == q

    code, out, err = cli(run_argv(tiny_export, "--video", video_npy, *flags, question=question), capsys)
    assert code == 0, err
    run = json.loads(out)
    assert run["kept_tokens_per_frame"] == [result["kept_tokens_per_frame"]]
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    assert run["prompt_token_ids"] == expected_prompt_ids(tokenizer, question, len(kept))


@pytest.mark.parametrize("source, grid", [("two_frames", (1, 8, 14)), ("three_patches", (3, 8, 14))])
def test_videos_shorter_than_a_bucket_are_served(bad_inputs, tiny_export, question, source, grid, capsys):
    """A 2-frame clip (one temporal patch) and 3 temporal patches (a bucket of 4 holds them) are answered."""
    argv = ["--pixel-values-videos", bad_inputs["unexported_frames"], "--video-grid-thw", "3,8,14"] \
        if source == "three_patches" else ["--video", bad_inputs["two_frames"]]
    code, out, err = cli(run_argv(tiny_export, *argv, question=question), capsys)
    assert code == 0, err
    counts = json.loads(out)["kept_tokens_per_frame"][0]
    assert len(counts) == grid[0] and sum(counts) == max(TOKENS_PER_FRAME, int(TOKENS_PER_FRAME * grid[0] * 0.5))


def test_encode_prints_counts_and_the_kept_map(run_json, tiny_export, video_npy, capsys):
    code, out, err = cli(["encode", tiny_export, "--video", video_npy], capsys)
    assert code == 0, err
    assert f"kept tokens per frame: {run_json['kept_tokens_per_frame'][0]}" in out
    rows = [line.strip() for line in out.splitlines() if set(line.strip()) <= {"#", "."} and line.strip()]
    assert len(rows) == GRID[0] * 4 and all(len(row) == 7 for row in rows)  # h rows of w marks per patch
    assert "".join(rows).count("#") == KEPT
    assert "[qeff-evs] encoded temporal patches 4/4" in err


def test_export_then_run(tiny_checkpoint, video_npy, question, tokenizer, tmp_path, capsys):
    out_dir = tmp_path / "cli_export"
    code, out, err = cli(["export", tiny_checkpoint, "-o", out_dir, "--video-pruning-rate", 0.25,
                          "--frames", 4, "--frames", 8, "--height", 112, "--width", 196, "--prefill-seq-len", 16,
                          "--ctx-len", 128, "--kv-precision", "mxint8", "--mxfp6", "--num-cores", 4], capsys)
    assert code == 0, err
    assert json.loads(out) == {"export_dir": str(out_dir), "family": "qwen2_5_vl", "encoder_specializations": 1,
                               "sampled_frame_buckets": [4, 8], "temporal_patch_buckets": [2, 4], "video_pruning_methods": ["evs", "vidcom2"],
                               "pruning_specializations": 4}
    manifest = json.loads((out_dir / "manifest.json").read_text())
    assert manifest["user_vision_size"] == 16  # defaults to the prefill length
    assert manifest["video_pruning_rate"] == 0.25
    language_specs = json.loads((out_dir / "language" / "specializations.json").read_text())["specializations"]
    assert {entry["symbols"]["vision_size"] for entry in language_specs} == {"16"}
    custom_io = (out_dir / "language" / "custom_io.yaml").read_text()
    assert "IOName: past_key.0\n  Precision: mxint8" in custom_io
    script = (out_dir / "compile.sh").read_text()
    assert "-aic-num-cores=4" in script and "-mxfp6-matmul" in script

    code, out, err = cli(run_argv(out_dir, "--video", video_npy, question=question), capsys)
    assert code == 0, err
    result = json.loads(out)
    kept = max(TOKENS_PER_FRAME, int(TOKENS_PER_FRAME * GRID[0] * 0.75))
    assert sum(result["kept_tokens_per_frame"][0]) == kept
    assert result["prompt_token_ids"] == expected_prompt_ids(tokenizer, question, kept)
    assert result["num_prefill_chunks"] == math.ceil(len(result["prompt_token_ids"]) / 16)
    assert max(result["vision_rows_per_chunk"]) <= 16


def test_export_for_the_cpu_runs_longer_chunks_and_answers_the_same(tiny_checkpoint, video_npy, question, run_json,
                                                                tmp_path, capsys):
    """``--target cpu`` defaults to chunks of 2048 (window as long), its shorter lengths halving down to 32 and its
    compute context lengths in steps of 2; the
    clip's 84-token prompt then runs as 64 + 20 (no chunk padded by more than 32) where the session's export (chunks
    of 32) takes 3, and the answer is the same: prompt ids and tokens exactly, the first token's top logits within
    fp32 tolerance."""
    out_dir = tmp_path / "cpu_export"
    code, out, err = cli(["export", tiny_checkpoint, "-o", out_dir, "--target", "cpu", "--frames", 4, "--frames", 8,
                          "--height", 112, "--width", 196, "--ctx-len", 4096, "--video-pruning-methods", "evs"], capsys)
    assert code == 0, err
    manifest = json.loads((out_dir / "manifest.json").read_text())
    assert (manifest["prefill_seq_len"], manifest["user_vision_size"]) == (2048, 2048)
    assert manifest["short_prefill_lens"] == [32, 64, 128, 256, 512, 1024]
    assert manifest["language_shape"]["comp_ctx_lengths"] == [2048, 4096]  # steps of 2 (the card's: 4096 alone)

    code, out, err = cli(run_argv(out_dir, "--video", video_npy, question=question), capsys)
    assert code == 0, err
    result = json.loads(out)
    assert len(result["prompt_token_ids"]) == 84
    assert (run_json["num_prefill_chunks"], result["num_prefill_chunks"]) == (3, 2)
    for key in ("prompt_token_ids", "generated_token_ids", "kept_tokens_per_frame"):
        assert result[key] == run_json[key], key
    assert [i for i, _ in result["prefill_top_logits"]] == [i for i, _ in run_json["prefill_top_logits"]]
    np.testing.assert_allclose([v for _, v in result["prefill_top_logits"]],
                               [v for _, v in run_json["prefill_top_logits"]], atol=1e-4, rtol=0)


# --------------------------------------------------------------------------------------------------
# compile and demo


def test_compile_without_the_sdk_prints_the_commands(tiny_export, tmp_path, monkeypatch, capsys):
    if Path(compile_command.SDK_COMPILER_PATH).exists():
        pytest.skip("the Cloud AI 100 SDK is installed here; compile would really run")
    monkeypatch.setenv("PATH", str(tmp_path))  # no qaic-compile on PATH
    build = tmp_path / "build"
    shutil.copytree(tiny_export, build)  # compile rewrites compile.sh: keep the session export as it is
    code, out, err = cli(["compile", build, "--num-cores", 8], capsys)
    assert code == 0, err
    lines = [line for line in out.splitlines() if line.startswith("qaic-compile ")]
    assert len(lines) == 4
    assert all("-aic-num-cores=8" in line for line in lines)
    assert "-m=vision/encoder.onnx" in lines[0] and "-m=vision/pruning_evs.onnx" in lines[1]
    assert "-m=vision/pruning_vidcom2.onnx" in lines[2] and "-m=language/language.onnx" in lines[3]
    assert "not found" in out
    assert (build / "compile.sh").read_text().count("-aic-num-cores=8") == 4


def test_demo_runs(tmp_path, capsys):
    code, out, err = cli(["demo", "--workdir", tmp_path], capsys)
    assert code == 0, err
    assert "kept map" in out and "generated token ids (ort):" in out
    assert (tmp_path / "export" / "manifest.json").is_file()


# --------------------------------------------------------------------------------------------------
# bad input: exit status 2 and a message naming the value


@pytest.fixture(scope="module")
def bad_inputs(tmp_path_factory, tiny_checkpoint, tiny_export):
    """Folders and files that each hold one mistake."""
    root = tmp_path_factory.mktemp("bad")
    paths = {}

    paths["unexported_frames"] = root / "grid_3_8_14.npy"
    np.save(paths["unexported_frames"], np.zeros((3 * 8 * 14, 1176), dtype=np.float32))
    paths["too_many_frames"] = root / "grid_5_8_14.npy"
    np.save(paths["too_many_frames"], np.zeros((5 * 8 * 14, 1176), dtype=np.float32))
    paths["unexported_size"] = root / "grid_4_10_10.npy"
    np.save(paths["unexported_size"], np.zeros((4 * 10 * 10, 1176), dtype=np.float32))
    paths["wrong_rows"] = root / "rows_10.npy"
    np.save(paths["wrong_rows"], np.zeros((10, 1176), dtype=np.float32))
    paths["wrong_columns"] = root / "columns_10.npy"
    np.save(paths["wrong_columns"], np.zeros((4 * 8 * 14, 10), dtype=np.float32))
    paths["jsonl_no_grid"] = root / "no_grid.jsonl"
    paths["jsonl_no_grid"].write_text(json.dumps({"prompt": "hi", "pixel_values_videos": str(paths["wrong_rows"])}) + "\n")
    paths["two_frames"] = root / "two_frames.npy"
    np.save(paths["two_frames"], moving_square_video(2, 120, 200, seed=0))

    text_only = root / "qwen2_text_only"
    config = Qwen2Config(vocab_size=len(build_tokenizer()), hidden_size=16, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    Qwen2ForCausalLM(config).save_pretrained(text_only)
    build_tokenizer().save_pretrained(text_only)
    paths["text_only"] = text_only

    other_type = root / "other_model_type"
    shutil.copytree(tiny_checkpoint, other_type)
    raw = json.loads((other_type / "config.json").read_text())
    raw["model_type"] = "llava"
    (other_type / "config.json").write_text(json.dumps(raw))
    paths["other_type"] = other_type

    no_tokenizer = root / "checkpoint_without_tokenizer"
    shutil.copytree(tiny_checkpoint, no_tokenizer,
                    ignore=shutil.ignore_patterns("tokenizer*", "vocab*", "merges*", "special_tokens*",
                                                  "chat_template*"))
    paths["no_tokenizer"] = no_tokenizer

    export_no_tokenizer = root / "export_without_tokenizer"
    # the tokenizer files at the export's top (and tokenizer/ of older exports)
    shutil.copytree(tiny_export, export_no_tokenizer, ignore=shutil.ignore_patterns("tokenizer*", "vocab.json"))
    paths["export_no_tokenizer"] = export_no_tokenizer

    export_evs_only = root / "export_evs_only"  # as `--video-pruning-methods evs` writes it
    shutil.copytree(tiny_export, export_evs_only, ignore=shutil.ignore_patterns("pruning_vidcom2*"))
    manifest = json.loads((export_evs_only / "manifest.json").read_text())
    manifest["video_pruning_methods"] = ["evs"]
    manifest["pruning_entries"] = [e for e in manifest["pruning_entries"] if e["method"] == "evs"]
    manifest["files"] = {k: v for k, v in manifest["files"].items() if "vidcom2" not in k}
    (export_evs_only / "manifest.json").write_text(json.dumps(manifest))
    paths["export_evs_only"] = export_evs_only
    return paths


EXPORT_GRID = ["--frames", "8", "--height", "112", "--width", "196"]

BAD_COMMANDS = {
    "10 frames above the largest bucket": (["run", "{export}", "--pixel-values-videos", "{too_many_frames}",
                                            "--video-grid-thw", "5,8,14", "--prompt", "hi"],
                                           r"video grid \(5, 8, 14\) has 5 temporal patches but the export's largest "
                                           r"frame bucket holds 4 \(8 frames\)"),
    "resolution 140x140 not exported": (["run", "{export}", "--pixel-values-videos", "{unexported_size}",
                                         "--video-grid-thw", "4,10,10", "--prompt", "hi"],
                                        r"no vision specialization for video grid \(4, 10, 10\)"),
    "encode: 10 frames above the largest bucket": (["encode", "{export}", "--pixel-values-videos", "{too_many_frames}",
                                                    "--video-grid-thw", "5,8,14"],
                                                   r"5 temporal patches but the export's largest frame bucket"),
    "unknown pruning method": (["run", "{export}", "--video", "{video}", "--prompt", "hi", "--video-pruning-method",
                                "topk"], r"unknown video pruning method 'topk'; choose one of evs, vidcom2"),
    "encode: rate 1": (["encode", "{export}", "--video", "{video}", "--video-pruning-rate", "1"],
                       r"video pruning rate must be in \[0, 1\) \(0 disables EVS\), got 1\.0"),
    "method the export lacks": (["run", "{export_evs_only}", "--video", "{video}", "--prompt", "hi",
                                 "--video-pruning-method", "vidcom2"],
                                r"video pruning method 'vidcom2' is not one this export carries \(evs\)"),
    "default rate above the maximum rate": (["export", "{checkpoint}", "-o", "{out}", *EXPORT_GRID,
                                             "--video-pruning-rate", "0.8", "--max-video-pruning-rate", "0.5"],
                                            r"--video-pruning-rate 0.8 is above --max-video-pruning-rate 0.5"),
    "a method twice": (["export", "{checkpoint}", "-o", "{out}", *EXPORT_GRID, "--video-pruning-methods", "evs,evs"],
                       r"--video-pruning-methods must list distinct methods"),
    "max frames off the largest bucket": (["export", "{checkpoint}", "-o", "{out}", *EXPORT_GRID, "--max-frames", "16"],
                                          r"--max-frames 16 is not the largest of --frames \[8\]"),
    "encode: resolution 140x140 not exported": (["encode", "{export}", "--pixel-values-videos", "{unexported_size}",
                                                 "--video-grid-thw", "4,10,10"],
                                                r"no encoder specialization .*\(10, 10\).*\[\(112, 196\), \(168, 168\)\]"),
    "frames per call 0": (["export", "{checkpoint}", "-o", "{out}", *EXPORT_GRID, "--frames-per-call", "0"],
                          r"--frames-per-call must be a positive integer.*got 0"),
    "pixel rows do not match the grid": (["run", "{export}", "--pixel-values-videos", "{wrong_rows}",
                                          "--video-grid-thw", "4,8,14", "--prompt", "hi"],
                                         r"shape \(10, 1176\) do not match --video-grid-thw 4,8,14"),
    "pixel values without a grid": (["run", "{export}", "--pixel-values-videos", "{wrong_rows}", "--prompt", "hi"],
                                    r"needs --video-grid-thw"),
    "prompt does not fit ctx_len": (["run", "{export}", "--video", "{video}", "--prompt", "{long_question}"],
                                    r"the prompt \(\d+ tokens\).* ctx_len is 256"),
    "max new tokens do not fit ctx_len": (["run", "{export}", "--video", "{video}", "--prompt", "hi",
                                           "--max-new-tokens", "250"], r"max_new_tokens \(250\).* ctx_len is 256"),
    "export folder without tokenizer": (["run", "{export_no_tokenizer}", "--video", "{video}", "--prompt", "hi"],
                                        r"export_without_tokenizer holds no tokenizer"),
    "not an export folder": (["run", "{checkpoint}", "--video", "{video}", "--prompt", "hi"],
                             r"manifest.json not found"),
    "user_vision_size below the prefill length": (["export", "{checkpoint}", "-o", "{out}", *EXPORT_GRID,
                                                   "--prefill-seq-len", "32", "--user-vision-size", "16"],
                                                  r"user_vision_size=16 is smaller than prefill_seq_len=32"),
    "user_vision_size at ctx_len": (["export", "{checkpoint}", "-o", "{out}", *EXPORT_GRID, "--prefill-seq-len", "32",
                                     "--ctx-len", "256", "--user-vision-size", "256"],
                                    r"user_vision_size=256 must be smaller than ctx_len=256"),
    "text-only Qwen2 checkpoint": (["export", "{text_only}", "-o", "{out}", *EXPORT_GRID],
                                   r"model_type='qwen2'"),
    "config of another model_type": (["export", "{other_type}", "-o", "{out}", *EXPORT_GRID],
                                     r"model_type='llava'"),
    "checkpoint without tokenizer": (["export", "{no_tokenizer}", "-o", "{out}", *EXPORT_GRID],
                                     r"checkpoint_without_tokenizer has no tokenizer"),
    "frame size not a multiple of 28": (["export", "{checkpoint}", "-o", "{out}", "--frames", "8", "--height", "100",
                                         "--width", "196"], r"frame size 100x196 .*multiple of .* 28"),
    "odd frame count": (["export", "{checkpoint}", "-o", "{out}", "--frames", "3", "--height", "112", "--width", "196"],
                        r"--frames 3 .*temporal_patch_size 2"),
    "missing pixel values file": (["run", "{export}", "--pixel-values-videos", "{out}/missing.npy",
                                   "--video-grid-thw", "4,8,14", "--prompt", "hi"], r"missing\.npy not found"),
    "pixel values of another patch size": (["run", "{export}", "--pixel-values-videos", "{wrong_columns}",
                                            "--video-grid-thw", "4,8,14", "--prompt", "hi"],
                                           r"rows have 10 values but this model's patches have 1176"),
    "zero new tokens": (["run", "{export}", "--video", "{video}", "--prompt", "hi", "--max-new-tokens", "0"],
                        r"max_new_tokens must be >= 1, got 0"),
    "missing requests file": (["run", "{export}", "--requests", "{out}/missing.jsonl"], r"missing\.jsonl not found"),
    "request without a grid": (["run", "{export}", "--requests", "{jsonl_no_grid}"],
                               r"no_grid\.jsonl:1: 'video_grid_thw' must be \[T, H, W\]"),
    "export into a file": (["export", "{checkpoint}", "-o", "{video}", *EXPORT_GRID], r"moving_square\.npy"),
    "pruning rate 1": (["export", "{checkpoint}", "-o", "{out}", *EXPORT_GRID, "--video-pruning-rate", "1.0"],
                       r"1\.0"),
}


@pytest.mark.parametrize("case", list(BAD_COMMANDS))
def test_bad_input_exits_2_naming_the_value(case, bad_inputs, tiny_checkpoint, tiny_export, video_npy, tmp_path,
                                            capsys):
    argv, message = BAD_COMMANDS[case]
    values = {**{k: str(v) for k, v in bad_inputs.items()}, "export": str(tiny_export), "video": str(video_npy),
              "checkpoint": str(tiny_checkpoint), "out": str(tmp_path / "out"),
              "long_question": "Describe the video in detail, please. " * 40}
    code, out, err = cli([a.format(**values) for a in argv], capsys)
    assert code == 2, (out, err)
    assert "Traceback" not in err
    assert f"qeff-evs {argv[0]}: error:" in err
    assert re.search(message, err), err


def test_cli_offers_every_backend_the_runtime_opens():
    """cli.BACKENDS and the plugin's are written out (neither imports the runtime); they must stay the runtime's."""
    from qeff_evs import cli
    from qeff_evs.runtime.sessions import BACKENDS
    from qeff_evs.vllm import activation

    assert cli.BACKENDS == BACKENDS
    assert sorted(activation.BACKENDS) == sorted(BACKENDS)
