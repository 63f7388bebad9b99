"""``qeff-evs bench`` smoke test (tiny widths via the hidden --smoke flag) and its pure pieces.

One CLI run (module fixture, ~10 s) writes every output; the tests check its counts, bytes and
layouts against independent references: vLLM's kept-count rule, the chunk arithmetic, the
byte sizes both ways must send, and the QEfficient way's ``image_idx`` counted token by token. The
two ways' first-token logits must agree (same graph, same rows). Timings are not asserted.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from qeff_evs import cli
from qeff_evs.bench.config import PRESETS, preset, validate
from qeff_evs.bench.overhead import kernel_time
from qeff_evs.bench.pruning import PruningPoint, PruningSweep, pruning_rows
from qeff_evs.bench.timing import Samples, alternating
from qeff_evs.bench.window_sweep import QEFFICIENT, USER_VISION_SIZE, qefficient_steps
from qeff_evs.bench.workload import language_prompt, pixel_kept_indices, synthetic_clip
from qeff_evs.runtime.inputs.preprocess_spec import VisionPreprocessSpec

vllm_evs = pytest.importorskip("vllm.multimodal.video_prune.evs")

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"

SMOKE = PRESETS["smoke"]
WORKDIR = "graphs"  # the smoke run's --workdir, inside its output folder
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
MAX_PNG_BYTES = 200_000
TINY_HIDDEN = 64  # tiny_config's text hidden size
TINY_PATCH, TINY_MERGE, TINY_TEMPORAL = 14, 2, 2


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code = cli.main(["bench", "--smoke", "-o", str(out), "--workdir", str(out / WORKDIR)])
    assert code == 0
    return out, json.loads((out / "results.json").read_text())


def _tokens_per_patch(size: int) -> int:
    return (size // (TINY_PATCH * TINY_MERGE)) ** 2


def benchmark_script(name: str):
    """A standalone script of ``benchmarks/`` (not a package), loaded as a module."""
    module_name = f"benchmarks_{name}"
    if module_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(module_name, BENCHMARKS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module  # dataclasses look their module up while the script runs
        spec.loader.exec_module(module)
    return sys.modules[module_name]


# ---------------------------------------------------------------------------------------------
# the CLI run


def test_outputs_written(smoke_run):
    out, _ = smoke_run
    for name in ("latency_vs_q.png", "window_sweep.png", "kept_tokens.png"):
        data = (out / name).read_bytes()
        assert data.startswith(PNG_SIGNATURE), name
        assert len(data) < MAX_PNG_BYTES, (name, len(data))
    text = (out / "results.md").read_text()
    assert "### Pruning sweep" in text and "### Window sweep" in text


def test_ttft_runs_against_transformers_generate(smoke_run):
    """The TTFT phase times the engine and transformers' own generate on the same clip; at q 0 both pick the same
    first token (same fp32 weights), and every rate has a ratio to transformers."""
    out, results = smoke_run
    section = results["ttft"]
    assert section["same_first_token_at_q0"] and section["first_tokens"]["transformers"]
    assert set(section["vs_transformers"]) == {"transformers", "q=0", "q=0.5", "q=0.75"}
    assert section["vs_transformers"]["transformers"] == {"wall": 1.0, "cpu": 1.0}
    assert section["sessions"] == "qeff-evs run"  # the sessions a user gets, not the bench's timing ones
    assert (out / "ttft.png").read_bytes().startswith(PNG_SIGNATURE)
    assert "### Time to first token against transformers' generate" in (out / "results.md").read_text()


def test_decode_context_runs_each_position_in_its_length(smoke_run):
    """The decode phase: a step at each position ran in the smallest length holding it, beside the one-length graph
    (timings are the bench's; the smoke run only checks what it measured)."""
    out, results = smoke_run
    section = results["decode_context"]
    assert section["lengths"] == [64, 256]
    assert [(r["position"], r["comp_ctx_len"]) for r in section["rows"]] == [(16, 64), (100, 256), (200, 256)]
    assert all(r["ladder_ms"]["cpu"] > 0 and r["single_ms"]["cpu"] > 0 for r in section["rows"])
    assert (out / "decode_context.png").read_bytes().startswith(PNG_SIGNATURE)
    assert "### Decode step against position" in (out / "results.md").read_text()


def test_prefill_lengths_times_each_length(smoke_run):
    _, results = smoke_run
    section = results["prefill_lengths"]
    assert [r["seq_len"] for r in section["rows"]] == [4, 8, 16] and section["rows"][-1]["over_longest"]["cpu"] == 1


def test_bench_graphs_are_a_qeff_evs_export(smoke_run):
    """The bench saved a checkpoint and measured the folder ``qeff-evs export`` made of it, which opens as
    ``qeff-evs run`` opens an export, with a specialization for every clip the phases ran."""
    from qeff_evs.runtime.export_bundle import open_export

    work = smoke_run[0] / WORKDIR
    bundle = open_export(work / "export")
    manifest = bundle.manifest
    assert manifest.model_dir == str((work / "checkpoint").resolve())
    assert (work / "checkpoint" / "config.json").is_file() and (work / "export" / "compile.sh").is_file()
    frames = {SMOKE.frames, SMOKE.vision_frames, SMOKE.overhead_frames, *SMOKE.window_frames,
              *SMOKE.vision_sweep_frames}
    assert set(manifest.sampled_frame_buckets) == frames  # every clip its own bucket: nothing padded
    assert {(SMOKE.frame_size,) * 2, (SMOKE.vision_frame_size,) * 2} == set(manifest.resolutions)
    assert manifest.video_pruning_rate == SMOKE.window_rate
    shape = manifest.language_shape
    assert (shape.ctx_len, shape.vision_size) == (SMOKE.ctx_len, SMOKE.effective_user_vision_size)
    assert shape.prefill_lens == (4, 8, 16)  # every chunk length the prefill-lengths phase timed, as the card needs
    assert bundle.family.name == SMOKE.family


def test_pruning_counts_follow_vllm(smoke_run):
    _, results = smoke_run
    rows = results["pruning_sweep"]["rows"]
    assert [r["q"] for r in rows] == sorted({0.0, *SMOKE.pruning_rates})
    per_patch = _tokens_per_patch(SMOKE.frame_size)
    patches = SMOKE.frames // TINY_TEMPORAL
    vision_per_patch = _tokens_per_patch(SMOKE.vision_frame_size)
    for r in rows:
        k = vllm_evs.compute_retained_tokens_count(per_patch, patches, r["q"])
        assert r["video_tokens"] == per_patch * patches
        assert r["kept_tokens"] == k
        assert r["prompt_tokens"] == k + SMOKE.question_tokens + 2  # + <|vision_start|>, <|vision_end|>
        assert r["prefill_chunks"] == math.ceil(r["prompt_tokens"] / SMOKE.prefill_seq_len)
        assert r["vision_kept_tokens"] == vllm_evs.compute_retained_tokens_count(
            vision_per_patch, SMOKE.vision_frames // TINY_TEMPORAL, r["q"])
        assert r["encoder_cache_bytes"] == k * TINY_HIDDEN * 4
        for clock in ("wall", "cpu"):
            assert r[clock]["prefill_ms"] > 0 and r[clock]["vision_ms"] > 0


def test_vision_graph_keeps_frame_zero(smoke_run):
    _, results = smoke_run
    per_patch = _tokens_per_patch(SMOKE.vision_frame_size)
    for sample in results["pruning_sweep"]["samples"]:
        kept = sample["vision_kept_indices"]
        assert len(kept) == sample["vision_kept_tokens"]
        assert kept == sorted(set(kept))
        assert set(range(per_patch)) <= set(kept)  # frame 0 always survives (sentinel 255)
        assert sum(sample["vision_kept_per_frame"]) == len(kept)


def test_window_bytes_and_parity(smoke_run):
    _, results = smoke_run
    rows = results["window_sweep"]["rows"]
    assert [r["frames"] for r in rows] == list(SMOKE.window_frames)
    per_patch = _tokens_per_patch(SMOKE.frame_size)
    for r in rows:
        k = vllm_evs.compute_retained_tokens_count(per_patch, r["frames"] // TINY_TEMPORAL, SMOKE.window_rate)
        assert r["kept_tokens"] == k
        assert r["chunks"] == math.ceil((k + SMOKE.question_tokens + 2) / SMOKE.prefill_seq_len)
        ours, theirs = r[USER_VISION_SIZE], r[QEFFICIENT]
        assert ours["vision_size"] == SMOKE.prefill_seq_len
        assert ours["bytes_per_chunk"] == SMOKE.prefill_seq_len * TINY_HIDDEN * 4
        assert ours["bytes_per_chunk_constant"] and theirs["bytes_per_chunk_constant"]
        assert theirs["vision_size"] == k
        assert theirs["bytes_per_chunk"] == k * TINY_HIDDEN * 4
        assert ours["chunk_samples"] == theirs["chunk_samples"] == r["chunks"] * SMOKE.repeats
        assert ours["ms_per_chunk"]["cpu"] > 0 and theirs["ms_per_chunk"]["wall"] > 0
        assert r["logits_max_abs_diff"] <= 1e-4


def test_targets_reported(smoke_run):
    """benchmarks/bench_targets.py judges a bench run against the published targets."""
    _, results = smoke_run
    targets = [dataclasses.asdict(t) for t in benchmark_script("bench_targets").evaluate(results)]
    names = [t["name"] for t in targets]
    assert len(names) == 11
    by_name = {t["name"]: t for t in targets}
    assert by_name["window: bytes per chunk, user_vision_size"]["met"] is True
    assert by_name["check: both ways give the same first-token logits"]["met"] is True
    overhead = results["evs_overhead"]
    assert overhead["profiled_selection_us"] > 0 and overhead["profiled_tower_us"] > 0


def test_render_rebuilds_the_same_results(smoke_run, tmp_path):
    out, results = smoke_run
    assert cli.main(["bench", "--render", str(out / "results.json"), "-o", str(tmp_path)]) == 0
    assert json.loads((tmp_path / "results.json").read_text()) == results
    assert (tmp_path / "results.md").read_text() == (out / "results.md").read_text()


def test_only_one_phase_keeps_the_others_of_the_base_run(smoke_run, tmp_path):
    """--only vision_sweep --base: that phase is measured again, every other one is the base run's, as saved."""
    out, results = smoke_run
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert cli.main(["bench", "--smoke", "--only", "vision_sweep", "--base", str(out / "results.json"),
                         "-o", str(tmp_path)]) == 0
    partial = json.loads((tmp_path / "results.json").read_text())
    for phase in ("pruning_sweep", "window_sweep", "evs_overhead", "decode_context", "prefill_lengths"):
        assert partial[phase] == results[phase]
        assert partial["phase_runs"][phase] == results["phase_runs"][phase]
    assert partial["vision_sweep"]["samples"] != results["vision_sweep"]["samples"]  # timed again
    assert [r["frames"] for r in partial["vision_sweep"]["rows"]] == list(SMOKE.vision_sweep_frames)
    assert partial["vision_sweep"]["call_peak_mb"] is not None
    assert (tmp_path / "results.md").read_text().count("Measured: ") == 7  # one per phase


def test_only_refuses_a_base_run_of_other_graphs(smoke_run, tmp_path, capsys):
    out, _ = smoke_run
    code = cli.main(["bench", "--smoke", "--vision-layers", "3", "--only", "vision_sweep",
                     "--base", str(out / "results.json"), "-o", str(tmp_path)])
    assert code == 2
    assert "vision_layers (2 there, 3 here)" in capsys.readouterr().err
    assert cli.main(["bench", "--smoke", "--base", str(out / "results.json"), "-o", str(tmp_path)]) == 2  # no --only
    assert cli.main(["bench", "--smoke", "--only", "speed", "--base", str(out / "results.json"),
                     "-o", str(tmp_path)]) == 2


def test_qwen3_smoke_sends_deepstack_rows_too(tmp_path):
    """Qwen3-VL: presets scale to 32-px tokens; each window row carries its deepstack rows as well."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert cli.main(["bench", "--smoke", "--family", "qwen3_vl", "-o", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["config"]["frame_size"] == 128 and results["config"]["vision_frame_size"] == 128
    levels = 1  # tiny_config's deepstack_visual_indexes=[0]
    for r in results["window_sweep"]["rows"]:
        k = vllm_evs.compute_retained_tokens_count(16, r["frames"] // TINY_TEMPORAL, SMOKE.window_rate)
        assert r["kept_tokens"] == k
        assert r[USER_VISION_SIZE]["bytes_per_chunk"] == SMOKE.prefill_seq_len * TINY_HIDDEN * 4 * (1 + levels)
        assert r[QEFFICIENT]["bytes_per_chunk"] == k * TINY_HIDDEN * 4 * (1 + levels)
        assert r["logits_max_abs_diff"] <= 1e-4


def test_qwen3_5_smoke_runs_the_hybrid_graph(tmp_path):
    """Qwen3.5 with a linear-attention and a full-attention layer: the language graph carries layer states
    from chunk to chunk; the user_vision_size and QEfficient ways give the same logits."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert cli.main(["bench", "--smoke", "--family", "qwen3_5", "--text-layers", "2", "-o", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["config"]["family"] == "qwen3_5" and results["config"]["text_layers"] == 2
    rows = results["window_sweep"]["rows"]
    assert rows and all(r["logits_max_abs_diff"] <= 1e-4 for r in rows)


def test_nemotron_sound_track_stays_while_the_video_is_pruned(tmp_path):
    """--sound-seconds on Nemotron-H Omni: the clip's sound rows (vLLM's count for 1.5 s: 19) and its two markers are
    in every q's prompt beside the video's kept rows; a family without audio is refused in one line."""
    runs = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for seconds in ("0", "1.5"):
            out = tmp_path / seconds
            assert cli.main(["bench", "--smoke", "--family", "nemotron_h_omni", "--only", "pruning_sweep",
                             "--sound-seconds", seconds, "-o", str(out)]) == 0
            runs[seconds] = json.loads((out / "results.json").read_text())["pruning_sweep"]
    assert runs["1.5"]["sound_seconds"] == 1.5 and runs["0"]["sound_seconds"] == 0
    for silent, heard in zip(runs["0"]["rows"], runs["1.5"]["rows"], strict=True):
        assert (silent["sound_rows"], heard["sound_rows"]) == (0, 19)
        assert heard["kept_tokens"] == silent["kept_tokens"]
        assert heard["prompt_tokens"] == silent["prompt_tokens"] + 19 + 2  # + <so_start>, <so_end>
    assert cli.main(["bench", "--smoke", "--only", "pruning_sweep", "--sound-seconds", "1",
                     "-o", str(tmp_path / "qwen")]) == 2


def test_bench_without_matplotlib_names_the_extra(monkeypatch, tmp_path, capsys):
    """matplotlib is the optional bench extra: without it the bench stops first, exit 2, with the install line."""
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    assert cli.main(["bench", "--smoke", "-o", str(tmp_path / "out")]) == 2
    assert "pip install 'qeff-evs[bench]'" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------
# pure pieces


def test_qefficient_steps_image_idx_counts_media_tokens():
    from qeff_evs.bench.checkpoint import model_config
    from qeff_evs.models.registry import family_for_config

    family = family_for_config(model_config(SMOKE))
    clip = synthetic_clip(VisionPreprocessSpec.for_family("qwen2_5_vl"), 8, 112, seed=0)
    prompt = language_prompt(family, clip, 0.5, tuple(range(10, 18)), TINY_HIDDEN, {}, TINY_MERGE, seed=0)
    video_pad = family.special_tokens().video_pad
    steps = qefficient_steps(prompt, SMOKE, TINY_HIDDEN, {}, family.special_tokens().media_pads)
    seen = 0
    for number, step in enumerate(steps):
        assert int(step.image_idx[0, 0]) == seen
        np.testing.assert_array_equal(step.vision_embeds[0], prompt.encoded[0].rows)
        chunk = prompt.ids[number * SMOKE.prefill_seq_len:(number + 1) * SMOKE.prefill_seq_len]
        seen += sum(1 for token in chunk if token == video_pad)
    assert seen == len(prompt.encoded[0].rows)


def test_pixel_selection_equals_vllm_on_merged_pixels():
    clip = synthetic_clip(VisionPreprocessSpec.for_family("qwen2_5_vl"), 8, 112, seed=1)
    pixels = clip.video.pixel_values
    group = TINY_MERGE * TINY_MERGE
    # One merged token = its merge x merge patches, consecutive rows in the processor's order.
    tokens = torch.stack([torch.cat(list(pixels[j * group:(j + 1) * group])) for j in range(pixels.shape[0] // group)])
    for q in (0.25, 0.5, 0.9):
        expected = torch.nonzero(vllm_evs.compute_retention_mask(tokens, clip.grid_thw, TINY_MERGE, q)).reshape(-1)
        np.testing.assert_array_equal(pixel_kept_indices(clip.video, TINY_MERGE, q), expected.numpy())


def test_pruning_rows_limits():
    def point(q, k, chunks, prefill_cpu):
        return PruningPoint(q=q, video_tokens=1000, kept_tokens=k, text_tokens=24, prompt_tokens=k + 24,
                            prefill_chunks=chunks, vision_video_tokens=10, vision_kept_tokens=5,
                            encoder_cache_bytes=0, vision=Samples([0.2] * 3, [0.1] * 3),
                            prefill=Samples([2.0] * 3, prefill_cpu))

    sweep = PruningSweep((16, 448), (16, 224), (8, 8, 8),
                         [point(0.0, 1000, 8, [1.0, 1.2, 0.8]), point(0.5, 500, 4, [0.6, 0.5, 0.7])])
    rows = pruning_rows(sweep)
    cpu = rows[1]["cpu"]
    assert rows[0]["cpu"]["prefill_ms"] == pytest.approx(1000.0)
    assert cpu["proportional_ms"] == pytest.approx(1000.0 * 524 / 1024)
    assert cpu["chunk_limit_ms"] == pytest.approx(500.0)
    assert cpu["prefill_speedup"] == pytest.approx(1000.0 / 600.0)
    assert cpu["ttft_ms"] == pytest.approx(700.0)
    assert rows[1]["wall"]["prefill_speedup"] == pytest.approx(1.0)


def test_window_targets_verdicts():
    def row(frames, ours_ms, theirs_bytes, theirs_ms):
        def way(nbytes, ms):
            # Wall times are made wild on purpose: verdicts follow CPU time.
            return {"bytes_per_chunk": nbytes, "bytes_per_chunk_constant": True,
                    "ms_per_chunk": {"cpu": ms, "wall": 5 * ms if frames > 4 else ms}}

        return {"frames": frames, "logits_max_abs_diff": 0.0,
                USER_VISION_SIZE: way(1024, ours_ms), QEFFICIENT: way(theirs_bytes, theirs_ms)}

    targets = benchmark_script("bench_targets")
    good = targets.window_targets([row(4, 100, 2048, 100), row(64, 109, 32768, 150)])
    assert [t.met for t in good] == [True, True, True, True]
    bad = targets.window_targets([row(4, 100, 2048, 100), row(64, 112, 2048, 105)])
    assert [t.met for t in bad] == [True, False, False, False]


def test_kernel_time_sums_node_kernels_only():
    events = [
        {"cat": "Node", "name": "/visual/blocks.0/attn/MatMul_kernel_time", "dur": 900},
        {"cat": "Node", "name": "Gelu_token_3_kernel_time", "dur": 50},  # ORT-fused, renamed
        {"cat": "Node", "name": "/TopK_fence_before", "dur": 100},
        {"cat": "Session", "name": "SequentialExecutor::Execute", "dur": 5000},
    ]
    assert kernel_time(events) == 950.0


def test_alternating_order():
    assert alternating([1, 2, 3], 0) == [1, 2, 3]
    assert alternating([1, 2, 3], 1) == [3, 2, 1]


def test_qwen3_presets_keep_the_token_grids():
    for name in ("full", "quick", "smoke"):
        q25, q3 = preset(name, "qwen2_5_vl"), preset(name, "qwen3_vl")
        assert q25.frame_size // 28 == q3.frame_size // 32
        assert q25.vision_frame_size // 28 == q3.vision_frame_size // 32
    assert preset("full").frame_size == 448 and preset("full", "qwen3_vl").frame_size == 512


def test_target_cpu_exports_as_export_target_cpu_does():
    """``bench --target cpu`` benches what ``export --target cpu`` writes: chunks of 2048 unless --prefill-seq-len
    says otherwise, compute context lengths in steps of 2 (the export's ladder, 2048, 4096, 8192 at ctx 8192)."""
    from qeff_evs.bench import config_from_args
    from qeff_evs.bench.graphs import export_options
    from qeff_evs.specializations import comp_ctx_lengths

    def options(*flags):
        config = config_from_args(cli.build_parser().parse_args(["bench", "--only", "ttft", *flags]))
        return export_options(config)

    cpu, card = options("--target", "cpu"), options()
    assert (cpu.prefill_seq_len, card.prefill_seq_len) == (2048, 128)
    assert comp_ctx_lengths(None, cpu.ctx_len, cpu.prefill_seq_len, cpu.comp_ctx_step) == (2048, 4096, 8192)
    assert comp_ctx_lengths(None, card.ctx_len, card.prefill_seq_len, card.comp_ctx_step) == (2048, 8192)
    assert options("--target", "cpu", "--prefill-seq-len", "512").prefill_seq_len == 512
    with pytest.raises(ValueError, match="--target 'gpu'"):
        validate(SMOKE.replace(target="gpu"), TINY_PATCH, TINY_MERGE, TINY_TEMPORAL)


@pytest.mark.parametrize("change, flag", [
    ({"vision_layers": 1}, "vision-layers"),
    ({"ctx_len": 64}, "ctx-len"),
    ({"window_frames": (3,)}, "window-frames"),
    ({"frame_size": 100}, "frame-size"),
    ({"user_vision_size": 8}, "user-vision-size"),
])
def test_config_errors_name_the_flag(change, flag):
    with pytest.raises(ValueError, match=flag):
        validate(SMOKE.replace(**change), TINY_PATCH, TINY_MERGE, TINY_TEMPORAL)


def test_vision_sweep_rows(smoke_run):
    _, results = smoke_run
    rows = results["vision_sweep"]["rows"]
    assert [r["frames"] for r in rows] == list(SMOKE.vision_sweep_frames)
    per_patch = _tokens_per_patch(SMOKE.frame_size)
    for r in rows:
        patches = r["frames"] // TINY_TEMPORAL
        assert r["temporal_patches"] == patches and r["video_tokens"] == per_patch * patches
        assert r["kept_tokens"] == vllm_evs.compute_retained_tokens_count(per_patch, patches, SMOKE.window_rate)
        assert r["accumulated_mb"] == pytest.approx(per_patch * patches * TINY_HIDDEN * 4 / 2**20)
        assert r["encoder"]["cpu_s_per_patch"] > 0
    assert (smoke_run[0] / "vision_sweep.png").read_bytes().startswith(PNG_SIGNATURE)


def test_whole_video_baseline_equals_the_stock_tower_and_evs(tmp_path):
    """The vision sweep's baseline graph computes what the encoder + EVS graphs compute."""
    import onnxruntime as ort

    from qeff_evs.bench.checkpoint import model_config, random_model
    from qeff_evs.evs import kept_from_ranking
    from qeff_evs.models.qwen2_5_vl import reference_vision_evs
    from qeff_evs.models.registry import family_for_config

    baseline = benchmark_script("whole_video_baseline")
    export_whole_video_graph, host_inputs = baseline.export_whole_video_graph, baseline.host_inputs
    hf_config = model_config(SMOKE)
    model = random_model(hf_config, SMOKE.family, seed=3)
    family = family_for_config(hf_config, None)
    path = export_whole_video_graph(family.encoder(model), family.pruning_ranking("evs"), tmp_path / "whole.onnx")
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    grid, q = (3, 8, 12), 0.5
    pixels = torch.randn(3 * 8 * 12, 1176, generator=torch.Generator().manual_seed(0))
    ref_rows, ref_indices = reference_vision_evs(model.model.visual, pixels, grid, q)
    feeds = {"pixel_values": pixels.numpy(), **host_inputs(hf_config.vision_config, grid)}
    rows, ranking = session.run(None, feeds)
    indices = kept_from_ranking(ranking, len(ref_indices))  # the host keeps the first K of the ranking
    np.testing.assert_array_equal(indices, ref_indices.numpy())
    np.testing.assert_allclose(rows[indices], ref_rows.numpy(), atol=1e-4, rtol=0)


def test_whole_video_baseline_script(smoke_run, tmp_path, capsys):
    """benchmarks/whole_video_baseline.py times both graphs per frame count; bench_targets.py reads its JSON."""
    baseline = benchmark_script("whole_video_baseline")
    assert baseline.main(["--smoke", "-o", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "whole_video.json").read_text())
    assert [r["frames"] for r in result["rows"]] == list(baseline.FRAMES["smoke"])
    for r in result["rows"]:
        assert r["temporal_patches"] == r["frames"] // TINY_TEMPORAL
        for name in ("encoder", "whole_video"):
            assert r[name]["cpu_s_per_patch"] > 0 and len(r[name]["samples"]["cpu"]) == SMOKE.repeats
    assert "| 4 |" in capsys.readouterr().out
    targets = benchmark_script("bench_targets").evaluate(smoke_run[1], whole_video=result)
    speedup = next(t for t in targets if t.name == "vision: 16 frames vs the whole-video graph")
    assert speedup.met is None and "not measured at 16 frames" in speedup.measured


# ---------------------------------------------------------------------------------------------
# the phase table: how a new measurement joins the bench


def test_a_phase_added_to_the_table_is_measured_reported_and_plotted(smoke_run, tmp_path, monkeypatch):
    """A phase module's ``PHASE`` (defined here) and one entry in ``phases.PHASES``: an --only choice, a flag
    for its option, a results.json section, lines of results.md and a PNG; --render keeps it."""
    from qeff_evs.bench import phases, plots
    from qeff_evs.bench.phase import Option, Phase, measured_in
    from qeff_evs.bench.timing import Samples, timed

    def measure(config, graphs, progress):
        video = synthetic_clip(graphs.preprocess, 2, config.frame_size, config.seed).video
        pipeline, samples = graphs.vision_pipeline(), Samples()
        for _ in range(config.option("encoder_call_count")):
            timed(lambda: pipeline.merged_rows(video), samples)
        return {"calls": len(samples.cpu), "samples": dataclasses.asdict(samples)}

    def markdown(results):
        return ["", "### Encoder calls", "", measured_in(results, "encoder_calls"), "",
                f"{results['encoder_calls']['calls']} calls timed"]

    def draw(results, path):
        figure = plots.figure(3.0, 2.0)
        figure.add_subplot().plot(results["encoder_calls"]["samples"]["cpu"], "o-")
        return plots.save(figure, path)

    phase = Phase("encoder_calls", measure, markdown=markdown, plots={"encoder_calls.png": draw}, language=False,
                  options=(Option("encoder_call_count", int, {"full": 5, "smoke": 2}, "encoder calls to time"),))
    monkeypatch.setattr(phases, "PHASES", phases.check_table((*phases.PHASES, phase)))
    assert phases.with_option_defaults(SMOKE).option("encoder_call_count") == 2
    out, results = smoke_run
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert cli.main(["bench", "--smoke", "--only", "encoder_calls", "--encoder-call-count", "3",
                         "--base", str(out / "results.json"), "-o", str(tmp_path)]) == 0
    partial = json.loads((tmp_path / "results.json").read_text())
    assert partial["encoder_calls"]["calls"] == 3 and partial["config"]["options"]["encoder_call_count"] == 3
    for name in ("pruning_sweep", "window_sweep", "vision_sweep", "evs_overhead", "decode_context", "prefill_lengths"):
        assert partial[name] == results[name]
    text = (tmp_path / "results.md").read_text()
    assert text.index("### EVS overhead") < text.index("### Encoder calls") and "3 calls timed" in text
    assert (tmp_path / "encoder_calls.png").read_bytes().startswith(PNG_SIGNATURE)
    assert cli.main(["bench", "--render", str(tmp_path / "results.json"), "-o", str(tmp_path / "again")]) == 0
    assert json.loads((tmp_path / "again" / "results.json").read_text()) == partial


def test_phase_table_refuses_clashing_names():
    from qeff_evs.bench import phases
    from qeff_evs.bench.phase import Option, Phase

    def measure(config, graphs, progress):
        return {}

    with pytest.raises(ValueError, match="pruning_sweep"):
        phases.check_table((*phases.PHASES, Phase("pruning_sweep", measure)))
    with pytest.raises(ValueError, match="'frames'.*BenchConfig"):
        phases.check_table((Phase("x", measure, options=(Option("frames", int, {"full": 1}),)),))
