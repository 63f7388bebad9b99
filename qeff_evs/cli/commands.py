"""The ``qeff-evs`` commands, one function each (``cmd_export``, ``cmd_run``, ...): each turns its parsed arguments into
the package's calls; the parser (``parser.py``) names them."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

from qeff_evs.specializations import TARGETS


def print_progress(message: str) -> None:
    print(f"[qeff-evs] {message}", file=sys.stderr, flush=True)


def _per_graph(text: str | None, option: str):
    """``--num-cores`` / ``--num-devices``: one value for every graph, or role=value pairs (None: not given)."""
    from qeff_evs.specializations.placement import parse_per_graph

    return None if text is None else parse_per_graph(text, option)


def _device_ids(args: argparse.Namespace):
    from qeff_evs.specializations.placement import parse_device_ids

    return None if args.device_ids is None else parse_device_ids(args.device_ids, "--device-ids")


def _flatten(lists: list[list[int]] | None) -> list[int]:
    return [v for chunk in (lists or []) for v in chunk]


def _resolutions(heights: list[int], widths: list[int]) -> list[tuple[int, int]]:
    if len(heights) != len(widths):
        raise ValueError(
            f"--height and --width pair up position by position; got {len(heights)} heights {heights} "
            f"and {len(widths)} widths {widths}")
    return list(zip(heights, widths))


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
    manifest = export_checkpoint(args.model_dir, args.output, options, progress=print_progress)
    print(json.dumps({"export_dir": str(args.output), "family": manifest.family,
                      "encoder_specializations": len(manifest.encoder_entries),
                      "sampled_frame_buckets": list(manifest.sampled_frame_buckets),
                      "temporal_patch_buckets": list(manifest.temporal_patch_buckets),
                      "video_pruning_methods": list(manifest.video_pruning_methods),
                      "pruning_specializations": len(manifest.pruning_entries)}))
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from qeff_evs.export.verify import format_report, verify_export

    report = verify_export(Path(args.export_dir), fp16=args.fp16, progress=print_progress)
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
    print_progress(f"compiling for {hw}: " + ", ".join(
        f"{graph} {cores[graph]} cores" + (f" on each of {devices[graph]} devices" if devices[graph] > 1 else "")
        for graph in cores))
    return compile_export(Path(args.export_dir), options, progress=print_progress)


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
    engine = build_engine(bundle, args.backend, args.max_new_tokens, progress=print_progress, device_ids=_device_ids(args),
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
    report = encode_video(bundle, _video(args, bundle), args.backend, progress=print_progress, device_ids=_device_ids(args),
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
                                  args.encoder_cache_rows, progress=print_progress, device_ids=_device_ids(args),
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

    return run_demo(Path(args.workdir) if args.workdir else None, backend=args.backend, progress=print_progress)


def cmd_epd_proxy(args: argparse.Namespace) -> int:
    from qeff_evs.vllm.ec_connector.epd_proxy import serve

    serve([url.rstrip("/") for url in args.encoder], args.language, args.host, args.port)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from qeff_evs.bench import run_bench

    return run_bench(args, progress=print_progress)
