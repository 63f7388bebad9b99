"""qeff-evs's side of a comparison with another runtime, in a child process of its own (so its peak memory is its
own): ``python -m qeff_evs.bench.engine_driver EXPORT_DIR BACKEND``.

It opens the export's sessions once, says ``{"ready": ...}`` on stdout, then answers one request per stdin line
with one JSON line, the protocol of ``openvino_driver``:

* request: ``{"frames": NPY, "fps": FPS, "question": TEXT, "max_new_tokens": N, "video_pruning_rate": Q}``;
* reply: ``ttft_s`` (the frames in memory to the first token: cut into patches, encoded, pruned, prefilled),
  ``vision_s`` (of that, the frames to the kept rows: cut into patches, encoded, pruned), ``total_s``, ``cpu_s``,
  ``ids`` (greedy, no stop token: exactly N), ``prompt_tokens``, ``kept_tokens``, ``seconds`` (the engine's phases,
  as ``qeff-evs run --json`` reports them) and ``peak_mb`` (``VmHWM`` so far); or ``{"error"}``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

from qeff_evs.bench.memory import peak_mb
from qeff_evs.bench.openvino_driver import serve


def answer(bundle, sessions, request: dict) -> dict:
    from qeff_evs.models.pruning import VideoPruning
    from qeff_evs.runtime.builders import engine_config
    from qeff_evs.runtime.engine.single_request import Engine
    from qeff_evs.runtime.inputs.prompt import video_question_pieces
    from qeff_evs.runtime.media import video_from_frames

    frames = np.load(request["frames"])
    vision, language = sessions
    pruning = VideoPruning(bundle.manifest.video_pruning_method, float(request["video_pruning_rate"]))
    engine = Engine(bundle.family, vision, language,
                    engine_config(bundle, pruning, max_new_tokens=int(request["max_new_tokens"])))
    pieces = video_question_pieces(bundle.tokenizer, request["question"], bundle.family.token_strings)
    cpu = time.process_time()
    started = time.perf_counter()
    video = video_from_frames(frames, {"total_num_frames": len(frames), "fps": float(request["fps"])}, bundle)
    prompt = engine.prepare(pieces, [video])
    prepared = time.perf_counter()
    result = engine.generate(prompt, eos_ids=())
    finished = time.perf_counter()
    return {"ttft_s": prepared - started + result.seconds["prefill"], "total_s": finished - started,
            "vision_s": prepared - started,
            "cpu_s": time.process_time() - cpu,
            "ids": result.generated_token_ids, "prompt_tokens": len(result.prompt_token_ids),
            "kept_tokens": int(sum(len(e.kept_indices) for e in prompt.encoded)),
            "seconds": {"preprocess_and_vision": prepared - started, **result.seconds}, "peak_mb": peak_mb()}


def main() -> int:
    export_dir, backend = Path(sys.argv[1]), sys.argv[2]

    def load():
        from qeff_evs.runtime.export_bundle import open_export
        from qeff_evs.runtime.sessions import sessions_for

        bundle = open_export(export_dir)
        return (bundle, sessions_for(bundle, backend)), {}

    return serve(load, lambda state, request: answer(*state, request))


if __name__ == "__main__":
    sys.exit(main())
