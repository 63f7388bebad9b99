"""The export's language graph run directly on ONNX Runtime, step by step, for the vLLM settings tests.

vLLM's sampler, logits processors and detokenizer run on the logits our worker hands them; to hold them to
vLLM's documented behaviour the tests need those logits independently of vLLM: this oracle runs one
request through the executor every engine shares (encoder + EVS + language graphs on ORT), returning the
``(vocab,)`` logits after the prompt and after each token a test feeds it. A test then applies vLLM's
documented rule (a penalty, a bias, a mask) and picks the token itself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from qeff_evs.runtime.engine.executor import EngineConfig, Executor
from qeff_evs.runtime.export_bundle import ExportBundle
from qeff_evs.runtime.sessions import sessions_for


class GraphOracle:
    def __init__(self, bundle: ExportBundle):
        m = bundle.manifest
        self.executor = Executor(bundle.family, *sessions_for(bundle, "ort"),
                                 EngineConfig(m.prefill_seq_len, m.ctx_len, m.user_vision_size, m.video_pruning_rate))
        self.step = m.prefill_seq_len
        self.count = 0

    def logits(self, pieces, media, tokens: Sequence[int] = ()) -> list[np.ndarray]:
        """Logits after the prompt, then after feeding each of ``tokens`` (``len(tokens) + 1`` rows)."""
        return list(self.run(pieces, media, lambda rows: None if len(rows) > len(tokens) else tokens[len(rows) - 1]))

    def run(self, pieces, media, next_token: Callable[[list[np.ndarray]], int | None]) -> list[np.ndarray]:
        """Prefill, then feed ``next_token(rows so far)`` until it returns None; the rows of logits."""
        ex, request_id = self.executor, f"oracle-{self.count}"
        self.count += 1
        plan = ex.plan(pieces, media)
        ex.add(request_id, plan, media, ex.media_hashes(media))
        try:
            for item in range(len(media)):
                ex.encode(request_id, item)
            n = len(plan.ids)
            logits = None
            for start in range(0, n, self.step):
                logits = ex.prefill_logits(request_id, start, min(self.step, n - start))
            rows = [np.asarray(logits, dtype=np.float64).reshape(-1)]
            while (token := next_token(rows)) is not None:
                ex.accept(request_id, int(token))
                rows.append(np.asarray(ex.decode_logits([(request_id, n + len(rows) - 1)])[request_id],
                                       dtype=np.float64).reshape(-1))
            return rows
        finally:
            ex.drop(request_id)
            ex.free(ex.media_hashes(media))

    def greedy(self, pieces, media, max_tokens: int, rule: Callable[[np.ndarray, list[int]], np.ndarray],
               stop_ids: Sequence[int] = ()) -> list[int]:
        """Greedy decoding where ``rule(logits, generated)`` first changes the logits (vLLM's documented rule)."""
        tokens: list[int] = []

        def next_token(rows):
            token = int(np.argmax(rule(rows[-1].copy(), tokens)))
            tokens.append(token)
            return None if len(tokens) >= max_tokens or token in stop_ids else token

        self.run(pieces, media, next_token)
        return tokens
