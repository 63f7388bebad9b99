"""ONNX Runtime sessions for measuring: the runtime's session classes over ORT sessions opened for timing.

The runtime opens ORT with its default memory arena, which keeps the largest activation set ever
allocated; then every later call looks as big as the biggest earlier one. Here the arena is off,
so the peak resident memory of a call reflects that call, and thread spinning is off, so process
CPU time measures work. One ``InferenceSession`` per graph is
opened once and handed to the runtime's ``OrtEncoderSession``/``OrtPruningSession``/``OrtLanguageSession``, which take an
opened session as well as a path (the language graph serves both ways).
"""

from __future__ import annotations

from pathlib import Path


def open_inference_session(path: str | Path, profile_prefix: str | Path | None = None):
    """CPU session without the memory arena; with ``profile_prefix``, ORT's per-node profiler is on."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.enable_cpu_mem_arena = False
    # Idle worker threads block instead of spinning: CPU time then counts work only, and a busy
    # machine's other programs are not slowed by our spinning.
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if profile_prefix is not None:
        options.enable_profiling = True
        options.profile_file_prefix = str(profile_prefix)
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
