"""The vLLM platform that serves qeff-evs exports (active while ``QEFF_EVS_BACKEND`` is set).

vLLM's scheduler, API server, detokenizer and sampler run unchanged; this platform points vLLM at our
worker (which runs the export's sessions on the chosen backend), turns off what only applies to
torch models (compilation, CUDA graphs), and refuses at start-up any setting the export cannot serve.

KV accounting: the worker declares one KV block per exported KV row, each as long as the model
(``block_size = max_model_len``), so vLLM's block pool admits at most as many running requests as the
export has rows, a request never asks for a second block, and vLLM therefore never preempts one (a
preemption would need a block that cannot exist). Prefix caching is refused, so blocks are never shared.
"""

from __future__ import annotations

from pathlib import Path

import torch
from vllm.platforms.interface import Platform, PlatformEnum

from qeff_evs.manifest import read_manifest
from qeff_evs.vllm.data_parallel import data_parallel_problems, record_local_ranks
from qeff_evs.vllm.ec_config import ec_refusals, ec_worker_class
from qeff_evs.vllm.limits import ServingSettings, refusals, served_pruning
from qeff_evs.vllm.plugin import BACKEND_ENV, active_backend, logger

WORKER_CLASS = "qeff_evs.vllm.worker.QeffEvsWorker"


class QeffEvsPlatform(Platform):
    _enum = PlatformEnum.OOT
    device_name = "cpu"  # the host side: sessions own their device (ORT on CPU, a QAIC card, torch's device)
    device_type = "cpu"
    dispatch_key = "CPU"
    dist_backend = "gloo"

    def is_cpu(self) -> bool:
        # The host vLLM runs on is a CPU (sessions own their device); vLLM's shutdown would otherwise
        # ask an accelerator that does not exist to empty its cache.
        return True

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return f"qeff-evs ({active_backend()})"

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        import psutil

        return psutil.virtual_memory().total

    @classmethod
    def is_pin_memory_available(cls) -> bool:
        return False

    @classmethod
    def inference_mode(cls):
        return torch.no_grad()

    @classmethod
    def pre_register_and_update(cls, parser=None) -> None:
        # Exports never serve prefix caching (start-up refuses it): off unless asked for, so `vllm serve`
        # needs no --no-enable-prefix-caching. Offline LLM(...) takes no parser and passes it itself.
        if parser is not None:
            parser.set_defaults(enable_prefix_caching=False)

    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        model_config = vllm_config.model_config
        if model_config is None:
            return
        export_dir = Path(model_config.model)
        manifest = read_manifest(export_dir)
        scheduler, cache, parallel = vllm_config.scheduler_config, vllm_config.cache_config, vllm_config.parallel_config
        mm = model_config.multimodal_config
        settings = ServingSettings(
            max_num_seqs=scheduler.max_num_seqs, max_model_len=model_config.max_model_len,
            video_pruning_rate=None if mm is None else mm.video_pruning_rate,
            video_pruning_method=served_pruning(mm).method,
            enable_prefix_caching=bool(cache.enable_prefix_caching),
            tensor_parallel_size=parallel.tensor_parallel_size, pipeline_parallel_size=parallel.pipeline_parallel_size,
            speculative=vllm_config.speculative_config is not None)
        record_local_ranks(vllm_config)
        problems = refusals(settings, manifest) + ec_refusals(vllm_config) + data_parallel_problems(vllm_config)
        if problems:
            raise ValueError(f"{BACKEND_ENV}={active_backend()}: the export {export_dir} cannot serve these settings:\n"
                             + "\n".join(f"  - {p}" for p in problems))

        from vllm.config import CompilationMode, CUDAGraphMode

        parallel.worker_cls = ec_worker_class(vllm_config) or WORKER_CLASS
        parallel.distributed_executor_backend = "uni"
        vllm_config.compilation_config.mode = CompilationMode.NONE
        vllm_config.compilation_config.cudagraph_mode = CUDAGraphMode.NONE
        scheduler.async_scheduling = False
        cache.block_size = model_config.max_model_len  # one block per request: see the module docstring
        if Path(model_config.tokenizer) == export_dir:  # no --tokenizer given: the export's own
            model_config.tokenizer = str(manifest.path(export_dir, "tokenizer"))
        pruning = served_pruning(mm)
        logger.info("qeff-evs serves %s (%s, %s pruning at q=%s) on the %s backend: %d KV rows, chunks of %d tokens",
                    export_dir, manifest.family, pruning.method, pruning.rate, active_backend(),
                    manifest.language_shape.full_batch_size, manifest.prefill_seq_len)

    @classmethod
    def validate_request(cls, processed_inputs, params) -> None:
        """Refuse, per request (a 400), what the worker does not do, instead of ignoring it."""
        from vllm.sampling_params import SamplingParams

        if not isinstance(params, SamplingParams):
            raise ValueError("qeff-evs exports generate text; pooling requests are not supported")
        if params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs are not supported by qeff-evs exports (the graphs return the last "
                             "position's logits only); drop prompt_logprobs")
        if params.structured_outputs is not None:
            raise ValueError("structured outputs (guided decoding) are not supported by the qeff-evs worker; drop "
                             "the response_format / structured_outputs")
