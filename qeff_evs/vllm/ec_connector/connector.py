"""qeff-evs's EC connector: an encoder instance ships each media item's kept rows, and only those.

vLLM's encoder disaggregation (``--ec-transfer-config``) runs the vision side in an encoder instance
(``ec_role: ec_producer``) and the language model in prefill/decode instances (``ec_consumer``); an EC
connector carries each encoded item, keyed by vLLM's content hash ``mm_hash``, from one to the other. vLLM's
shared-storage connector (``ECExampleConnector``) writes one tensor per item. Ours keeps its scheduler side
(an item is available once its file exists in ``shared_storage_path``) and writes what qeff-evs's encoder
and pruning graphs return instead (``runtime.engine.kept_rows``): the K kept rows, their kept indices, the
per-frame kept counts and the family's extra per-row tensors, as one safetensors file per item, written
under a temporary name and renamed, so a reader never sees half a file. Its header records what the item's rows
are: K, the kind of item, and for a video the pruning method and rate that chose them (the request's own, or the
server's when the request chose none: ``item_header``).

A consumer-only instance never encodes (it loads no vision graph). Where vLLM's consumer falls back to
encoding an item it cannot find, ours keeps the request waiting (``ensure_cache_available``) until the item's
file appears, for at most ``payload_wait_s`` seconds (``ec_connector_extra_config``, default 10); then, or
at once when the file holds another K than the request's placeholder (an encoder instance at another rate),
the request fails with an error naming the item, and the instance serves the others.

Usage (one encoder instance, one prefill/decode instance, the same export path and storage folder)::

    --ec-transfer-config '{"ec_connector": "QeffEvsECConnector", "ec_role": "ec_producer",
                           "ec_connector_extra_config": {"shared_storage_path": "/shared/ec"}}'
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

from qeff_evs.models.pruning import VideoPruning
from qeff_evs.runtime.engine import kept_rows
from qeff_evs.vllm.ec_connector.config import CONNECTOR_NAME
from qeff_evs.vllm.activation import logger
from qeff_evs.vllm.surface import ECExampleConnector

if TYPE_CHECKING:
    from qeff_evs.vllm.surface import Request

FILE_NAME = "kept_rows.safetensors"
STORAGE_KEY = "shared_storage_path"
WAIT_KEY = "payload_wait_s"
DEFAULT_WAIT_S = 10.0
FORMAT = "qeff-evs kept rows 1"


def payload_path(storage: str | os.PathLike, mm_hash: str) -> str:
    """Where the kept rows of the item with content hash ``mm_hash`` are written."""
    return os.path.join(storage, mm_hash, FILE_NAME)


def item_header(rows: int, kind: str | None = None, pruning: VideoPruning | None = None) -> dict[str, str]:
    """A payload's header: its K ``rows``, and what chose them where the caller says: the item's ``kind``
    (``video``, ``image``) and a video's ``pruning`` (its own: a request may choose one per video)."""
    header = {"format": FORMAT, "rows": str(rows)}
    if kind is not None:
        header["kind"] = kind
    if pruning is not None:
        header.update(video_pruning_method=pruning.method, video_pruning_rate=str(pruning.rate))
    return header


def shipped_as(header: dict[str, str]) -> str:
    """What a header says chose its rows, for a message: ``a video pruned by evs at rate 0.75``."""
    if "video_pruning_method" in header:
        return (f"a {header.get('kind', 'video')} pruned by {header['video_pruning_method']} at rate "
                f"{header['video_pruning_rate']}")
    return f"an {header['kind']}, every row" if header.get("kind") == "image" else "its pruning not recorded"


def write_payload(path: str, arrays: dict, metadata: dict[str, str]) -> int:
    """Write the arrays (then rename into place); the file's size in bytes."""
    from safetensors.numpy import save_file

    os.makedirs(os.path.dirname(path), exist_ok=True)
    partial = f"{path}.{os.getpid()}.partial"
    save_file(arrays, partial, metadata=metadata)
    os.replace(partial, path)
    return os.path.getsize(path)


def read_header(path: str) -> dict[str, str]:
    """The metadata a payload file was written with (its header only)."""
    from safetensors import safe_open

    with safe_open(path, framework="numpy") as payload:
        return dict(payload.metadata() or {})


def read_payload(path: str) -> dict:
    from safetensors.numpy import load_file

    return load_file(path)


class QeffEvsECConnector(ECExampleConnector):
    def __init__(self, vllm_config, role):
        super().__init__(vllm_config=vllm_config, role=role)
        config = vllm_config.ec_transfer_config
        self._wait_s = float(config.get_from_extra_config(WAIT_KEY, DEFAULT_WAIT_S))
        self._waiting_since: dict[str, float] = {}  # request id -> when an item of it was first missing
        self._unavailable: set[str] = set()
        # mm_hash -> (K, what chose its rows) as its file's header records them (a file never changes once written)
        self._shipped: dict[str, tuple[int, str]] = {}

    def _path(self, mm_hash: str) -> str:
        return payload_path(self._storage_path, mm_hash)

    # -- worker side --------------------------------------------------------------------------------
    def save_caches(self, encoder_cache, mm_hash, kind: str | None = None, pruning: VideoPruning | None = None,
                    **kwargs) -> None:
        """Write the kept rows of ``encoder_cache[mm_hash]`` (an ``EncodedMedia``) for the consumers; ``kind`` and
        ``pruning``: what the item is and, for a video, the pruning that chose its rows (``item_header``)."""
        if not self.is_producer:
            return
        encoded = encoder_cache[mm_hash]
        arrays = kept_rows.to_arrays(encoded)
        k, frames = len(encoded.kept_indices), len(encoded.kept_per_frame)
        header = item_header(k, kind, pruning)
        size = write_payload(self._path(mm_hash), arrays, header)
        logger.info("qeff-evs EC: shipped %s: %d kept rows over %d temporal patches (%s), %d bytes (arrays %d B)",
                    mm_hash, k, frames, shipped_as(header), size, kept_rows.nbytes(arrays))

    def start_load_caches(self, encoder_cache, **kwargs) -> None:
        """Load the items the scheduler found in storage into ``encoder_cache`` (``EncodedMedia`` by mm_hash)."""
        for item in self._get_connector_metadata().mm_datas:
            if item.mm_hash in encoder_cache:
                continue
            encoded = kept_rows.from_arrays(read_payload(self._path(item.mm_hash)))
            if len(encoded.kept_indices) != item.num_token:  # ensure_cache_available compared the headers
                raise AssertionError(f"{self._path(item.mm_hash)} holds {len(encoded.kept_indices)} kept rows, "
                                     f"the request's placeholder {item.num_token}")
            encoder_cache[item.mm_hash] = encoded

    # -- scheduler side -----------------------------------------------------------------------------
    def has_cache_item(self, identifier: str) -> bool:
        return os.path.exists(self._path(identifier))

    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        """Whether every item the request still needs is in storage, holding the K its placeholder expects.

        An instance that encodes (producer, or both) never waits: it encodes what it cannot load. A consumer
        waits ``payload_wait_s`` for a missing item, then fails the request (``take_unavailable_requests``).
        """
        if self.is_producer:
            return True
        if request.request_id in self._unavailable:
            return False
        missing = []
        for index, feature in enumerate(request.mm_features):
            placeholder = feature.mm_position
            if placeholder.offset + placeholder.length <= num_computed_tokens:
                continue  # prefilled already: its rows were loaded and used
            mm_hash = feature.identifier
            if not self.has_cache_item(mm_hash):
                missing.append(mm_hash)
                continue
            problem = self._mismatch(mm_hash, request.get_num_encoder_embeds(index))
            if problem:
                self._fail(request.request_id, problem)
                return False
        if not missing:
            self._waiting_since.pop(request.request_id, None)
            return True
        since = self._waiting_since.setdefault(request.request_id, time.monotonic())
        if time.monotonic() - since > self._wait_s:
            self._fail(request.request_id,
                       f"no kept rows for {missing} in {self._storage_path} after {self._wait_s:g} s; this instance "
                       "is an EC consumer and runs no vision graph: send the request through the encoder instance "
                       "first (the EPD proxy does), give both instances the same export path (vLLM hashes it into "
                       f"mm_hash) and the same {STORAGE_KEY}, or raise ec_connector_extra_config {WAIT_KEY}")
        return False

    def _mismatch(self, mm_hash: str, expected_rows: int) -> str | None:
        if mm_hash not in self._shipped:
            header = read_header(self._path(mm_hash))
            if header.get("format") != FORMAT:
                return (f"{self._path(mm_hash)} is not a qeff-evs kept-rows file ({header.get('format')!r}); the "
                        f"encoder instance must use ec_connector {CONNECTOR_NAME} too")
            self._shipped[mm_hash] = int(header["rows"]), shipped_as(header)
        rows, chosen_by = self._shipped[mm_hash]
        if rows != expected_rows:
            return (f"the encoder instance shipped {rows} kept rows for {mm_hash} ({chosen_by}) but the request's "
                    f"placeholder here holds {expected_rows}; serve the same export with the same "
                    "--video-pruning-rate and --video-pruning-method on both instances (a request's own pruning is "
                    "part of mm_hash, the servers' defaults are not)")
        return None

    def _fail(self, request_id: str, reason: str) -> None:
        logger.error("qeff-evs EC: request %s fails: %s", request_id, reason)
        self._unavailable.add(request_id)
        self._waiting_since.pop(request_id, None)

    def take_unavailable_requests(self) -> set[str]:
        failed, self._unavailable = self._unavailable, set()
        return failed
