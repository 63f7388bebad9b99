"""The ``qeff-evs`` command: export, compile, run, encode, demo, epd-proxy (and bench)."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

from qeff_evs.models.registry import shipped_family_names
from qeff_evs.specializations import DEFAULT_FRAMES_PER_CALL, DEFAULT_MAX_FRAMES, FLOAT16, MXINT8, TARGETS

# runtime.sessions.BACKENDS, written out: importing the runtime here would slow every command's start
BACKENDS = ("ort", "openvino", "openvino-bf16", "torch", "qaic")
BACKEND_HELP = ("ort: ONNX Runtime on the CPU, fp32 (the default); openvino, openvino-bf16: the same graphs on "
                "OpenVINO's CPU plugin (pip install 'qeff-evs[openvino]') computing in fp32, or in bf16 where the CPU "
                "has bf16 instructions (faster; tolerance in docs/performance.md); torch: the PyTorch reference; "
                "qaic: Cloud AI 100 programs compiled from the export")


def _progress(message: str) -> None:
    print(f"[qeff-evs] {message}", file=sys.stderr, flush=True)


def _int_list(text: str) -> list[int]:
    try:
        return [int(v) for v in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, got {text!r}") from None


def _per_graph(text: str | None, option: str):
    """``--num-cores`` / ``--num-devices``: one value for every graph, or role=value pairs (None: not given)."""
    from qeff_evs.specializations.placement import parse_per_graph

    return None if text is None else parse_per_graph(text, option)


def _device_ids(args: argparse.Namespace):
    from qeff_evs.specializations.placement import parse_device_ids

    return None if args.device_ids is None else parse_device_ids(args.device_ids, "--device-ids")


def _grid(text: str) -> tuple[int, int, int]:
    values = _int_list(text)
    if len(values) != 3:
        raise argparse.ArgumentTypeError(f"--video-grid-thw takes T,H,W (patch units), got {text!r}")
    return tuple(values)


def _flatten(lists: list[list[int]] | None) -> list[int]:
    return [v for chunk in (lists or []) for v in chunk]


def _resolutions(heights: list[int], widths: list[int]) -> list[tuple[int, int]]:
    if len(heights) != len(widths):
        raise ValueError(
            f"--height and --width pair up position by position; got {len(heights)} heights {heights} "
            f"and {len(widths)} widths {widths}")
    return list(zip(heights, widths))


def _methods(text: str) -> tuple[str, ...]:
    return tuple(m.strip() for m in text.split(",") if m.strip())


def _json_object(option: str):
    """``--media-io-kwargs`` / ``--mm-processor-kwargs``: a JSON object, as vLLM takes them."""
    def parse(text: str) -> dict:
        try:
            value = json.loads(text)
        except json.JSONDecodeError as error:
            raise argparse.ArgumentTypeError(f"{option} takes a JSON object, got {text!r} ({error})") from None
        if not isinstance(value, dict):
            raise argparse.ArgumentTypeError(f"{option} takes a JSON object, got {text!r}")
        return value
    return parse


def cmd_export(args: argparse.Namespace) -> int:
    from qeff_evs.export.pipeline import ExportOptions, export_checkpoint

    options = ExportOptions(
        video_pruning_rate=args.video_pruning_rate,
        frames=tuple(_flatten(args.frames)),
        max_frames=args.max_frames,
        max_video_pruning_rate=args.max_video_pruning_rate,
        video_pruning_methods=args.video_pruning_methods,
        resolutions=tuple(_resolutions(_flatten(args.height), _flatten(args.width))),
        prefill_seq_len=TARGETS[args.target].prefill_seq_len if args.prefill_seq_len is None else args.prefill_seq_len,
        comp_ctx_step=TARGETS[args.target].comp_ctx_step,
        ctx_len=args.ctx_len,
        ctx_lengths=None if args.ctx_lengths is None else tuple(_flatten(args.ctx_lengths)),
        short_prefill_lens=None if args.short_prefill_lens is None else tuple(
            n for n in _flatten(args.short_prefill_lens) if n != 0),
        user_vision_size=args.user_vision_size,
        kv_precision=args.kv_precision,
        num_cores=_per_graph(args.num_cores, "--num-cores"),
        mxfp6_matmul=args.mxfp6,
        full_batch_size=args.full_batch_size,
        rope_positions=args.rope_positions,
        frames_per_call=args.frames_per_call,
        weight_dtype=args.weight_dtype or ("float32" if args.in_memory else TARGETS[args.target].weight_dtype),
        in_memory=args.in_memory,
        layer_functions=args.layer_functions,
    )
    manifest = export_checkpoint(args.model_dir, args.output, options, progress=_progress)
    print(json.dumps({"export_dir": str(args.output), "family": manifest.family,
                      "encoder_specializations": len(manifest.encoder_entries),
                      "sampled_frame_buckets": list(manifest.sampled_frame_buckets),
                      "temporal_patch_buckets": list(manifest.temporal_patch_buckets),
                      "video_pruning_methods": list(manifest.video_pruning_methods),
                      "pruning_specializations": len(manifest.pruning_entries)}))
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from qeff_evs.export.verify import format_report, verify_export

    report = verify_export(Path(args.export_dir), fp16=args.fp16, progress=_progress)
    print(json.dumps(report.to_json(), indent=2) if args.json else format_report(report))
    return 1 if report.problems else 0


def cmd_compile(args: argparse.Namespace) -> int:
    from qeff_evs.export.compile import compile_export
    from qeff_evs.specializations import CompileOptions, detect_aic_hw_version

    try:
        extra = tuple(shlex.split(args.extra_flags or ""))
    except ValueError as error:
        raise ValueError(f"--extra-flags {args.extra_flags!r} is not a valid shell word list ({error})") from None
    hw = detect_aic_hw_version() if args.aic_hw_version == "auto" else args.aic_hw_version
    options = CompileOptions(num_cores=_per_graph(args.num_cores, "--num-cores"), mxfp6_matmul=args.mxfp6,
                             aic_hw_version=hw, num_devices=_per_graph(args.num_devices, "--num-devices"),
                             extra_flags=extra, language_programs=args.programs,
                             specializations_layout=args.specializations_layout)
    cores, devices = options.cores, options.devices
    _progress(f"compiling for {hw}: " + ", ".join(
        f"{graph} {cores[graph]} cores" + (f" on each of {devices[graph]} devices" if devices[graph] > 1 else "")
        for graph in cores))
    return compile_export(Path(args.export_dir), options, progress=_progress)


def _video(args: argparse.Namespace, bundle):
    """The video of ``--video`` or ``--pixel-values-videos`` + ``--video-grid-thw`` (run and encode)."""
    from qeff_evs.runtime.media import video_from_file, video_from_patches

    if args.video:
        return video_from_file(args.video, bundle, media_io_kwargs=(args.media_io_kwargs or {}).get("video"),
                               mm_processor_kwargs=args.mm_processor_kwargs, array_fps=args.fps)
    if args.video_grid_thw is None:
        raise ValueError("--pixel-values-videos needs --video-grid-thw T,H,W")
    return video_from_patches(args.pixel_values_videos, args.video_grid_thw, args.fps, bundle)


def _image(path: str, args: argparse.Namespace, bundle):
    """One ``--image``: the file as PIL reads it, made RGB (as vLLM's image loader does)."""
    import numpy as np
    from PIL import Image, UnidentifiedImageError

    from qeff_evs.runtime.media import image_from_array

    try:
        with Image.open(path) as image:
            pixels = np.asarray(image.convert("RGB"))
    except (FileNotFoundError, IsADirectoryError, UnidentifiedImageError, OSError) as error:
        raise ValueError(f"--image {path}: PIL cannot read it ({error}); give a PNG, JPEG or another image file "
                         "PIL opens") from None
    try:
        return image_from_array(pixels, bundle, args.mm_processor_kwargs)
    except ValueError as error:
        raise ValueError(f"--image {path}: {error}") from None


def _audio(path: str, bundle):
    """One ``--audio``: the file's first audio stream, mono, at the checkpoint's rate."""
    from qeff_evs.runtime.inputs.audio_features import audio_from_file

    features = bundle.family.audio_features()
    if features is None:
        raise ValueError(f"--audio {path}: this export ({bundle.family.name}) serves no audio")
    return audio_from_file(path, features)


def _video_sound(args: argparse.Namespace, bundle):
    """``use_audio_in_video``: the ``--video`` file's soundtrack (None: none, or not asked for)."""
    from qeff_evs.runtime.inputs.audio_features import use_audio_in_video, video_sound

    if not use_audio_in_video(args.mm_processor_kwargs):
        return None
    features = bundle.family.audio_features()
    if features is None:
        raise ValueError(f"use_audio_in_video: this export ({bundle.family.name}) serves no audio")
    if not args.video:
        raise ValueError("use_audio_in_video reads the --video file's soundtrack; give --video")
    return video_sound(args.video, features)


def cmd_run(args: argparse.Namespace) -> int:
    from qeff_evs.runtime.builders import answer, answer_media, build_engine, video_pruning
    from qeff_evs.runtime.export_bundle import open_export

    bundle = open_export(args.export_dir)
    pruning = video_pruning(bundle, args.video_pruning_method, args.video_pruning_rate)
    if args.requests and (args.image or args.audio):
        raise ValueError("--image and --audio are one request's; with --requests give each request's media in the "
                         "JSONL")
    if args.requests:
        return _serve_requests(args, bundle, pruning)
    if not (args.video or args.pixel_values_videos or args.image or args.audio):
        raise ValueError("run needs --requests, or --prompt with --video, --pixel-values-videos, --image or --audio")
    started = time.perf_counter()
    images = [_image(path, args, bundle) for path in args.image or ()]
    audios = [_audio(path, bundle) for path in args.audio or ()]
    video = _video(args, bundle) if args.video or args.pixel_values_videos else None
    sound = _video_sound(args, bundle)
    preprocess = time.perf_counter() - started
    if args.prompt is None:
        raise ValueError("--prompt is required with --video / --pixel-values-videos / --image / --audio")
    engine = build_engine(bundle, args.backend, args.max_new_tokens, progress=_progress, device_ids=_device_ids(args),
                          pruning=pruning)
    try:
        if images or audios or sound:  # images, audio, the video (and its sound), then the question: one user turn
            media = [*images, *audios, *([video] if video else []), *([sound] if sound else [])]
            result = answer_media(bundle, engine, media, args.prompt, use_audio_in_video=sound is not None)
        else:
            result = answer(bundle, engine, video, args.prompt)
    finally:
        engine.close()
    result.seconds = {"preprocess": preprocess, **result.seconds}  # the video read and cut into patches
    if args.json:
        print(json.dumps(result.to_json()))
    else:
        print("kept tokens per frame:", result.kept_tokens_per_frame)
        print("generated token ids:", result.generated_token_ids)
        print("generated text:", repr(bundle.tokenizer.decode(result.generated_token_ids)))
    return 0


def cmd_encode(args: argparse.Namespace) -> int:
    from qeff_evs.runtime.builders import video_pruning
    from qeff_evs.runtime.encode import encode_video
    from qeff_evs.runtime.export_bundle import open_export

    bundle = open_export(args.export_dir)
    pruning = video_pruning(bundle, args.video_pruning_method, args.video_pruning_rate)
    report = encode_video(bundle, _video(args, bundle), args.backend, progress=_progress, device_ids=_device_ids(args),
                          pruning=pruning)
    if args.json:
        print(json.dumps(report.to_json()))
        return 0
    t, h, w = report.merged_grid
    print(f"{report.frames} frames at {report.resolution[0]}x{report.resolution[1]}: {t} temporal patches of "
          f"{h}x{w} tokens, {len(report.kept_indices)} of {t * h * w} kept "
          f"(encoder {report.seconds['encoder']:.2f} s in calls of {report.frames_per_call}, "
          f"pruning ({report.pruning.method}, q = {report.pruning.rate:g}) {report.seconds['pruning']:.3f} s)")
    print("kept tokens per frame:", report.kept_tokens_per_frame)
    print("\n".join(report.kept_map()))
    return 0


def _serve_requests(args: argparse.Namespace, bundle, pruning) -> int:
    """Many requests at once through the continuous-batching engine; one JSON line per finished request (with its
    time to first token, from when it was queued). A follow-up (``after``) is queued when the request it continues
    has finished."""
    import time

    from qeff_evs.runtime.builders import build_serving_engine, generate_all
    from qeff_evs.runtime.requests_jsonl import Conversations, requests_from_jsonl

    lines = requests_from_jsonl(args.requests, bundle, pruning)
    engine = build_serving_engine(bundle, args.backend, args.max_num_seqs, args.max_num_batched_tokens,
                                  args.encoder_cache_rows, progress=_progress, device_ids=_device_ids(args),
                                  pruning=pruning, row_reuse=args.row_reuse)
    chats = Conversations(bundle)
    follow_ups: dict[str, list] = {}
    for line in lines:
        if line.after is not None:
            follow_ups.setdefault(line.after, []).append(line)
    queued: dict[str, float] = {}
    first_token: dict[str, float] = {}

    def queue(requests: list) -> list:
        now = time.perf_counter()
        queued.update({request.request_id: now for request in requests})
        return requests

    def on_token(event) -> None:
        first_token.setdefault(event.request_id, time.perf_counter())

    def print_finished(request_id: str, token_ids: list[int], event) -> list:
        print(json.dumps({"id": request_id, "generated_token_ids": token_ids,
                          "finish_reason": event.finish_reason.value, "prompt_tokens": event.num_prompt_tokens,
                          "num_cached_tokens": event.num_cached_tokens,
                          "time_to_first_token_s": round(first_token[request_id] - queued[request_id], 4)}),
              flush=True)
        return queue([chats.follow_up(line, token_ids) for line in follow_ups.pop(request_id, ())])

    try:
        generate_all(engine, queue([chats.first_turn(line) for line in lines if line.after is None]),
                     print_finished, on_token)
    finally:
        engine.close()
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from qeff_evs.demo import run_demo

    return run_demo(Path(args.workdir) if args.workdir else None, backend=args.backend, progress=_progress)


def cmd_epd_proxy(args: argparse.Namespace) -> int:
    from qeff_evs.vllm.ec_connector.epd_proxy import serve

    serve([url.rstrip("/") for url in args.encoder], args.language, args.host, args.port)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from qeff_evs.bench import run_bench

    return run_bench(args, progress=_progress)


def _add_video_arguments(p: argparse.ArgumentParser, source) -> None:
    """The video input and pruning flags ``run`` and ``encode`` share (``source``: their exclusive group)."""
    source.add_argument("--video", help="a video file or a .npy array (T, H, W, 3) uint8 of every frame of a clip")
    source.add_argument("--pixel-values-videos", help=".npy of patchified pixels (rows, C*tp*p*p); Qwen families "
                        "only: a Nemotron-H export refuses it (its prompt needs each frame's time: give --video)")
    p.add_argument("--video-grid-thw", type=_grid, default=None, help="T,H,W patch grid for --pixel-values-videos")
    p.add_argument("--fps", type=float, default=None,
                   help="frame rate of a .npy --video's frames or of --pixel-values-videos (default 2); a video "
                        "file is sampled with --media-io-kwargs / --mm-processor-kwargs as vLLM samples it")
    p.add_argument("--media-io-kwargs", type=_json_object("--media-io-kwargs"), default=None,
                   help='vLLM\'s --media-io-kwargs, e.g. \'{"video": {"num_frames": 16}}\' (its video loader; default '
                        "the loader vLLM picks for the checkpoint)")
    p.add_argument("--mm-processor-kwargs", type=_json_object("--mm-processor-kwargs"), default=None,
                   help="vLLM's --mm-processor-kwargs for the video processor: fps, num_frames, do_sample_frames, "
                        "min_frames, max_frames; max_num_tiles for a Nemotron-H export's images, use_audio_in_video "
                        "for a Nemotron-H Omni export's video sound")
    p.add_argument("--video-pruning-rate", type=float, default=None,
                   help="pruning rate q in [0, 1) (0: off; default: the export's)")
    p.add_argument("--video-pruning-method", default=None,
                   help="evs or vidcom2, one the export carries (default: the export's)")


def _add_device_ids_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device-ids", default=None,
                   help="--backend qaic: the devices each graph's program opens on: 0 (every graph), or e.g. "
                        "encoder=1,pruning=1,language=0 (a multi-device program: language=0+1); default 0 "
                        "(0..N-1 for a program compiled for N devices)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qeff-evs", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("export", help="export encoder, pruning and language ONNX graphs, specializations, compile.sh")
    p.add_argument("model_dir", help="a local transformers checkpoint folder of a family qeff-evs ships (its "
                   f"config.json's model_type one of {', '.join(shipped_family_names())})")
    p.add_argument("-o", "--output", required=True, type=Path, help="export folder")
    p.add_argument("--video-pruning-rate", type=float, default=0.5,
                   help="the default pruning rate q in [0, 1) (run, encode and vllm serve may pass another)")
    p.add_argument("--max-video-pruning-rate", type=float, default=0.9,
                   help="the largest rate served: the RoPE tables cover ctx_len / (1 - it) positions (default 0.9)")
    p.add_argument("--video-pruning-methods", type=_methods, default=None,
                   help="pruning graphs to export, the first the default method (default: the methods vLLM prunes "
                        "the family with: evs,vidcom2 for the Qwen families, evs for Nemotron-H)")
    p.add_argument("--frames", type=_int_list, action="append", default=None,
                   help="frame buckets in sampled frames (multiples of the temporal patch), e.g. 8,16,32: a video "
                        "is padded to the smallest that holds it; the largest is the export's maximum "
                        "(default: 2, 4, 8, ... frames up to --max-frames)")
    p.add_argument("--max-frames", type=int, default=None,
                   help=f"the most sampled frames a video may have, when --frames is not given (default "
                        f"{DEFAULT_MAX_FRAMES})")
    p.add_argument("--height", type=_int_list, action="append", required=True,
                   help="frame heights the encoder sees (multiples of patch*merge), paired with --width")
    p.add_argument("--width", type=_int_list, action="append", required=True, help="frame widths")
    p.add_argument("--target", choices=tuple(TARGETS), default="card",
                   help="where the export runs first, which sets the default --prefill-seq-len and --ctx-lengths: "
                        f"card (AI 100: {TARGETS['card'].prefill_seq_len}, --ctx-len / 4^k) or cpu (ONNX Runtime: "
                        f"{TARGETS['cpu'].prefill_seq_len}, --ctx-len / 2^k; longer chunks cost less per token there, "
                        "see docs/performance.md)")
    p.add_argument("--prefill-seq-len", type=int, default=None,
                   help=f"tokens per prefill chunk (default: {TARGETS['card'].prefill_seq_len} for --target card, "
                        f"{TARGETS['cpu'].prefill_seq_len} for cpu)")
    p.add_argument("--ctx-len", type=int, default=8192)
    p.add_argument("--short-prefill-lens", type=_int_list, action="append", default=None,
                   help="shorter prefill lengths, e.g. 32: a chunk holding at most that many tokens (a prompt's tail) "
                        "runs in it instead of a full --prefill-seq-len chunk; 0 for none (default: --prefill-seq-len halved "
                        "down to 32, e.g. 32,64 for 128; none for a graph unrolled for one length: Qwen3.5)")
    p.add_argument("--ctx-lengths", type=_int_list, action="append", default=None,
                   help="compute context lengths, e.g. 2048,8192,32768: decode and prefill specializations that read "
                        "only that many KV slots; a call runs in the smallest holding its last position (--ctx-len is "
                        "always one; pass just --ctx-len for one length; default: --ctx-len / 4^k down to 2048, / 2^k for "
                        "--target cpu)")
    p.add_argument("--user-vision-size", type=int, default=None,
                   help="vision rows per prefill chunk (default: the prefill length)")
    p.add_argument("--kv-precision", choices=(FLOAT16, MXINT8), default=FLOAT16)
    p.add_argument("--num-cores", default=None, help="cores per graph in the generated compile.sh (as for compile)")
    p.add_argument("--mxfp6", action="store_true", help="-mxfp6-matmul for the language graph")
    p.add_argument("--full-batch-size", type=int, default=None,
                   help="continuous batching: KV cache rows (requests served at once) and a batch_index input")
    p.add_argument("--rope-positions", type=int, default=None,
                   help="M-RoPE positions the language graph's cos/sin tables cover (default: ctx_len / (1 - "
                        "max rate), rounded up to 64: pruning keeps the unpruned positions)")
    p.add_argument("--frames-per-call", type=int, default=DEFAULT_FRAMES_PER_CALL,
                   help="temporal patches per encoder call (one encoder specialization per resolution serves "
                        f"every video length; default {DEFAULT_FRAMES_PER_CALL}, see docs/performance.md)")
    p.add_argument("--weight-dtype", choices=("float32", "float16"), default=None,
                   help="the dtype the graphs store their weights in (default: float16 for --target card, which "
                        "compiles fp16 from them; float32 for --target cpu, where ONNX Runtime computes from them)")
    p.add_argument("--in-memory", action="store_true",
                   help="load the whole model and trace it at once (the export before streaming, about 1.7x the "
                        "model's fp32 bytes of memory; fp32 weights), instead of a decoder layer per kind, stamped")
    p.add_argument("--layer-functions", action="store_true",
                   help="each kind of decoder layer as an ONNX local function, each layer a call of it (QEfficient's "
                        "use_onnx_subfunctions; see docs/export-compile.md)")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("compile", help="run qaic-compile where the SDK is installed, else print the commands")
    p.add_argument("export_dir", type=Path)
    p.add_argument("--num-cores", default=None,
                   help="cores of each graph's program: N for every graph, or e.g. encoder=6,pruning=1,language=9 "
                        "(the default: the three fit one 16-core device, all active together; every method's "
                        "pruning graph gets the pruning cores)")
    p.add_argument("--mxfp6", action="store_true")
    p.add_argument("--aic-hw-version", choices=("auto", "ai100", "ai200"), default="auto",
                   help="-aic-hw-version (auto: what qaic-util -q reports, else ai100)")
    p.add_argument("--num-devices", default="1",
                   help="devices per program: N for every graph or e.g. language=2; > 1 writes QEfficient's MDP "
                        "partition config and passes it")
    p.add_argument("--extra-flags", default="",
                   help='more qaic-compile flags, e.g. "-mos=1 -aic-enable-depth-first -node-precision-info=x.yaml" '
                        "(a node-precision file goes to the language graph only)")
    p.add_argument("--specializations-layout", choices=("named", "flat"), default="named",
                   help="specializations.json layout: named (QEfficient >= 1.22) or flat (older SDKs)")
    p.add_argument("--programs", choices=("both", "prefill", "decode"), default="both",
                   help="the language program(s): both (one instance), or one side of prefill/decode disaggregation: "
                        "prefill (vision graphs + language/prefill_qpc, prompts only) or decode (language/decode_qpc, "
                        "one-token calls only)")
    p.set_defaults(func=cmd_compile)

    p = sub.add_parser("verify", help="run every exported graph on sample inputs in fp32 and (--fp16) in an "
                                      "emulation of qaic-compile -convert-to-fp16; exit 1 on inf/NaN")
    p.add_argument("export_dir", type=Path)
    p.add_argument("--fp16", action="store_true", help="also run the fp16 twin that follows compile.sh")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("run", help="answer a question about a video with the exported graphs")
    p.add_argument("export_dir", type=Path)
    source = p.add_mutually_exclusive_group()
    source.add_argument("--requests", type=Path, help="JSONL of requests (id, prompt, video, max_new_tokens; or "
                        "id, after, prompt: a follow-up in the conversation of request 'after', queued when that "
                        "one has finished) served together with continuous batching (export with --full-batch-size)")
    _add_video_arguments(p, source)
    p.add_argument("--image", action="append", default=None,
                   help="an image file as PIL reads it (repeatable; before the video in the prompt); a Nemotron-H "
                        "export tiles it as vLLM does (max_num_tiles through --mm-processor-kwargs)")
    p.add_argument("--audio", action="append", default=None,
                   help="an audio file FFmpeg reads, at the checkpoint's rate (repeatable; after the images, before "
                        "the video); a Nemotron-H Omni export cuts it into 30 s clips as vLLM does. A video's own "
                        "sound: --mm-processor-kwargs '{\"use_audio_in_video\": true}'")
    p.add_argument("--prompt", help="the question (not with --requests)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="--requests: running requests (<= full batch)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="--requests: token budget per step")
    p.add_argument("--encoder-cache-rows", type=int, default=None, help="--requests: encoder cache size in rows")
    p.add_argument("--no-row-reuse", dest="row_reuse", action="store_false",
                   help="--requests: every request computes its whole prompt, even where a free KV row holds its "
                        "first tokens from an earlier request (row reuse is on by default and exact)")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--backend", choices=BACKENDS, default="ort", help=BACKEND_HELP)
    _add_device_ids_argument(p)
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (with --video: token ids and counts, and seconds per phase: "
                        "preprocess, vision, prefill, ttft = vision + prefill, decode)")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("encode", help="only the vision side of one video: encoder + pruning, kept tokens per frame")
    p.add_argument("export_dir", type=Path)
    _add_video_arguments(p, p.add_mutually_exclusive_group(required=True))
    p.add_argument("--backend", choices=BACKENDS, default="ort", help=BACKEND_HELP)
    _add_device_ids_argument(p)
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (adds kept_indices, frame count, resolution, timings)")
    p.set_defaults(func=cmd_encode)

    p = sub.add_parser("demo", help="tiny random Qwen2.5-VL, exported and run on a synthetic video")
    p.add_argument("--workdir", default=None, help="where to keep the checkpoint and export (default: a temp dir)")
    p.add_argument("--backend", choices=("ort", "torch"), default="ort")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("epd-proxy", help="the front of encoder disaggregation: each media item to an encoder instance, "
                                         "then the request to the language side (an ec_consumer or a vllm-router)")
    p.add_argument("--encoder", action="append", required=True,
                   help="an encoder instance's URL (ec_producer); repeat for several (round robin)")
    p.add_argument("--language", required=True,
                   help="the URL requests go to once their media are encoded: an ec_consumer instance, or a "
                        "vllm-router in front of several")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.set_defaults(func=cmd_epd_proxy)

    p = sub.add_parser("bench", help="measure what pruning and user_vision_size buy (JSON, Markdown, PNG plots)")
    from qeff_evs.bench import add_bench_arguments

    add_bench_arguments(p)
    p.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    started = time.perf_counter()
    try:
        code = args.func(args)
    except ValueError as error:
        print(f"qeff-evs {args.command}: error: {error}", file=sys.stderr)
        return 2
    except OSError as error:  # a path that is missing, unreadable or not a folder
        print(f"qeff-evs {args.command}: error: {error}", file=sys.stderr)
        return 2
    _progress(f"{args.command} finished in {time.perf_counter() - started:.1f} s")
    return code


if __name__ == "__main__":
    sys.exit(main())
