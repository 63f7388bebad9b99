"""Specialization sets and the compile artifacts built from them (docs/design.md#specializations).

* :mod:`.sets` -- :class:`Specialization`, :class:`PruningTarget`, the language/vision builders;
* :mod:`.files` -- ``specializations.json`` in QEfficient's flat and named layouts;
* :mod:`.custom_io` -- ``custom_io.yaml`` (fp16 vision embeds, fp16/mxint8 KV cache);
* :mod:`.symbols` -- the graph's dimension symbols and the "every symbol bound" check;
* :mod:`.compile_command` -- ``qaic-compile`` command lines, ``compile.sh``, the runner;
* :mod:`.artifacts` -- all of the above for one exported graph, check first.
"""

from .artifacts import CUSTOM_IO_FILE, QPC_DIR, SPECIALIZATIONS_FILE, compile_file_name, prepare_graph_compile
from .compile_command import (
    HW_VERSIONS,
    CompileCommand,
    CompileOptions,
    detect_aic_hw_version,
    find_qaic_compile,
    qaic_compile_command,
    run_compile,
    write_compile_script,
)
from .custom_io import (
    EMBEDDING_NAMES,
    FLOAT16,
    MXINT8,
    RETAINED_SUFFIX,
    custom_io_precisions,
    pruning_custom_io,
    language_custom_io,
    read_custom_io_yaml,
    state_precisions,
    vision_custom_io,
    write_custom_io_yaml,
)
from .files import parse_specializations, read_specializations_json, write_specializations_json
from .sets import (
    COMP_CTX_SYMBOL,
    NUM_LOGITS_SYMBOL,
    DEFAULT_FRAMES_PER_CALL,
    EncoderTarget,
    Specialization,
    DEFAULT_MAX_FRAMES,
    TARGETS,
    TargetDefaults,
    PruningTarget,
    comp_ctx_lengths,
    default_sampled_frame_buckets,
    LANGUAGE_PROGRAMS,
    language_specializations,
    program_specializations,
    manifest_entries,
    short_prefill_lens,
    specialization_for_target,
    vision_specializations,
)
from .symbols import check_specializations, graph_symbols

__all__ = [
    "CUSTOM_IO_FILE",
    "EMBEDDING_NAMES",
    "FLOAT16",
    "MXINT8",
    "QPC_DIR",
    "RETAINED_SUFFIX",
    "SPECIALIZATIONS_FILE",
    "CompileCommand",
    "CompileOptions",
    "HW_VERSIONS",
    "detect_aic_hw_version",
    "COMP_CTX_SYMBOL",
    "NUM_LOGITS_SYMBOL",
    "DEFAULT_FRAMES_PER_CALL",
    "EncoderTarget",
    "Specialization",
    "DEFAULT_MAX_FRAMES",
    "TARGETS",
    "TargetDefaults",
    "PruningTarget",
    "comp_ctx_lengths",
    "default_sampled_frame_buckets",
    "check_specializations",
    "compile_file_name",
    "custom_io_precisions",
    "pruning_custom_io",
    "find_qaic_compile",
    "graph_symbols",
    "language_custom_io",
    "language_specializations",
    "manifest_entries",
    "parse_specializations",
    "prepare_graph_compile",
    "qaic_compile_command",
    "read_custom_io_yaml",
    "read_specializations_json",
    "run_compile",
    "short_prefill_lens",
    "specialization_for_target",
    "state_precisions",
    "vision_custom_io",
    "vision_specializations",
    "write_compile_script",
    "write_custom_io_yaml",
    "write_specializations_json",
]
