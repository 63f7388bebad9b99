"""What an export can serve, checked against vLLM's settings before the engine starts.

The graphs fix a context length, a number of KV rows and a pruning rate; vLLM's scheduler must never ask
for more. Each refusal is one line naming the setting, its value, the export's limit and the flag that
fixes it. Pure: the platform hands in the values it read from ``VllmConfig``.

No token budget is refused: the driver runs a scheduled chunk longer than the graph's prefill length
as several calls, each with its own window (vLLM's ``long_prefill_token_threshold`` cannot bound a
chunk: vLLM lifts it while a request runs alone), so every budget and threshold is served exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

from qeff_evs.manifest import Manifest
from qeff_evs.positions import rope_table_length


@dataclass(frozen=True)
class ServingSettings:
    """The vLLM settings an export constrains (as vLLM resolved them)."""

    max_num_seqs: int
    max_model_len: int
    video_pruning_rate: float | None
    enable_prefix_caching: bool
    video_pruning_method: str = "evs"


@dataclass(frozen=True)
class ServedPruning:
    """What the export's graphs can prune with at serve time: the methods it carries and the rates they run."""

    methods: tuple[str, ...]
    rates: tuple[float, ...]  # the rates the export serves exactly


def served_pruning(manifest: Manifest) -> ServedPruning:
    """Read from the manifest: an export made with ``--video-pruning-rate q`` runs EVS at q (its EVS graph's
    specializations are sized for q's retained counts)."""
    return ServedPruning(methods=("evs",), rates=(manifest.video_pruning_rate,))


def pruning_refusals(method: str, rate: float | None, manifest: Manifest) -> list[str]:
    """``--video-pruning-method``/``--video-pruning-rate`` against what the export carries (one place for both)."""
    served = served_pruning(manifest)
    problems = []
    if method not in served.methods:
        problems.append(f"video_pruning_method {method!r} is not one this export carries ({', '.join(served.methods)}"
                        f"); pass --video-pruning-method {served.methods[0]}, or use an export that carries {method}")
    if (rate or 0.0) not in served.rates:
        rates = ", ".join(str(r) for r in served.rates)
        problems.append(f"video_pruning_rate {rate} is not a rate the export serves ({rates}); pass "
                        f"--video-pruning-rate {served.rates[0]}, or re-export with the rate you want")
    return problems


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
    q = manifest.video_pruning_rate
    table = shape.rope_positions
    if (settings.max_model_len <= manifest.ctx_len and table is not None
            and rope_table_length(settings.max_model_len, q, multiple=1) > table):
        problems.append(f"max_model_len {settings.max_model_len} at q={q} reaches M-RoPE positions up to "
                        f"{rope_table_length(settings.max_model_len, q, multiple=1)} (positions stay unpruned) but the "
                        f"export's RoPE tables cover {table}; pass a smaller --max-model-len, or re-export with a "
                        "larger --rope-positions")
    problems += pruning_refusals(settings.video_pruning_method, settings.video_pruning_rate, manifest)
    if settings.enable_prefix_caching:
        problems.append("prefix caching is on, but an export's KV rows are not shared blocks; pass "
                        "--no-enable-prefix-caching")
    return problems
