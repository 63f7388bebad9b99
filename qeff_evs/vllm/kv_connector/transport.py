"""How a hand-over travels: a prefill instance's outbox, served over TCP, and the decode instance's pull.

The prefill instance keeps each finished prompt's hand-over (``kv_handover.RowHandover``, in its wire form) in an
:class:`Outbox` until a decode instance pulls it, at most ``lease_s`` seconds: a decode instance that never pulls
(it died, the router gave up, the client went away) does not pin memory for longer. A pull takes the entry out:
one request, one transfer. The :class:`OutboxServer` answers pulls on its own threads; the engine's step never
waits for the network.

The protocol, one connection per pull: the decode instance sends a 4-byte big-endian length and a JSON object
``{"request_id": ...}``; the prefill instance answers a 4-byte length and a JSON header (``{"bytes": N}``, or
``{"error": "..."}`` when it holds nothing for that id), then the N bytes.
"""

from __future__ import annotations

import json
import socket
import socketserver
import threading
import time
from collections.abc import Iterable

from qeff_evs.vllm.activation import logger


class Outbox:
    """Hand-overs waiting for their decode instance, by the prefill request's id, each for at most ``lease_s``."""

    def __init__(self, lease_s: float):
        self.lease_s = lease_s
        self._items: dict[str, tuple[bytes, float]] = {}
        self._lock = threading.Lock()

    def put(self, request_id: str, blob: bytes) -> None:
        with self._lock:
            self._items[request_id] = (blob, time.monotonic() + self.lease_s)

    def take(self, request_id: str) -> bytes | None:
        """The hand-over for ``request_id``, out of the outbox; None when there is none (never kept, pulled already,
        or its lease ran out)."""
        self.expire()
        with self._lock:
            item = self._items.pop(request_id, None)
        return None if item is None else item[0]

    def discard(self, request_ids: Iterable[str]) -> None:
        with self._lock:
            for request_id in request_ids:
                self._items.pop(request_id, None)

    def expire(self) -> list[str]:
        """Drop the hand-overs whose lease ran out; their ids."""
        now = time.monotonic()
        with self._lock:
            expired = [rid for rid, (_, until) in self._items.items() if until <= now]
            for request_id in expired:
                del self._items[request_id]
        for request_id in expired:
            logger.warning("qeff-evs KV: no decode instance pulled %s within %g s; its hand-over is dropped",
                           request_id, self.lease_s)
        return expired

    @property
    def held(self) -> dict[str, int]:
        """Bytes held per request id."""
        with self._lock:
            return {rid: len(blob) for rid, (blob, _) in self._items.items()}


def _send(sock: socket.socket, header: dict, body: bytes = b"") -> None:
    raw = json.dumps(header).encode()
    sock.sendall(len(raw).to_bytes(4, "big") + raw + body)


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise ConnectionError(f"the connection closed after {n - left} of {n} bytes")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _read_header(sock: socket.socket) -> dict:
    return json.loads(_read_exactly(sock, int.from_bytes(_read_exactly(sock, 4), "big")))


class OutboxServer:
    """Serves an :class:`Outbox` on ``host:port`` (port 0: one the system picks; :attr:`port` says which)."""

    def __init__(self, outbox: Outbox, host: str, port: int):
        self.outbox = outbox

        class Handler(socketserver.BaseRequestHandler):
            def handle(handler) -> None:
                request_id = str(_read_header(handler.request).get("request_id"))
                blob = outbox.take(request_id)
                if blob is None:
                    _send(handler.request, {"error": f"this prefill instance holds no hand-over for {request_id}: "
                                                     f"never kept, pulled already, or older than its {outbox.lease_s:g} "
                                                     "s lease (kv_connector_extra_config kv_lease_s)"})
                    return
                _send(handler.request, {"bytes": len(blob)}, blob)

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self._server = Server((host, port), Handler)
        self.host, self.port = host, self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="qeff-evs-kv-outbox", daemon=True)
        self._thread.start()
        # Leases run out on time even while the engine is idle (no step, no pull).
        self._closed = threading.Event()
        self._expiry = threading.Thread(target=self._expire_until_closed, name="qeff-evs-kv-lease", daemon=True)
        self._expiry.start()

    def _expire_until_closed(self) -> None:
        while not self._closed.wait(min(1.0, self.outbox.lease_s / 4)):
            self.outbox.expire()

    def close(self) -> None:
        self._closed.set()
        self._server.shutdown()
        self._server.server_close()


def pull(host: str, port: int, request_id: str, timeout_s: float) -> bytes:
    """The hand-over the prefill instance at ``host:port`` keeps for ``request_id``.

    Raises ``ConnectionError`` (one line: where, and why) when the instance cannot be reached or holds nothing."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.settimeout(timeout_s)
            _send(sock, {"request_id": request_id})
            header = _read_header(sock)
            blob = b"" if "error" in header else _read_exactly(sock, int(header["bytes"]))
    except OSError as error:  # refused, reset, timed out, closed early
        raise ConnectionError(f"the prefill instance's hand-over server {host}:{port} failed for {request_id}: "
                              f"{type(error).__name__}: {error}") from error
    if "error" in header:
        raise ConnectionError(f"{host}:{port}: {header['error']}")
    return blob
