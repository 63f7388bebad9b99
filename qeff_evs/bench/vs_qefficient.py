"""``qeff-evs bench --vs-qefficient CHECKPOINT --clip CLIP --qefficient-python PY``: the same checkpoint and frames
through QEfficient's graphs and ours, side by side, on ONNX Runtime.

* QEfficient (its own interpreter, a child process running ``qefficient_driver.py``): exports the checkpoint as
  its dual QPC (vision + language graph) and computes its prompt's positions. It takes a video as its frames, one
  image each (it has no video input), so its prompt holds every frame's image tokens, unpruned. Its graphs run
  here with its host's loop (``qefficient_host``): the whole prompt's vision rows with every prefill chunk, twice:
  every state fed and read back per call (as QEfficient's own ORT runner does), and the state bound in place (as
  ours is, and as the card keeps it), so its time per chunk is compared with ours without the KV copies.
* qeff-evs: ``qeff-evs export`` of the same checkpoint at the clip's size and frame count, the video through the
  engine at each pruning rate (``OrtLanguageSession``: the state bound in place); each chunk gets its window of
  ``user_vision_size`` rows.
* transformers referees both on the same inputs (``hf_reference``): QEfficient's image prompt, our video prompt
  at q = 0 (vLLM's positions).

Where QEfficient fails (export, memory, a config it assumes) the report says so in one line and carries on with
ours. Results (``vs_qefficient_report``): ``vs_qefficient.json``, ``vs_qefficient.md``, ``vs_qefficient.png``; the
commands to repeat the comparison on a card are in both.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from qeff_evs.bench.phase import MS, Progress
from qeff_evs.bench.timing import CPU, WALL, ChunkedRun, Samples, run_interleaved, timed
from qeff_evs.bench.vs_qefficient_report import OURS, QEFFICIENT, save
from qeff_evs.runtime.backends.base import LanguageInputs

QEFFICIENT_PYTHON_ENV = "QEFF_EVS_QEFFICIENT_PYTHON"
DRIVER = Path(__file__).with_name("qefficient_driver.py")


@dataclass(frozen=True)
class VsConfig:
    """What one comparison runs: the user's checkpoint and clip, the export's sizes, the rates."""

    checkpoint: Path
    clip: Path
    qefficient_python: Path | None
    frames: int = 16  # the export's largest frame bucket: the clip is sampled to at most this many
    size: tuple[int, int] = (448, 448)  # (height, width) the encoder sees
    pruning_rates: tuple[float, ...] = (0.0, 0.5, 0.75)
    prefill_seq_len: int = 128
    ctx_len: int = 8192
    new_tokens: int = 8
    question: str = "What happens in this video?"
    accounting_frames: tuple[int, ...] = (64,)  # vision bytes per chunk, counted (not run) at these frame counts
    driver_timeout_s: float = 3600.0

    def __post_init__(self) -> None:
        rates = tuple(sorted({0.0, *(float(q) for q in self.pruning_rates)}))
        object.__setattr__(self, "pruning_rates", rates)
        if self.new_tokens < 1:
            raise ValueError(f"--new-tokens must be >= 1, got {self.new_tokens}")


def qefficient_python(given: str | Path | None) -> Path | None:
    """``--qefficient-python``, else $QEFF_EVS_QEFFICIENT_PYTHON; None when neither names one."""
    value = given or os.environ.get(QEFFICIENT_PYTHON_ENV)
    if not value:
        return None
    path = Path(value)
    if not path.is_file() or not os.access(path, os.X_OK):
        raise ValueError(f"--qefficient-python {value}: no executable Python there; give the Python of an "
                         f"environment with QEfficient installed (or set {QEFFICIENT_PYTHON_ENV})")
    return path


# ---- bytes accounting (pure) ---------------------------------------------------------------------------


def vision_bytes(rows: int, hidden: int, levels: int = 0, itemsize: int = 4) -> int:
    """Bytes of a chunk's vision inputs: ``rows`` rows of ``vision_embeds`` and of each extra level."""
    return rows * hidden * (1 + levels) * itemsize


def step_bytes(step: LanguageInputs, logits_rows: bool = False) -> tuple[int, int]:
    """(vision bytes, all bytes) fed to one of our language calls on ONNX Runtime: the window's rows (and extras),
    ids, positions, ``image_idx``, and with ``logits_rows`` (a graph that takes it) that input: one int64 where the
    step wants its logits, none where it does not. The retained state (KV, layer states) is bound in place by
    ``OrtLanguageSession``: never fed."""
    vision = int(np.asarray(step.vision_embeds, dtype=np.float32).nbytes) if step.vision_embeds is not None else 0
    vision += sum(int(np.asarray(v, dtype=np.float32).nbytes) for v in step.extras.values())
    other = int(step.input_ids.nbytes + step.position_ids.nbytes + step.image_idx.nbytes)
    other += 8 * int(logits_rows and step.wants_logits)
    return vision, vision + other


@dataclass(frozen=True)
class BytesPoint:
    """Vision bytes each side feeds per prefill chunk for a clip of ``frames`` frames (counted from shapes)."""

    frames: int
    qefficient_rows: int  # every frame's image rows: the whole prompt's
    qeff_evs_rows: int  # the window: user_vision_size
    qefficient_bytes: int
    qeff_evs_bytes: int

    @property
    def ratio(self) -> float:
        return self.qefficient_bytes / self.qeff_evs_bytes


def bytes_point(frames: int, rows_per_frame: int, window: int, hidden: int, levels: int) -> BytesPoint:
    """QEfficient feeds ``frames * rows_per_frame`` rows per chunk (frames as images), we feed the window."""
    rows = frames * rows_per_frame
    return BytesPoint(frames, rows, window, vision_bytes(rows, hidden, levels), vision_bytes(window, hidden, levels))


# ---- the result ----------------------------------------------------------------------------------------


@dataclass
class SideCost:
    """One side's cost for the request: vision, prefill (sum of chunks), TTFT = vision + prefill."""

    prompt_tokens: int
    chunks: int
    vision_rows: int  # rows the vision side produced (kept rows for ours)
    vision_rows_per_chunk: int
    vision_bytes_per_chunk: int
    all_bytes_per_chunk: int  # every input fed to a chunk's call; state bound in place is not fed
    state_in_place: bool = True  # the KV cache (and every retained state) bound in place, not fed per call
    upload_bytes: int = 0  # fed once per request outside the chunks (QEfficient in place: its vision rows)
    vision: Samples = field(default_factory=Samples)
    prefill_chunks: Samples = field(default_factory=Samples)

    def seconds(self, clock: str = WALL) -> dict:
        vision = sum(self.vision.clock(clock))
        prefill = sum(self.prefill_chunks.clock(clock))
        per_chunk = prefill / max(1, len(self.prefill_chunks.clock(clock)))
        return {"vision_s": vision, "prefill_s": prefill, "ttft_s": vision + prefill, "ms_per_chunk": per_chunk * MS}

    def to_json(self) -> dict:
        data = asdict(self)
        data.update({clock: self.seconds(clock) for clock in (WALL, CPU)})
        return data


def failure_line(stage: str, detail: str) -> str:
    """The report's one line where QEfficient fails: what failed and QEfficient's own last words."""
    last = [line.strip() for line in str(detail).strip().splitlines() if line.strip()]
    return f"QEfficient failed at {stage}: {last[-1] if last else 'no message'} (qeff-evs measured alone)"


# ---- QEfficient's side, in its own interpreter ----------------------------------------------------------


@dataclass(frozen=True)
class DriverResult:
    vision_onnx: Path | None = None
    language_onnx: Path | None = None
    positions: np.ndarray | None = None
    info: dict = field(default_factory=dict)
    failure: str | None = None


def run_driver(python: Path, request: dict, folder: Path, input_ids: np.ndarray, timeout_s: float,
               progress: Progress) -> DriverResult:
    """QEfficient's export in its own interpreter; its log in ``folder/qefficient.log``."""
    folder.mkdir(parents=True, exist_ok=True)
    result_path = folder / "qefficient.json"
    result_path.unlink(missing_ok=True)  # a rerun in the same folder must not read the last run's result
    np.save(folder / "qefficient_input_ids.npy", np.asarray(input_ids, dtype=np.int64)[None])
    (folder / "request.json").write_text(json.dumps(request, indent=2) + "\n")
    log = folder / "qefficient.log"
    progress(f"QEfficient ({python}): exporting its vision and language graphs (log: {log})")
    with open(log, "w") as handle:
        try:
            code = subprocess.run([str(python), str(DRIVER), str(folder / "request.json")], stdout=handle,
                                  stderr=subprocess.STDOUT, timeout=timeout_s, cwd=folder).returncode
        except subprocess.TimeoutExpired:
            return DriverResult(failure=failure_line("export", f"no result after {timeout_s:.0f} s"))
    if not result_path.is_file():
        killed = f" (killed by signal {-code}; 9 is also the kernel's out-of-memory kill)" if code < 0 else ""
        return DriverResult(failure=failure_line("export", f"its Python exited {code}{killed} without a result; "
                                                 f"see {log}"))
    info = json.loads(result_path.read_text())
    if "error" in info:
        return DriverResult(info=info, failure=failure_line("export", info["error"]))
    positions = np.load(folder / "qefficient_positions.npy")
    return DriverResult(Path(info["vision_onnx"]), Path(info["language_onnx"]), positions, info)


def image_prompt_ids(tokenizer, tokens, question: str, rows_per_image: Sequence[int]) -> np.ndarray:
    """The chat template with one image per frame, then the question; each image pad expanded to its rows
    (what transformers' processor does for images)."""
    from qeff_evs.runtime.inputs.prompt import chat_pieces

    content = [{"type": "image"} for _ in rows_per_image] + [{"type": "text", "text": question}]
    pad = tokenizer.convert_tokens_to_ids(tokens.image)
    ids: list[int] = []
    for piece in chat_pieces(tokenizer, content, tokens):
        ids += [pad] * rows_per_image[piece.media_item] if piece.media_item is not None else list(piece.ids)
    return np.asarray(ids, dtype=np.int64)


# ---- the comparison --------------------------------------------------------------------------------------


def run_comparison(config: VsConfig, output: Path, workdir: Path, progress: Progress, command: str = "") -> dict:
    from qeff_evs.bench import hf_reference
    from qeff_evs.bench.qefficient_host import QEfficientGraphs
    from qeff_evs.export.pipeline import ExportOptions, export_checkpoint
    from qeff_evs.runtime.backends.ort import OrtLanguageSession
    from qeff_evs.runtime.engine.single_request import Engine, EngineConfig
    from qeff_evs.runtime.engine.steps import prefill_step
    from qeff_evs.runtime.engine.window import prefill_chunks
    from qeff_evs.runtime.export_bundle import open_export
    from qeff_evs.runtime.inputs.processor import preprocess_image, video_file_frames
    from qeff_evs.runtime.inputs.prompt import video_question_pieces
    from qeff_evs.runtime.media import video_from_file
    from qeff_evs.runtime.sessions import sessions_for

    workdir.mkdir(parents=True, exist_ok=True)
    output.mkdir(parents=True, exist_ok=True)
    started_utc = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())

    # ours: export at the clip's size and frame count
    export_dir = workdir / "qeff_evs_export"
    progress(f"qeff-evs export of {config.checkpoint} ({config.frames} frames, {config.size[0]}x{config.size[1]})")
    export = Samples()
    # Shaped as QEfficient's graphs are: every chunk of prefill_seq_len reads all ctx_len slots (one compute context
    # length, no short last chunk), so a chunk's time differs between the sides only by their vision inputs.
    timed(lambda: export_checkpoint(config.checkpoint, export_dir, ExportOptions(
        0.0, (config.frames,), (tuple(config.size),), config.prefill_seq_len, config.ctx_len,
        ctx_lengths=(config.ctx_len,), short_prefill_lens=())), export)
    bundle = open_export(export_dir)
    family, shape, spec = bundle.family, bundle.language_shape, bundle.preprocess
    video = video_from_file(config.clip, bundle)
    frames = video_file_frames(config.clip, spec, max_frames=bundle.manifest.max_frames).frames
    height, width = video.grid_thw[1] * spec.patch_size, video.grid_thw[2] * spec.patch_size
    images = [preprocess_image(frame, (height, width), spec) for frame in frames]
    image_inputs = [(np.asarray(im.pixel_values, dtype=np.float32), tuple(int(v) for v in im.grid_thw))
                    for im in images]
    merge = spec.merge_size
    rows_per_image = [t * h * w // merge**2 for _, (t, h, w) in image_inputs]
    image_ids = image_prompt_ids(bundle.tokenizer, family.token_strings, config.question, rows_per_image)
    levels = sum(shape.extras.values())
    progress(f"clip: {len(frames)} frames at {height}x{width}; QEfficient's prompt {len(image_ids)} tokens "
             f"({len(frames)} images of {rows_per_image[0]} rows)")

    # QEfficient: export in its interpreter
    driver = DriverResult(failure="QEfficient not run: no --qefficient-python given "
                                  f"(nor ${QEFFICIENT_PYTHON_ENV}); qeff-evs measured alone")
    if config.qefficient_python is not None:
        request = {"checkpoint": str(Path(config.checkpoint).resolve()), "prefill_seq_len": config.prefill_seq_len,
                   "ctx_len": config.ctx_len, "image_grid_thw": [list(g) for _, g in image_inputs]}
        driver = run_driver(config.qefficient_python, request, workdir / "qefficient", image_ids,
                            config.driver_timeout_s, progress)
    if driver.failure:
        progress(driver.failure)

    # ours at every rate
    vision_session, language_session = sessions_for(bundle, "ort")
    pieces = video_question_pieces(bundle.tokenizer, config.question, family.token_strings)
    ours: dict[float, SideCost] = {}
    runs: dict[str, ChunkedRun] = {}
    prompts = {}
    for q in config.pruning_rates:
        engine = Engine(family, vision_session, language_session,
                        EngineConfig(config.prefill_seq_len, config.ctx_len, shape.vision_size, q,
                                     max_new_tokens=config.new_tokens))
        cost_vision = Samples()
        progress(f"qeff-evs q={q:g}: vision (encoder + pruning)")
        prompt = timed(lambda: engine.prepare(pieces, [video]), cost_vision)
        prompts[q] = prompt
        steps = [prefill_step(prompt, c, n, config.prefill_seq_len, shape.vision_size, shape.hidden, shape.extras)
                 for c, n in prefill_chunks(len(prompt.ids), config.prefill_seq_len)]
        vision_b, call_b = zip(*(step_bytes(s, shape.logits_rows) for s in steps))
        ours[q] = SideCost(len(prompt.ids), len(steps), int(sum(len(e.kept_indices) for e in prompt.encoded)),
                           shape.vision_size, max(vision_b), max(call_b), vision=cost_vision)
        runs[f"q={q:g}"] = ChunkedRun(OrtLanguageSession(language_session.session, shape), steps)

    # QEfficient's run (vision + every chunk + decode), then our prefills interleaved chunk by chunk
    theirs = theirs_in_place = None
    qeff_run = qeff_in_place = None
    if not driver.failure:
        try:
            progress("QEfficient's graphs on ONNX Runtime: vision per image")
            graphs = QEfficientGraphs(driver.vision_onnx, driver.language_onnx)
            qeff_vision = Samples()
            vision_rows = graphs.encode_images(image_inputs, qeff_vision)
            runs_qeff = {}
            for in_place in (False, True):
                progress("QEfficient's chunked prefill and decode, " + (
                    "its retained state bound in place" if in_place else "every state fed (as its ORT runner)"))
                runs_qeff[in_place] = graphs.generate(image_ids, driver.positions, image_inputs,
                                                      config.prefill_seq_len, config.ctx_len, config.new_tokens,
                                                      in_place=in_place, vision=vision_rows)
            qeff_run, qeff_in_place = runs_qeff[False], runs_qeff[True]
            theirs, theirs_in_place = (qefficient_cost(r, qeff_vision) for r in (qeff_run, qeff_in_place))
            del graphs, vision_rows
        except Exception as error:  # noqa: BLE001 - QEfficient's graph failing is a result, not a crash
            driver = DriverResult(info=driver.info, failure=failure_line("run on ONNX Runtime", str(error)))
            progress(driver.failure)
    progress("qeff-evs prefill at every rate, chunk by chunk in turn")
    run_interleaved(list(runs.values()))
    for q in config.pruning_rates:
        ours[q].prefill_chunks = runs[f"q={q:g}"].samples

    # fidelity against transformers
    progress("transformers' reference: the video at q=0 (vLLM positions), the frames as images")
    model = hf_reference.load_reference_model(config.checkpoint, family.model_class)
    engine = Engine(family, vision_session, language_session,
                    EngineConfig(config.prefill_seq_len, config.ctx_len, shape.vision_size, 0.0,
                                 max_new_tokens=config.new_tokens))
    generated = engine.generate(prompts[0.0], eos_ids=())
    video_ref = hf_reference.video_reference(model, prompts[0.0].ids, prompts[0.0].positions, video.pixel_values,
                                             video.grid_thw, config.new_tokens)
    fidelity = {OURS: hf_reference.fidelity(runs["q=0"].logits, generated.generated_token_ids, video_ref).to_json()}
    if qeff_run is not None:
        image_ref = hf_reference.images_reference(model, image_ids, np.concatenate([p for p, _ in image_inputs]),
                                                  np.asarray([g for _, g in image_inputs]), config.new_tokens)
        fidelity[QEFFICIENT] = hf_reference.fidelity(qeff_run.first_logits, qeff_run.tokens, image_ref).to_json()
    del model

    accounting = [bytes_point(f, rows_per_image[0], shape.vision_size, shape.hidden, levels)
                  for f in sorted({len(frames), *config.accounting_frames})]
    results = {
        "config": {**{k: str(v) if isinstance(v, Path) else v for k, v in asdict(config).items()},
                   "family": family.model_type, "frames_sampled": len(frames), "height": height, "width": width,
                   "user_vision_size": shape.vision_size, "hidden": shape.hidden, "extra_levels": levels},
        "started_utc": started_utc,
        "finished_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "load_average": [round(v, 2) for v in os.getloadavg()],
        "qefficient": {"failure": driver.failure, **driver.info,
                       "cost": theirs.to_json() if theirs else None,
                       "cost_in_place": theirs_in_place.to_json() if theirs_in_place else None,
                       "in_place_agrees": in_place_agreement(qeff_run, qeff_in_place)},
        OURS: {"export_seconds": export.wall[0],
               "rates": {f"{q:g}": cost.to_json() for q, cost in ours.items()}},
        "fidelity": fidelity,
        "vision_bytes_per_chunk": [{**asdict(p), "ratio": p.ratio} for p in accounting],
        "card_commands": card_commands(config, export_dir, driver),
        "command": command,
    }
    save(results, output)
    return results


def qefficient_cost(run, vision: Samples) -> SideCost:
    """One QEfficient run's cost: every image's rows with every chunk, its vision timed once for both runs."""
    return SideCost(run.prompt_tokens, len(run.vision_bytes_per_chunk), run.vision_rows, run.vision_rows,
                    max(run.vision_bytes_per_chunk), max(run.all_bytes_per_chunk), run.in_place,
                    run.vision_upload_bytes, vision, run.chunks)


def in_place_agreement(host, in_place) -> dict | None:
    """QEfficient's graphs with the state bound in place against the same graphs fed as its runner feeds them."""
    if host is None or in_place is None:
        return None
    diff = float(np.max(np.abs(host.first_logits - in_place.first_logits)))
    return {"max_abs_logit_diff": diff, "tokens_equal": host.tokens == in_place.tokens}


def card_commands(config: VsConfig, export_dir: Path, driver: DriverResult) -> list[str]:
    """How to repeat the comparison on a card: both compiled with qaic-compile, both run through qaicrt."""
    h, w = config.size
    lines = [
        "# qeff-evs: qaic-compile of its three graphs (compile.sh), then the engine on qaicrt",
        f"qeff-evs compile {export_dir}",
        *(f"qeff-evs run {export_dir} --video {config.clip} --prompt {json.dumps(config.question)} --backend qaic "
          f"--video-pruning-rate {q:g} --json" for q in config.pruning_rates),
        "# QEfficient: its own compile (qaic-compile of the vision and language QPCs) and generate (qaicrt)",
        f"{config.qefficient_python or 'python'} -c \"from QEfficient import QEFFAutoModelForImageTextToText as M; "
        f"m = M.from_pretrained('{config.checkpoint}', kv_offload=True); "
        f"m.compile(prefill_seq_len={config.prefill_seq_len}, ctx_len={config.ctx_len}, height={h}, width={w}, "
        f"num_frames={config.frames}, num_cores=16); print(m.vision_model.qpc_path, m.lang_model.qpc_path)\"",
        f"# (num_frames: its language program's vision_size holds {config.frames} images' rows, one vision call each)",
        "# then m.generate(inputs=processor(text=<the chat template with one image per frame>, images=<the frames>),"
        f" generation_len={config.new_tokens}) on the card",
    ]
    if driver.vision_onnx is not None:
        lines.append(f"# (QEfficient's graphs from this run, for qaic-compile by hand: {driver.vision_onnx} and "
                     f"{driver.language_onnx})")
    return lines
