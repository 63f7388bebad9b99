"""The sessions of a chosen backend (ONNX Runtime, PyTorch reference, QAIC) over an opened export: the vision
pipeline, the language session, or both."""

from __future__ import annotations

from qeff_evs.manifest import AUDIO_ENCODER, IMAGE_ENCODER, LANGUAGE_DECODE, pruning_graph
from qeff_evs.runtime.backends.openvino import PRECISIONS as OPENVINO_PRECISIONS
from qeff_evs.runtime.backends.ort import OrtEncoderSession, OrtLanguageSession, OrtPruningSession
from qeff_evs.runtime.backends.torch_reference import TorchEncoderSession, TorchLanguageSession, TorchPruningSession
from qeff_evs.runtime.backends.vision import VisionPipeline
from qeff_evs.runtime.export_bundle import ExportBundle

BACKENDS = ("ort", *OPENVINO_PRECISIONS, "torch", "qaic")


def _check_device_ids(backend: str, device_ids) -> None:
    if device_ids is not None and backend != "qaic":
        raise ValueError(f"device ids place the programs of the qaic backend on AI 100 devices; the {backend} "
                         "backend does not use them: drop --device-ids (or QEFF_EVS_DEVICE_IDS)")


def vision_pipeline(bundle: ExportBundle, backend: str, device: str | None = None,
                    checkpoint=None, device_ids=None, method: str | None = None) -> VisionPipeline:
    """The encoder and the pruning sessions of ``backend`` over the export, at its frames per call and frame
    buckets: on ORT and torch every method the export carries (a request may choose its own), on QAIC
    ``method``'s program (default: the export's method).

    ``device_ids`` (qaic only, ``placement.DeviceIdsSpec``): the devices each program opens on."""
    m, root = bundle.manifest, bundle.export_dir
    _check_device_ids(backend, device_ids)
    method = m.video_pruning_method if method is None else method
    problem = m.method_refusal(method)
    if problem:
        raise ValueError(problem)
    methods = runnable_methods(bundle, backend, method)
    tiled, audio = IMAGE_ENCODER in m.files, AUDIO_ENCODER in m.files
    image_encoder = audio_encoder = None
    if backend == "ort":
        encoder = OrtEncoderSession(m.path(root, "encoder"), m.weight_dtype)
        if tiled:
            image_encoder = OrtEncoderSession(m.path(root, IMAGE_ENCODER), m.weight_dtype)
        if audio:
            audio_encoder = OrtEncoderSession(m.path(root, AUDIO_ENCODER), m.weight_dtype)
        pruning = {name: OrtPruningSession(m.path(root, pruning_graph(name))) for name in methods}
    elif backend in OPENVINO_PRECISIONS:
        from qeff_evs.runtime.backends.openvino import OpenVinoEncoderSession, OpenVinoPruningSession

        encoder = OpenVinoEncoderSession(m.path(root, "encoder"), OPENVINO_PRECISIONS[backend])
        if tiled:
            image_encoder = OpenVinoEncoderSession(m.path(root, IMAGE_ENCODER), OPENVINO_PRECISIONS[backend])
        if audio:
            audio_encoder = OpenVinoEncoderSession(m.path(root, AUDIO_ENCODER), OPENVINO_PRECISIONS[backend])
        pruning = {name: OpenVinoPruningSession(m.path(root, pruning_graph(name))) for name in methods}
    elif backend == "torch":
        from qeff_evs.models.checkpoint import load_checkpoint

        checkpoint = checkpoint or load_checkpoint(m.model_dir)
        encoder = TorchEncoderSession(bundle.family.encoder(checkpoint.model), device)
        if tiled:
            image_encoder = TorchEncoderSession(bundle.family.image_encoder(checkpoint.model), device)
        if audio:
            audio_encoder = TorchEncoderSession(bundle.family.audio_encoder(checkpoint.model), device)
        pruning = {name: TorchPruningSession(bundle.family.pruning_ranking(name), device) for name in methods}
    elif backend == "qaic":
        from qeff_evs.runtime.backends.qaic import qaic_vision_pipeline

        return qaic_vision_pipeline(bundle, device_ids, method=method)
    else:
        raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    return VisionPipeline(bundle.family, encoder, pruning, m.frames_per_call, m.temporal_patch_buckets,
                          image_encoder, tiled, audio_encoder, m.audio_buckets)


def runnable_methods(bundle: ExportBundle, backend: str, method: str | None = None) -> tuple[str, ...]:
    """The pruning methods a deployment of ``backend`` runs, the served ``method`` first: every method the export
    carries, except on QAIC, where each would be a program placed on a device and only the served one is loaded."""
    m = bundle.manifest
    method = m.video_pruning_method if method is None else method
    if backend == "qaic":
        return (method,)
    return (method, *(name for name in m.video_pruning_methods if name != method))


def sessions_for(bundle: ExportBundle, backend: str, device: str | None = None, device_ids=None,
                 method: str | None = None):
    """``(VisionPipeline, language session)`` of ``backend`` over the export, the pipeline with ``method``'s
    pruning graph; ``device_ids`` as for :func:`vision_pipeline` (every program is loaded and activated once,
    here)."""
    _check_device_ids(backend, device_ids)
    if backend == "ort" or backend in OPENVINO_PRECISIONS:
        return vision_pipeline(bundle, backend, method=method), language_session(bundle, backend)
    if backend == "torch":
        from qeff_evs.models.checkpoint import load_checkpoint

        checkpoint = load_checkpoint(bundle.manifest.model_dir)
        return (vision_pipeline(bundle, backend, device, checkpoint, method=method),
                _torch_language(bundle, checkpoint, device))
    if backend == "qaic":
        from qeff_evs.runtime.backends.qaic import qaic_sessions

        return qaic_sessions(bundle, device_ids, method=method)
    raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")


def _torch_language(bundle: ExportBundle, checkpoint, device: str | None) -> TorchLanguageSession:
    from qeff_evs.models.language import ExportableLanguageGraph

    shape = bundle.language_shape
    language = ExportableLanguageGraph(
        bundle.family.language_graph(checkpoint.model, bundle.family.special_tokens().media_pads,
                                     shape.rope_positions, bundle.manifest.prefill_seq_len),
        continuous_batching=shape.continuous_batching, comp_ctx_lengths=bool(shape.comp_ctx_lengths),
        logits_rows=shape.logits_rows)
    return TorchLanguageSession(language, shape, device)


# Which calls a language session serves: both (one instance), or one side of prefill/decode disaggregation.
LANGUAGE_PROGRAMS = ("both", "prefill", "decode")


def language_session(bundle: ExportBundle, backend: str, device: str | None = None, device_ids=None,
                     programs: str = "both"):
    """The language session of ``backend`` over the export, alone (an instance that runs no vision graph:
    a prefill/decode instance of encoder disaggregation); ``device_ids`` as for :func:`vision_pipeline`.

    ``programs``: ``prefill`` or ``decode`` for one side of prefill/decode disaggregation. On ONNX Runtime a graph
    runs any length, so a side loads only the graph file its calls run: a prefill instance the language graph
    without an export's decode-only twin, a decode instance that twin where the export has one (Qwen3.5: the graph
    unrolled for the prefill length is never opened), else the language graph for its one-token calls."""
    m, root = bundle.manifest, bundle.export_dir
    _check_device_ids(backend, device_ids)
    if programs not in LANGUAGE_PROGRAMS:
        raise ValueError(f"language programs {programs!r}: choose one of {', '.join(LANGUAGE_PROGRAMS)}")
    if backend == "ort":
        decode = m.path(root, LANGUAGE_DECODE) if LANGUAGE_DECODE in m.files else None
        if programs == "prefill":
            return OrtLanguageSession(m.path(root, "language"), bundle.language_shape, None, m.weight_dtype)
        if programs == "decode":
            return OrtLanguageSession(decode or m.path(root, "language"), bundle.language_shape, None, m.weight_dtype)
        return OrtLanguageSession(m.path(root, "language"), bundle.language_shape, decode, m.weight_dtype)
    if backend in OPENVINO_PRECISIONS:
        from qeff_evs.runtime.backends.openvino import OpenVinoLanguageSession

        decode = m.path(root, LANGUAGE_DECODE) if LANGUAGE_DECODE in m.files else None
        return OpenVinoLanguageSession(decode if programs == "decode" and decode else m.path(root, "language"),
                                       bundle.language_shape, decode if programs == "both" else None,
                                       OPENVINO_PRECISIONS[backend])
    if backend == "torch":
        from qeff_evs.models.checkpoint import load_checkpoint

        return _torch_language(bundle, load_checkpoint(m.model_dir), device)
    if backend == "qaic":
        from qeff_evs.runtime.backends.qaic import qaic_language_session

        return qaic_language_session(bundle, device_ids)
    raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
