"""vLLM's scheduler, plus one path: a request the worker could not run finishes with an error, alone.

The frontend refuses everything a request can get wrong (``request_checks.py``), so the worker's own
checks are assertions. Should one still fail (a bug, a backend error on one item), raising in the worker
would stop vLLM's engine core and every request with it. vLLM 0.32 has no worker-side way to fail one
request: its scheduler finishes requests with ``finish_reason="error"`` (``RequestStatus.FINISHED_ERROR``;
the OpenAI server answers HTTP 500 for that request and keeps serving) only for causes it detects
itself: a grammar that fails to compile, an encoder-cache entry whose size does not match, a KV
connector's failed load. The worker reports the ids it could not run in :class:`RunnerOutput`, and
:class:`QeffEvsScheduler` finishes them through that same path of vLLM's ``update_from_output``.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import ModelRunnerOutput


@dataclass
class RunnerOutput(ModelRunnerOutput):
    """vLLM's ``ModelRunnerOutput`` with the requests the worker could not run this step (id -> reason)."""

    failed: dict[str, str] | None = None


class QeffEvsScheduler(Scheduler):
    def update_from_output(self, scheduler_output, model_runner_output):
        failed = getattr(model_runner_output, "failed", None) or {}
        # vLLM finishes every id in this set with FINISHED_ERROR at the end of update_from_output (its encoder-
        # cache mismatch path); the worker's reason is in the engine's log.
        self.encoder_cache_mismatch_reqs.update(r for r in failed if r in self.requests)
        return super().update_from_output(scheduler_output, model_runner_output)
