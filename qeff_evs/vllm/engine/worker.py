"""The vLLM worker that runs a qeff-evs export: vLLM's ``SchedulerOutput`` in, ``ModelRunnerOutput`` out.

Per step (``execute_model``): the host sampler's request states are updated (:mod:`qeff_evs.vllm.sampling`), new
requests are admitted to the driver with their prompt plan (rebuilt from vLLM's prompt ids and the media
our processor prepared), and the driver runs the scheduled encoder items, prefill chunks (window rows,
int64 positions, the request's KV row) and decodes over the backend's sessions. Then (``sample_tokens``,
as vLLM's model runner) the host sampler applies vLLM's structured-output bitmask and sampling rules to the
logits and picks the tokens. Encoder outputs are dropped when vLLM's encoder cache frees them, KV rows when vLLM finishes
or aborts a request. Each new request runs in the KV row the scheduler chose (``engine/scheduler.py``), from the
first token the row does not already hold.

The frontend has refused whatever a request could get wrong; the checks here assert what it guaranteed.
Should one fail anyway, or a backend call raise for one request, that request alone fails (logged, reported
in ``RunnerOutput.failed``; the scheduler finishes it with an error) and the engine serves the others.

On the qaic backend every program of the export is loaded once, on the devices ``QEFF_EVS_DEVICE_IDS`` or
``--additional-config '{"device_ids": ...}'`` name (refused before loading if they over-subscribe a device;
with ``--data-parallel-size``, one group per rank: ``engine/data_parallel.py``), stays active while the engine
serves, and is released when vLLM shuts the worker down.
"""

from __future__ import annotations

import numpy as np
import torch

from qeff_evs.runtime.engine.request import PromptPiece
from qeff_evs.runtime.builders import engine_config
from qeff_evs.runtime.export_bundle import open_export
from qeff_evs.runtime.sessions import sessions_for
from qeff_evs.vllm.engine.data_parallel import configured_device_ids, log_rank
from qeff_evs.vllm.engine.driver import VllmDriver
from qeff_evs.vllm.engine.limits import served_pruning
from qeff_evs.vllm.activation import active_backend, logger
from qeff_evs.vllm.processing.processor import media_from_fields
from qeff_evs.vllm.sampling.host_sampler import HostSampler
from qeff_evs.vllm.engine.scheduler import RunnerOutput
from qeff_evs.vllm.surface import CompilationTimes, FullAttentionSpec, WorkerBase

# vLLM's block accounting needs a layer name; the real KV state lives in our sessions.
KV_LAYER = "qeff_evs.kv_rows"


def prompt_pieces(prompt_ids: list[int], features) -> list[PromptPiece]:
    """Text between the media placeholders, and one piece per media item (features in prompt order)."""
    pieces, at = [], 0
    for item, feature in enumerate(features):
        offset, length = int(feature.mm_position.offset), int(feature.mm_position.length)
        if offset > at:
            pieces.append(PromptPiece(ids=tuple(prompt_ids[at:offset])))
        pieces.append(PromptPiece(media_item=item))
        at = offset + length
    if at < len(prompt_ids):
        pieces.append(PromptPiece(ids=tuple(prompt_ids[at:])))
    return pieces


class QeffEvsWorker(WorkerBase):
    def init_device(self) -> None:
        from qeff_evs.vllm.surface import set_random_seed

        self.device = torch.device("cpu")
        set_random_seed(self.model_config.seed)  # as vLLM's workers: unseeded sampling follows --seed

    def load_model(self, *, load_dummy_weights: bool = False) -> None:
        bundle = open_export(self.model_config.model)
        config = engine_config(bundle, served_pruning(self.model_config.multimodal_config))
        self.bundle = bundle
        self.driver = VllmDriver(bundle.family, *self._sessions(bundle, config.video_pruning_method), config)
        self.sampling: HostSampler | None = None
        self._step = None  # (scheduler output, logits, failed) between execute_model and sample_tokens

    def _sessions(self, bundle, method: str):
        """The vision pipeline (with ``method``'s pruning graph) and language session this worker runs."""
        device_ids = configured_device_ids(self.vllm_config)
        log_rank(self.vllm_config, device_ids)
        return sessions_for(bundle, active_backend(), device_ids=device_ids, method=method)

    def get_model(self) -> torch.nn.Module:
        return torch.nn.Module()  # the model lives in the sessions; nothing to inspect

    def get_supported_tasks(self):
        return ("generate",)

    # -- KV accounting: one block per exported KV row -----------------------------------------------------
    def _kv_spec(self) -> FullAttentionSpec:
        return FullAttentionSpec(block_size=self.cache_config.block_size, num_kv_heads=1, head_size=1,
                                 dtype=torch.float32)

    def get_kv_cache_spec(self):
        return {KV_LAYER: self._kv_spec()}

    def get_supported_kv_cache_layouts(self) -> list[str]:
        return ["NHD"]

    def determine_available_memory(self) -> int:
        # One block per KV row, plus vLLM's reserved null block.
        return self._kv_spec().page_size_bytes * (self.driver.executor.language.shape.full_batch_size + 1)

    def initialize_from_config(self, kv_cache_config) -> None:
        self.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
        self.sampling = HostSampler(self.vllm_config, self.model_config.get_vocab_size())

    def compile_or_warm_up_model(self) -> CompilationTimes:
        return CompilationTimes(language_model=0.0, encoder=0.0)

    # -- one step ---------------------------------------------------------------------------------------
    def execute_model(self, scheduler_output) -> None:
        """Run the step's graphs; ``sample_tokens`` samples (vLLM calls it next, with the grammar bitmask)."""
        self.sampling.update(scheduler_output)
        for request_id in scheduler_output.finished_req_ids:  # first: vLLM may reuse an aborted request's id
            self.driver.finish(request_id)
        # A preempted request comes back as a new one with its outputs in prefill_token_ids. The platform sizes blocks
        # so that vLLM never preempts (one block per row); should it happen, the request fails alone.
        preempted = set(getattr(scheduler_output, "preempted_req_ids", None) or ())
        for request_id in preempted:
            self.driver.finish(request_id)
        failed: dict[str, str] = {}
        for new in scheduler_output.scheduled_new_reqs:
            try:
                if new.req_id in preempted or len(new.prefill_token_ids) != len(new.prompt_token_ids):
                    raise RuntimeError("vLLM preempted and resumed the request; the qeff-evs platform sizes KV blocks "
                                       "so that this cannot happen (block_size must equal max_model_len)")
                self._admit(new, scheduler_output.kv_rows[new.req_id])
            except Exception as error:  # noqa: BLE001 - one request's failure must not stop the engine
                failed[new.req_id] = f"{type(error).__name__}: {error}"
        logits = self.driver.step(scheduler_output, failed)
        for request_id, reason in failed.items():
            logger.error("qeff-evs could not run request %s, which fails alone (the frontend should have refused "
                         "it): %s", request_id, reason)
        self._step = (scheduler_output, logits, failed)
        return None

    def sample_tokens(self, grammar_output) -> RunnerOutput:
        scheduler_output, logits, failed = self._step
        self._step = None
        output, sampled = self.sampling.sample(logits, scheduler_output, grammar_output)
        for request_id, tokens in sampled.items():
            self.driver.accept(request_id, tokens)
        output.failed = failed
        return output

    def _admit(self, new, row: int | None = None) -> None:
        """Take a request vLLM scheduled for the first time, in KV row ``row`` (the scheduler's choice: it may
        already hold the first ``new.num_computed_tokens`` tokens, which are then not run again)."""
        features = sorted(new.mm_features or [], key=lambda f: f.mm_position.offset)
        media = [media_from_fields(f.data.get_data(), f.modality) for f in features]
        plan = self.driver.plan(prompt_pieces(list(new.prompt_token_ids), features), media)
        # Assertions of what the frontend guaranteed (engine/request_checks.py, the processor and validate_request).
        if not np.array_equal(plan.ids, np.asarray(new.prompt_token_ids)):
            raise AssertionError(f"request {new.req_id}: vLLM's prompt ids differ from the export's layout of the "
                                 "same media; the prompt was not made by the qeff-evs processor")
        self.driver.admit(new.req_id, plan, media, features, max_new_tokens=new.sampling_params.max_tokens,
                          row=row)

    def execute_dummy_batch(self) -> None:
        # vLLM steps the data-parallel ranks of a MoE model (config with experts: Qwen3-VL-MoE, Qwen3.5-MoE,
        # Nemotron-H) in lockstep, and a rank without requests runs a dummy batch so that the others' expert
        # collectives find it. An export's ranks share no collective: there is nothing to run.
        return

    def check_health(self) -> None:
        return

    def shutdown(self) -> None:
        """Release the export's programs (on QAIC: deactivate and unload them from their devices)."""
        driver = getattr(self, "driver", None)  # None when the engine stopped before load_model
        if driver is not None:
            self.driver = None
            driver.executor.close()
