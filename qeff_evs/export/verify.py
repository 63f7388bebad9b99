"""``qeff-evs verify EXPORT [--fp16]``: run the exported graphs on sample inputs before anyone compiles them.

Without ``--fp16`` every graph listed in the manifest is checked (``onnx.checker`` with its functions)
and run through the ORT runtime in fp32 (no inf/NaN). With ``--fp16`` the same workloads also run on
an fp16 twin of the export that follows ``compile.sh``: a graph whose compile line converts
(``-convert-to-fp16``) is replaced by its fp16 copy (``qeff_evs.export.fp16``), a graph compiled in
fp32 keeps fp32 arithmetic and only sees fp16-rounded float inputs (its custom I/O). The report,
per workload, compares the twin with fp32:

* each vision-side graph on video-like inputs (the ``encoder`` graph with its family's host inputs, each
  pruning graph with video-like merged rows of a video shorter than its first bucket, at the export's default
  rate; another with random floats at its first specialization): output error, inf/NaN, and kept-token
  agreement where the graph returns a ``ranking`` (its first K, the method's count);
* ``positions``: one text chunk whose M-RoPE positions start at increasing offsets (KV slots unchanged),
  then a few decode steps: max logit error and greedy agreement per offset. With table RoPE the error
  does not grow with the position; with ``Cos(position * inv_freq)`` in fp16 it does;
* ``magnitude``: a prefill chunk whose media rows have magnitude 1e3 (hidden states through the first
  RMSNorm at that size): inf/NaN and logit error;
* ``layer_states`` (a hybrid family's graph, e.g. Qwen3.5's linear-attention layers): many prefill
  chunks then decode steps, so the retained state passes through every chunk; the twin keeps an fp32
  state and the ops listed in the export's node-precision file in fp32 (``node_precision.keep_in_fp32``),
  as the card does. Logit error, greedy agreement, and each state's relative error at the end;
* ``evs``: the EVS ranking alone on video-like embeddings with realistic norms (20..100) at widths
  2048 and 3584, computed the way the compile line of the EVS pruning graph says: kept-token agreement.
"""

from __future__ import annotations

import shlex
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import onnx
import yaml

from qeff_evs import evs
from qeff_evs.evs import kept_from_ranking
from qeff_evs.export.fp16 import convert_to_fp16
from qeff_evs.export.node_precision import keep_in_fp32
from qeff_evs.export.onnx_graph import legacy_export
from qeff_evs.export.verify_routers import ROUTER_CHUNKS, router_comparison
from qeff_evs.export.verify_runs import (
    EVS_NORMS,
    Comparison,
    LanguageRun,
    agreement,
    chunk_feeds,
    graph_session,
    kept_agreement,
    nonfinite,
    video_like_rows,
)
from qeff_evs.manifest import (
    AUDIO_ENCODER,
    IMAGE_ENCODER,
    LANGUAGE_DECODE,
    MODEL_CONFIG_DIR,
    PRUNING_ROLE,
    check_export_graphs,
    graph_role,
    pruning_graph,
    read_manifest,
)
from qeff_evs.models.parakeet import AUDIO_FRAMES
from qeff_evs.models.pruning import BUCKET_TOKENS, PruningRanking, VideoPruning, pad_to_bucket, pruning_host_inputs
from qeff_evs.specializations import read_specializations_json

Progress = Callable[[str], None]
CONVERT_FLAG = "-convert-to-fp16"
POSITION_OFFSETS = (10, 1000, 2000, 4000, 8000)
EVS_WIDTHS = (2048, 3584)
MAGNITUDE = 1e3
DECODE_STEPS = 4
STATE_CHUNKS, STATE_DECODE_STEPS = 16, 64  # the layer-state workload: prefill chunks, then decode steps


def compile_lines(export_dir: Path) -> dict[str, bool]:
    """``{onnx path relative to the export: compiled with -convert-to-fp16}`` from ``compile.sh``."""
    script = Path(export_dir) / "compile.sh"
    if not script.is_file():
        raise ValueError(f"{script} not found; run `qeff-evs export` (or `qeff-evs compile`) first")
    lines = {}
    for line in script.read_text().splitlines():
        words = shlex.split(line, comments=True) if "-m=" in line else []
        models = [word[len("-m="):] for word in words if word.startswith("-m=")]
        if models:
            lines[models[0]] = CONVERT_FLAG in words
    return lines


def graph_files(export_dir: Path) -> dict[str, str]:
    """``{role: relative path}`` of every ONNX graph the manifest lists for the card (not the host-only decode twin,
    ``manifest.LANGUAGE_DECODE``, which compile.sh does not compile)."""
    manifest = read_manifest(export_dir)
    return {role: file for role, file in manifest.files.items() if file.endswith(".onnx") and role != LANGUAGE_DECODE}


def fp16_twin(export_dir: Path, twin_dir: Path) -> dict[str, bool]:
    """Copy the export to ``twin_dir``, converting the graphs whose compile line converts; returns that map."""
    converts = compile_lines(export_dir)
    shutil.copytree(export_dir, twin_dir, dirs_exist_ok=True)
    for role, file in graph_files(export_dir).items():
        if file not in converts:
            raise ValueError(f"compile.sh has no line for the {role} graph {file}; rerun `qeff-evs compile`")
        if converts[file]:
            target = twin_dir / file
            converted = convert_to_fp16(onnx.load(str(export_dir / file)), in_place=True)
            # Weights in a file of their own (a released-width graph passes protobuf's 2 GB), which also leaves
            # the graph without them for the node edits below.
            onnx.save(converted, str(target), save_as_external_data=True, location=f"{target.name}.fp16.data")
            if role == "language":
                onnx.save(_kept_fp32(export_dir, converted), str(target))
    return converts


def _kept_fp32(export_dir: Path, converted: onnx.ModelProto) -> onnx.ModelProto:
    """The converted language graph with what its compile line keeps fp32: the nodes its node-precision
    file lists, and the layer states left out of custom IO (fp32 buffers)."""
    manifest = read_manifest(export_dir)
    if "language_node_precision" not in manifest.files:
        return converted
    listed = yaml.safe_load(manifest.path(export_dir, "language_node_precision").read_text())
    fp32_inputs = [name for state in manifest.language_shape.layer_states if state.precision == "float32"
                   for name in state.input_names]
    return keep_in_fp32(converted, listed.get("FP32NodeInstanceNames") or [], fp32_inputs)


# --------------------------------------------------------------------------------------------------
# The report, and the language graph's workloads (runs: verify_runs.py; the routers' check: verify_routers.py)


@dataclass
class VerifyReport:
    export_dir: str
    graphs: dict[str, dict]  # role -> {"file", "convert_to_fp16", "checked"}
    fp16: bool
    comparisons: list[Comparison] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)

    @property
    def problems(self) -> list[str]:
        found = []
        for c in self.comparisons:
            if c.nonfinite_fp32:
                found.append(f"{c.name}: {c.nonfinite_fp32} inf/NaN values in fp32")
            if self.fp16 and c.nonfinite_fp16:
                found.append(f"{c.name}: {c.nonfinite_fp16} inf/NaN values in fp16")
        return found


def _chunk(run: LanguageRun, seq_len: int, offset: int, seed: int, media_rows: np.ndarray | None = None):
    """Feeds of a prefill chunk of ``seq_len`` tokens at KV slots 0.. and M-RoPE positions ``offset``.."""
    return chunk_feeds(run.shape, run.tokens, seq_len, offset, seed, media_rows)


def _generate(run: LanguageRun, chunk, offset: int, steps: int) -> tuple[np.ndarray, list[int]]:
    """Prefill ``chunk`` then greedy-decode ``steps`` tokens; (every logits row, greedy tokens)."""
    ids, positions, vision = chunk
    run.reset()
    logits = [run.run(ids, positions, **vision)]
    tokens = [int(np.argmax(logits[-1]))]
    seq_len = ids.shape[1]
    for j in range(steps):
        slot, position = seq_len + j, offset + seq_len + j
        step_positions = np.array([slot, position, position, position], np.int64).reshape(4, 1, 1)
        logits.append(run.run(np.array([[tokens[-1]]], np.int64), step_positions))
        tokens.append(int(np.argmax(logits[-1])))
    return np.stack(logits), tokens


def _compare_runs(name: str, fp32: tuple[np.ndarray, list[int]], fp16: tuple[np.ndarray, list[int]] | None,
                  **detail) -> Comparison:
    result = Comparison(name, nonfinite_fp32=nonfinite(fp32[0]), detail=detail)
    if fp16 is not None:
        result.nonfinite_fp16 = nonfinite(fp16[0])
        result.max_abs_error = float(np.nan_to_num(np.abs(fp16[0] - fp32[0]), nan=np.inf).max())
        result.greedy_agreement = agreement(fp32[1], fp16[1])
    return result


def position_comparisons(fp32_dir: Path, fp16_dir: Path | None, seq_len: int = 16) -> list[Comparison]:
    fp32 = LanguageRun(fp32_dir)
    fp16 = LanguageRun(fp16_dir) if fp16_dir else None
    seq_len = fp32.chunk_len(seq_len)
    table = fp32.shape.rope_positions or fp32.shape.ctx_len
    last = table - seq_len - DECODE_STEPS - 1
    offsets = sorted({offset for offset in POSITION_OFFSETS if offset <= last} | {max(0, last)})
    results = []
    for offset in offsets:
        chunk = _chunk(fp32, seq_len, offset, seed=7)
        results.append(_compare_runs(f"positions@{offset}", _generate(fp32, chunk, offset, DECODE_STEPS),
                                     _generate(fp16, chunk, offset, DECODE_STEPS) if fp16 else None,
                                     first_position=offset, last_position=offset + seq_len + DECODE_STEPS - 1))
    return results


def magnitude_comparison(fp32_dir: Path, fp16_dir: Path | None, seq_len: int = 16) -> Comparison:
    fp32 = LanguageRun(fp32_dir)
    fp16 = LanguageRun(fp16_dir) if fp16_dir else None
    seq_len = fp32.chunk_len(seq_len)
    rng = np.random.default_rng(3)
    rows = (rng.choice([-1.0, 1.0], size=(seq_len // 2, fp32.shape.hidden)) * MAGNITUDE).astype(np.float32)
    chunk = _chunk(fp32, seq_len, 0, seed=11, media_rows=rows)
    return _compare_runs("magnitude_1e3", _generate(fp32, chunk, 0, DECODE_STEPS),
                         _generate(fp16, chunk, 0, DECODE_STEPS) if fp16 else None, magnitude=MAGNITUDE)


def state_comparison(fp32_dir: Path, fp16_dir: Path | None, chunks: int = STATE_CHUNKS,
                     steps: int = STATE_DECODE_STEPS) -> Comparison:
    """``chunks`` prefill chunks of the compiled length at consecutive slots, then ``steps`` decode steps
    (both runs fed fp32's greedy tokens, so the states see the same inputs): logits all along, greedy
    agreement, and each layer state's largest relative error (Frobenius, over its layers) at the end."""
    fp32 = LanguageRun(fp32_dir)
    fp16 = LanguageRun(fp16_dir) if fp16_dir else None
    seq_len = fp32.prefill_seq_len
    total = chunks * seq_len + steps
    if total > fp32.shape.ctx_len:  # as many chunks as the context holds
        chunks = max(1, (fp32.shape.ctx_len - steps) // seq_len)
    runs = {"fp32": fp32, **({"fp16": fp16} if fp16 else {})}
    results, fed = {}, None
    for label, run in runs.items():  # fp32 first: the fp16 run decodes fp32's tokens (teacher forcing)
        run.reset()
        logits = []
        for c in range(chunks):
            ids, positions, vision = _chunk(fp32, seq_len, 0, seed=100 + c)
            logits.append(run.run(ids, positions + c * seq_len, **vision))
        tokens = [int(np.argmax(logits[-1]))]
        for j in range(steps):
            step_positions = np.full((4, 1, 1), chunks * seq_len + j, np.int64)
            token = tokens[-1] if fed is None else fed[j]
            logits.append(run.run(np.array([[token]], np.int64), step_positions))
            tokens.append(int(np.argmax(logits[-1])))
        fed = tokens if fed is None else fed
        results[label] = (np.stack(logits), tokens)
    detail = {"chunks": chunks, "chunk_len": seq_len, "decode_steps": steps}
    if fp16:
        names = [name for state in fp32.shape.layer_states for name in state.input_names]
        for state in fp32.shape.layer_states:
            errors = [float(np.linalg.norm(fp16.state[n] - fp32.state[n]) / max(np.linalg.norm(fp32.state[n]), 1e-30))
                      for n in state.input_names]
            detail[f"{state.name}_relative_error"] = max(errors)
        detail["states"] = len(names)
    return _compare_runs("layer_states", results["fp32"], results.get("fp16"), **detail)


def _vision_feeds(export_dir: Path, role: str, session, seed: int) -> dict[str, np.ndarray]:
    """Sample inputs of a vision-side graph at its first specialization.

    The ``encoder`` graph gets its family's host inputs and video-like pixels (frames that drift a
    little), the ``evs`` graph video-like merged rows (so EVS has something to rank); another graph
    gets random floats and zero integers (shape carriers and indices stay in range).
    """
    manifest = read_manifest(export_dir)
    rng = np.random.default_rng(seed)
    entries = {"encoder": manifest.encoder_entries, IMAGE_ENCODER: manifest.image_encoder_entries}.get(role)
    if entries:  # the image encoder takes the video encoder's host inputs (its tiles' grid)
        from qeff_evs.models.checkpoint import load_config
        from qeff_evs.models.registry import family_for_config

        entry = entries[0]
        family = family_for_config(load_config(export_dir / MODEL_CONFIG_DIR))
        host = family.encoder_host_inputs(entry.grid_hw, entry.frames_per_call)
        pixels = next(i for i in session.get_inputs() if i.name not in host)
        per_frame = int(np.prod(entry.grid_hw))
        width = pixels.shape[1] if isinstance(pixels.shape[1], int) else entry.symbols[pixels.shape[1]]
        return {pixels.name: video_like_rows(entry.frames_per_call, per_frame, width,
                                             (0.5 * width ** 0.5, 2 * width ** 0.5), seed), **host}
    if role == AUDIO_ENCODER:  # a clip filling three quarters of its bucket, the rest masked
        symbols = read_specializations_json(manifest.path(export_dir, f"{role}_specializations"))[0].symbols
        frames = symbols[AUDIO_FRAMES]
        mask = (np.arange(frames) < max(1, 3 * frames // 4)).astype(np.int64)
        mels = next(i for i in session.get_inputs() if i.name == "pixel_values").shape[1]
        return {"pixel_values": rng.standard_normal((frames, mels)).astype(np.float32) * mask[:, None],
                "feature_mask": mask}
    if graph_role(role) == PRUNING_ROLE and manifest.pruning_entries:
        entry = next(e for e in manifest.pruning_entries if pruning_graph(e.method) == role)
        bucket = entry.temporal_patches
        tokens = entry.symbols[BUCKET_TOKENS] // bucket
        frames = bucket // 2 + 1  # a video shorter than its bucket (padding present) when it can be
        feeds = {}
        for value in session.get_inputs():
            if value.name == "merged_embeds":
                rows = video_like_rows(frames, tokens, value.shape[1], (8.0, 32.0), seed)
                feeds[value.name] = pad_to_bucket(rows, bucket * tokens)
            elif value.name == "score_extras":  # a family's extra rows, (levels, rows, hidden)
                levels = np.stack([video_like_rows(frames, tokens, value.shape[2], (8.0, 32.0), seed + 1 + i)
                                   for i in range(value.shape[0])])
                feeds[value.name] = pad_to_bucket(levels, bucket * tokens, axis=1)
        return {**feeds, **pruning_host_inputs(entry.method, bucket, frames, manifest.video_pruning_rate)}
    symbols = read_specializations_json(manifest.path(export_dir, f"{role}_specializations"))[0].symbols
    feeds = {}
    for value in session.get_inputs():
        dims = [d if isinstance(d, int) else symbols[d] for d in value.shape]
        if "float" in value.type:
            feeds[value.name] = rng.standard_normal(dims).astype(np.float32)
        else:
            feeds[value.name] = np.zeros(dims, np.int64 if "int64" in value.type else np.int32)
    return feeds


def _kept_by_ranking(manifest, role: str, feeds: dict[str, np.ndarray], ranking: np.ndarray) -> np.ndarray:
    """The kept indices a pruning graph's ranking gives for its sample feeds at the export's default rate."""
    method = role[len(PRUNING_ROLE) + 1:]
    bucket, frames = feeds["bucket_carrier"].shape[0], int(feeds["frame_count"][0])
    tokens = ranking.shape[0] // bucket
    pruning = VideoPruning(method, manifest.video_pruning_rate)
    return kept_from_ranking(ranking, pruning.kept_token_count(tokens, frames))


def vision_comparisons(fp32_dir: Path, fp16_dir: Path | None) -> list[Comparison]:
    results = []
    manifest = read_manifest(fp32_dir)
    for role, file in graph_files(fp32_dir).items():
        if role == "language":
            continue
        fp32 = graph_session(fp32_dir / file)
        feeds = _vision_feeds(fp32_dir, role, fp32, seed=1)
        names = [o.name for o in fp32.get_outputs()]
        reference = dict(zip(names, fp32.run(names, feeds)))
        floats = [n for n in names if reference[n].dtype.kind == "f"]
        result = Comparison(role, nonfinite_fp32=sum(nonfinite(reference[n]) for n in floats))
        if fp16_dir is not None:
            card = dict(zip(names, graph_session(fp16_dir / file).run(names, feeds)))
            result.nonfinite_fp16 = sum(nonfinite(card[n]) for n in floats)
            errors = [np.abs(card[n] - reference[n]) for n in floats if card[n].shape == reference[n].shape]
            result.max_abs_error = float(max((np.nan_to_num(e, nan=np.inf).max() for e in errors), default=0.0))
            if "ranking" in names:
                result.kept_token_agreement = kept_agreement(_kept_by_ranking(manifest, role, feeds, reference["ranking"]),
                                                             _kept_by_ranking(manifest, role, feeds, card["ranking"]))
        results.append(result)
    return results


def evs_comparisons(export_dir: Path, converts_evs: bool, frames: int = 8, tokens: int = 256,
                    q: float = 0.5) -> list[Comparison]:
    """Kept-token agreement of the EVS ranking's arithmetic in the precision its compile line gives it."""
    import onnxruntime as ort

    ranking = PruningRanking("evs")
    k = evs.kept_token_count(tokens, frames, q)
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "evs.onnx"
        example = ranking.dummy_inputs(tokens_per_frame=5, bucket=3, hidden=8, frame_count=2)
        axes = {**ranking.graph_spec.dynamic_axes, "merged_embeds": {0: BUCKET_TOKENS, 1: "width"}}  # any width
        legacy_export(ranking, list(example.values()), path, input_names=ranking.graph_spec.input_names,
                      output_names=ranking.graph_spec.output_names, dynamic_axes=axes)
        model = onnx.load(str(path))
        fp32 = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        card = convert_to_fp16(model) if converts_evs else model
        fp16 = ort.InferenceSession(card.SerializeToString(), providers=["CPUExecutionProvider"])
        for width in EVS_WIDTHS:
            rows = video_like_rows(frames, tokens, width, EVS_NORMS, seed=width)
            feeds = {"merged_embeds": rows, **ranking.host_inputs(frames, frames, q)}
            reference = kept_from_ranking(fp32.run(None, feeds)[0], k)
            # The card's I/O is fp16 either way (custom IO): the rows arrive rounded.
            card_rows = dict(feeds, merged_embeds=rows.astype(np.float16).astype(np.float32))
            kept = kept_from_ranking(fp16.run(None, card_rows)[0], k)
            results.append(Comparison(f"evs@width{width}", kept_token_agreement=kept_agreement(reference, kept),
                                      detail={"frames": frames, "tokens_per_frame": tokens, "kept": k,
                                              "norms": list(EVS_NORMS), "fp32_arithmetic": not converts_evs}))
    return results


def _evs_graph_converts(export_dir: Path, converts: dict[str, bool]) -> bool:
    """Whether the EVS pruning graph is compiled with fp16 arithmetic (an export without it: as the encoder)."""
    files = graph_files(export_dir)
    return converts.get(files.get(pruning_graph("evs"), files["encoder"]), True)


def verify_export(export_dir: str | Path, fp16: bool = False, progress: Progress = lambda message: None) -> VerifyReport:
    export_dir = Path(export_dir)
    check_export_graphs(export_dir, read_manifest(export_dir))  # before onnx or ONNX Runtime reads external data
    converts = compile_lines(export_dir)
    graphs = {}
    for role, file in graph_files(export_dir).items():
        progress(f"checking the {role} graph {file}")
        onnx.checker.check_model(str(export_dir / file), full_check=True)
        graphs[role] = {"file": file, "convert_to_fp16": converts.get(file), "checked": True}
    report = VerifyReport(str(export_dir), graphs, fp16)
    with tempfile.TemporaryDirectory() as scratch:
        twin = None
        if fp16:
            progress("writing the fp16 twin of the export (graphs converted as compile.sh converts them)")
            twin = Path(scratch) / "fp16"
            fp16_twin(export_dir, twin)
        progress("vision graph(s) on video-like inputs")
        report.comparisons += vision_comparisons(export_dir, twin)
        progress("language graph at increasing M-RoPE positions")
        report.comparisons += position_comparisons(export_dir, twin)
        progress(f"language graph with hidden states of magnitude {MAGNITUDE:g}")
        report.comparisons.append(magnitude_comparison(export_dir, twin))
        if read_manifest(export_dir).language_shape.layer_states:
            progress(f"language graph's layer states over {STATE_CHUNKS} chunks and {STATE_DECODE_STEPS} decode steps")
            report.comparisons.append(state_comparison(export_dir, twin))
        if fp16:
            progress(f"MoE routers over {ROUTER_CHUNKS} chunks of video-like rows, router in fp16 and in fp32")
            router = router_comparison(export_dir)
            if router is not None:
                report.comparisons.append(router)
            progress(f"EVS arithmetic at widths {EVS_WIDTHS}, norms {EVS_NORMS}")
            report.comparisons += evs_comparisons(export_dir, _evs_graph_converts(export_dir, converts))
    return report


def format_report(report: VerifyReport) -> str:
    lines = [f"qeff-evs verify {report.export_dir} ({'fp32 and fp16 emulation' if report.fp16 else 'fp32'})"]
    for role, graph in report.graphs.items():
        precision = "fp16 (-convert-to-fp16)" if graph["convert_to_fp16"] else "fp32"
        lines.append(f"  graph {role}: {graph['file']} checked, compiled in {precision}")
    for c in report.comparisons:
        parts = [f"{c.name:<18}"]
        if report.fp16:
            parts.append(f"max |fp16 - fp32| {c.max_abs_error:.3g}")
            parts.append(f"greedy agreement {c.greedy_agreement:.0%}")
        if c.kept_token_agreement is not None:
            parts.append(f"kept-token agreement {c.kept_token_agreement:.2%}")
        parts += [f"{key.replace('_', ' ')} {value:.3g}" for key, value in c.detail.items()
                  if isinstance(value, float) and (key.endswith("_relative_error")
                                                 or key.startswith(("flipped_", "prob_error_max", "router_own")))]
        if "compiled_router_precision" in c.detail:
            parts.append(f"compiled router {c.detail['compiled_router_precision']}")
        parts.append(f"inf/NaN fp32 {c.nonfinite_fp32}" + (f" fp16 {c.nonfinite_fp16}" if report.fp16 else ""))
        lines.append("  " + "  ".join(parts))
    lines += [f"  problem: {p}" for p in report.problems] or ["  no inf/NaN"]
    return "\n".join(lines)
