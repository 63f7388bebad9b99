"""Run by OpenVINO GenAI's own Python (a child process), never imported by qeff-evs: OpenVINO's side of the comparison.

``python openvino_driver.py CONVERTED_DIR PROPERTIES_JSON``. optimum-intel pins a transformers older than ours, so
OpenVINO lives in its own environment (``vs_openvino.openvino_python``); this script imports openvino, openvino_genai
and numpy only. It loads ``VLMPipeline`` once with ``PROPERTIES_JSON`` (threads, precision hints), says
``{"ready": ...}`` on stdout, then answers one request per stdin line, one JSON line each:

* request: ``{"frames": NPY, "prompt": TEXT, "max_new_tokens": N, "pruning_ratio": R}`` (R > 0: its CDPruner);
* reply: ``ttft_s`` (the call to the first token the streamer receives, timed here as the other side times its own),
  ``total_s``, ``cpu_s`` (the process's CPU seconds, every thread), ``ids`` (greedy, ``ignore_eos``: exactly N),
  ``prompt_tokens``, ``ttft_ms_reported`` (its ``perf_metrics``), ``vision_s`` (its perf metrics' embeddings
  preparation: the vision encoder and the merge), ``peak_mb`` (the process's ``VmHWM`` so far); or
  ``{"error": LINE}``.
"""

from __future__ import annotations

import json
import sys
import time


def peak_mb() -> float | None:
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return None


def answer(pipe, request: dict) -> dict:
    import numpy as np
    import openvino as ov
    import openvino_genai as genai

    frames = ov.Tensor(np.ascontiguousarray(np.load(request["frames"])))
    config = genai.GenerationConfig()
    config.max_new_tokens = int(request["max_new_tokens"])
    config.ignore_eos = True
    config.do_sample = False
    ids: list[int] = []
    first: list[float] = []

    class TokenIds(genai.StreamerBase):
        def write(self, token):
            if not first:
                first.append(time.perf_counter())
            ids.extend(token if isinstance(token, (list, tuple)) else [token])
            return genai.StreamingStatus.RUNNING

        def end(self):
            pass

    extra = {"pruning_ratio": int(request["pruning_ratio"])} if request.get("pruning_ratio") else {}
    cpu = time.process_time()
    started = time.perf_counter()
    result = pipe.generate(request["prompt"], videos=[frames], generation_config=config, streamer=TokenIds(), **extra)
    finished = time.perf_counter()
    metrics = result.perf_metrics
    # the frames to the prompt's embeddings (vision encoder and merge), where this release reports it
    vision = getattr(metrics, "get_prepare_embeddings_duration", None)
    return {"vision_s": float(vision().mean) / 1000 if vision else None,
            "ttft_s": (first[0] if first else finished) - started, "total_s": finished - started,
            "cpu_s": time.process_time() - cpu, "ids": ids, "prompt_tokens": int(metrics.get_num_input_tokens()), "ttft_ms_reported": float(metrics.get_ttft().mean),
            "peak_mb": peak_mb()}


def error_line(error: Exception) -> dict:
    """A failure as the protocol replies it: the exception's type and its last line (OpenVINO's checks print the
    C++ location first)."""
    lines = [text for text in str(error).strip().splitlines() if text.strip()]
    return {"error": f"{type(error).__name__}: {lines[-1] if lines else ''}"}


def serve(load, answer) -> int:
    """The protocol both drivers speak (the module docstring): ``load()`` -> ``(state, ready dict)``, then
    ``answer(state, request)`` per stdin line. Standard library only: ``engine_driver`` imports it too."""
    started = time.perf_counter()
    try:
        state, ready = load()
    except Exception as error:  # noqa: BLE001 - reported to the parent in one line
        print(json.dumps(error_line(error)), flush=True)
        return 1
    print(json.dumps({"ready": True, "load_s": time.perf_counter() - started, "peak_mb": peak_mb(), **ready}),
          flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            reply = answer(state, json.loads(line))
        except Exception as error:  # noqa: BLE001 - one failed request is a result, the driver goes on
            reply = error_line(error)
        print(json.dumps(reply), flush=True)
    return 0


def main() -> int:
    model_dir, properties = sys.argv[1], json.loads(sys.argv[2])

    def load():
        import openvino_genai as genai

        return genai.VLMPipeline(model_dir, "CPU", **properties), {"version": genai.__version__}

    return serve(load, answer)


if __name__ == "__main__":
    sys.exit(main())
