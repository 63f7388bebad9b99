"""The QAIC backend (``qeff_evs.runtime.backends.qaic``) against a fake Apps SDK that runs the real graphs.

No card and no SDK here, so ``qaicrt`` and ``QAicApi_pb2`` are replaced (through ``sys.modules``) by a
fake that behaves like a card: a "compile" step records the graph, its specializations, its custom IO
and the cores and devices ``compile.sh`` compiles it for next to the QPC folder; loading it yields an
IoDesc whose bindings carry the device dtypes (fp16 where custom_io.yaml says so) and one allowed shape
set per specialization; a run checks the buffer shapes against those sets, keeps ``*_RetainedState``
outputs as device state (in the device dtype), serves a skipped (empty) input from that state and fails
if the host skips one it never uploaded, and computes the outputs with ONNX Runtime. Devices have cores
and memory: a program's load takes its size on each of its devices (its QPC's declared size, else its
weights and retained state), its activation its compiled cores, and either fails when a device runs out;
a program compiled for N devices opens only on N device ids. Every ``setData`` is recorded with the
bytes each binding moves host->device and device->host, every load/activate/deactivate/unload as an event.

Checks: the missing-SDK and missing-QPC errors; greedy tokens equal the ONNX Runtime backend's, for a
single request (plain and continuous-batching exports) and for the serving engine; KV buffers go up once
per program load (never per request), ``*_RetainedState`` outputs are skipped on every call, and each
prefill chunk and decode call moves exactly its inputs, its window of vision rows and its logits; a shape
no specialization serves raises before anything reaches the device. Placement: ``test_qaic_placement.py``.
"""

from __future__ import annotations

import json
import math
import shlex
import sys
import types
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from qeff_evs.export.pipeline import ExportOptions, export_checkpoint
from qeff_evs.models.graph_io import state_shapes
from qeff_evs.models.tiny import save_tiny_checkpoint
from qeff_evs.runtime.engine.single_request import Engine, EngineConfig
from qeff_evs.runtime.inputs.prompt import video_question_pieces
from qeff_evs.runtime.backends.qaic import QPC_FILE, QaicLanguageSession, QaicProgram, load_sdk, qaic_sessions, qpc_dir
from qeff_evs.runtime.builders import build_serving_engine, stop_ids
from qeff_evs.runtime.export_bundle import open_export
from qeff_evs.runtime.media import video_from_file
from qeff_evs.runtime.sessions import sessions_for
from qeff_evs.runtime.engine.serving import ServeRequest
from qeff_evs.runtime.inputs.synthetic import moving_square_video
from qeff_evs.specializations import read_custom_io_yaml, read_specializations_json

DECODE_STEPS = 8
QUESTION = "What happens in this video?"
# 8 frames of 120x200 -> the processor resizes to 112x196: grid (4, 8, 14), merged (4, 4, 7).
EXPORT = dict(video_pruning_rate=0.5, frames=(8,), resolutions=((112, 196),), prefill_seq_len=32, ctx_len=256,
              user_vision_size=48)
FULL_BATCH = 2
# Qwen3.5: 16 px patches (120x200 -> 128x192), layers linear, full, linear, linear.
FAMILY_EXPORT = {"qwen3_5": dict(resolutions=((128, 192),)), "qwen3_5_moe": dict(resolutions=((128, 192),))}
FAMILY_CHECKPOINT = {"qwen3_5": dict(text_layers=4), "qwen3_5_moe": dict(text_layers=4)}

# --------------------------------------------------------------------------------------------------
# the fake Apps SDK

SUCCESS, FAILURE = 0, 1
FLOAT_TYPE, FLOAT_16_TYPE, INT64_I_TYPE, INT32_I_TYPE = 1, 2, 3, 4
INPUT, OUTPUT = 0, 1
ONNX_TO_DEVICE = {onnx.TensorProto.FLOAT: FLOAT_TYPE, onnx.TensorProto.INT64: INT64_I_TYPE,
                  onnx.TensorProto.INT32: INT32_I_TYPE}
DEVICE_DTYPE = {FLOAT_TYPE: np.float32, FLOAT_16_TYPE: np.float16, INT64_I_TYPE: np.int64, INT32_I_TYPE: np.int32}
ONNX_DTYPE = {onnx.TensorProto.FLOAT: np.float32, onnx.TensorProto.INT64: np.int64, onnx.TensorProto.INT32: np.int32}
RETAINED = "_RetainedState"


DEVICE_MEMORY = 32 << 30  # bytes of DDR per fake device (an AI 100 Pro card's)


def compiled_for(export: Path, onnx_file: str) -> tuple[int, int]:
    """``(-aic-num-cores, devices)`` of the graph's line in ``compile.sh`` (what a real QPC would carry)."""
    for line in (export / "compile.sh").read_text().splitlines():
        argv = shlex.split(line)
        if f"-m={onnx_file}" in argv:
            options = dict(a.split("=", 1) for a in argv if a.startswith("-") and "=" in a)
            mdp = options.get("-mdp-load-partition-config")
            devices = len(json.loads((export / mdp).read_text())["connections"][0]["devices"]) if mdp else 1
            return int(options["-aic-num-cores"]), devices
    raise AssertionError(f"compile.sh has no line for {onnx_file}")


def fake_compile(export: Path, graph: str, size_bytes: int | None = None) -> Path:
    """What qaic-compile would consume, written as the QPC folder's program file (the fake loads it).

    The encoder and pruning graphs share ``vision/``: their files (and QPC folders) carry the graph's name.
    Cores and devices come from the graph's ``compile.sh`` line; ``size_bytes`` declares the program's
    device memory (default: its weights and retained state).
    """
    folder, prefix = (export / "language", "") if graph == "language" else (export / "vision", f"{graph}_")
    qpc = folder / f"{prefix}qpc"
    qpc.mkdir(exist_ok=True)
    specs = [spec.symbols for spec in read_specializations_json(folder / f"{prefix}specializations.json")]
    cores, devices = compiled_for(export, str((folder / f"{graph}.onnx").relative_to(export)))
    program = {"onnx": str(folder / f"{graph}.onnx"), "specializations": specs,
               "custom_io": read_custom_io_yaml(folder / f"{prefix}custom_io.yaml"),
               "num_cores": cores, "num_devices": devices, "size_bytes": size_bytes}
    (qpc / QPC_FILE).write_text(json.dumps(program))
    return qpc


@dataclass
class Call:
    """One ``setData``: per binding the bytes it moves (0 = skipped) each way, and the dims passed."""

    qpc: str
    to_device: dict[str, int]  # inputs uploaded, host -> device
    to_host: dict[str, int]  # outputs copied back, device -> host
    dims: dict[str, list[int]]


@dataclass
class FakeDevice:
    """The fake card: its devices' cores and memory, every call and every program event."""

    num_devices: int = 2
    cores: int = 16
    memory: int = DEVICE_MEMORY
    calls: list[Call] = field(default_factory=list)
    events: list[tuple[str, str, tuple[int, ...]]] = field(default_factory=list)  # (what, qpc, devices)
    cores_used: dict[int, int] = field(default_factory=dict)
    memory_used: dict[int, int] = field(default_factory=dict)
    timeouts: list[int] = field(default_factory=list)  # dataPathTimeoutMs of each program made

    def language_calls(self) -> list[Call]:
        return [c for c in self.calls if c.qpc.endswith("language/qpc")]

    def take(self, table: dict[int, int], devices: tuple[int, ...], amount: int, limit: int) -> bool:
        if any(d not in range(self.num_devices) or table.get(d, 0) + amount > limit for d in devices):
            return False
        for d in devices:
            table[d] = table.get(d, 0) + amount
        return True

    def give(self, table: dict[int, int], devices: tuple[int, ...], amount: int) -> None:
        for d in devices:
            table[d] -= amount


def build_fake_sdk(device: FakeDevice) -> tuple[types.ModuleType, types.ModuleType]:
    rt = types.ModuleType("qaicrt")
    api = types.ModuleType("QAicApi_pb2")
    for name, value in dict(FLOAT_TYPE=FLOAT_TYPE, FLOAT_16_TYPE=FLOAT_16_TYPE, INT64_I_TYPE=INT64_I_TYPE,
                            INT32_I_TYPE=INT32_I_TYPE, BUFFER_IO_TYPE_INPUT=INPUT,
                            BUFFER_IO_TYPE_OUTPUT=OUTPUT).items():
        setattr(api, name, value)

    class IoDesc:
        def ParseFromString(self, raw: bytes) -> None:  # noqa: N802 (protobuf's name)
            desc = json.loads(raw)
            ns = types.SimpleNamespace
            self.selected_set = ns(bindings=[ns(**b) for b in desc["bindings"]])
            self.allowed_shapes = [ns(shapes=[ns(type=t, dims=d) for t, d in shapes]) for shapes in desc["allowed"]]

    api.IoDesc = IoDesc
    rt.QStatus = types.SimpleNamespace(QS_SUCCESS=SUCCESS, QS_ERROR=FAILURE)

    class QBuffer:
        def __init__(self, data: bytes):
            self.data = bytes(data)
            self.size = len(self.data)

        def __bytes__(self) -> bytes:
            return self.data

    class Qpc:
        def __init__(self, path: str):
            self.path = path
            program = json.loads((Path(path) / QPC_FILE).read_text())
            self.model = onnx.load(program["onnx"], load_external_data=False)
            self.onnx_path = program["onnx"]
            self.num_cores, self.num_devices = program["num_cores"], program["num_devices"]
            custom = program["custom_io"]
            values = [(v, INPUT) for v in self.model.graph.input] + [(v, OUTPUT) for v in self.model.graph.output]
            self.bindings = []
            for index, (value, direction) in enumerate(values):
                elem = value.type.tensor_type.elem_type
                kind = FLOAT_16_TYPE if custom.get(value.name) == "float16" else ONNX_TO_DEVICE[elem]
                dims = [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]
                self.bindings.append(dict(name=value.name, index=index, dir=direction, type=kind, onnx=elem,
                                          symbolic=dims))
            self.allowed = []
            for spec in program["specializations"]:
                symbols = {k: int(v) for k, v in spec.items()}
                self.allowed.append([(b["type"], [symbols[d] if isinstance(d, str) else d for d in b["symbolic"]])
                                     for b in self.bindings])
            self.output_names = {b["name"] for b in self.bindings if b["dir"] == OUTPUT}
            # Device memory: declared, else the weights (ONNX file and external data) and the retained state.
            onnx_file = Path(self.onnx_path)
            external = {entry.value for t in self.model.graph.initializer for entry in t.external_data
                        if entry.key == "location"}
            weights = onnx_file.stat().st_size + sum((onnx_file.parent / name).stat().st_size for name in external)
            retained = sum(math.prod(dims) * np.dtype(DEVICE_DTYPE[t]).itemsize
                           for b, (t, dims) in zip(self.bindings, self.allowed[0])
                           if b["dir"] == INPUT and b["name"] + RETAINED in self.output_names)
            self.size = program["size_bytes"] or weights + retained

        def getIoDescriptor(self):  # noqa: N802
            first = self.allowed[0]
            bindings = [dict(name=b["name"], index=b["index"], dir=b["dir"], type=b["type"], dims=dims,
                             size=np.dtype(DEVICE_DTYPE[b["type"]]).itemsize * math.prod(dims))
                        for b, (_, dims) in zip(self.bindings, first)]
            return SUCCESS, json.dumps({"bindings": bindings, "allowed": self.allowed}).encode()

    class QAicProgramProperties:
        __slots__ = ("dataPathTimeoutMs", "devMapping")  # a fixed set of fields, as in the SDK's binding

        def __init__(self):
            self.dataPathTimeoutMs, self.devMapping = 0, ""

    class Context:
        def __init__(self, devices=None):
            self.devices = tuple(devices or ())

    class Program:
        def __init__(self, context, device_id, qpc: Qpc, properties):
            self.qpc = qpc
            mapped = tuple(int(d) for d in properties.devMapping.split(":")) if properties.devMapping else ()
            self.devices = mapped if device_id is None else (device_id,)
            assert (device_id is None) == bool(mapped), "one device id, or a devMapping of several (QEfficient)"
            assert set(self.devices) <= set(context.devices), "the context spans the program's devices"
            device.timeouts.append(properties.dataPathTimeoutMs)
            options = ort.SessionOptions()
            options.log_severity_level = 3
            self.session = ort.InferenceSession(qpc.onnx_path, options, providers=["CPUExecutionProvider"])
            self.state: dict[str, np.ndarray] = {}  # retained inputs, in device dtype
            self.loaded = self.active = False

        def _event(self, what: str) -> None:
            device.events.append((what, self.qpc.path, self.devices))

        def load(self):
            share = -(-self.qpc.size // self.qpc.num_devices)  # a multi-device program splits over its devices
            if self.loaded or len(self.devices) != self.qpc.num_devices or \
                    not device.take(device.memory_used, self.devices, share, device.memory):
                return FAILURE
            self.loaded = True
            self._event("load")
            return SUCCESS

        def unload(self):
            if self.active or not self.loaded:
                return FAILURE
            device.give(device.memory_used, self.devices, -(-self.qpc.size // self.qpc.num_devices))
            self.loaded = False
            self._event("unload")
            return SUCCESS

        def activate(self):
            if not self.loaded or self.active or \
                    not device.take(device.cores_used, self.devices, self.qpc.num_cores, device.cores):
                return FAILURE
            self.active = True
            self._event("activate")
            return SUCCESS

        def deactivate(self):
            if not self.active:
                return FAILURE
            device.give(device.cores_used, self.devices, self.qpc.num_cores)
            self.active = False
            self._event("deactivate")
            return SUCCESS

    class ExecObj:
        def __init__(self, context, program: Program):
            self.program = program
            self.results: list[bytes] = []

        def setData(self, buffers, dims):  # noqa: N802
            self.buffers, self.dims = list(buffers), list(dims.items)
            qpc = self.program.qpc
            device.calls.append(Call(qpc.path,
                                     {b["name"]: buffers[b["index"]].size for b in qpc.bindings if b["dir"] == INPUT},
                                     {}, {b["name"]: list(dims.items[b["index"]][1]) for b in qpc.bindings}))
            return SUCCESS

        def waitForCompletion(self):  # noqa: N802
            program, qpc = self.program, self.program.qpc
            given = {b["name"]: list(self.dims[b["index"]][1]) for b in qpc.bindings
                     if b["dir"] == INPUT and self.buffers[b["index"]].size}
            matching = [a for a in qpc.allowed
                        if all(given[b["name"]] == dims for b, (_, dims) in zip(qpc.bindings, a) if b["name"] in given)]
            if not program.active or not matching:
                return FAILURE  # the device finds no specialization for these buffers
            feeds = {}
            for b in qpc.bindings:
                if b["dir"] != INPUT:
                    continue
                buffer = self.buffers[b["index"]]
                if buffer.size:
                    value = np.frombuffer(buffer.data, DEVICE_DTYPE[b["type"]]).reshape(given[b["name"]])
                    if b["name"] + RETAINED in qpc.output_names:  # an upload replaces the device's copy
                        program.state[b["name"]] = value
                elif b["name"] in program.state:
                    value = program.state[b["name"]]
                else:
                    return FAILURE  # skipped an input the device never received
                feeds[b["name"]] = value.astype(ONNX_DTYPE[b["onnx"]])
            outputs = dict(zip([o.name for o in program.session.get_outputs()], program.session.run(None, feeds)))
            self.results = [b"" for _ in qpc.bindings]
            for b in qpc.bindings:
                if b["dir"] != OUTPUT:
                    continue
                value = outputs[b["name"]].astype(DEVICE_DTYPE[b["type"]])
                if b["name"].endswith(RETAINED):
                    program.state[b["name"][: -len(RETAINED)]] = value
                buffer, dims = self.buffers[b["index"]], list(self.dims[b["index"]][1])
                if buffer.size:
                    if dims != list(value.shape) or buffer.size != value.nbytes:
                        return FAILURE  # output buffer of the wrong size
                    self.results[b["index"]] = value.tobytes()
                device.calls[-1].to_host[b["name"]] = len(self.results[b["index"]])
            return SUCCESS

        def getData(self):  # noqa: N802
            return SUCCESS, [QBuffer(r) for r in self.results]

    class BufferDimensionsVecRef:
        def __init__(self, items):
            self.items = [(int(size), list(dims)) for size, dims in items]

    class Queue:
        def __init__(self, context, device_id):
            assert device_id in context.devices, "the queue sits on one of the context's devices"

        def enqueue(self, exec_obj):
            return SUCCESS

    rt.QBuffer, rt.Qpc, rt.Program, rt.ExecObj, rt.Queue = QBuffer, Qpc, Program, ExecObj, Queue
    rt.BufferDimensionsVecRef, rt.Context, rt.QAicProgramProperties = BufferDimensionsVecRef, Context, QAicProgramProperties
    rt.QIDList = list
    return rt, api


# --------------------------------------------------------------------------------------------------
# fixtures


def export_tiny(root: Path, full_batch_size: int | None, family: str = "qwen2_5_vl") -> Path:
    checkpoint = save_tiny_checkpoint(family, root / "checkpoint", seed=0, **FAMILY_CHECKPOINT.get(family, {}))
    out = root / "export"
    options = {**EXPORT, **FAMILY_EXPORT.get(family, {})}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        export_checkpoint(checkpoint, out, ExportOptions(**options, full_batch_size=full_batch_size))
    return out


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict[str, Path]:
    """A plain and a continuous-batching export, and continuous-batching Qwen3.5 and Qwen3.5-MoE ones (linear-attention
    layers: conv and recurrent state kept on the device beside the KV cache; sparse MLPs, routers in the
    node-precision file); QPC folders not yet "compiled"."""
    return {"plain": export_tiny(tmp_path_factory.mktemp("plain"), None),
            "cb": export_tiny(tmp_path_factory.mktemp("cb"), FULL_BATCH),
            "qwen3_5_cb": export_tiny(tmp_path_factory.mktemp("qwen3_5_cb"), FULL_BATCH, "qwen3_5"),
            "qwen3_5_moe_cb": export_tiny(tmp_path_factory.mktemp("qwen3_5_moe_cb"), FULL_BATCH, "qwen3_5_moe")}


@pytest.fixture(scope="module")
def compiled(exports) -> dict[str, Path]:
    for export in exports.values():
        for graph in ("encoder", "pruning_evs", "pruning_vidcom2", "language"):
            fake_compile(export, graph)
    return exports


@pytest.fixture(scope="module")
def video_npy(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("video") / "clip.npy"
    np.save(path, moving_square_video(8, 120, 200, seed=3))
    return path


@pytest.fixture
def device(monkeypatch) -> FakeDevice:
    """The fake SDK in sys.modules for one test; its record of every setData call."""
    fake = FakeDevice()
    rt, api = build_fake_sdk(fake)
    monkeypatch.setitem(sys.modules, "qaicrt", rt)
    monkeypatch.setitem(sys.modules, "QAicApi_pb2", api)
    return fake


def engine_for(bundle, backend: str, prefill_seq_len: int | None = None) -> Engine:
    m = bundle.manifest
    config = EngineConfig(prefill_seq_len or m.prefill_seq_len, m.ctx_len, m.user_vision_size,
                          m.video_pruning_rate, max_new_tokens=DECODE_STEPS)
    vision, language = sessions_for(bundle, backend)
    return Engine(bundle.family, vision, language, config)


def generate(bundle, engine: Engine, video_npy: Path):
    prompt = engine.prepare(video_question_pieces(bundle.tokenizer, QUESTION, bundle.family.token_strings), [video_from_file(video_npy, bundle)])
    return engine.generate(prompt, eos_ids=stop_ids(bundle))


# --------------------------------------------------------------------------------------------------
# errors


def test_missing_sdk_names_the_sdk_and_the_fix(exports, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "qaicrt", None)  # import fails, as on a machine without the SDK
    monkeypatch.setitem(sys.modules, "QAicApi_pb2", None)
    bundle = open_export(exports["plain"])
    with pytest.raises(ValueError, match=r"Apps SDK.*qaicrt.*qeff-evs compile"):
        sessions_for(bundle, "qaic")
    with pytest.raises(ValueError, match=str(tmp_path / "dev" / "python")):
        qaic_sessions(bundle, sdk_root=tmp_path)


def test_missing_qpc_folder_says_to_compile(exports, device, tmp_path):
    import shutil

    copy = tmp_path / "export"
    shutil.copytree(exports["plain"], copy, ignore=shutil.ignore_patterns("*qpc"))
    with pytest.raises(ValueError, match=r"no compiled encoder QPC .*qeff-evs compile"):
        sessions_for(open_export(copy), "qaic")
    fake_compile(copy, "encoder")
    with pytest.raises(ValueError, match=r"no compiled pruning_evs QPC"):
        sessions_for(open_export(copy), "qaic")
    fake_compile(copy, "pruning_evs")  # the default method's: a deployment loads only its method's graph
    with pytest.raises(ValueError, match=r"no compiled language QPC"):
        sessions_for(open_export(copy), "qaic")
    assert device.calls == []


# --------------------------------------------------------------------------------------------------
# results and buffer traffic


@pytest.mark.parametrize("kind", ["plain", "cb", "qwen3_5_cb", "qwen3_5_moe_cb"])
def test_tokens_equal_onnx_runtime_backend(compiled, device, video_npy, kind):
    bundle = open_export(compiled[kind])
    expected = generate(bundle, engine_for(bundle, "ort"), video_npy)
    got = generate(bundle, engine_for(bundle, "qaic"), video_npy)
    assert got.generated_token_ids == expected.generated_token_ids
    assert got.prompt_token_ids == expected.prompt_token_ids
    assert got.kept_tokens_per_frame == expected.kept_tokens_per_frame
    # fp16 vision rows and KV on the device: logits agree to fp16 accuracy, not to 1e-4.
    np.testing.assert_allclose([v for _, v in got.prefill_top_logits], [v for _, v in expected.prefill_top_logits],
                               atol=2e-2)
    assert len(got.generated_token_ids) > 1  # decode calls ran, not only the prefill


def language_call_bytes(shape, seq_len: int, rows: int, continuous_batching: bool) -> tuple[dict, dict]:
    """``(host->device, device->host)`` bytes per binding of one language call of ``rows`` x ``seq_len`` tokens:
    the per-call inputs (int64; logits_rows where the graph takes it), a prefill's window of vision rows (fp16),
    the logits (fp32) and image_idx_output.
    No term depends on ``ctx_len``: a KV buffer crossing the link would break the equality."""
    up = {"input_ids": 8 * rows * seq_len, "position_ids": 8 * 4 * rows * seq_len, "image_idx": 8}
    if continuous_batching:
        up["batch_index"] = 8 * rows
    if shape.logits_rows:  # one row on the card: its specializations all compute one
        up["logits_rows"] = 8
    if seq_len > 1:  # prefill: its own window of U rows (decode keeps the device's copy)
        up["vision_embeds"] = 2 * shape.vision_size * shape.hidden
        for name, levels in shape.extras.items():  # the family's extra rows, windowed alike
            up[name] = 2 * levels * shape.vision_size * shape.hidden
    return up, {"logits": 4 * rows * shape.vocab, "image_idx_output": 8}


def moved(table: dict[str, int]) -> dict[str, int]:
    return {name: size for name, size in table.items() if size}


@pytest.mark.parametrize("kind", ["plain", "cb", "qwen3_5_cb", "qwen3_5_moe_cb"])
def test_kv_goes_up_once_per_load_and_each_call_moves_only_its_inputs(compiled, device, video_npy, kind):
    bundle = open_export(compiled[kind])
    engine = engine_for(bundle, "qaic")
    shape, prefill_len = bundle.language_shape, bundle.manifest.prefill_seq_len
    # Every retained input but the vision window, at its device size (fp16 per custom_io.yaml, else fp32).
    custom_io = read_custom_io_yaml(compiled[kind] / "language" / "custom_io.yaml")
    state_bytes = {name: (2 if custom_io.get(name) == "float16" else 4) * math.prod(dims)
                   for name, dims in state_shapes(shape).items() if name != "vision_embeds" and name not in shape.extras}
    assert len(state_bytes) == 2 * len(shape.kv_layer_indices) + sum(len(s.layers) for s in shape.layer_states)
    prefill_bytes = language_call_bytes(shape, prefill_len, 1, shape.continuous_batching)
    decode_bytes = language_call_bytes(shape, 1, shape.decode_rows, shape.continuous_batching)
    for request in range(2):  # the second request finds the first one's KV on the device: nothing re-zeroed
        start = len(device.language_calls())
        result = generate(bundle, engine, video_npy)
        calls = device.language_calls()[start:]
        prefill, decode = calls[: result.num_prefill_chunks], calls[result.num_prefill_chunks:]
        assert len(decode) == len(result.generated_token_ids) - 1 > 0
        for number, call in enumerate(calls):
            up, down = prefill_bytes if call in prefill else decode_bytes
            if request == 0 and number == 0:  # the first call after the program's load: zeros, once
                up = {**up, **state_bytes}
            assert moved(call.to_device) == up, (request, number)
            assert moved(call.to_host) == down, (request, number)  # *_RetainedState never comes back
        assert [c.dims["input_ids"][1] for c in prefill] == [prefill_len] * len(prefill)
    # Per request: the video's 4 temporal patches in encoder calls of 2, then the EVS ranking once.
    encoder_calls = [c for c in device.calls if c.qpc.endswith("vision/encoder_qpc")]
    evs_calls = [c for c in device.calls if c.qpc.endswith("vision/pruning_evs_qpc")]
    assert (len(encoder_calls), len(evs_calls)) == (2 * 2, 2)
    grid_height, grid_width = encoder_calls[0].dims["pixel_values"]
    assert encoder_calls[0].to_device["pixel_values"] == 2 * grid_height * grid_width  # fp16 per custom_io.yaml
    assert moved(encoder_calls[0].to_host) == {"vision_embeds": 2 * math.prod(encoder_calls[0].dims["vision_embeds"])}
    rows, hidden = evs_calls[0].dims["merged_embeds"]
    assert evs_calls[0].to_device["merged_embeds"] == 2 * rows * hidden


def test_unserved_shape_lists_the_compiled_ones(compiled, device, video_npy):
    bundle = open_export(compiled["plain"])
    engine = engine_for(bundle, "qaic", prefill_seq_len=16)  # the QPC was compiled for chunks of 32
    prompt = engine.prepare(video_question_pieces(bundle.tokenizer, QUESTION, bundle.family.token_strings), [video_from_file(video_npy, bundle)])
    before = len(device.calls)
    with pytest.raises(ValueError, match=r"no compiled specialization .*input_ids \(1, 16\)") as error:
        engine.generate(prompt)
    message = str(error.value)
    assert "input_ids (1, 32)" in message and "input_ids (1, 1)" in message
    assert "past_key.0" not in message  # fixed retained state that fits every entry is not listed
    assert len(device.calls) == before  # refused on the host, nothing reached the device


def test_qpc_for_another_ctx_len_is_refused(compiled, device):
    bundle = open_export(compiled["plain"])
    program = QaicProgram(qpc_dir(bundle, "language"), load_sdk())
    with pytest.raises(ValueError, match=r"compiled for past_key.0 of shape \(1, 2, 256, 16\).*qeff-evs compile"):
        QaicLanguageSession(program, replace(bundle.language_shape, ctx_len=128))


def test_serving_engine_tokens_equal_onnx_runtime(compiled, device, video_npy):
    bundle = open_export(compiled["cb"])
    video = video_from_file(video_npy, bundle)
    questions = ("What happens in this video?", "Describe the moving square.")

    def serve(backend: str) -> dict[str, list[int]]:
        engine = build_serving_engine(bundle, backend)
        for i, question in enumerate(questions):
            engine.add_request(ServeRequest(f"r{i}", video_question_pieces(bundle.tokenizer, question, bundle.family.token_strings), [video],
                                            max_new_tokens=DECODE_STEPS - 2 * i))
        return engine.run_to_completion()

    expected = serve("ort")
    got = serve("qaic")
    assert got == expected
    decode_batches = {c.dims["input_ids"][0] for c in device.language_calls() if c.dims["input_ids"][1] == 1}
    assert decode_batches == {FULL_BATCH}  # decode always runs the compiled width, padded when needed
