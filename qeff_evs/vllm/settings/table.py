"""Every vLLM 0.34 engine argument and sampling parameter, and what qeff-evs does with it: one row each.

vLLM's own frontend, scheduler, sampler and detokenizer run unchanged around our worker, so most settings
are honoured by vLLM's own code; what configures vLLM's torch model runner (which the export's graphs
replace) or asks for something the graphs cannot do is refused, one line each: engine arguments at
start-up (:func:`engine_refusals`, called by the platform), sampling parameters per request
(:func:`sampling_refusals`, called by ``validate_request``: an HTTP 400). docs/settings.md's tables are
rendered from these rows (:func:`settings_table`), and ``tests/test_vllm_settings.py`` holds every row to
what it says: each refused row's example is refused with its line, each honoured row is accepted, and the
behaviour of the honoured sampling parameters is compared with vLLM's documentation on the graph's logits.

Verdicts:
  ``honoured``      vLLM's behaviour, through the plugin (``how`` says which part of vLLM does it);
  ``refused``       qeff-evs refuses it, one line (the platform at start-up, ``validate_request`` per request);
  ``vllm refuses``  vLLM 0.34 itself stops at start-up on this platform or export (its own message);
  ``no effect``     a performance knob of vLLM's torch model runner (kernel choice, compilation) that vLLM
                    resolves before qeff-evs can tell it was given; outputs are the graphs' either way.
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from qeff_evs.vllm.ec_connector.config import EC_WORKER_CLASS
from qeff_evs.vllm.kv_connector.config import KV_WORKER_CLASS
from qeff_evs.vllm.plugin import ADDITIONAL_CONFIG_KEYS, RANKS_KEY

HONOURED, REFUSED, VLLM_REFUSES, NO_EFFECT = "honoured", "refused", "vllm refuses", "no effect"
_UNSET = object()


@dataclass(frozen=True)
class Setting:
    """One engine argument (``EngineArgs`` field) or sampling parameter (``SamplingParams`` field)."""

    name: str
    verdict: str
    how: str  # honoured: which part of vLLM does it; refused: why (the client reads it); else: the reason
    read: Callable[[Any], Any] | None = None  # refused: the value in use, from VllmConfig / SamplingParams
    unused: tuple = (None,)  # refused: the values ``read`` gives when the setting is not in use
    example: Any = _UNSET  # a value that uses it (the tests set it; refused rows must be refused)
    test: str = ""  # the test that holds an honoured row to vLLM's documented behaviour
    via: str = ""  # refused through another row's check (vLLM turns this setting into that one)

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def refusal(self, source: Any) -> str | None:
        """The one-line refusal when ``source`` (a VllmConfig or SamplingParams) uses this setting."""
        if self.verdict != REFUSED or self.read is None:
            return None
        value = self.read(source)
        if isinstance(value, enum.Enum):
            value = value.name.lower() if self.verdict == REFUSED and isinstance(value.value, str) and not value.value \
                else value.value
        if any(value == u for u in self.unused):
            return None
        return f"{self.name}={value!r}: {self.how}"


def _path(dotted: str) -> Callable[[Any], Any]:
    def read(source: Any) -> Any:
        for part in dotted.split("."):
            if source is None:
                return None
            source = getattr(source, part)
        return source
    return read


def _h(name: str, how: str, test: str = "", example: Any = _UNSET) -> Setting:
    return Setting(name, HONOURED, how, example=example, test=test)


def _r(name: str, path: str | Callable[[Any], Any], why: str, example: Any, unused: tuple = (None,)) -> Setting:
    read = _path(path) if isinstance(path, str) else path
    return Setting(name, REFUSED, why, read=read, unused=unused, example=example)


def _v(name: str, why: str, example: Any) -> Setting:
    return Setting(name, VLLM_REFUSES, why, example=example)


def _n(name: str, why: str) -> Setting:
    return Setting(name, NO_EFFECT, why)


# --- reasons shared by many rows ---------------------------------------------------------------------
FRONTEND = "vLLM's own frontend (API server, renderer, tokenizer, media loading), unchanged"
SCHEDULER = "vLLM's own scheduler, unchanged (our worker runs whatever it schedules)"
OBSERVE = "vLLM's own logging / metrics / tracing, unchanged"
LOADING = "vLLM's own loading of config and tokenizer, unchanged (a local export folder, as any local model)"
WEIGHTS = ("loads torch weights, but an export's graphs are the model and its worker loads no weights; "
           "remove it")
RUNNER = ("configures vLLM's torch model runner (kernels, memory, compilation), which the export's graphs "
          "replace; remove it")
ONE_WORKER = ("an export runs as one worker per engine core over its own sessions (data parallel and encoder and "
              "prefill/decode disaggregation are served: --data-parallel-size, --ec-transfer-config, "
              "--kv-transfer-config); remove it")
DATA_PARALLEL = "vLLM's own data-parallel launch, unchanged (with --data-parallel-size)"
LORA = "only with --enable-lora, which is refused"
KV = ("the KV cache lives in the export's graphs: one KV row per request, sized by `qeff-evs export "
      "--full-batch-size/--ctx-len`, its precision fixed by the export (--kv-precision); remove it")
FEATURE = "a feature of vLLM's torch model runner that the export's graphs do not have; remove it"


# Tests that hold several rows (tests/test_vllm_settings.py checks that every named test exists).
RULE_TEST = "test_vllm_settings.py::test_sampling_parameter_follows_vllms_rule_on_the_graph_logits"
STRUCTURED_TEST = "test_vllm_settings.py::test_structured_output_is_a_choice_picked_on_the_graph_logits"
BUDGET_TEST = "test_vllm_settings.py::test_thinking_budget_forces_the_end_of_thinking"
SAMPLER_TEST = "test_vllm_plugin.py::test_vllm_sampler_runs_on_our_logits"
STOP_TEST = "test_vllm_settings.py::test_stop_strings_cut_the_text_as_vllm_documents"
PROCESSOR_TEST = "test_vllm_settings.py::test_custom_logits_processor_with_extra_args"
EPD_REFUSALS_TEST = "test_vllm_epd.py::test_what_encoder_disaggregation_cannot_serve_is_refused_one_line_each"
BENCH_TEST = "test_vllm_serve.py::test_vllm_bench_serve_runs_with_no_failed_request"
PD_TEST = "test_vllm_pd.py::test_tokens_equal_one_instance"
ROW_REUSE_TEST = "test_vllm_serve.py::test_a_follow_up_reuses_its_conversations_row_with_the_same_tokens"


def _default(path: str, value: Any) -> Callable[[Any], Any]:
    """``path`` with None read as ``value`` (settings vLLM leaves None until a later step resolves them)."""
    read = _path(path)
    return lambda c: value if read(c) is None else read(c)


def _as_list(name: str) -> Callable[[Any], Any]:
    """A parameter vLLM holds as an array, read as the list a request sent."""
    return lambda p: None if getattr(p, name) is None else getattr(p, name).tolist()


def _additional(key: str) -> Callable[[Any], Any]:
    return lambda c: (c.additional_config or {}).get(key)


def _user_device_ids(c) -> Any:
    """--device-ids as the user gave it, read where the config is made. vLLM later assigns each data-parallel
    rank's engine core ids of its own; by then the platform has recorded RANKS_KEY in additional_config."""
    return None if RANKS_KEY in (c.additional_config or {}) else c.parallel_config.assigned_physical_gpu_ids


def _user_mm_embeds(c) -> Any:
    """--enable-mm-embeds, except where vLLM turns it on itself: an EC or KV consumer may be sent media as
    metadata only (the encoder's or prefill instance's outputs)."""
    if c.ec_transfer_config is not None and c.ec_transfer_config.is_ec_consumer:
        return None
    if c.kv_transfer_config is not None and c.kv_transfer_config.is_kv_consumer:
        return None
    return _path("model_config.multimodal_config.enable_mm_embeds")(c)


def _processor_device(c) -> Any:
    """--mm-processor-device: vLLM hands it to the HF processor as mm_processor_kwargs["device"]."""
    kwargs = _path("model_config.multimodal_config.mm_processor_kwargs")(c) or {}
    return kwargs.get("device")


# Keys vLLM itself puts into additional_config from engine arguments (their own rows refuse them).
VLLM_ADDITIONAL_KEYS = ("gdn_prefill_backend", "kda_prefill_backend", "kda_decode_backend")


def _unknown_additional_keys(c) -> dict | None:
    """The --additional-config entries neither qeff-evs (plugin.ADDITIONAL_CONFIG_KEYS) nor vLLM's own rows read."""
    known = ADDITIONAL_CONFIG_KEYS + VLLM_ADDITIONAL_KEYS
    return {k: v for k, v in (c.additional_config or {}).items() if k not in known} or None


ENGINE_SETTINGS: tuple[Setting, ...] = (
    _h("model", "the export folder is the model path (config.json, tokenizer, generation_config.json at its top)",
       "test_vllm_serve.py::test_video_url_equals_qeff_evs_run"),
    _v("enable_return_routed_experts", "vLLM: 'AuxOutput Connector only supports MoE models'", True),
    _v("return_sampling_mask", "vLLM: 'sampling distribution replay requires logprobs_mode='processed_logprobs''; with "
       "it, the platform refuses it (the host sampler returns no sampling masks)", True),
    _r("model_weights", "model_config.model_weights", WEIGHTS, "/weights", unused=("",)),
    _h("served_model_name", FRONTEND, "test_vllm_serve.py (every request names the served model 'tiny')", "tiny"),
    _h("tokenizer", LOADING + "; default: the export's own tokenizer at its top",
       "test_vllm_settings.py::test_export_folder_is_a_model_folder"),
    _v("hf_config_path", "vLLM inspects the config's Hugging Face architecture and fails (no vLLM model class "
       "here); the export's config.json is the one to use", "CHECKPOINT"),
    _r("runner", "model_config.runner", "an export generates text; pooling runners are not served; remove it",
       "pooling", unused=("auto", "generate")),
    _r("convert", "model_config.convert", "an export generates text; pooling conversions are not served; remove it",
       "embed", unused=(None, "auto", "none")),
    _r("skip_tokenizer_init", "model_config.skip_tokenizer_init",
       "the export's multimodal processor tokenizes media layouts (Qwen3-VL timestamps) itself; remove it", True,
       unused=(False,)),
    _r("enable_prompt_embeds", "model_config.enable_prompt_embeds",
       "the language graph embeds token ids itself and takes no embeddings input; remove it", True, unused=(False,)),
    _h("tokenizer_mode", LOADING, example="slow"),
    _h("trust_remote_code", LOADING + " (an export carries no remote code)", example=True),
    _h("allowed_local_media_path", FRONTEND, BENCH_TEST, "/tmp"),
    _h("allowed_media_domains", FRONTEND, example=["example.com"]),
    _r("download_dir", "load_config.download_dir", WEIGHTS, "/tmp/downloads"),
    _r("safetensors_load_strategy", "load_config.safetensors_load_strategy", WEIGHTS, "eager"),
    _r("safetensors_prefetch_num_threads", "load_config.safetensors_prefetch_num_threads", WEIGHTS, 2,
       unused=(None, 8)),
    _r("safetensors_prefetch_block_size", "load_config.safetensors_prefetch_block_size", WEIGHTS, 1024,
       unused=(16777216,)),
    _r("load_format", "load_config.load_format", WEIGHTS, "dummy", unused=("auto",)),
    _r("shuffle_safetensors_files", "load_config.shuffle_safetensors_files", WEIGHTS, True, unused=(False,)),
    _h("config_format", LOADING, example="hf"),
    _n("dtype", "vLLM resolves 'auto' from the config before qeff-evs sees it; the graphs' precision is the "
       "export's (fp32 on ONNX Runtime, fp16 on the card after `qeff-evs compile`), whatever --dtype says"),
    _r("kv_cache_dtype", "cache_config.cache_dtype", KV, "fp8", unused=("auto",)),
    _h("seed", "vLLM's seeding: the worker seeds torch with it for unseeded sampled requests (vLLM's set_random_seed, "
       "as its GPU workers do); per-request seeds through vLLM's sampler", example=7),
    _h("max_model_len", "up to the export's ctx_len and its RoPE tables (engine/limits.py refuses more)",
       "test_vllm_platform_plugin.py::test_each_unservable_setting_is_one_line", 128),
    _r("cudagraph_capture_sizes", "compilation_config.cudagraph_capture_sizes", RUNNER, [1, 2]),
    _n("max_cudagraph_capture_size", "vLLM resolves it with the CUDA-graph sizes; no CUDA graph is captured: the "
       "graphs run on the export's backend"),
    _n("ir_op_priority", "vLLM resolves the kernel priorities with the platform's defaults; no vLLM kernel runs"),
    _r("distributed_executor_backend", lambda c: None if c.parallel_config.world_size_across_dp > 1
       else c.parallel_config.distributed_executor_backend,
       "the plugin runs its worker in vLLM's engine process ('uni'); remove it", "mp", unused=(None, "uni")),
    _v("pipeline_parallel_size", "vLLM: 'Pipeline parallelism is not supported for this model'", 2),
    _r("master_addr", "parallel_config.master_addr", ONE_WORKER, "127.0.0.2", unused=("127.0.0.1",)),
    _r("master_port", "parallel_config.master_port", ONE_WORKER, 29600, unused=(29501,)),
    _v("nnodes", "vLLM: '--nnodes 2 must evenly divide the total world size (1)'", 2),
    _r("node_rank", "parallel_config.node_rank", ONE_WORKER, 1, unused=(0,)),
    _r("distributed_timeout_seconds", "parallel_config.distributed_timeout_seconds", ONE_WORKER, 30),
    _r("cpu_distributed_timeout_seconds", "parallel_config.cpu_distributed_timeout_seconds", ONE_WORKER, 30),
    _r("numa_bind", "parallel_config.numa_bind", ONE_WORKER, True, unused=(None, False)),
    Setting("numa_bind_nodes", REFUSED, ONE_WORKER, example=[0], via="numa_bind"),
    Setting("numa_bind_cpus", REFUSED, ONE_WORKER, example=["0"], via="numa_bind"),
    _r("device_ids", _user_device_ids,
       "GPU ids of vLLM's workers; an export's sessions choose their device (QEFF_EVS_BACKEND); remove it", "0"),
    _r("tensor_parallel_size", "parallel_config.tensor_parallel_size", ONE_WORKER, 2, unused=(1,)),
    _r("prefill_context_parallel_size", "parallel_config.prefill_context_parallel_size", ONE_WORKER, 2,
       unused=(1,)),
    _v("decode_context_parallel_size", "vLLM: 'tp_size=1 must be divisible by dcp_size=2'", 2),
    _r("dcp_comm_backend", "parallel_config.dcp_comm_backend", ONE_WORKER, "a2a", unused=("ag_rs",)),
    _r("dcp_q_replicate", "parallel_config.dcp_q_replicate", ONE_WORKER, True, unused=(False,)),
    _r("dcp_kv_cache_interleave_size", "parallel_config.dcp_kv_cache_interleave_size", ONE_WORKER, 2, unused=(1,)),
    _r("cp_kv_cache_interleave_size", "parallel_config.cp_kv_cache_interleave_size", ONE_WORKER, 2, unused=(1,)),
    _h("data_parallel_size", "one engine core per rank, each a whole replica on its own sessions and devices "
       "(engine/data_parallel.py; device groups per rank on the card)",
       "test_vllm_data_parallel.py::test_two_ranks_serve_16_concurrent_videos_with_single_request_tokens"),
    _v("data_parallel_rank", "vLLM: 'data_parallel_external_lb can only be set when data_parallel_size > 1'", 1),
    _h("data_parallel_start_rank", DATA_PARALLEL),
    _v("data_parallel_size_local", "vLLM: 'data_parallel_size_local (2) must be <= data_parallel_size (1)'", 2),
    _h("data_parallel_address", DATA_PARALLEL),
    _h("data_parallel_rpc_port", DATA_PARALLEL, example=29700),
    _v("data_parallel_hybrid_lb", "vLLM: '--data-parallel-hybrid-lb requires --data-parallel-size-local'", True),
    _v("data_parallel_external_lb", "vLLM: '--data-parallel-external-lb requires a data-parallel rank'", True),
    _h("data_parallel_multi_port_external_lb", DATA_PARALLEL),
    _r("data_parallel_backend", "parallel_config.data_parallel_backend", ONE_WORKER, "ray", unused=("mp",)),
    _r("enable_hc_sp", "parallel_config.enable_hc_sp", ONE_WORKER, True, unused=(False,)),
    _v("enable_expert_parallel", "vLLM: 'Number of experts in the model must be greater than 0'", True),
    _v("enable_batch_sharded_sampling", "vLLM: 'Model Runner V1 does not support: batch-sharded sampling'", True),
    _r("enable_ep_weight_filter", "parallel_config.enable_ep_weight_filter", ONE_WORKER, True, unused=(False,)),
    _r("moe_backend", _default("kernel_config.moe_backend", "auto"), RUNNER, "triton", unused=("auto",)),
    _r("linear_backend", _default("kernel_config.linear_backend", "auto"), RUNNER, "triton", unused=("auto",)),
    _r("monokernel", "kernel_config.monokernel", RUNNER, True, unused=(False,)),
    _r("sparse_indexer_topk_backend", _default("kernel_config.sparse_indexer_topk_backend", "auto"), RUNNER,
       "triton", unused=("auto",)),
    _n("all2all_backend", "vLLM reads it only with expert parallelism, which vLLM refuses here"),
    _v("enable_elastic_ep", "vLLM: 'Elastic EP is only supported with enable_eplb=True'", True),
    _n("elastic_ep_max_dp_size", "vLLM reads it only with --enable-elastic-ep, which vLLM refuses here"),
    _v("enable_dbo", "vLLM: 'Microbatching currently only supports the deepep ... all2all backends'", True),
    _v("ubatch_size", "vLLM: 'Microbatching currently only supports the deepep ... all2all backends'", 2),
    _r("dbo_decode_token_threshold", "parallel_config.dbo_decode_token_threshold", RUNNER, 16, unused=(32,)),
    _r("dp_sync_interval", "parallel_config.dp_sync_interval", ONE_WORKER, 8, unused=(16,)),
    _r("dbo_prefill_token_threshold", "parallel_config.dbo_prefill_token_threshold", RUNNER, 256, unused=(512,)),
    _n("disable_nccl_for_dp_synchronization", "vLLM resolves it for one worker before qeff-evs sees it; no NCCL "
       "group exists"),
    _n("eplb_config", "vLLM reads it only with --enable-eplb, which vLLM refuses here"),
    _v("enable_eplb", "vLLM: 'Expert parallelism load balancing is only supported on CUDA ... devices'", True),
    _r("expert_placement_strategy", "parallel_config.expert_placement_strategy", RUNNER, "round_robin",
       unused=("linear",)),
    _n("_api_process_count", "set by `vllm serve --api-server-count`: vLLM's own API server processes"),
    _n("_api_process_rank", "set by `vllm serve --api-server-count`: vLLM's own API server processes"),
    _r("max_parallel_loading_workers", "parallel_config.max_parallel_loading_workers", WEIGHTS, 2),
    _n("block_size", "vLLM resolves its default before qeff-evs sees it; the plugin sets one KV block per KV row "
       "of the export (block_size = max_model_len), the only layout its graphs have"),
    _h("enable_prefix_caching", "row reuse, on by default as in vLLM: a new request runs in the free KV row that "
       "holds the longest prefix of its tokens (same media at the same places, same pruning; Qwen3.5: the row's "
       "whole history), vLLM schedules only the rest and reports the prefix as cached tokens; "
       "--no-enable-prefix-caching computes every prompt from its start", ROW_REUSE_TEST, example=True),
    _h("prefix_caching_hash_algo", "row reuse compares token ids and media identifiers themselves, so it is exact "
       "whatever the algorithm; vLLM's block hashes (one block per KV row) find no hit", example="xxhash"),
    _h("prefix_cache_retention_interval", "applies to vLLM's sliding-window and Mamba cache groups, which an "
       "export's KV rows are not", example=5),
    _r("disable_sliding_window", "model_config.disable_sliding_window", FEATURE, True, unused=(False,)),
    _n("disable_cascade_attn", "vLLM resolves it before qeff-evs sees it; cascade attention is a kernel of vLLM's "
       "torch runner"),
    _r("offload_backend", _default("offload_config.offload_backend", "auto"), RUNNER, "uva", unused=("auto",)),
    _r("cpu_offload_gb", "offload_config.uva.cpu_offload_gb", RUNNER, 1, unused=(0, 0.0)),
    _r("cpu_offload_params", "offload_config.uva.cpu_offload_params", RUNNER, ["x"], unused=(set(),)),
    _r("offload_group_size", "offload_config.prefetch.offload_group_size", RUNNER, 2, unused=(0,)),
    _r("offload_num_in_group", "offload_config.prefetch.offload_num_in_group", RUNNER, 2, unused=(1,)),
    _r("offload_prefetch_step", "offload_config.prefetch.offload_prefetch_step", RUNNER, 2, unused=(1,)),
    _r("offload_params", "offload_config.prefetch.offload_params", RUNNER, ["x"], unused=(set(),)),
    _r("gpu_memory_utilization", "cache_config.gpu_memory_utilization", KV, 0.5, unused=(None,)),
    _r("kv_cache_memory_bytes", "cache_config.kv_cache_memory_bytes", KV, 1000000),
    _r("enable_extensible_kv_cache", "cache_config.enable_extensible_kv_cache", KV, True, unused=(None, False)),
    _h("max_num_batched_tokens", SCHEDULER + "; a chunk longer than the graph's prefill length runs as several "
       "calls, each with its own window", "test_vllm_plugin.py::test_llm_generate_equals_each_request_alone", 64),
    _h("max_num_scheduled_tokens", SCHEDULER, example=32),
    _h("long_prefill_token_threshold", SCHEDULER, example=8),
    _h("long_prefill_token_threshold_adaptive", SCHEDULER, example=True),
    _h("max_num_seqs", "up to the export's KV rows (--full-batch-size; engine/limits.py refuses more)",
       "test_vllm_platform_plugin.py::test_each_unservable_setting_is_one_line", 2),
    _r("cache_aware_admission_window", "scheduler_config.cache_aware_admission_window",
       "cache-aware admission ranks waiting requests by their hits in vLLM's block prefix cache, which an export's "
       "KV rows do not use (the plugin's scheduler reuses rows: enable_prefix_caching); remove it", 4, unused=(0,)),
    _h("cache_aware_admission_threshold", "only with --cache-aware-admission-window, which is refused"),
    _r("max_num_inflight_kv_loads", "scheduler_config.max_num_inflight_kv_loads",
       "a KV pull from a prefill instance writes into one of the export's KV rows, and none is free while they are "
       "all running: pulls start when a row is; remove it", 2),
    _h("max_num_active_seqs", SCHEDULER, example=2),
    _h("max_num_queued_reqs", SCHEDULER, example=10),
    _h("max_num_queued_tokens", SCHEDULER, example=1000),
    _h("max_logprobs", FRONTEND + " (a request asking for more logprobs gets HTTP 400)",
       "test_vllm_settings.py::test_refused_sampling_parameters_fail_alone_with_their_line", 5),
    _h("logprobs_mode", "vLLM's sampler computes the logprobs it names from the graph's logits (raw_logprobs: "
       "log_softmax of the logits)", "test_vllm_settings.py::test_logprobs_are_log_softmax_of_the_graph_logits",
       "processed_logprobs"),
    _r("use_fp64_gumbel", "model_config.use_fp64_gumbel", "an option of vLLM's GPU sampling kernel, which the "
       "plugin's host sampler does not run (it runs vLLM's torch-native sampler); remove it", True,
       unused=(False,)),
    _r("enable_trace_replay", "model_config.enable_trace_replay", "the plugin's host sampler does not replay traces; remove it",
       True, unused=(None, False)),
    _h("disable_log_stats", OBSERVE, example=True),
    _h("watchdog_config", "vLLM's own stack-dump watchdog, unchanged"),
    _h("aggregate_engine_logging", OBSERVE, example=True),
    _h("revision", LOADING, example="main"),
    _h("code_revision", LOADING, example="main"),
    _h("hf_token", LOADING, example="token"),
    _r("hf_overrides", "model_config.hf_overrides", "would change the config vLLM reads but not the export's "
       "graphs; re-export from a checkpoint with the config you want; remove it", {"foo": 1}, unused=({}, None)),
    _v("model_class_overrides", "vLLM validates the override's '<module>:<class>' form; an export's class is the "
       "plugin's", {"a": "b"}),
    _h("tokenizer_revision", LOADING, example="main"),
    _v("quantization", "vLLM's quantization setup fails here (no quantization packages); an export's precision "
       "is set by `qeff-evs compile --mxfp6`", "fp8"),
    _v("quantization_config", "vLLM validates it against its quantization methods and fails", {"quant_method": "fp8"}),
    _r("allow_deprecated_quantization", "model_config.allow_deprecated_quantization", RUNNER, True, unused=(False,)),
    _h("enforce_eager", "the graphs run as they are; nothing is captured or compiled (what --enforce-eager asks)",
       example=True),
    _n("disable_custom_all_reduce", "vLLM resolves it for one worker before qeff-evs sees it; no all-reduce runs"),
    _r("enable_shm_tensor_arena", "parallel_config.enable_shm_tensor_arena", RUNNER, True, unused=(False,)),
    _r("language_model_only", "model_config.multimodal_config.language_model_only",
       "an export's language graph is served with its media path; a text-only export is not a mode; remove it",
       True, unused=(False,)),
    _h("limit_mm_per_prompt", FRONTEND + " (more items gets HTTP 400)",
       "test_vllm_serve.py::test_bad_request_is_a_400_and_the_server_goes_on", {"video": 2, "image": 2}),
    _r("enable_mm_embeds", _user_mm_embeds,
       "the export's vision graphs take pixels; precomputed media embeddings are not an input; remove it", True,
       unused=(None, False)),
    _h("interleave_mm_strings", FRONTEND + " (chat content order)", example=True),
    _h("media_io_kwargs", FRONTEND + "; video_url bytes are decoded by the plugin's video loaders, registered under "
       "vLLM's names (opencv, qwen2_vl, qwen3_vl): vLLM's frames and metadata where its loader works, a one-frame file "
       "served, bytes no frame decodes from a 400; the processor then samples the frames it was given",
       "test_frame_sampling.py::test_plugin_loader_equals_vllm_loader_where_it_works", {"video": {"num_frames": 8}}),
    _h("mm_processor_kwargs", "the family's HF video sampling rule with vLLM's kwargs (fps, num_frames, "
       "do_sample_frames, min/max frames), at most the export's largest frame bucket, and a request's own "
       "video_pruning_rate, video_pruning_method, max_video_tokens within the export's bounds; others are a 400 "
       "naming the ones honoured", "test_frame_sampling.py::test_loaded_frames_equal_vllm_processor_for_processor_kwargs",
       {"fps": 1}),
    _h("mm_processor_cache_gb", "vLLM's processor cache in the engine process, unchanged; the API server processes "
       "repeated media again (its copy of the cache would drift when a request is refused after processing, which "
       "vLLM answers with HTTP 500 on the next request with that media)",
       "test_vllm_serve.py::test_a_refused_request_does_not_spoil_its_media_for_the_next", 0),
    _r("mm_processor_cache_type", "model_config.multimodal_config.mm_processor_cache_type",
       "only vLLM's 'lru' processor cache is tested with the export's processor; pass 'lru' or remove it", "shm",
       unused=("lru",)),
    _h("mm_hasher_algorithm", FRONTEND + " (media hashes key vLLM's caches and our encoder outputs)",
       example="sha256"),
    _v("mm_shm_cache_max_object_size_mb", "vLLM: only with --mm-processor-cache-type shm (refused)", 64),
    _h("mm_encoder_only", "an encoder instance of encoder disaggregation (with --ec-transfer-config, ec_producer; "
       "ec_connector/config.py refuses it alone)", EPD_REFUSALS_TEST),
    _n("mm_encoder_tp_mode", "vLLM reads it only with tensor parallelism (--tensor-parallel-size, refused)"),
    _r("mm_encoder_attn_backend", "model_config.multimodal_config.mm_encoder_attn_backend", RUNNER, "TORCH_SDPA"),
    _r("mm_encoder_attn_dtype", "model_config.multimodal_config.mm_encoder_attn_dtype", RUNNER, "fp8"),
    _v("mm_encoder_fp8_scale_path", "vLLM: requires --mm-encoder-attn-dtype fp8 (refused)", "/tmp/scales"),
    _v("mm_encoder_fp8_scale_save_path", "vLLM: requires --mm-encoder-attn-dtype fp8 (refused)", "/tmp/scales"),
    _r("mm_encoder_fp8_scale_save_margin", "model_config.multimodal_config.mm_encoder_fp8_scale_save_margin", RUNNER,
       2.0, unused=(1.5,)),
    _r("io_processor_plugin", "model_config.io_processor_plugin", "IO processor plugins serve pooling models; an "
       "export generates text; remove it", "plugin"),
    _h("renderer_num_workers", FRONTEND, example=2),
    _h("skip_mm_profiling", "the worker profiles nothing (its KV rows are the export's); nothing to skip",
       example=True),
    _h("video_pruning_rate", "any rate the export's RoPE tables cover, chosen at start-up (engine/limits.py refuses others, "
       "naming the largest); the default of a request's own mm_processor_kwargs video_pruning_rate / "
       "max_video_tokens", "test_vllm_serve.py::test_rate_and_method_chosen_at_serve_time"),
    _h("video_pruning_method", "a method the export carries (evs, vidcom2 by default; engine/limits.py refuses others, "
       "naming them); the default of a request's own mm_processor_kwargs video_pruning_method",
       "test_vllm_serve.py::test_rate_and_method_chosen_at_serve_time"),
    _v("mm_tensor_ipc", "vLLM: 'torch_shm is known to fail without VLLM_WORKER_MULTIPROC_METHOD set to spawn'",
       "torch_shm"),
    _r("mm_processor_device", _processor_device, "the export's preprocessing runs on the host's CPU (no HF processor "
       "to move); remove it", "cpu"),
    _r("mm_ipc_gpu_memory_gb", "model_config.multimodal_config.mm_ipc_gpu_memory_gb", RUNNER, 1, unused=(0, 0.0)),
    _n("mm_device_do_normalize", "vLLM turns it off itself for models without device normalisation (ours)"),
    _v("enable_lora", "vLLM: 'LoRA is not supported for QeffEvs...: Supported models implement the SupportsLoRA "
       "interface' (an export's graphs have fixed weights)", True),
    _n("max_loras", LORA),
    _n("max_lora_rank", LORA),
    _n("default_mm_loras", LORA),
    _n("fully_sharded_loras", LORA),
    _n("max_cpu_loras", LORA),
    _n("lora_dtype", LORA),
    _n("lora_target_modules", LORA),
    _n("enable_tower_connector_lora", LORA),
    _n("specialize_active_lora", LORA),
    _n("enable_mixed_moe_lora_format", LORA),
    _n("enable_moe_shared_loras", LORA),
    _n("max_lora_cls_labels", LORA),
    _v("ray_workers_use_nsight", "vLLM: 'Unable to use nsight profiling unless workers run with Ray'", True),
    _r("num_gpu_blocks_override", "cache_config.num_gpu_blocks_override", KV, 3),
    _r("model_loader_extra_config", "load_config.model_loader_extra_config", WEIGHTS, {"a": 1}, unused=({}, None)),
    _r("ignore_patterns", "load_config.ignore_patterns", WEIGHTS, ["x"], unused=(["original/**/*"],)),
    _h("enable_chunked_prefill", SCHEDULER + " (off: whole prompts, each run as calls of the graph's prefill "
       "length)", example=False),
    _h("disable_chunked_mm_input", SCHEDULER, example=True),
    _h("scheduler_reserve_full_isl", SCHEDULER, example=False),
    _h("prefill_schedule_interval", SCHEDULER, example=2),
    _h("watermark", SCHEDULER, example=0.1),
    _n("disable_hybrid_kv_cache_manager", "vLLM resolves it (one KV cache group here) and refuses the hybrid "
       "manager itself"),
    _h("structured_outputs_config", "vLLM's structured output manager; the worker applies its grammar bitmask to "
       "the graph's logits before vLLM's sampler", STRUCTURED_TEST),
    _n("aux_output_config", "vLLM reads it only with --enable-return-routed-experts, which vLLM refuses here"),
    _v("reasoning_parser", "vLLM 0.34's reasoning parsers import mistral_common, which this install leaves out "
       "(and qwen3's needs single-token think markers): vLLM stops at start-up. A thinking budget works through "
       "--reasoning-config", "qwen3"),
    _n("reasoning_parser_plugin", "vLLM loads a plugin parser only with --reasoning-parser (vLLM refuses here)"),
    _r("speculative_config", "speculative_config", "the export decodes one token per step; remove "
       "--speculative-config", {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2}),
    _v("spec_method", "vLLM: needs num_speculative_tokens; speculative decoding is refused", "ngram"),
    _v("spec_model", "vLLM loads the draft model's config and fails; speculative decoding is refused", "/tmp/draft"),
    _v("spec_tokens", "vLLM: 'num_speculative_tokens was provided but without speculative model'", 2),
    _r("watermark_config", "watermark_config", "watermarking runs in vLLM's GPU sampler, not the plugin's; remove "
       "it", {"key": 1}),
    _r("diffusion_config", "diffusion_config", "an export decodes autoregressively; remove it", {"canvas_length": 8}),
    _h("show_hidden_metrics_for_version", OBSERVE, example="0.31"),
    _h("otlp_traces_endpoint", OBSERVE, example="http://127.0.0.1:4317"),
    _h("collect_detailed_traces", OBSERVE + " (vLLM requires --otlp-traces-endpoint with it)"),
    _v("per_request_spec_decode_metrics", "vLLM: 'requires speculative decoding to be enabled' (refused)", "summary"),
    _h("kv_cache_metrics", OBSERVE + " (vLLM's block pool: one block per KV row)", example=True),
    _h("kv_cache_metrics_sample", OBSERVE, example=0.5),
    _h("custom_histogram_buckets", OBSERVE, example={"request_latency": [1.0, 10.0]}),
    _r("cudagraph_metrics", "observability_config.cudagraph_metrics", RUNNER, True, unused=(False,)),
    _r("enable_layerwise_nvtx_tracing", "observability_config.enable_layerwise_nvtx_tracing", RUNNER, True,
       unused=(False,)),
    _r("enable_mfu_metrics", "observability_config.enable_mfu_metrics",
       "vLLM estimates MFU from its torch model's FLOPs, which the export's graphs do not report; remove it", True,
       unused=(False,)),
    _h("enable_logging_iteration_details", OBSERVE, example=True),
    _h("jit_monitor_mode", OBSERVE, example="error"),
    _h("jit_monitor_verbose", OBSERVE, example=True),
    _h("enable_mm_processor_stats", OBSERVE, example=True),
    _r("scheduling_policy", "scheduler_config.policy", "vLLM's priority policy preempts running requests, and an "
       "export's KV rows cannot resume a preempted request; pass --scheduling-policy fcfs", "priority",
       unused=("fcfs",)),
    _r("scheduler_cls", "scheduler_config.scheduler_cls",
       "the plugin runs vLLM's scheduler with one addition (a request the worker could not run finishes with an "
       "error instead of stopping the engine); remove --scheduler-cls", "vllm.v1.core.sched.scheduler.Scheduler",
       unused=(None, "qeff_evs.vllm.engine.scheduler.QeffEvsScheduler")),
    _r("pooler_config", lambda c: c.model_config.pooler_config if c.model_config.runner_type == "generate" else None,
       "an export generates text; pooling is not served; remove it", {"seq_pooling_type": "LAST"}),
    _n("compilation_config", "vLLM resolves the compilation mode before qeff-evs sees it; the plugin compiles "
       "nothing (mode NONE, no CUDA graphs): the graphs are the export's"),
    _n("attention_config", "its backend is --attention-backend (refused); the rest are kernel options of vLLM's "
       "torch runner that vLLM resolves before qeff-evs sees them"),
    _n("engram_config", "a torch-model feature (n-gram embedding memory) vLLM builds only for models with it"),
    _n("mamba_config", "its backend is --mamba-backend (refused); Mamba layers are not in an export"),
    _n("kernel_config", "vLLM merges it with the platform's kernel defaults before qeff-evs sees it; no vLLM "
       "kernel runs"),
    _n("enable_flashinfer_autotune", "vLLM resolves it before qeff-evs sees it; no FlashInfer kernel runs"),
    _r("worker_cls", "parallel_config.worker_cls", "the plugin's worker runs the export's graphs; remove "
       "--worker-cls", "x.Worker", unused=(None, "auto", "qeff_evs.vllm.engine.worker.QeffEvsWorker", EC_WORKER_CLASS,
                                           KV_WORKER_CLASS)),
    _r("worker_extension_cls", "parallel_config.worker_extension_cls", "extends vLLM's GPU worker, which the "
       "plugin replaces; remove it", "x.Extension", unused=(None, "")),
    _h("profiler_config", "vLLM's own profiler (torch profiler of the engine process)"),
    _h("logging_config", OBSERVE),
    _h("log_level", OBSERVE, example="DEBUG"),
    _h("log_config_file", OBSERVE),
    _h("kv_transfer_config", "prefill/decode disaggregation through qeff-evs's KV connector (QeffEvsKVConnector): a "
       "kv_producer computes prompts and hands each KV row's used part to a kv_consumer, which decodes "
       "(kv_connector/config.py refuses other connectors, kv_both and the qaic backend, one line each)", PD_TEST),
    _r("kv_events_config", lambda c: None if c.kv_events_config is None else c.kv_events_config.enable_kv_cache_events,
       "KV cache events describe vLLM's block pool, which holds placeholders for the export's KV rows; remove it",
       {"enable_kv_cache_events": True}, unused=(None, False)),
    _h("ec_transfer_config", "encoder disaggregation through qeff-evs's EC connector: an ec_producer encodes and "
       "prunes, ec_consumers run the language graph on the kept rows (ec_connector/config.py refuses other connectors and "
       "roles, one line each)", "test_vllm_epd.py::test_tokens_equal_a_single_instance"),
    _h("ec_manager_config", "vLLM's encoder-cache manager options for EC connectors, unchanged"),
    _h("reasoning_config", "vLLM's thinking-budget state in the plugin's sampler: after the budget, the end string's "
       "tokens are forced on the graph's logits", BUDGET_TEST),
    _h("generation_config", FRONTEND + " (default sampling parameters from the export's generation_config.json)",
       example="vllm"),
    _v("enable_sleep_mode", "vLLM: 'Sleep mode is not supported on current platform'", True),
    _h("sleep_mode_backend", "only with --enable-sleep-mode, which vLLM refuses here"),
    _v("checkpoint_prepare_on_startup", "vLLM: 'checkpoint_prepare_on_startup requires enable_sleep_mode' (which "
       "vLLM refuses here)", True),
    _n("sleep_mode_offload_cudagraph", "vLLM reads it only with --enable-sleep-mode, which vLLM refuses here"),
    _n("sleep_preserve_parameter_names", "vLLM reads it only with --enable-sleep-mode, which vLLM refuses here"),
    _v("enable_cumem_allocator", "vLLM: 'cumem allocator is not supported on current platform'", True),
    _r("enable_nccl_comm_suspend", "model_config.enable_nccl_comm_suspend", ONE_WORKER, True, unused=(False,)),
    _h("override_generation_config", FRONTEND + " (default sampling parameters)",
       example={"temperature": 0.5}),
    _v("model_impl", "vLLM looks the export's architecture up in the chosen implementation and fails: the model "
       "is the export's graphs", "transformers"),
    _r("attention_backend", "attention_config.backend", RUNNER, "TORCH_SDPA"),
    _r("kv_cache_dtype_skip_layers", "cache_config.kv_cache_dtype_skip_layers", KV, ["0"], unused=([],)),
    _r("mamba_cache_dtype", "cache_config.mamba_cache_dtype", FEATURE, "float32", unused=(None, "auto")),
    _r("mamba_ssm_cache_dtype", "cache_config.mamba_ssm_cache_dtype", FEATURE, "float32", unused=(None, "auto")),
    _h("mamba_block_size", "applies to vLLM's Mamba cache groups, which an export's KV rows are not (Qwen3.5's "
       "linear-attention state lives in its KV row, reused only whole); with --no-enable-prefix-caching vLLM refuses "
       "it ('--mamba-block-size can only be set with --enable-prefix-caching')", example=16),
    _r("prefix_match_unit", "cache_config.prefix_match_unit", FEATURE, 16),
    _n("mamba_cache_mode", "deprecated in vLLM 0.34, which warns and drops it"),
    _r("enable_mamba_shared_prefix_checkpoint", "cache_config.enable_mamba_shared_prefix_checkpoint", FEATURE, True,
       unused=(False,)),
    _r("replayssm_buffer_len", "cache_config.replayssm_buffer_len", FEATURE, 8, unused=(16,)),
    _v("use_replayssm", "vLLM: '--use-replayssm is not supported for architecture QeffEvs...'", True),
    _r("mamba_backend", _default("mamba_config.backend", "triton"), FEATURE, "flashinfer", unused=("triton",)),
    _v("mamba_ssu_algorithm", "vLLM validates it (auto, simple, vertical, horizontal); Mamba layers are not in "
       "an export", "x"),
    _v("enable_mamba_cache_stochastic_rounding", "vLLM: 'Stochastic rounding for Mamba cache requires the SSM cache "
       "to be float16'", True),
    _r("mamba_cache_philox_rounds", "mamba_config.stochastic_rounding_philox_rounds", FEATURE, 2, unused=(None, 0)),
    _r("additional_config", _unknown_additional_keys,
       f"keys the qeff-evs platform does not read (it reads {', '.join(ADDITIONAL_CONFIG_KEYS)}; a key for another "
       "platform does nothing here); remove them", {"a": 1}),
    _r("use_tqdm_on_load", "load_config.use_tqdm_on_load", WEIGHTS, False, unused=(True,)),
    _r("pt_load_map_location", "load_config.pt_load_map_location", WEIGHTS, "cuda", unused=("cpu",)),
    _h("logits_processors", "vLLM's logits processors run in the plugin's sampler on the graph's logits",
       PROCESSOR_TEST),
    _n("async_scheduling", "vLLM turns it on by default before qeff-evs sees it; the plugin turns it off (its "
       "worker samples each step before the next is scheduled); outputs are the same either way"),
    _h("stream_interval", FRONTEND, "test_vllm_serve.py::test_streaming_gives_the_same_text", 4),
    _r("kv_sharing_fast_prefill", "cache_config.kv_sharing_fast_prefill", KV, True, unused=(False,)),
    _r("swa_bounded_replay", "cache_config.swa_bounded_replay", FEATURE, False, unused=(True,)),
    _n("optimization_level", "vLLM turns it into compilation settings before qeff-evs sees them; the plugin compiles "
       "nothing"),
    _n("performance_mode", "vLLM turns it into compilation and CUDA-graph settings; the plugin compiles nothing"),
    _n("fault_tolerance_config", "vLLM reads it only with --enable-fault-tolerance, which vLLM refuses here"),
    _v("enable_fault_tolerance", "vLLM: 'Fault tolerance requires external load balancer mode'", True),
    _r("kv_offloading_size", "cache_config.kv_offloading_size", KV, 1.0),
    _r("kv_offloading_backend", "cache_config.kv_offloading_backend", KV, "lmcache", unused=("native",)),
    Setting("tokens_only", REFUSED, "implies --skip-tokenizer-init (refused)", example=True, via="skip_tokenizer_init"),
    _h("shutdown_timeout", FRONTEND, example=5),
    _r("weight_transfer_config", "weight_transfer_config", WEIGHTS, {"backend": "nccl"}),
    _h("fail_on_environ_validation", FRONTEND, example=True),
    _r("gdn_prefill_backend", _additional("gdn_prefill_backend"), RUNNER, "triton"),
    _r("kda_prefill_backend", _additional("kda_prefill_backend"), RUNNER, "triton"),
    _r("kda_decode_backend", _additional("kda_decode_backend"), RUNNER, "triton"),
    _h("enable_log_requests", OBSERVE),
)

SAMPLER = "the plugin's host sampler, vLLM 0.34's rule, on the graph's logits"
DETOK = "vLLM's detokenizer and output processor, unchanged"

SAMPLING_SETTINGS: tuple[Setting, ...] = (
    _h("n", "vLLM's frontend fans a request out into n requests; each runs through the worker",
       "test_vllm_settings.py::test_n_gives_n_completions"),
    _h("presence_penalty", SAMPLER, RULE_TEST),
    _h("frequency_penalty", SAMPLER, RULE_TEST),
    _h("repetition_penalty", SAMPLER, RULE_TEST),
    _h("temperature", SAMPLER, SAMPLER_TEST),
    _h("watermarking", "vLLM resolves it per request: off without --watermark-config (refused)"),
    _h("top_p", SAMPLER, SAMPLER_TEST),
    _h("top_k", SAMPLER, SAMPLER_TEST),
    _h("min_p", SAMPLER, RULE_TEST),
    _h("seed", SAMPLER + " (vLLM 0.34's stateless noise over seed, position and token)",
       "test_vllm_settings.py::test_seeded_sampling_is_vllms_stream_on_the_graph_logits"),
    _h("stop", DETOK, STOP_TEST),
    _h("stop_token_ids", "vLLM's scheduler stops on them", RULE_TEST),
    _h("ignore_eos", "vLLM's scheduler", RULE_TEST),
    _h("max_tokens", "vLLM's scheduler (the frontend also checks the RoPE tables with it)",
       "test_vllm_serve.py::test_bad_request_is_a_400_and_the_server_goes_on"),
    _h("min_tokens", SAMPLER + " (vLLM's min-tokens logits processor)",
       RULE_TEST),
    _h("logprobs", SAMPLER + " (log_softmax of the graph's logits)",
       "test_vllm_settings.py::test_logprobs_are_log_softmax_of_the_graph_logits"),
    _r("prompt_logprobs", "prompt_logprobs", "the language graph returns the last position's logits only; drop "
       "prompt_logprobs", 1),
    _r("prompt_logprob_token_ids", _as_list("prompt_logprob_token_ids"), "the language graph returns the last position's "
       "logits only; drop prompt_logprob_token_ids", [[1]]),
    _v("prompt_logprob_start", "vLLM: 'prompt_logprob_start requires prompt_logprobs or prompt_logprob_token_ids' "
       "(both refused)", 1),
    _h("logprob_token_ids", SAMPLER + " (each request's own ids' logprobs, the others' top logprobs, as vLLM 0.34)",
       "test_vllm_settings.py::test_logprobs_are_log_softmax_of_the_graph_logits"),
    _h("flat_logprobs", DETOK),
    _h("detokenize", DETOK),
    _h("skip_special_tokens", DETOK, "test_vllm_settings.py::test_special_tokens_in_the_text"),
    _h("spaces_between_special_tokens", DETOK),
    _h("include_stop_str_in_output", DETOK, STOP_TEST),
    _h("output_kind", DETOK + " (streaming)", "test_vllm_serve.py::test_streaming_gives_the_same_text"),
    _h("stream_interval", DETOK + " (streaming)"),
    _h("skip_clone", "vLLM-internal"),
    _h("output_text_buffer_length", "vLLM-internal (set from the stop strings)"),
    _h("structured_outputs", "vLLM's grammar bitmask applied to the graph's logits before the sampling rules (a "
       "choice and a JSON schema tested)",
       STRUCTURED_TEST),
    _h("logit_bias", SAMPLER + " (vLLM's logit-bias logits processor)",
       RULE_TEST),
    _h("allowed_token_ids", SAMPLER, RULE_TEST),
    _h("extra_args", "passed to custom logits processors", PROCESSOR_TEST),
    _h("bad_words", SAMPLER, RULE_TEST),
    _h("skip_reading_prefix_cache", "the request reuses no row's history (row reuse: enable_prefix_caching)",
       ROW_REUSE_TEST),
    _h("thinking_token_budget", "vLLM's thinking-budget state in the plugin's sampler (needs --reasoning-config; "
       "vLLM refuses it without)", BUDGET_TEST),
    _h("repetition_detection", "vLLM's scheduler stops a repeating output"),
    _h("routed_experts_prompt_start", "only with --enable-return-routed-experts, which vLLM refuses here"),
    _h("trace_decode_token_ids", "only with --enable-trace-replay, which is refused; vLLM refuses the "
       "parameter without it"),
)


def engine_refusals(vllm_config: Any) -> list[str]:
    """The refused engine arguments ``vllm_config`` uses, one line each (``Setting.refusal``)."""
    return [line for s in ENGINE_SETTINGS if (line := s.refusal(vllm_config))]


def sampling_refusals(params: Any) -> list[str]:
    """The refused sampling parameters a request uses, one line each."""
    return [line for s in SAMPLING_SETTINGS if (line := s.refusal(params))]


def _example(setting: Setting, engine: bool) -> str:
    value = setting.example
    if engine and isinstance(value, bool):
        return f"`{setting.flag}`" if value else f"`--no-{setting.flag[2:]}`"
    if isinstance(value, (dict, list)):
        value = "'" + json.dumps(value) + "'" if engine else json.dumps(value)
    return f"`{setting.flag} {value}`" if engine else f"`{setting.name}={value}`"


def _tested(setting: Setting, engine: bool) -> str:
    """How a row is held to its verdict (see tests/test_vllm_settings.py)."""
    has_example = setting.example is not _UNSET
    if setting.verdict in (REFUSED, VLLM_REFUSES) and has_example:
        return _example(setting, engine) + " fails" + (" (start-up)" if engine else "")
    if setting.test:
        return setting.test
    if setting.verdict == HONOURED and has_example and engine:
        return _example(setting, engine) + " starts"
    return ""


def settings_table(settings: Iterable[Setting], heading: str) -> str:
    """docs/settings.md's rows for ``settings``: name, verdict, how (or the refusal's reason), how it is tested."""
    engine = heading == "engine argument"
    lines = [f"| {heading} | verdict | how / why | tested |", "|---|---|---|---|"]
    for s in settings:
        name = f"`{s.flag}`" if engine else f"`{s.name}`"
        lines.append(f"| {name} | {s.verdict} | {s.how} | {_tested(s, engine)} |")
    return "\n".join(lines)


# The headline settings: docs/settings.md shows their rows first, then the rest grouped, then every row.
NAMED_ENGINE = ("video_pruning_method", "video_pruning_rate", "enable_lora", "enable_prompt_embeds",
                "logits_processors", "reasoning_parser", "reasoning_config", "num_gpu_blocks_override",
                "kv_cache_dtype", "speculative_config", "max_logprobs", "additional_config")
NAMED_SAMPLING = ("n", "stop", "stop_token_ids", "min_tokens", "ignore_eos", "logit_bias", "allowed_token_ids",
                  "bad_words", "presence_penalty", "frequency_penalty", "repetition_penalty", "seed", "logprobs",
                  "logprob_token_ids", "skip_special_tokens", "prompt_logprobs", "structured_outputs",
                  "thinking_token_budget")


def named(settings: Iterable[Setting], names: Iterable[str]) -> list[Setting]:
    by_name = {s.name: s for s in settings}
    return [by_name[name] for name in names]


def settings_groups(settings: Iterable[Setting], min_size: int = 3) -> str:
    """docs/settings.md's grouped view: settings sharing a verdict and a reason, one row per group of ``min_size`` or
    more (largest first); the full table holds every row, these included."""
    groups: dict[tuple[str, str], list[Setting]] = {}
    for s in settings:
        groups.setdefault((s.verdict, s.how), []).append(s)
    lines = ["| verdict | how / why | engine arguments |", "|---|---|---|"]
    for (verdict, how), rows in sorted(groups.items(), key=lambda item: -len(item[1])):
        if len(rows) >= min_size:
            lines.append(f"| {verdict} | {how} | {', '.join(f'`{s.flag}`' for s in rows)} |")
    return "\n".join(lines)


def _counts(settings: Iterable[Setting]) -> str:
    verdicts = [s.verdict for s in settings]
    counts = [f"{verdicts.count(HONOURED)} honoured", f"{verdicts.count(REFUSED)} refused",
              f"{verdicts.count(VLLM_REFUSES)} refused by vLLM"]
    return ", ".join(counts + ([f"{verdicts.count(NO_EFFECT)} no effect"] if NO_EFFECT in verdicts else []))


def settings_page(page: str) -> str:
    """``page`` (docs/settings.md's text) with every part made from the rows rendered again from them: the row counts
    and the five tables, in page order (the named engine arguments, the named sampling parameters, the grouped engine
    arguments, every engine argument, every sampling parameter). ``scripts/render_settings_page.py`` writes it."""
    page = re.sub(r"Each of vLLM 0\.3\d's \d+ engine arguments and \d+ sampling parameters",
                  f"Each of vLLM 0.34's {len(ENGINE_SETTINGS)} engine arguments and {len(SAMPLING_SETTINGS)} "
                  "sampling parameters", page)
    page = re.sub(r"Engine arguments: [^;]*; sampling parameters: [^.]*\.",
                  f"Engine arguments: {_counts(ENGINE_SETTINGS)}; sampling parameters: {_counts(SAMPLING_SETTINGS)}.",
                  page)
    page = re.sub(r"Engine arguments \(\d+ rows\)", f"Engine arguments ({len(ENGINE_SETTINGS)} rows)", page)
    page = re.sub(r"Sampling parameters \(\d+ rows\)", f"Sampling parameters ({len(SAMPLING_SETTINGS)} rows)", page)
    tables = [settings_table(named(ENGINE_SETTINGS, NAMED_ENGINE), "engine argument"),
              settings_table(named(SAMPLING_SETTINGS, NAMED_SAMPLING), "sampling parameter"),
              settings_groups(ENGINE_SETTINGS), settings_table(ENGINE_SETTINGS, "engine argument"),
              settings_table(SAMPLING_SETTINGS, "sampling parameter")]
    blocks = list(re.finditer(r"^\|.*(?:\n\|.*)*", page, flags=re.M))
    if len(blocks) != len(tables):
        raise ValueError(f"docs/settings.md has {len(blocks)} tables where {len(tables)} are rendered from the rows; "
                         "restore the page's tables (git checkout docs/settings.md) and render it again")
    for block, table in zip(reversed(blocks), reversed(tables)):
        page = page[:block.start()] + table + page[block.end():]
    return page
