"""What an export can serve, checked against vLLM's settings before the engine starts.

The graphs fix a context length, a number of KV rows, the pruning methods they carry and the rates their RoPE
tables cover; vLLM's scheduler must never ask for more. Each refusal is one line naming the setting, its value, the export's limit and the flag that
fixes it. Pure: the platform hands in the values it read from ``VllmConfig``.

No token budget is refused: the driver runs a scheduled chunk longer than the graph's prefill length
as several calls, each with its own window (vLLM's ``long_prefill_token_threshold`` cannot bound a
chunk: vLLM lifts it while a request runs alone), so every budget and threshold is served exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

from qeff_evs.manifest import Manifest
from qeff_evs.models.pruning import DEFAULT_METHOD, VideoPruning


@dataclass(frozen=True)
class ServingSettings:
    """The vLLM settings an export constrains (as vLLM resolved them)."""

    max_num_seqs: int
    max_model_len: int
    video_pruning_rate: float | None
    video_pruning_method: str = DEFAULT_METHOD


def served_pruning(multimodal_config) -> VideoPruning:
    """``--video-pruning-method`` and ``--video-pruning-rate`` as vLLM resolved them (no rate: pruning off)."""
    if multimodal_config is None:
        return VideoPruning()
    return VideoPruning(multimodal_config.video_pruning_method, multimodal_config.video_pruning_rate or 0.0)


def refusals(settings: ServingSettings, manifest: Manifest) -> list[str]:
    """Why ``manifest``'s export cannot serve ``settings``; empty when it can."""
    shape = manifest.language_shape
    rows = shape.full_batch_size
    problems = []
    if not shape.continuous_batching:
        problems.append("the export has no KV rows for concurrent requests (exported without --full-batch-size); "
                        "re-export with --full-batch-size N to serve it with vLLM")
    if settings.max_num_seqs > rows:
        problems.append(f"max_num_seqs {settings.max_num_seqs} is above the export's full batch size {rows} (its KV "
                        f"rows); pass --max-num-seqs {rows}, or re-export with --full-batch-size {settings.max_num_seqs}")
    if settings.max_model_len > manifest.ctx_len:
        problems.append(f"max_model_len {settings.max_model_len} is above the export's ctx_len {manifest.ctx_len}; "
                        f"pass --max-model-len {manifest.ctx_len} (or less)")
    # The rate's positions within the contexts the export can hold at all (a longer one is refused above).
    context = min(settings.max_model_len, manifest.ctx_len)
    problems += [p for p in (manifest.method_refusal(settings.video_pruning_method),
                             manifest.rate_refusal(settings.video_pruning_rate or 0.0, context)) if p]
    return problems
