"""Host-side runtime, in three layers: ``inputs`` (video -> patches, prompt pieces), ``backends`` (ONNX
Runtime, PyTorch reference and QAIC sessions) and ``engine`` (scheduler, encoder cache, window gather,
prefill/decode assembly, the engines); the modules beside them open an export folder (``export_bundle``), take
media in (``media``), choose a backend's sessions (``sessions``), build engines (``builders``), run the vision
side alone (``encode``) and read JSONL requests (``requests_jsonl``)."""

# The embedding API a server uses: open an export, build a serving engine, add requests, step, abort.
from qeff_evs.runtime.engine.serving import ServeRequest, ServingEngine, TokenEvent
from qeff_evs.runtime.builders import build_serving_engine
from qeff_evs.runtime.export_bundle import open_export
from qeff_evs.runtime.requests_jsonl import Conversations, requests_from_jsonl

__all__ = ["Conversations", "ServeRequest", "ServingEngine", "TokenEvent", "build_serving_engine", "open_export",
           "requests_from_jsonl"]
