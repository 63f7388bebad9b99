"""The ``qeff-evs`` argument parser: every subcommand's flags, their types and help, each subcommand's function."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from qeff_evs.cli.commands import (
    cmd_bench,
    cmd_compile,
    cmd_demo,
    cmd_encode,
    cmd_epd_proxy,
    cmd_export,
    cmd_run,
    cmd_verify,
)
from qeff_evs.models.registry import shipped_family_names
from qeff_evs.specializations import DEFAULT_FRAMES_PER_CALL, DEFAULT_MAX_FRAMES, FLOAT16, MXINT8, TARGETS


DESCRIPTION = "The ``qeff-evs`` command: export, compile, run, encode, demo, epd-proxy (and bench)."
# runtime.sessions.BACKENDS, written out: importing the runtime here would slow every command's start
BACKENDS = ("ort", "openvino", "openvino-bf16", "torch", "qaic")
BACKEND_HELP = ("ort: ONNX Runtime on the CPU, fp32 (the default); openvino, openvino-bf16: the same graphs on "
                "OpenVINO's CPU plugin (pip install 'qeff-evs[openvino]') computing in fp32, or in bf16 where the CPU "
                "has bf16 instructions (faster; tolerance in docs/performance.md); torch: the PyTorch reference; "
                "qaic: Cloud AI 100 programs compiled from the export")


def _int_list(text: str) -> list[int]:
    try:
        return [int(v) for v in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, got {text!r}") from None


def _grid(text: str) -> tuple[int, int, int]:
    values = _int_list(text)
    if len(values) != 3:
        raise argparse.ArgumentTypeError(f"--video-grid-thw takes T,H,W (patch units), got {text!r}")
    return tuple(values)


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
    parser = argparse.ArgumentParser(prog="qeff-evs", description=DESCRIPTION)
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
