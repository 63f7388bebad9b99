"""Host-side runtime: video input and preprocessing, prompt layout, sessions and the chunked-prefill engine."""

# The embedding API a server uses: open an export, build a serving engine, add requests, step, abort.
from qeff_evs.runtime.runner import build_serving_engine, open_export, requests_from_jsonl  # noqa: E402
from qeff_evs.runtime.serving import ServeRequest, ServingEngine, TokenEvent  # noqa: E402

__all__ = ["ServeRequest", "ServingEngine", "TokenEvent", "build_serving_engine", "open_export",
           "requests_from_jsonl"]
