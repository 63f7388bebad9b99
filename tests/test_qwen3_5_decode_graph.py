"""Qwen3.5's decode-only graph: ONNX Runtime runs one-token calls in a graph with the recurrence alone, not in the
prefill+decode graph (which computes the chunked rule over a padded prefill-length chunk there too, and selects).

The reference is the same export served with the language graph alone (today's path for every call); the serving
engine (chunks interleaved with continuous-batching decodes) must give the same tokens and logits (1e-4), and every
one-token call must have run in the decode-only graph.
"""

from __future__ import annotations

import numpy as np
import onnx

from qeff_evs.manifest import LANGUAGE_DECODE, read_manifest
from qeff_evs.runtime.backends.ort import OrtLanguageSession
from test_ctx_lengths import REQUESTS, _serve


class CountingSession:
    """An ONNX Runtime session that counts its runs (delegation)."""

    def __init__(self, inner):
        self.inner, self.runs = inner, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def run(self, *args, **kwargs):
        self.runs += 1
        return self.inner.run(*args, **kwargs)

    def run_with_iobinding(self, *args, **kwargs):  # the language session's calls (state bound in place)
        self.runs += 1
        return self.inner.run_with_iobinding(*args, **kwargs)


def test_decode_steps_run_in_the_decode_only_graph_and_equal_todays(served_export, tmp_path):
    _, export = served_export("qwen3_5")
    m = read_manifest(export)
    decode_path = m.path(export, LANGUAGE_DECODE)
    decode_graph = onnx.load(str(decode_path), load_external_data=False)
    full_graph = onnx.load(str(m.path(export, "language")), load_external_data=False)
    assert len(decode_graph.graph.node) < len(full_graph.graph.node)  # the unrolled chunk is not in it
    reference = _serve(export, "ort", tmp_path, OrtLanguageSession(m.path(export, "language"), m.language_shape))
    session = OrtLanguageSession(m.path(export, "language"), m.language_shape, decode_path)
    counting = CountingSession(session.decode_session)
    session.decode_session = counting
    tokens, logits, _ = _serve(export, "ort", tmp_path, session)
    assert tokens == reference[0]
    assert len(logits) == len(reference[1])
    for got, want in zip(logits, reference[1]):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    decode_calls = sum(1 for got in logits if got.ndim == 2)  # decode returns (rows, vocab), prefill (1, 1, vocab)
    assert counting.runs == decode_calls > 0
    assert sum(new for *_, new in REQUESTS) - len(REQUESTS) <= decode_calls * m.language_shape.decode_rows
