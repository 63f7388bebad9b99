"""Whether qeff-evs is switched on in this process, and with which backend: ``QEFF_EVS_BACKEND``.

The entry points (``plugin.py``) and every part of the plugin that asks which backend serves read the
switch here. This module imports nothing of the plugin, so any part may import it.
"""

from __future__ import annotations

import logging
import os

BACKEND_ENV = "QEFF_EVS_BACKEND"
BACKENDS = ("ort", "openvino", "openvino-bf16", "qaic", "torch")  # sessions.BACKENDS (not imported here)

# A child of vLLM's logger, so lines come out with vLLM's own format and level.
logger = logging.getLogger("vllm.qeff_evs")


def active_backend() -> str | None:
    """The backend ``QEFF_EVS_BACKEND`` names, or None when qeff-evs is switched off."""
    value = os.environ.get(BACKEND_ENV, "").strip().lower()
    if not value:
        return None
    if value not in BACKENDS:
        raise ValueError(f"{BACKEND_ENV}={value!r} is not a qeff-evs backend; use one of {', '.join(BACKENDS)} "
                         f"(or unset it to leave vLLM alone)")
    return value
