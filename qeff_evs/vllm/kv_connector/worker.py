"""The worker of a prefill/decode-disaggregation instance: it loads its side's programs and moves KV rows.

With ``--kv-transfer-config`` (qeff-evs's connector, ``kv_connector/connector.py``) one export is served by instances of two
roles:

===============  ==========================================  ==============================================
``kv_role``      programs loaded                             per step
===============  ==========================================  ==============================================
``kv_producer``  encoder, pruning, language (prefill calls;   each prompt as any qeff-evs worker runs it, cut
                 an export's decode-only twin is not opened)  one token before its end, where the row's used
                                                             part goes to the outbox (then its last token)
``kv_consumer``  language, one-token calls only (Qwen3.5:     the hand-overs that arrived written into their
                 its decode-only graph), no vision graph      rows, each prompt's last token, decodes
===============  ==========================================  ==============================================

The connector's worker side lives in this worker (vLLM's GPU runner mixin is not used): it is bound to each step's
metadata, its pulls are started, and what ended is reported in the step's ``kv_connector_output``. While requests
only wait for their hand-overs, vLLM keeps stepping with nothing scheduled; such a step waits up to
``IDLE_WAIT_S`` for a pull to end instead of returning at once, so waiting does not spin a core.
"""

from __future__ import annotations

import time

from qeff_evs.runtime.sessions import language_session, vision_pipeline
from qeff_evs.vllm.kv_connector import handover as kv_handover
from qeff_evs.vllm.activation import active_backend, logger
from qeff_evs.vllm.engine.data_parallel import configured_device_ids
from qeff_evs.vllm.ec_connector.worker import NotLoaded
from qeff_evs.vllm.kv_connector.config import PRODUCER, kv_role
from qeff_evs.vllm.engine.worker import QeffEvsWorker
from qeff_evs.vllm.surface import KVConnectorFactory
from qeff_evs.vllm.surface import KVConnectorOutput
from qeff_evs.vllm.surface import KVConnectorRole

IDLE_WAIT_S = 0.02


class QeffEvsKVWorker(QeffEvsWorker):
    """A qeff-evs worker in one role of prefill/decode disaggregation (module docstring)."""

    def init_device(self) -> None:
        super().init_device()
        self.producer = kv_role(self.vllm_config) == PRODUCER
        self.connector = None
        self._prompt_ids: dict[str, tuple[int, ...]] = {}
        self._finished: set[str] = set()  # requests vLLM finished or aborted (a late hand-over is not written)
        self._transfers: KVConnectorOutput | None = None

    def _sessions(self, bundle, method: str):
        device_ids, backend = configured_device_ids(self.vllm_config), active_backend()
        if self.producer:
            sessions = (vision_pipeline(bundle, backend, device_ids=device_ids, method=method),
                        language_session(bundle, backend, device_ids=device_ids, programs="prefill"))
        else:
            sessions = (NotLoaded("kv_consumer", "vision graphs (encoder, pruning)"),
                        language_session(bundle, backend, device_ids=device_ids, programs="decode"))
        logger.info("qeff-evs %s instance: loaded the %s of %s", "kv_producer" if self.producer else "kv_consumer",
                    "vision graphs and the language graph for prefill calls" if self.producer else
                    "language graph for one-token calls only", bundle.export_dir)
        return sessions

    def load_model(self, *, load_dummy_weights: bool = False) -> None:
        super().load_model(load_dummy_weights=load_dummy_weights)
        self.driver.decode_only = not self.producer
        self.driver.on_handover = self._hand_over

    def initialize_from_config(self, kv_cache_config) -> None:
        super().initialize_from_config(kv_cache_config)
        self.connector = KVConnectorFactory.create_connector(self.vllm_config, KVConnectorRole.WORKER,
                                                             kv_cache_config)

    def get_kv_connector_handshake_metadata(self):
        """Where this worker serves its hand-overs, for the scheduler side to advertise (vLLM asks at start-up)."""
        metadata = None if self.connector is None else self.connector.get_handshake_metadata()
        return None if metadata is None else {(0, 0): metadata}

    # -- one step ---------------------------------------------------------------------------------------
    def execute_model(self, scheduler_output) -> None:
        meta = scheduler_output.kv_connector_metadata
        for request_id in scheduler_output.finished_req_ids:
            self._prompt_ids.pop(request_id, None)
            self.driver.handover_at.pop(request_id, None)  # a prompt aborted before its cut
            if not self.producer and self.connector.pulling(request_id):
                self._finished.add(request_id)
        received, failed = set(), set()
        if meta is not None:
            self.connector.bind_connector_metadata(meta)
            if self.producer:
                self.driver.handover_at.update(meta.keep)
                self.connector.drop(meta.drop)
            else:
                self.connector.start_load_kv()
        if not self.producer:
            idle = scheduler_output.total_num_scheduled_tokens == 0
            for arrival in self.connector.take_arrivals(IDLE_WAIT_S if idle else 0.0):
                problem = arrival.error or self._write(arrival)
                received.add(arrival.request_id)
                if problem:
                    failed.add(arrival.request_id)
                    logger.error("qeff-evs KV: request %s gets no hand-over from %s:%d (%s); it fails alone",
                                 arrival.request_id, arrival.pull.host, arrival.pull.port, problem)
        self._transfers = KVConnectorOutput(finished_recving=received, failed_recving=failed)
        try:
            return super().execute_model(scheduler_output)
        finally:
            if meta is not None:
                self.connector.clear_connector_metadata()

    def sample_tokens(self, grammar_output):
        output = super().sample_tokens(grammar_output)
        transfers, self._transfers = self._transfers, None
        if transfers is not None and not transfers.is_empty():
            output.kv_connector_output = transfers
        return output

    def _write(self, arrival) -> str | None:
        """Write an arrived hand-over into its row; why not, or None."""
        if arrival.request_id in self._finished:
            self._finished.discard(arrival.request_id)
            return None  # aborted while its pull was in flight: vLLM only needs to hear it ended
        handover, pull = arrival.handover, arrival.pull
        if handover.token_ids != pull.token_ids:
            return (f"the hand-over holds {handover.num_tokens} tokens that differ from this request's prompt; serve "
                    "the same export with the same pruning on both instances")
        language = self.driver.executor.language
        started = time.perf_counter()
        kv_handover.put_row(language.state, language.shape, pull.row, handover)
        logger.info("qeff-evs KV: received %s: %d tokens, %d bytes into row %d (pulled in %.1f ms, %.1f ms to write)",
                    arrival.request_id, handover.num_tokens, handover.nbytes, pull.row, 1e3 * arrival.seconds,
                    1e3 * (time.perf_counter() - started))
        return None

    def _admit(self, new, row: int | None = None) -> None:
        super()._admit(new, row)
        self._prompt_ids[new.req_id] = tuple(new.prompt_token_ids)

    def _hand_over(self, request_id: str, num_tokens: int) -> None:
        """A prefill instance's request has run its first ``num_tokens`` tokens: its row's used part to the outbox."""
        started = time.perf_counter()
        state = self.driver.executor.requests[request_id]
        language = self.driver.executor.language
        handover = kv_handover.take_row(language.state, language.shape, state.cache_row,
                                        self._prompt_ids[request_id][:num_tokens])
        size = self.connector.keep(request_id, handover)
        logger.info("qeff-evs KV: handing over %s: %d tokens, %d bytes (arrays %d B; %.1f ms to copy)", request_id,
                    num_tokens, size, handover.nbytes, 1e3 * (time.perf_counter() - started))

    def shutdown(self) -> None:
        try:
            super().shutdown()
        finally:
            if self.connector is not None:
                self.connector.shutdown()
