"""The vLLM platform that serves qeff-evs exports (active while ``QEFF_EVS_BACKEND`` is set).

vLLM's scheduler, API server, detokenizer and sampler run unchanged; this platform points vLLM at our
worker (which runs the export's sessions on the chosen backend) and at vLLM's scheduler with one addition
(``engine/scheduler.py``), turns off what only applies to torch models (compilation, CUDA graphs), refuses at
start-up any setting the export cannot serve (``engine/limits.py``, ``settings/table.py``), and refuses per request, as
an HTTP 400, what a request asks that the worker cannot do (``validate_request``: ``settings/table.py`` for
sampling parameters, ``engine/request_checks.py`` for the prompt).

KV accounting: the worker declares one KV block per exported KV row, each as long as the model
(``block_size = max_model_len``), so vLLM's block pool admits at most as many running requests as the
export has rows, a request never asks for a second block, and vLLM therefore never preempts one (a
preemption would need a block that cannot exist). Blocks are never shared: vLLM's ``--enable-prefix-caching``
(on by default) turns on row reuse instead, the scheduler's own (``engine/scheduler.py``: a follow-up runs in the row
that holds its conversation so far, and only its tail is computed).
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import torch

from qeff_evs.manifest import read_manifest
from qeff_evs.vllm.engine.data_parallel import data_parallel_problems, record_local_ranks
from qeff_evs.vllm.ec_connector.config import ec_refusals, ec_worker_class
from qeff_evs.vllm.kv_connector.config import CONSUMER, PRODUCER, REMOTE_KEYS, kv_refusals, kv_role, kv_worker_class
from qeff_evs.vllm.engine.limits import ServingSettings, refusals, served_pruning
from qeff_evs.vllm.activation import BACKEND_ENV, active_backend, logger
from qeff_evs.vllm.engine.request_checks import RequestLimits, positions_problem, stray_media_pads
from qeff_evs.vllm.settings.table import engine_refusals, sampling_refusals
from qeff_evs.vllm.surface import Platform, PlatformEnum

WORKER_CLASS = "qeff_evs.vllm.engine.worker.QeffEvsWorker"
ROUTER_PD = "send requests through vllm-router --vllm-pd-disaggregation (or a proxy speaking its kv_transfer_params)"


def kv_role_refusals(role: str | None, params) -> list[str]:
    """What a request to one side of prefill/decode disaggregation cannot ask, one line each (an HTTP 400)."""
    transfer = (params.extra_args or {}).get("kv_transfer_params") or {}
    if role == PRODUCER and params.max_tokens != 1:
        return [f"max_tokens={params.max_tokens}: this instance is a kv_producer (prefill programs only): it computes "
                f"a prompt and one token; {ROUTER_PD}, which asks it for max_tokens 1"]
    if role == PRODUCER and not transfer.get("do_remote_decode"):
        return [f"kv_transfer_params {transfer or None}: this kv_producer hands each prompt's KV row to a decode "
                f"instance, asked with do_remote_decode true; {ROUTER_PD}"]
    missing = [key for key in REMOTE_KEYS if transfer.get(key) is None]
    if role == CONSUMER and (not transfer.get("do_remote_prefill") or missing):
        return [f"kv_transfer_params {transfer or None}: this instance is a kv_consumer (one-token programs only) and "
                f"computes no prompt; it needs a prefill instance's answer (do_remote_prefill with "
                f"{', '.join(REMOTE_KEYS)}); {ROUTER_PD}"]
    return []
SCHEDULER_CLASS = "qeff_evs.vllm.engine.scheduler.QeffEvsScheduler"


class QeffEvsPlatform(Platform):
    _enum = PlatformEnum.OOT
    device_name = "cpu"  # the host side: sessions own their device (ORT on CPU, a QAIC card, torch's device)
    device_type = "cpu"
    dispatch_key = "CPU"
    dist_backend = "gloo"
    # What requests must respect, set when vLLM builds its config in this process (check_and_update_config runs
    # in the API server's process too): vLLM calls validate_request with the request alone.
    request_limits: ClassVar[RequestLimits | None] = None
    # This instance's side of prefill/decode disaggregation (kv_producer, kv_consumer), or None.
    kv_role: ClassVar[str | None] = None

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
    def manual_seed_all(cls, seed: int) -> None:
        # The host's torch generator is the only one vLLM's sampler draws from here (set_random_seed seeded it).
        torch.manual_seed(seed)

    @classmethod
    def inference_mode(cls):
        return torch.no_grad()

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
            video_pruning_method=served_pruning(mm).method)
        # Before record_local_ranks: settings/table.py reads --device-ids only where the config is made (see there).
        ours = [f"{line} (the qeff-evs platform)" for line in engine_refusals(vllm_config)]
        record_local_ranks(vllm_config)
        if model_config.return_sampling_mask:  # vLLM accepts it with --logprobs-mode processed_logprobs
            ours.append("return_sampling_mask=True: the host sampler returns no sampling masks (vLLM's sampling-"
                        "distribution replay); remove it (the qeff-evs platform)")
        problems = (refusals(settings, manifest) + ec_refusals(vllm_config) + kv_refusals(vllm_config, active_backend())
                    + data_parallel_problems(vllm_config) + ours)
        if problems:
            raise ValueError(f"{BACKEND_ENV}={active_backend()}: the export {export_dir} cannot serve these settings:\n"
                             + "\n".join(f"  - {p}" for p in problems))

        from qeff_evs.vllm.surface import CompilationMode, CUDAGraphMode

        parallel.worker_cls = ec_worker_class(vllm_config) or kv_worker_class(vllm_config) or WORKER_CLASS
        cls.kv_role = kv_role(vllm_config)
        scheduler.scheduler_cls = SCHEDULER_CLASS
        parallel.distributed_executor_backend = "uni"
        vllm_config.compilation_config.mode = CompilationMode.NONE
        vllm_config.compilation_config.cudagraph_mode = CUDAGraphMode.NONE
        scheduler.async_scheduling = False
        cache.block_size = model_config.max_model_len  # one block per request: see the module docstring
        tokenizer_dir = manifest.path(export_dir, "tokenizer")
        if Path(model_config.tokenizer) == export_dir != tokenizer_dir:  # an older export (tokenizer/)
            model_config.tokenizer = str(tokenizer_dir)
        # vLLM's image loader refuses an image over VLLM_MAX_IMAGE_PIXELS with a ValueError (HTTP 400) right after
        # reading its header, but Pillow's own decompression-bomb check fires first above the same size and raises
        # an error vLLM answers with HTTP 500. Hand the limit to vLLM's check (the documented knob).
        from PIL import Image

        Image.MAX_IMAGE_PIXELS = None
        from qeff_evs.models.registry import family_class

        tokens, strings = manifest.special_tokens, family_class(manifest.family).token_strings
        # (Where one pad serves both, as Nemotron-H's <image> does, the image's name is the one kept.)
        names = {tokens.video_pad: strings.video, tokens.image_pad: strings.image}
        cls.request_limits = RequestLimits(names, manifest.language_shape.rope_positions, model_config.max_model_len)
        pruning = served_pruning(mm)
        logger.info("qeff-evs serves %s (%s, %s pruning at q=%s) on the %s backend: %d KV rows, chunks of %d tokens",
                    export_dir, manifest.family, pruning.method, pruning.rate, active_backend(),
                    manifest.language_shape.full_batch_size, manifest.prefill_seq_len)

    @classmethod
    def validate_request(cls, processed_inputs, params) -> None:
        """Refuse, per request (an HTTP 400), what the worker would not do or could not run.

        vLLM calls this in its frontend after its renderer and our processor made the prompt, before the
        request reaches the engine; nothing a request carries may raise in the worker.
        """
        from qeff_evs.vllm.surface import VLLMValidationError
        from qeff_evs.vllm.surface import SamplingParams

        from qeff_evs.vllm.processing.processor import POSITIONS_END

        if not isinstance(params, SamplingParams):
            raise VLLMValidationError("qeff-evs exports generate text; pooling requests are not supported")
        problems = sampling_refusals(params) + kv_role_refusals(cls.kv_role, params)
        if problems:
            raise VLLMValidationError("; ".join(problems))
        if processed_inputs.get("type") == "embeds":
            raise VLLMValidationError("prompt embeddings are not an input of qeff-evs exports (the language graph "
                                      "embeds token ids itself); send token ids or text", parameter="prompt_embeds")
        limits = cls.request_limits
        ids = processed_inputs["prompt_token_ids"]
        ranges = [r for placed in processed_inputs.get("mm_placeholders", {}).values() for r in placed]
        problem = stray_media_pads(ids, [(r.offset, r.length) for r in ranges], limits)
        if problem:
            raise VLLMValidationError(problem, parameter="messages")
        if cls.kv_role is not None and ranges and max(r.offset + r.length for r in ranges) >= len(ids):
            # A decode instance runs the prompt's last token as a one-token call, which merges no vision row.
            raise VLLMValidationError("the prompt ends inside a media item; under prefill/decode disaggregation a "
                                      "prompt ends with text (as chat templates end it): add text after the media",
                                      parameter="messages")
        end = processed_inputs[POSITIONS_END] if ranges else len(ids)  # text only: one position per token
        problem = positions_problem(end, len(ids), params.max_tokens, limits)
        if problem:
            raise VLLMValidationError(problem, parameter="max_tokens", value=params.max_tokens)
