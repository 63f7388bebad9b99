"""Every vLLM symbol qeff-evs imports, subclasses or overrides, named once, and the one vLLM release it supports.

The plugin reaches vLLM only through this module (``from qeff_evs.vllm.surface import Scheduler``): each name
resolves lazily to the symbol of the row below, so importing this module imports no vLLM. Moving to the next vLLM
release is then a diff of this table (and of the code behind the rows that moved), and
``tests/test_vllm_surface.py`` names each row that release removed or changed: a missing module or attribute, or
a method whose parameters are no longer the ones the plugin calls or overrides.

Anything but :data:`SUPPORTED_VLLM` is refused at start-up, in one line (:func:`version_refusal`): a vLLM release
moves internals the plugin overrides (0.33 called the scheduler's prefix-hit hook with a new argument, 0.34 deleted
the model runner our sampler was built on), and a user must learn that before the first request, not from an
HTTP 500.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from importlib import metadata

SUPPORTED_VLLM = "0.34.0"
INSTALL_LINE = f"pip install --no-deps vllm=={SUPPORTED_VLLM} (or bash scripts/install.sh --vllm)"


@dataclass(frozen=True)
class VllmSymbol:
    """One vLLM symbol the plugin uses.

    ``module`` and ``attr`` say where vLLM 0.34 defines it (``attr`` may be dotted: a method of a class).
    ``parameters``: for a callable the plugin calls with keywords or overrides, the parameter names it relies on,
    in order, after ``self``/``cls`` (None: not checked). ``why``: what the plugin does with it.
    """

    module: str
    attr: str
    why: str
    parameters: tuple[str, ...] | None = None


def _s(module: str, attr: str, why: str, parameters: tuple[str, ...] | None = None) -> VllmSymbol:
    return VllmSymbol(module, attr, why, parameters)


# name used in qeff-evs -> where vLLM has it. Rows with a dotted attr are checked only (methods we override).
SYMBOLS: dict[str, VllmSymbol] = {
    # platform and worker
    "Platform": _s("vllm.platforms.interface", "Platform", "subclassed: the qeff-evs platform"),
    "PlatformEnum": _s("vllm.platforms.interface", "PlatformEnum", "the platform's kind (OOT)"),
    "Platform.check_and_update_config": _s("vllm.platforms.interface", "Platform.check_and_update_config",
                                           "overridden: start-up refusals", ("vllm_config",)),
    "Platform.validate_request": _s("vllm.platforms.interface", "Platform.validate_request",
                                    "overridden: per-request refusals", ("processed_inputs", "params")),
    "CompilationMode": _s("vllm.config", "CompilationMode", "compilation off: the graphs are ONNX"),
    "CUDAGraphMode": _s("vllm.config", "CUDAGraphMode", "CUDA graphs off"),
    "WorkerBase": _s("vllm.v1.worker.worker_base", "WorkerBase", "subclassed: the qeff-evs worker"),
    "CompilationTimes": _s("vllm.v1.worker.worker_base", "CompilationTimes", "what compile_or_warm_up_model returns"),
    "WorkerBase.execute_model": _s("vllm.v1.worker.worker_base", "WorkerBase.execute_model", "overridden",
                                   ("scheduler_output",)),
    "WorkerBase.sample_tokens": _s("vllm.v1.worker.worker_base", "WorkerBase.sample_tokens", "overridden",
                                   ("grammar_output",)),
    "FullAttentionSpec": _s("vllm.v1.kv_cache_interface", "FullAttentionSpec", "one KV block per exported row"),
    "set_random_seed": _s("vllm.utils.torch_utils", "set_random_seed", "--seed seeds the host as vLLM's workers do"),
    "Scheduler": _s("vllm.v1.core.sched.scheduler", "Scheduler", "subclassed: rows and failed requests"),
    "Scheduler._get_local_prefix_cache_hit": _s(
        "vllm.v1.core.sched.scheduler", "Scheduler._get_local_prefix_cache_hit",
        "overridden: a new request's row and its reusable prefix", ("request", "max_cache_hit_length")),
    "Scheduler.schedule": _s("vllm.v1.core.sched.scheduler", "Scheduler.schedule", "overridden: rows to the worker"),
    "Scheduler._free_request": _s("vllm.v1.core.sched.scheduler", "Scheduler._free_request",
                                  "overridden: a freed request's row keeps its history", ("request",)),
    "Scheduler.update_from_output": _s("vllm.v1.core.sched.scheduler", "Scheduler.update_from_output",
                                       "overridden: requests the worker failed",
                                       ("scheduler_output", "model_runner_output")),
    "SchedulerOutput": _s("vllm.v1.core.sched.output", "SchedulerOutput", "subclassed: carries the rows"),
    "ModelRunnerOutput": _s("vllm.v1.outputs", "ModelRunnerOutput", "subclassed: carries the failed requests"),
    "LogprobsTensors": _s("vllm.v1.outputs", "LogprobsTensors", "the sampler's logprobs, as vLLM's runner returns"),
    "KVConnectorOutput": _s("vllm.v1.outputs", "KVConnectorOutput", "the KV connector's step output"),
    "ECConnectorOutput": _s("vllm.v1.outputs", "ECConnectorOutput", "the EC connector's step output"),
    "make_empty_encoder_model_runner_output": _s("vllm.v1.outputs", "make_empty_encoder_model_runner_output",
                                                 "an encoder instance's step output"),
    "Request": _s("vllm.v1.request", "Request", "requests made outside vLLM's frontend (qeff-evs's driver)"),
    "Request.get_max_cache_hit_length": _s("vllm.v1.request", "Request.get_max_cache_hit_length",
                                           "bounds a reused row's prefix", ("bound",)),
    "RequestStatus": _s("vllm.v1.request", "RequestStatus", "the KV connector reads a request's state"),
    "SamplingParams": _s("vllm.sampling_params", "SamplingParams", "requests' sampling, checked and applied"),
    "VLLMValidationError": _s("vllm.exceptions", "VLLMValidationError", "a refused request: HTTP 400"),
    # sampling (Model Runner V2's custom logits processors)
    "LogitsProcessor": _s("vllm.v1.worker.gpu.sample.logits_processor", "LogitsProcessor",
                          "the custom logits processors' interface (--logits-processors)"),
    "LogitsContext": _s("vllm.v1.worker.gpu.sample.logits_processor", "LogitsContext",
                        "what a custom logits processor's apply is given"),
    "LogitsProcRequestState": _s("vllm.v1.worker.gpu.sample.logits_processor", "LogitsProcRequestState",
                                 "what a custom logits processor is built with"),
    "build_custom_logits_processors": _s("vllm.v1.worker.gpu.sample.logits_processor",
                                         "build_custom_logits_processors", "loads --logits-processors as vLLM does",
                                         ("vllm_config", "req_states", "is_pooling_model", "custom_logitsprocs")),
    # multimodal processing
    "ModelRegistry": _s("vllm", "ModelRegistry", "registers the export's interface classes"),
    "MULTIMODAL_REGISTRY": _s("vllm.multimodal", "MULTIMODAL_REGISTRY", "registers the export's processor"),
    "MultiModalFeatureSpec": _s("vllm.multimodal.inputs", "MultiModalFeatureSpec", "a media item of a request"),
    "MultiModalFieldConfig": _s("vllm.multimodal.inputs", "MultiModalFieldConfig", "the processor's fields"),
    "PlaceholderRange": _s("vllm.multimodal.inputs", "PlaceholderRange", "a media item's placeholder"),
    "MultiModalProcessorOnlyCache": _s("vllm.multimodal.cache.base", "MultiModalProcessorOnlyCache",
                                       "the processor cache vLLM keeps"),
    "MultiModalDataParser": _s("vllm.multimodal.parse", "MultiModalDataParser", "the processor's media parser"),
    "BaseDummyInputsBuilder": _s("vllm.multimodal.processing", "BaseDummyInputsBuilder", "subclassed"),
    "BaseMultiModalProcessor": _s("vllm.multimodal.processing", "BaseMultiModalProcessor", "subclassed"),
    "BaseProcessingInfo": _s("vllm.multimodal.processing", "BaseProcessingInfo", "subclassed"),
    "PromptReplacement": _s("vllm.multimodal.processing.processor", "PromptReplacement", "placeholders"),
    "PromptUpdateDetails": _s("vllm.multimodal.processing.processor", "PromptUpdateDetails", "placeholders"),
    "mm_input": _s("vllm.inputs.engine", "mm_input", "the processor's result"),
    "VIDEO_LOADER_REGISTRY": _s("vllm.multimodal.video", "VIDEO_LOADER_REGISTRY", "registers the video loaders"),
    "VideoLoader": _s("vllm.multimodal.video", "VideoLoader", "subclassed: the plugin's video loaders"),
    # KV connector
    "KVConnectorFactory": _s("vllm.distributed.kv_transfer.kv_connector.factory", "KVConnectorFactory",
                             "registers and builds qeff-evs's KV connector"),
    "KVConnectorBase_V1": _s("vllm.distributed.kv_transfer.kv_connector.v1.base", "KVConnectorBase_V1",
                             "subclassed: qeff-evs's KV connector"),
    "KVConnectorHandshakeMetadata": _s("vllm.distributed.kv_transfer.kv_connector.v1.base",
                                       "KVConnectorHandshakeMetadata", "the connector's handshake"),
    "KVConnectorMetadata": _s("vllm.distributed.kv_transfer.kv_connector.v1.base", "KVConnectorMetadata",
                              "the connector's per-step metadata"),
    "KVConnectorRole": _s("vllm.distributed.kv_transfer.kv_connector.v1.base", "KVConnectorRole",
                          "scheduler or worker side"),
    "KVConnectorBase_V1.may_load_async": _s("vllm.distributed.kv_transfer.kv_connector.v1.base",
                                            "KVConnectorBase_V1.may_load_async",
                                            "overridden: a pull waits for a free row", ("request",)),
    # EC connector
    "ECConnectorFactory": _s("vllm.distributed.ec_transfer.ec_connector.factory", "ECConnectorFactory",
                             "registers qeff-evs's EC connector"),
    "ECExampleConnector": _s("vllm.distributed.ec_transfer.ec_connector.example_connector", "ECExampleConnector",
                             "subclassed: qeff-evs's EC connector (files of kept rows)"),
    "ensure_ec_transfer_initialized": _s("vllm.distributed.ec_transfer", "ensure_ec_transfer_initialized",
                                         "the EC worker's connector"),
    "ensure_ec_transfer_shutdown": _s("vllm.distributed.ec_transfer", "ensure_ec_transfer_shutdown",
                                      "the EC worker's connector"),
    "get_ec_transfer": _s("vllm.distributed.ec_transfer", "get_ec_transfer", "the EC worker's connector"),
    "has_ec_transfer": _s("vllm.distributed.ec_transfer", "has_ec_transfer", "whether a step has EC work"),
    "init_distributed_environment": _s("vllm.distributed.parallel_state", "init_distributed_environment",
                                       "the EC worker's one-process group"),
    "ensure_model_parallel_initialized": _s("vllm.distributed.parallel_state", "ensure_model_parallel_initialized",
                                            "the EC worker's one-process group"),
}


def resolve(symbol: VllmSymbol):
    """The object ``symbol`` names in the installed vLLM (raises ImportError or AttributeError when it is gone)."""
    obj = importlib.import_module(symbol.module)
    for part in symbol.attr.split("."):
        obj = getattr(obj, part)
    return obj


def __getattr__(name: str):
    symbol = SYMBOLS.get(name)
    if symbol is None or "." in name:
        raise AttributeError(f"qeff_evs.vllm.surface has no vLLM symbol {name!r}: add its row to SYMBOLS")
    return resolve(symbol)


def installed_vllm() -> str | None:
    """The installed vLLM's version (its package metadata), or None when vLLM is not installed."""
    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return None


def version_refusal(installed: str | None) -> str | None:
    """The one line that refuses a vLLM other than the supported one; None for the supported release."""
    if installed == SUPPORTED_VLLM:
        return None
    return (f"qeff-evs serves through vLLM {SUPPORTED_VLLM} and vLLM {installed or '(none)'} is installed: the "
            f"plugin overrides vLLM internals that move between releases; {INSTALL_LINE}")
