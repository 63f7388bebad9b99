"""Prefill/decode disaggregation through the plugin: its names, and which settings an export serves with it.

qeff-evs serves vLLM's prefill/decode disaggregation through its own KV connector (``kv_connector/connector.py``: the used
part of a request's KV row, from a prefill instance's outbox to a decode instance, over TCP) and its KV worker
(``kv_connector/worker.py``: a prefill instance loads the prefill programs, a decode instance the decode ones). This module
names them for vLLM and checks the settings before the engine starts; it reads ``VllmConfig`` attributes and
imports neither.
"""

from __future__ import annotations

CONNECTOR_NAME = "QeffEvsKVConnector"
CONNECTOR_MODULE = "qeff_evs.vllm.kv_connector.connector"
KV_WORKER_CLASS = "qeff_evs.vllm.kv_connector.worker.QeffEvsKVWorker"
HOST_BACKENDS = ("ort", "torch")  # where a row's state is host memory the connector reads and writes
PRODUCER, CONSUMER = "kv_producer", "kv_consumer"
# What a decode instance needs of the prefill instance's answer to pull its hand-over.
REMOTE_KEYS = ("remote_host", "remote_port", "remote_request_id")


def register_connector() -> None:
    """Make ``QeffEvsKVConnector`` a name ``--kv-transfer-config`` accepts (in every process vLLM starts)."""
    from qeff_evs.vllm.surface import KVConnectorFactory

    try:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)
    except ValueError:  # registered already in this process (vLLM's factory refuses a second registration)
        pass


def kv_role(vllm_config) -> str | None:
    """``kv_producer`` (a prefill instance), ``kv_consumer`` (a decode instance), or None (no KV transfer)."""
    config = vllm_config.kv_transfer_config
    if config is None or config.kv_connector is None:
        return None
    return config.kv_role


def kv_worker_class(vllm_config) -> str | None:
    """Our KV worker's class path when this instance is a prefill or a decode instance, else None."""
    return KV_WORKER_CLASS if kv_role(vllm_config) is not None else None


def kv_refusals(vllm_config, backend: str | None) -> list[str]:
    """Why the KV-transfer settings cannot be served, one line each; empty when they can (or none are given)."""
    config = vllm_config.kv_transfer_config
    if config is None or config.kv_connector is None:
        return []
    problems = []
    if config.kv_connector != CONNECTOR_NAME:
        problems.append(f"kv_connector {config.kv_connector!r}: an export's KV rows live in its language graph's "
                        f"retained state, which only qeff-evs's connector reads and writes; pass \"kv_connector\": "
                        f"\"{CONNECTOR_NAME}\" (it speaks the kv_transfer_params of vllm-router's PD mode)")
    if config.kv_role not in (PRODUCER, CONSUMER):
        problems.append(f"kv_role {config.kv_role!r}: a qeff-evs instance either prefills (kv_producer: prefill "
                        "programs) or decodes (kv_consumer: decode programs); run one instance of each")
    if backend not in HOST_BACKENDS:
        problems.append(f"KV transfer on the {backend} backend: the hand-over reads and writes a row of the language "
                        "session's state in host memory (the ort and torch backends); on a card the retained state "
                        "stays on the device, which this connector does not read yet; serve P/D on ort or torch")
    if vllm_config.ec_transfer_config is not None and vllm_config.ec_transfer_config.ec_connector is not None:
        problems.append("--kv-transfer-config with --ec-transfer-config: a qeff-evs instance plays one role of one "
                        "disaggregation; split the encoder or split prefill from decode")
    if vllm_config.parallel_config.data_parallel_size > 1:
        problems.append(f"--data-parallel-size {vllm_config.parallel_config.data_parallel_size} with KV transfer: "
                        "start more prefill or decode instances behind vllm-router instead")
    return problems
