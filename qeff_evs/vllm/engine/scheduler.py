"""vLLM's scheduler, plus two paths: the KV row each request runs in (row reuse), and a request the worker could
not run finishing with an error, alone.

Rows: an export's KV rows are not vLLM's blocks, so :class:`QeffEvsScheduler` chooses each new request's row
where vLLM looks up its prefix-cache hit (``engine/kv_rows.py``): the row's reusable prefix is vLLM's local hit, so vLLM's
own accounting follows it (``num_computed_tokens`` starts there, only the tail is scheduled, encoder inputs wholly
inside the prefix are not, and ``usage.prompt_tokens_details.cached_tokens`` counts it). The rows chosen travel to
the worker in the step's output (:class:`RowsSchedulerOutput`); a row keeps what its request computed when vLLM
frees the request (finished, stopped or aborted), nothing when the worker failed it. With
``--no-enable-prefix-caching`` rows are still chosen here and nothing is reused.

Failures: the frontend refuses everything a request can get wrong (``engine/request_checks.py``), so the worker's own
checks are assertions. Should one still fail (a bug, a backend error on one item), raising in the worker
would stop vLLM's engine core and every request with it. vLLM 0.32 has no worker-side way to fail one
request: its scheduler finishes requests with ``finish_reason="error"`` (``RequestStatus.FINISHED_ERROR``;
the OpenAI server answers HTTP 500 for that request and keeps serving) only for causes it detects
itself: a grammar that fails to compile, an encoder-cache entry whose size does not match, a KV
connector's failed load. The worker reports the ids it could not run in :class:`RunnerOutput`, and
:class:`QeffEvsScheduler` finishes them through that same path of vLLM's ``update_from_output``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from qeff_evs.manifest import read_manifest
from qeff_evs.vllm.engine.kv_rows import RowBook
from qeff_evs.vllm.surface import ModelRunnerOutput, Scheduler, SchedulerOutput


@dataclass
class RunnerOutput(ModelRunnerOutput):
    """vLLM's ``ModelRunnerOutput`` with the requests the worker could not run this step (id -> reason)."""

    failed: dict[str, str] | None = None


@dataclass
class RowsSchedulerOutput(SchedulerOutput):
    """vLLM's ``SchedulerOutput`` with the KV row of each request scheduled for the first time (id -> row)."""

    kv_rows: dict[str, int] = field(default_factory=dict)


def row_reuse_on(vllm_config) -> bool:
    """Row reuse follows vLLM's ``--enable-prefix-caching``; an encoder-only instance (it computes no KV and must
    encode every item it is sent) never reuses."""
    ec_config = vllm_config.ec_transfer_config
    encoder_only = ec_config is not None and ec_config.is_ec_producer
    return bool(vllm_config.cache_config.enable_prefix_caching) and not encoder_only


class QeffEvsScheduler(Scheduler):
    def __init__(self, vllm_config, kv_cache_config, *args, **kwargs):
        super().__init__(vllm_config, kv_cache_config, *args, **kwargs)
        # vLLM strips a media item wholly inside the computed prefix (a reused row, a pulled hand-over) of its data,
        # keeping the keep_on_cpu fields (all but the pixels) for M-RoPE models only. The worker plans every item
        # from those fields, on every family: Nemotron-H's 1-D positions included.
        self.model_uses_mrope = True
        reuse = row_reuse_on(vllm_config)
        # The worker declares one block per KV row plus vLLM's null block (QeffEvsWorker.determine_available_memory).
        # Linear-attention state (Qwen3.5's layer_states) cannot be rewound: such rows are reused only whole.
        rewindable = not reuse or not read_manifest(Path(vllm_config.model_config.model)).language_shape.layer_states
        self.kv_rows = RowBook(max(kv_cache_config.num_blocks - 1, 0), rewindable=rewindable, reuse=reuse)
        if self.connector is not None and hasattr(self.connector, "rows"):  # qeff-evs's KV connector: rows to pull into
            self.connector.rows = self.kv_rows
        self._rows_unknown: set[str] = set()  # requests the worker failed: what their rows hold is unknown

    def _get_local_prefix_cache_hit(self, request, max_cache_hit_length=None):
        # vLLM asks this for every request it is about to schedule for the first time: the row is chosen here, its
        # reusable prefix is the hit, within the request's bound (its last token is always computed; none for a
        # request that skips the prefix cache). No vLLM block is shared (a row is the request's own block). Nothing
        # here may raise: an exception in the scheduler stops vLLM's engine.
        choice = self.kv_rows.claim(request, {r.request_id for r in self.running},
                                    limit=request.get_max_cache_hit_length(max_cache_hit_length))
        return self.kv_cache_manager.empty_kv_cache_blocks, 0 if choice is None else choice.prefix, 0, False

    def schedule(self, *args, **kwargs) -> RowsSchedulerOutput:
        output = super().schedule(*args, **kwargs)
        rows = self.kv_rows.confirm(new.req_id for new in output.scheduled_new_reqs)
        return RowsSchedulerOutput(**{f.name: getattr(output, f.name) for f in dataclasses.fields(output)},
                                   kv_rows=rows)

    def _free_request(self, request, *args, **kwargs):
        unknown = request.request_id in self._rows_unknown
        self._rows_unknown.discard(request.request_id)
        self.kv_rows.release(request, computed_known=not unknown)
        return super()._free_request(request, *args, **kwargs)

    def update_from_output(self, scheduler_output, model_runner_output):
        failed = getattr(model_runner_output, "failed", None) or {}
        # vLLM finishes every id in this set with FINISHED_ERROR at the end of update_from_output (its encoder-
        # cache mismatch path); the worker's reason is in the engine's log.
        self.encoder_cache_mismatch_reqs.update(r for r in failed if r in self.requests)
        self._rows_unknown.update(r for r in failed if r in self.requests)
        transfers = getattr(model_runner_output, "kv_connector_output", None)
        if transfers is not None:
            for request_id in (transfers.finished_recving or set()) - (transfers.failed_recving or set()):
                self.kv_rows.pulled(request_id)
        return super().update_from_output(scheduler_output, model_runner_output)
