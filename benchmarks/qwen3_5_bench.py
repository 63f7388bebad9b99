"""Qwen3.5 at its smallest released widths and full depth: export time, peak memory, state bytes per row, a run.

A random-weight checkpoint with Qwen3.5-0.8B's widths and depths (24 text layers = 18 Gated DeltaNet +
6 full attention, 12 vision blocks; ``Qwen3_5Family.realistic_widths``), saved with ``save_pretrained``
like a user's checkpoint, goes through the real ``qeff-evs export`` path and one 16-frame clip through
the ONNX Runtime engine::

    python benchmarks/qwen3_5_bench.py OUT_DIR [--text-layers 24] [--vision-layers 12] [--frames 16]
        [--size 256] [--prefill-seq-len 64] [--ctx-len 8192] [--q 0.5]

Each phase (build, export, run) runs in a child process so its own peak RSS is measured
(``resource.getrusage``); OUT_DIR/qwen3_5_bench.json holds every number. The checkpoint carries the
tiny tokenizer (a released one cannot be downloaded here): the config's special ids are that
tokenizer's, the vocabulary stays 248320 wide, so only the words are meaningless. State bytes per
request row (the linear layers' conv and recurrent state at their declared device precision) are
reported beside the KV cache bytes of the full-attention layers at ``ctx_len`` (fp16).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def build(args) -> dict:
    import torch

    from qeff_evs.bench.checkpoint import random_model
    from qeff_evs.models.qwen3_5 import Qwen3_5Family, _remembering_decays
    from qeff_evs.models.qwen_vl import special_token_ids
    from qeff_evs.models.tiny import build_tokenizer

    started = time.perf_counter()
    tokenizer = build_tokenizer("qwen3_5")
    ids = special_token_ids(tokenizer)
    kwargs = Qwen3_5Family.realistic_config_kwargs(args.text_layers, args.vision_layers)
    kwargs.update({k: ids[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                       "vision_end_token_id")})
    kwargs["text_config"]["eos_token_id"] = ids["eos_token_id"]
    config = Qwen3_5Family.config_class(**kwargs)
    model = random_model(config, "qwen3_5", seed=0)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # the init random_model skips: decays as trained heads have, zero-centred norms
        for layer in model.model.language_model.layers:
            if hasattr(layer, "linear_attn"):
                _remembering_decays(layer.linear_attn, generator)
        for name, parameter in model.named_parameters():
            if parameter.dim() == 1 and not torch.isfinite(parameter).all():
                raise ValueError(f"{name} is not finite after the random init")
    model.generation_config = Qwen3_5Family.tiny_generation_config(tokenizer)
    folder = Path(args.out) / "checkpoint"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / "preprocessor_config.json").write_text(json.dumps(Qwen3_5Family.tiny_preprocessor_config(config)))
    return {"build_s": time.perf_counter() - started, "parameters": sum(p.numel() for p in model.parameters()),
            "checkpoint_bytes": sum(f.stat().st_size for f in folder.iterdir())}


def export(args) -> dict:
    from qeff_evs.export.pipeline import ExportOptions, export_checkpoint

    started = time.perf_counter()
    options = ExportOptions(args.q, (args.frames,), ((args.size, args.size),), args.prefill_seq_len, args.ctx_len,
                            user_vision_size=args.prefill_seq_len)
    export_checkpoint(Path(args.out) / "checkpoint", Path(args.out) / "export", options, progress=print)
    out = Path(args.out) / "export"
    return {"export_s": time.perf_counter() - started,
            "onnx_bytes": sum(f.stat().st_size for f in out.rglob("*") if f.is_file())}


def run(args) -> dict:
    import numpy as np

    from qeff_evs.runtime.inputs.synthetic import moving_square_video
    from qeff_evs.runtime.builders import answer, build_engine
    from qeff_evs.runtime.export_bundle import open_export
    from qeff_evs.runtime.media import video_from_frames

    bundle = open_export(Path(args.out) / "export")
    shape = bundle.language_shape
    frames = moving_square_video(args.frames, args.size, args.size, seed=0)
    video = video_from_frames(frames, {"total_num_frames": len(frames), "fps": 2.0}, bundle)
    started = time.perf_counter()
    engine = build_engine(bundle, "ort", max_new_tokens=args.decode_steps)
    opened = time.perf_counter() - started
    started = time.perf_counter()
    result = answer(bundle, engine, video, "What happens in this video?")
    states = {state.name: {"layers": len(state.layers), "precision": state.precision,
                           "row_bytes": state.row_bytes(), "row_bytes_fp32": state.row_bytes(4)}
              for state in shape.layer_states}
    return {"open_s": opened, "answer_s": time.perf_counter() - started,
            "prompt_tokens": len(result.prompt_token_ids), "generated": len(result.generated_token_ids),
            "prefill_chunks": result.num_prefill_chunks,
            "kept_tokens_per_frame": result.kept_tokens_per_frame,
            "finite_logits": bool(np.isfinite(np.asarray(result.prefill_top_logits)).all()),
            "kv_layers": len(shape.kv_layer_indices), "kv_row_bytes_fp16": shape.kv_row_bytes(2),
            "state_row_bytes": shape.state_row_bytes(), "states": states}


PHASES = {"build": build, "export": export, "run": run}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--phase", choices=PHASES, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--text-layers", type=int, default=24)
    parser.add_argument("--vision-layers", type=int, default=12)
    parser.add_argument("--frames", type=int, default=16)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--prefill-seq-len", type=int, default=64)
    parser.add_argument("--ctx-len", type=int, default=8192)
    parser.add_argument("--q", type=float, default=0.5)
    parser.add_argument("--decode-steps", type=int, default=8)
    args = parser.parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.phase:  # a child: one phase, its numbers and its own peak RSS as the last line
        numbers = PHASES[args.phase](args)
        numbers[f"{args.phase}_peak_rss_mib"] = _peak_rss_mib()
        print(json.dumps(numbers))
        return 0
    report = {"config": {k: v for k, v in vars(args).items() if k != "phase"}}
    for phase in PHASES:
        print(f"[qwen3_5_bench] {phase}", flush=True)
        done = subprocess.run([sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]),
                               "--phase", phase], capture_output=True, text=True)
        if done.returncode:
            sys.stderr.write(done.stdout[-3000:] + done.stderr[-6000:])
            return done.returncode
        report.update(json.loads(done.stdout.strip().splitlines()[-1]))
        print(json.dumps({k: v for k, v in report.items() if k != "config"}, indent=1), flush=True)
    (Path(args.out) / "qwen3_5_bench.json").write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
