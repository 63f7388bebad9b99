"""vLLM's entry points into qeff-evs: active only while ``QEFF_EVS_BACKEND`` names a backend.

vLLM calls every installed ``vllm.platform_plugins`` function in every process to find the platform,
and every ``vllm.general_plugins`` function before it builds a model. Both stay inert unless the user
asked for qeff-evs (``QEFF_EVS_BACKEND=ort|qaic|torch``), so installing qeff-evs never changes any other
vLLM use. vLLM refuses two active out-of-tree platforms (vllm-qaic is one); with qeff-evs switched on
beside another, one log line names both before vLLM stops. Under any vLLM release but the one the plugin supports
(``surface.SUPPORTED_VLLM``) an active plugin stops the process at once with one line naming both versions and the
pip command (a ``SystemExit``: vLLM's plugin loader logs and swallows ordinary exceptions).
"""

from __future__ import annotations

from importlib.metadata import entry_points

from qeff_evs.vllm.activation import BACKEND_ENV, active_backend, logger
from qeff_evs.vllm.surface import installed_vllm, version_refusal

# The devices each graph's program opens on (qaic): "0", "encoder=1,evs=1,language=0+2" (placement.py), or
# the same under "device_ids" in --additional-config (a string, a list of ids, or a mapping of graph to ids).
DEVICE_IDS_ENV = "QEFF_EVS_DEVICE_IDS"
DEVICE_IDS_KEY = "device_ids"
RANKS_KEY = "qeff_evs_local_ranks"  # additional_config: the data-parallel ranks on this host (engine/data_parallel.py)
# Every key of --additional-config the qeff-evs platform reads; settings/table.py refuses any other (add new keys here).
ADDITIONAL_CONFIG_KEYS = (DEVICE_IDS_KEY, RANKS_KEY)
PLATFORM_PLUGIN_NAME = "qeff_evs"
PLATFORM_CLASS = "qeff_evs.vllm.engine.platform.QeffEvsPlatform"


def other_platform_plugins() -> list[str]:
    """Installed out-of-tree vLLM platform plugins besides ours (e.g. vllm-qaic's)."""
    return sorted(f"{ep.name} ({ep.value})" for ep in entry_points(group="vllm.platform_plugins")
                  if ep.name != PLATFORM_PLUGIN_NAME)


def refuse_other_vllm() -> None:
    """Stop here, in one line, under a vLLM release the plugin does not support."""
    line = version_refusal(installed_vllm())
    if line is not None:
        raise SystemExit(f"{BACKEND_ENV}={active_backend()}: {line}")


def platform_plugin() -> str | None:
    """``vllm.platform_plugins`` entry point: our Platform class path while active, else None."""
    try:
        backend = active_backend()
    except ValueError as error:
        # vLLM swallows exceptions raised here (debug log only): say it out loud instead.
        logger.error("qeff-evs platform not activated: %s", error)
        return None
    if backend is None:
        return None
    refuse_other_vllm()
    others = other_platform_plugins()
    if others:
        logger.warning("qeff-evs (%s=%s) is active beside other out-of-tree vLLM platform plugins %s; vLLM "
                       "activates only one: unset %s or switch the others off (e.g. VLLM_PLUGINS=qeff_evs)",
                       BACKEND_ENV, backend, ", ".join(others), BACKEND_ENV)
    return PLATFORM_CLASS


def register() -> None:
    """``vllm.general_plugins`` entry point: our model classes and processors, our EC and KV connectors and our
    video loaders, only while active."""
    if active_backend() is None:
        return
    refuse_other_vllm()
    from qeff_evs.vllm.ec_connector import config as ec_config
    from qeff_evs.vllm.kv_connector import config as kv_config
    from qeff_evs.vllm.processing.model import register_models
    from qeff_evs.vllm.processing.video_loader import register_video_loaders

    register_models()
    ec_config.register_connector()
    kv_config.register_connector()
    register_video_loaders()
