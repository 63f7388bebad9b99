"""The Apps SDK calls that put a compiled program on its devices and take it off again.

This module alone names them, so a difference between SDK versions is fixed in one place. The calls
follow QEfficient's ``QAICInferenceSession`` (``QEfficient/generation/cloud_infer.py``) and vllm-qaic's
(``vllm_qaic/model_loader/qaic_session_np.py``), which open programs the same way, and the C++ ``Program``
of Qualcomm's open runtime (``QAicOpenRtProgram.hpp``, software-kit-for-qualcomm-cloud-ai-100) for unload:

* a context over the program's devices, ``Context(QIDList(ids))``, and its queue on the first,
  ``Queue(context, ids[0])``;
* ``QAicProgramProperties()`` with ``dataPathTimeoutMs`` (how long the host waits for the device's data path;
  both projects set 60 s) and, for a program compiled for N > 1 devices, ``devMapping = "a:b:..."`` with no
  device id in ``Program(context, None, qpc, properties)``; one device: ``Program(context, id, qpc, ...)``;
* ``load()`` (device memory), ``activate()`` (the program's cores), then ``ExecObj(context, program)``;
* release: the ExecObj dropped, ``deactivate()``, ``unload()`` where the binding has it (the C++ Program does;
  its destructor releases the rest when the last reference goes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

DATA_PATH_TIMEOUT_MS = 60_000  # QEfficient's and vllm-qaic's value
# What a failed load or activation usually means on a card that other programs share.
BUSY_HINT = ("the devices may lack free memory or cores (programs of other processes count too: see "
             "`qaic-util -q`), or an id may not name a device")


@dataclass
class DeviceProgram:
    """One program loaded and activated on ``device_ids``; ``release`` takes it off them."""

    sdk: Any  # qaic.QaicSdk
    label: str
    device_ids: tuple[int, ...]
    context: Any
    queue: Any
    program: Any
    exec_obj: Any = None

    def release(self) -> None:
        """Deactivate and unload (idempotent): the program's cores and memory go back to the devices."""
        if self.program is None:
            return
        program, self.program, self.exec_obj = self.program, None, None
        status = program.deactivate()
        if status is not None:
            self.sdk.check(status, f"deactivating {self.label} on device(s) {list(self.device_ids)}")
        unload = getattr(program, "unload", None)
        if unload is not None:
            self.sdk.check(unload(), f"unloading {self.label} from device(s) {list(self.device_ids)}")
        self.queue = self.context = None


def open_program(sdk, qpc, device_ids: Sequence[int], label: str,
                 timeout_ms: int = DATA_PATH_TIMEOUT_MS) -> DeviceProgram:
    """Load and activate the QPC ``qpc`` (a ``qaicrt.Qpc``) on ``device_ids`` (as many as it was compiled for)."""
    rt = sdk.qaicrt
    ids = tuple(int(d) for d in device_ids)
    if not ids:
        raise ValueError(f"{label}: no device ids to open the program on")
    context = rt.Context(rt.QIDList(list(ids)))
    queue = rt.Queue(context, ids[0])
    properties = rt.QAicProgramProperties()
    if hasattr(properties, "dataPathTimeoutMs"):  # older SDKs lack it (their default applies)
        properties.dataPathTimeoutMs = int(timeout_ms)
    single = None
    if len(ids) > 1:
        properties.devMapping = ":".join(map(str, ids))
    else:
        single = ids[0]
    program = rt.Program(context, single, qpc, properties)
    where = f"device(s) {list(ids)}"
    status = program.load()
    if not sdk.ok(status):
        raise RuntimeError(f"qaicrt: loading {label} onto {where} failed with status {status}: {BUSY_HINT}")
    status = program.activate()
    if status is not None and not sdk.ok(status):
        unload = getattr(program, "unload", None)
        if unload is not None:
            unload()
        raise RuntimeError(f"qaicrt: activating {label} on {where} failed with status {status}: {BUSY_HINT}")
    return DeviceProgram(sdk, label, ids, context, queue, program, rt.ExecObj(context, program))
