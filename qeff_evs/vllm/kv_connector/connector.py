"""qeff-evs's KV connector: a prefill instance hands each prompt's KV row to a decode instance.

vLLM's prefill/decode disaggregation (``--kv-transfer-config``) runs each request's prompt on a prefill instance
(``kv_role: kv_producer``) and its generation on a decode instance (``kv_consumer``); a front (vllm-router's
``--vllm-pd-disaggregation``, vLLM's example proxies) sends the request to the prefill instance with
``kv_transfer_params: {"do_remote_decode": true}`` and ``max_tokens`` 1, then the same request to the decode instance
with the ``kv_transfer_params`` the prefill instance answered. This connector speaks that protocol (the key names of
vLLM's NIXL connector, which the router copies through unchanged) over the export's KV rows:

* **prefill instance.** The worker runs the prompt as any qeff-evs worker does (vision graphs, pruning, prefill
  chunks), cut so that one call ends one token before the prompt's end; right after that call it copies the row's
  used part (``kv_handover.take_row``: slots ``[0, N-1)`` of every KV layer and the layer states after ``N-1``
  tokens) into its outbox (``kv_transport``), then runs the last token for vLLM's one sampled token. The request
  ends, its row is free for the next prompt at once (held hand-overs never cost a row, so they never cut
  ``--max-num-seqs``), and ``request_finished`` answers ``do_remote_prefill`` with where to pull from. The outbox
  holds it until a decode instance pulled it, or ``kv_lease_s`` (default 30 s); an aborted prompt is dropped.
* **decode instance.** vLLM's scheduler asks how many tokens the connector can load: ``N-1`` (vLLM's own rule after a
  full remote hit: the last prompt token is computed here, so a recurrent state never sees it twice), loaded
  asynchronously. The request waits (``WAITING_FOR_REMOTE_KVS``) in the KV row the scheduler chose for it; the
  worker pulls on a thread, checks the ids against its own prompt, writes the row on its next step and reports the
  receive; vLLM then schedules the last prompt token and decodes. A pull that fails (the prefill instance is gone,
  its lease ran out) is reported as a failed receive: with ``kv_load_failure_policy`` ``fail`` (vLLM's default)
  the request ends with an error, the instance serves the others. A request aborted while its pull is in flight is
  reported too (vLLM holds its row until then) and nothing is written.

Extra config (``kv_connector_extra_config``): ``kv_host`` (the address the prefill instance listens on and
advertises; default 127.0.0.1), ``kv_port`` (default 0: any free port, advertised in the answer), ``kv_lease_s``,
``pull_timeout_s`` (default 30). One host or several: the hand-over goes over TCP either way.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from qeff_evs.vllm.kv_connector import handover as kv_handover
from qeff_evs.vllm.kv_connector import transport as kv_transport
from qeff_evs.vllm.activation import logger
from qeff_evs.vllm.kv_connector.config import REMOTE_KEYS
from qeff_evs.vllm.surface import KVConnectorBase_V1, KVConnectorHandshakeMetadata, KVConnectorMetadata, KVConnectorRole

if TYPE_CHECKING:
    from qeff_evs.vllm.surface import Request

DEFAULT_LEASE_S = 30.0
DEFAULT_PULL_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Pull:
    """Where a decode instance pulls one request's hand-over from, and the KV row it goes into."""

    row: int
    host: str
    port: int
    remote_request_id: str
    num_tokens: int
    token_ids: tuple[int, ...] = ()
    """The request's own first ``num_tokens`` prompt ids: the hand-over must hold exactly these."""


@dataclass
class HandoverMetadata(KVConnectorMetadata):
    """One step's orders from the scheduler side to the worker side."""

    keep: dict[str, int] = field(default_factory=dict)
    """Prefill instance: requests new this step whose row is handed over, and after how many tokens (N-1)."""
    drop: list[str] = field(default_factory=list)
    """Prefill instance: requests whose hand-over nobody will pull (aborted): out of the outbox."""
    pulls: dict[str, Pull] = field(default_factory=dict)
    """Decode instance: requests whose hand-over to pull now."""


@dataclass
class HandoverAddress(KVConnectorHandshakeMetadata):
    """Where a prefill instance's worker serves its outbox (told to its scheduler side at start-up)."""

    host: str
    port: int


@dataclass(frozen=True)
class Arrival:
    """A pull that ended: its hand-over, or why there is none."""

    request_id: str
    pull: Pull
    handover: kv_handover.RowHandover | None
    error: str | None = None
    seconds: float = 0.0
    """From the pull's start to its end (connect, the prefill instance's answer, the bytes, their parsing)."""
    wire_bytes: int = 0


def _param(request, key: str, default: Any = None) -> Any:
    return (request.kv_transfer_params or {}).get(key, default)


class QeffEvsKVConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        config = vllm_config.kv_transfer_config
        extra = config.kv_connector_extra_config or {}
        self.is_producer = bool(config.is_kv_producer)
        self.engine_id = config.engine_id
        self.host = str(extra.get("kv_host", "127.0.0.1"))
        self.port = int(extra.get("kv_port", 0))
        self.lease_s = float(extra.get("kv_lease_s", DEFAULT_LEASE_S))
        self.pull_timeout_s = float(extra.get("pull_timeout_s", DEFAULT_PULL_TIMEOUT_S))
        # scheduler side
        self.rows = None  # the scheduler's RowBook (QeffEvsScheduler sets it): the row a pull writes into
        self._keep: dict[str, int] = {}
        self._drop: list[str] = []
        self._pulls: dict[str, Pull] = {}
        # worker side
        self.outbox: kv_transport.Outbox | None = None
        self.server: kv_transport.OutboxServer | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._arrived: list[Arrival] = []
        self._arrival = threading.Condition()
        self._in_flight: set[str] = set()
        if role == KVConnectorRole.WORKER:
            if self.is_producer:
                self.outbox = kv_transport.Outbox(self.lease_s)
                self.server = kv_transport.OutboxServer(self.outbox, self.host, self.port)
                self.port = self.server.port
                logger.info("qeff-evs KV: prefill instance, hand-overs served on %s:%d (lease %g s)", self.host,
                            self.port, self.lease_s)
            else:
                self._pool = ThreadPoolExecutor(4, thread_name_prefix="qeff-evs-kv-pull")

    # -- scheduler side -----------------------------------------------------------------------------
    def set_xfer_handshake_metadata(self, metadata) -> None:
        """The worker's outbox address (vLLM hands the scheduler side what each worker's connector published)."""
        for address in metadata.values():
            if isinstance(address, HandoverAddress):
                self.host, self.port = address.host, address.port

    def set_xfer_handshake_metadata_pp_aware(self, metadata) -> None:
        self.set_xfer_handshake_metadata(metadata)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        if self.is_producer or not _param(request, "do_remote_prefill"):
            return 0, False
        if any(_param(request, key) is None for key in REMOTE_KEYS):
            return 0, False  # the frontend refuses such a request (platform.kv_role_refusals); never reached
        # N-1 of this prompt: the decode instance computes the last token (a prefill instance that reported another
        # count served another prompt; the ids' check refuses its hand-over)
        handed = min(int(_param(request, "remote_num_tokens", request.num_prompt_tokens - 1)),
                     request.num_prompt_tokens - 1)
        return max(handed - num_computed_tokens, 0), handed > num_computed_tokens

    def update_state_after_alloc(self, request: Request, blocks, num_external_tokens: int) -> None:
        rid = request.request_id
        if self.is_producer:
            if _param(request, "do_remote_decode"):
                self._keep[rid] = request.num_prompt_tokens - 1
            return
        if num_external_tokens == 0 or not _param(request, "do_remote_prefill"):
            return
        if self.rows is None or rid not in self.rows.claimed:
            raise AssertionError(f"{rid}: vLLM allocated a row for a remote prefill that the scheduler did not claim")
        row = self.rows.hold_for_pull(rid)  # the request waits in it; vLLM schedules it later without a new claim
        params = request.kv_transfer_params
        self._pulls[rid] = Pull(row, str(params["remote_host"]), int(params["remote_port"]),
                                str(params["remote_request_id"]), num_external_tokens,
                                tuple(request.prompt_token_ids[:num_external_tokens]))
        params["do_remote_prefill"] = False  # one transfer per request

    def build_connector_meta(self, scheduler_output) -> HandoverMetadata:
        meta = HandoverMetadata(self._keep, self._drop, self._pulls)
        self._keep, self._drop, self._pulls = {}, [], {}
        return meta

    def request_finished(self, request: Request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        """A prefill instance answers where its hand-over waits; the row is free at once (the outbox holds a copy)."""
        if not self.is_producer or not _param(request, "do_remote_decode"):
            return False, None
        from qeff_evs.vllm.surface import RequestStatus

        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            self._drop.append(request.request_id)  # aborted or failed: nobody will pull it
            return False, None
        return False, dict(do_remote_prefill=True, do_remote_decode=False, remote_engine_id=self.engine_id,
                           remote_request_id=request.request_id, remote_host=self.host, remote_port=self.port,
                           remote_block_ids=[], remote_num_tokens=request.num_prompt_tokens - 1, tp_size=1)

    # -- worker side --------------------------------------------------------------------------------
    def get_handshake_metadata(self) -> HandoverAddress | None:
        return HandoverAddress(self.host, self.port) if self.server is not None else None

    def start_load_kv(self, forward_context=None, **kwargs) -> None:
        """Start this step's pulls, each on a thread (the step does not wait for the network)."""
        for rid, pull in self._get_connector_metadata().pulls.items():
            self._in_flight.add(rid)
            self._pool.submit(self._pull, rid, pull)

    # Per-layer hooks of vLLM's torch runner: an export's language graph runs every layer in one call, so a row is
    # handed over whole (the worker's hand-over, start_load_kv's pulls), never layer by layer.
    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def _pull(self, request_id: str, pull: Pull) -> None:
        started = time.perf_counter()
        try:
            blob = kv_transport.pull(pull.host, pull.port, pull.remote_request_id, self.pull_timeout_s)
            arrival = Arrival(request_id, pull, kv_handover.from_bytes(blob), None, time.perf_counter() - started,
                              len(blob))
        except Exception as error:  # noqa: BLE001 - reported as a failed receive, whatever it was
            arrival = Arrival(request_id, pull, None, f"{type(error).__name__}: {error}", time.perf_counter() - started)
        with self._arrival:
            self._arrived.append(arrival)
            self._arrival.notify_all()

    def take_arrivals(self, wait_s: float = 0.0) -> list[Arrival]:
        """The pulls that ended since the last call; with ``wait_s``, wait that long for one when none has."""
        with self._arrival:
            if not self._arrived and wait_s > 0 and self._in_flight:
                self._arrival.wait(wait_s)
            arrived, self._arrived = self._arrived, []
        for arrival in arrived:
            self._in_flight.discard(arrival.request_id)
        return arrived

    def pulling(self, request_id: str) -> bool:
        """Whether a pull for ``request_id`` started and has not been taken as ended."""
        return request_id in self._in_flight

    def keep(self, request_id: str, handover: kv_handover.RowHandover) -> int:
        """Put a prompt's hand-over in the outbox; its size in bytes on the wire."""
        blob = kv_handover.to_bytes(handover)
        self.outbox.put(request_id, blob)
        return len(blob)

    def drop(self, request_ids) -> None:
        if self.outbox is not None:
            self.outbox.discard(request_ids)
            self.outbox.expire()

    def shutdown(self) -> None:
        if self.server is not None:
            self.server.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
