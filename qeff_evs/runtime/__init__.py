"""Host-side runtime, in three layers: ``inputs`` (video -> patches, prompt pieces), ``backends`` (ONNX
Runtime, PyTorch reference and QAIC sessions) and ``engine`` (scheduler, encoder cache, window gather,
prefill/decode assembly, the engines); ``runner`` opens an export folder and ties them together."""

# The embedding API a server uses: open an export, build a serving engine, add requests, step, abort.
from qeff_evs.runtime.engine.serving import ServeRequest, ServingEngine, TokenEvent
from qeff_evs.runtime.runner import build_serving_engine, open_export, requests_from_jsonl

__all__ = ["ServeRequest", "ServingEngine", "TokenEvent", "build_serving_engine", "open_export",
           "requests_from_jsonl"]
