"""Encoder disaggregation through the plugin: its names, and which settings an export serves with it.

qeff-evs serves vLLM's encoder disaggregation through its own EC connector (``ec_connector/connector.py``: kept rows,
indices, per-frame counts and extras in, the same out) and its EC worker (``ec_connector/worker.py``: each role loads
only its graphs). This module names them for vLLM and checks the settings before the engine starts; it reads
``VllmConfig`` attributes and imports neither.
"""

from __future__ import annotations

CONNECTOR_NAME = "QeffEvsECConnector"
CONNECTOR_MODULE = "qeff_evs.vllm.ec_connector.connector"
EC_WORKER_CLASS = "qeff_evs.vllm.ec_connector.worker.QeffEvsECWorker"


def register_connector() -> None:
    """Make ``QeffEvsECConnector`` a name ``--ec-transfer-config`` accepts (in every process vLLM starts)."""
    from qeff_evs.vllm.surface import ECConnectorFactory

    try:
        ECConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)
    except ValueError:  # registered already in this process (vLLM's factory refuses a second registration)
        pass


def ec_worker_class(vllm_config) -> str | None:
    """Our EC worker's class path when this instance plays a role in encoder disaggregation, else None."""
    ec_config = vllm_config.ec_transfer_config
    return EC_WORKER_CLASS if ec_config is not None and ec_config.is_ec_transfer_instance else None


def ec_refusals(vllm_config) -> list[str]:
    """Why the encoder-disaggregation settings cannot be served, one line each; empty when they can."""
    ec_config = vllm_config.ec_transfer_config
    mm = vllm_config.model_config.multimodal_config
    encoder_only = bool(mm is not None and mm.mm_encoder_only)
    if ec_config is None or ec_config.ec_connector is None:
        if encoder_only:
            return ["--mm-encoder-only without an encoder-disaggregation config ships its encoder outputs nowhere; "
                    f"pass --ec-transfer-config '{{\"ec_connector\": \"{CONNECTOR_NAME}\", \"ec_role\": "
                    "\"ec_producer\"}' instead"]
        return []
    problems = []
    if ec_config.ec_connector != CONNECTOR_NAME:
        problems.append(f"ec_connector {ec_config.ec_connector!r}: qeff-evs instances ship each video's kept rows with "
                        f"their indices, per-frame counts and extra rows, which only qeff-evs's connector carries; "
                        f"pass \"ec_connector\": \"{CONNECTOR_NAME}\" (vLLM's shared-storage scheme, same "
                        "ec_connector_extra_config)")
    if ec_config.is_ec_producer and ec_config.is_ec_consumer:
        problems.append("ec_role 'ec_both': qeff-evs instances either encode (ec_producer: encoder and pruning "
                        "graphs) or generate (ec_consumer: the language graph); run one instance of each")
    elif encoder_only and not ec_config.is_encode_only:
        problems.append(f"--mm-encoder-only with ec_role {ec_config.ec_role!r}: an encoder-only instance is an "
                        "ec_producer; drop --mm-encoder-only or pass \"ec_role\": \"ec_producer\"")
    parallel = vllm_config.parallel_config
    if parallel.data_parallel_size > 1:
        problems.append(f"--data-parallel-size {parallel.data_parallel_size} with encoder disaggregation: qeff-evs "
                        "runs one engine per encoder or prefill/decode instance; start more instances instead")
    return problems
