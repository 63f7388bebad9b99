"""The worker of an encoder-disaggregation instance: it loads only the graphs its EC role runs.

With ``--ec-transfer-config`` (qeff-evs's connector, ``ec_connector/connector.py``) one export is served by instances
of two roles, each loading its share of the export's programs:

===============  ===============================  ==============================================================
``ec_role``      graphs loaded                    per step
===============  ===============================  ==============================================================
``ec_producer``  encoder + pruning (``evs``)      encode the scheduled items and ship each one's kept rows; no
                                                  KV cache, no sampling (vLLM's encoder-only instance: vLLM
                                                  finishes a request once its prompt is consumed)
``ec_consumer``  language                         load the shipped kept rows, then prefill and decode as any
                                                  qeff-evs worker; never encodes
===============  ===============================  ==============================================================

On QAIC, an instance's device ids place only its own programs, so a consumer's language program can take the
cores the vision programs would have held. The graphs a role does not run are never opened: a consumer works
from an export folder without vision graphs, and anything that reached for them would fail, naming the role.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch

from qeff_evs.manifest import LanguageShape
from qeff_evs.runtime.engine.executor import media_pruning
from qeff_evs.runtime.sessions import language_session, vision_pipeline
from qeff_evs.vllm.engine.data_parallel import configured_device_ids
from qeff_evs.vllm.activation import active_backend, logger
from qeff_evs.vllm.engine.worker import QeffEvsWorker
from qeff_evs.vllm.surface import ensure_ec_transfer_initialized, ensure_ec_transfer_shutdown, get_ec_transfer
from qeff_evs.vllm.surface import make_empty_encoder_model_runner_output, ModelRunnerOutput


def ec_connector_output(scheduler_output, encoder_cache: dict):
    """The EC connector's part of one step, as vLLM's model runner runs it around the step's work: bind the step's
    metadata, start saving (a producer) or loading (a consumer: the shipped items land in ``encoder_cache``), and
    afterwards collect what finished. Ours, not vLLM 0.34's runner helper, which also saves every entry new to the
    cache after the step: an encoder instance saves each item itself, with the header that says how it was pruned."""
    from qeff_evs.vllm.surface import has_ec_transfer

    return _ec_step(scheduler_output, encoder_cache) if has_ec_transfer() else nullcontext()


@contextmanager
def _ec_step(scheduler_output, encoder_cache: dict) -> Iterator:
    from qeff_evs.vllm.surface import ECConnectorOutput

    output = ECConnectorOutput()
    connector = get_ec_transfer()
    connector.bind_connector_metadata(scheduler_output.ec_connector_metadata)
    if connector.is_producer:
        connector.start_save_caches(encoder_cache=encoder_cache)
    if connector.is_consumer:
        connector.start_load_caches(encoder_cache)
    try:
        yield output
    finally:
        output.finished_sending, output.finished_recving = connector.get_finished(scheduler_output.finished_req_ids)
        output.ec_connector_worker_meta = connector.build_connector_worker_meta()
        connector.clear_connector_metadata()


@dataclass(frozen=True)
class NotLoaded:
    """Stands for graphs this instance's role does not load; reaching for them is a bug, said as such.

    ``shape``: the unloaded language graph's shapes, which the export states: the executor reads its RoPE table
    length to refuse a request past it, on an encoder instance as on any other."""

    role: str
    graphs: str
    shape: LanguageShape | None = None

    def close(self) -> None:  # nothing was opened
        return None

    def __getattr__(self, name: str):
        raise RuntimeError(f"this {self.role} instance loads no {self.graphs} ({name!r} was asked for); vLLM's "
                           "scheduler must not schedule that work here")


@dataclass(frozen=True)
class _EncoderOutputWidth:
    """Answers vLLM's start-up measurement of an EC producer's encoder output width.

    vLLM (``measure_encoder_output_widths``) encodes a dummy item through ``worker.model_runner.get_model()
    .embed_multimodal`` on every producer and keeps the last dimension; only its CPU and Mooncake connectors
    read it, to size transfer buffers. The width of what our graphs return is fixed by the export (the kept
    rows and the family's extra rows of each token: ``hidden * (1 + levels)``, the width vLLM's
    own model classes report for multi-level rows too), so it is given from the export's shapes instead of running the graphs.
    """

    width: int
    device: torch.device = torch.device("cpu")
    supports_mm_inputs: bool = True

    def get_model(self) -> _EncoderOutputWidth:
        return self

    def embed_multimodal(self, **mm_kwargs) -> list[torch.Tensor]:
        return [torch.empty((0, self.width))]


class QeffEvsECWorker(QeffEvsWorker):
    """A qeff-evs worker in one role of vLLM's encoder disaggregation (module docstring)."""

    def init_device(self) -> None:
        super().init_device()
        # ec_config.ec_refusals admits the two roles only: an encoder-only producer, or a consumer.
        self.encoder_only = self.vllm_config.ec_transfer_config.is_encode_only
        if self.encoder_only:
            # vLLM measures a producer's encoder width through its pipeline-parallel group
            # (``get_pp_group``); set up its process groups, one rank, as its own workers do.
            from qeff_evs.vllm.surface import ensure_model_parallel_initialized, init_distributed_environment

            init_distributed_environment(1, 0, self.distributed_init_method, 0, "gloo")
            ensure_model_parallel_initialized(1, 1)
        ensure_ec_transfer_initialized(self.vllm_config)

    def _sessions(self, bundle, method: str):
        device_ids, backend = configured_device_ids(self.vllm_config), active_backend()
        if self.encoder_only:
            shape = bundle.language_shape
            self.model_runner = _EncoderOutputWidth(shape.hidden * (1 + sum(shape.extras.values())))
            sessions = (vision_pipeline(bundle, backend, device_ids=device_ids, method=method),
                        NotLoaded("ec_producer", "language graph", shape))
        else:
            sessions = (NotLoaded("ec_consumer", "vision graphs (encoder, pruning)"),
                        language_session(bundle, backend, device_ids=device_ids))
        logger.info("qeff-evs %s instance: loaded the %s of %s only", self.vllm_config.ec_transfer_config.ec_role,
                    "encoder and pruning graphs" if self.encoder_only else "language graph", bundle.export_dir)
        return sessions

    # -- KV accounting: an encoder-only instance has no KV cache (vLLM's MMEncoderModelRunner's rule) -------
    def get_kv_cache_spec(self):
        return {} if self.encoder_only else super().get_kv_cache_spec()

    def determine_available_memory(self) -> int:
        return 0 if self.encoder_only else super().determine_available_memory()

    def initialize_from_config(self, kv_cache_config) -> None:
        if not self.encoder_only:
            super().initialize_from_config(kv_cache_config)

    # -- one step ---------------------------------------------------------------------------------------
    def execute_model(self, scheduler_output) -> ModelRunnerOutput | None:
        executor = self.driver.executor
        # vLLM's order: the step's freed entries go before anything is loaded or encoded for it.
        executor.free(scheduler_output.free_encoder_mm_hashes)
        if scheduler_output.scheduled_encoder_inputs and not self.encoder_only:
            raise AssertionError(f"media items {dict(scheduler_output.scheduled_encoder_inputs)} were scheduled for "
                                 "encoding on an ec_consumer instance; its connector keeps such requests waiting")
        with ec_connector_output(scheduler_output, executor.encoder_outputs) as ec_output:
            # A consumer's connector has loaded the step's shipped items into the encoder cache by now.
            output = self._encode(scheduler_output) if self.encoder_only else super().execute_model(scheduler_output)
        if output is None:  # a language step: it samples in sample_tokens (vLLM calls it next), which carries this
            self._ec_output = ec_output
            return None
        return ModelRunnerOutput.with_ec_conn_output(output, ec_output)

    def sample_tokens(self, grammar_output) -> ModelRunnerOutput:
        ec_output, self._ec_output = getattr(self, "_ec_output", None), None
        return ModelRunnerOutput.with_ec_conn_output(super().sample_tokens(grammar_output), ec_output)

    def _encode(self, scheduler_output) -> ModelRunnerOutput:
        """An encoder instance's step: admit, encode and ship the scheduled items; it never samples."""
        executor = self.driver.executor
        for request_id in scheduler_output.finished_req_ids:
            self.driver.finish(request_id)
        for new in scheduler_output.scheduled_new_reqs:
            self._admit(new)
        for request_id, items in scheduler_output.scheduled_encoder_inputs.items():
            for item in items:
                executor.encode(request_id, item)
                request = executor.requests[request_id]
                media = request.media[item]
                # What chose the item's rows goes in its header: each request may prune its videos its own way.
                pruning = media_pruning(media, executor.config.pruning) if media.kind == "video" else None
                get_ec_transfer().save_caches(encoder_cache=executor.encoder_outputs, mm_hash=request.hashes[item],
                                              kind=media.kind, pruning=pruning)
        return make_empty_encoder_model_runner_output(scheduler_output)

    def shutdown(self) -> None:
        try:
            super().shutdown()
        finally:
            ensure_ec_transfer_shutdown()

