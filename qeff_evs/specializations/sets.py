"""Specialization sets: the concrete symbol values each compiled graph is built for.

A QAIC program is compiled once per *specialization*: a binding of every dynamic ONNX
dimension name (``seq_len``, ``grid_h``, ...) to an integer. At run time the device picks
the specialization whose shapes match the input buffers, so the host pads to one of them.

Two sets exist per model:

* language: ``Prefill`` (``seq_len = prefill_seq_len``) and ``Decode`` (``seq_len = 1``),
  both binding ``vision_size = user_vision_size`` -- each prefill chunk is handed only its
  own window of kept vision rows, so the language graph never needs the whole prompt's.
  With compute context lengths (docs/design.md#specializations) each of them comes once per length, binding
  ``comp_ctx_len`` too and named ``Prefill_<len>`` / ``Decode_<len>``: a call reads only that many
  slots of its KV row, and the host picks the smallest length holding the call's last slot.
  With continuous batching both also bind ``full_batch_size`` (the KV cache rows); prefill
  runs ``batch_size = 1`` (one request into its row) and decode ``batch_size = full_batch_size``
  (or a chosen decode batch), QEfficient's CB layout;
* vision: the encoder, one entry per (resolution, frames per call F)
  (``EncoderTarget``), whatever the video's length; each pruning graph, one entry per distinct
  symbol binding of (resolution, frame bucket) (``PruningTarget``), whatever the video's length up to
  the bucket and the rate: several targets can share one entry (two resolutions with as many merged
  tokens per frame), and the entry remembers which targets it serves so the manifest and the host can
  find it again.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

PREFILL_NAME = "Prefill"
DECODE_NAME = "Decode"
VISION_NAME = "Vision"
COMP_CTX_SYMBOL = "comp_ctx_len"  # slots a call reads of its KV row: the length of input comp_ctx_lengths
# Logits a call computes per batch row: the length of input logits_rows. Every specialization binds 1; only the
# host backends run a call with 0 (a prefill chunk before the prompt's last, whose logits nobody reads).
NUM_LOGITS_SYMBOL = "num_logits"

# Temporal patches per encoder call. Measured on this machine (docs/performance.md): Qwen2.5-VL-3B
# vision widths at 448x448, ONNX Runtime CPU time per temporal patch for F = 1, 2, 4, 8 was 0.82,
# 0.74, 0.82, 0.88 s; a call's memory grows with F and a short last batch pads up to F - 1 zero
# frames. With 2, every multiple of 4 sampled frames runs unpadded.
DEFAULT_FRAMES_PER_CALL = 2
# The frame buckets when --frames is not given: powers of two temporal patches up to this many frames. A
# video pads to the smallest bucket that holds it, so the pruning graph computes at most twice its real
# rows (docs/performance.md: the padding's measured cost).
DEFAULT_MAX_FRAMES = 64
# The default compute context lengths: ctx_len, ctx_len / 4, ctx_len / 16, ... down to this floor (a 32k
# export gets 2048, 8192, 32768, as QEfficient's examples). Steps of 4 keep a call within 4x of the slots
# it needs; below 2k a decode step's weights, not its KV reads, set the time.
DEFAULT_MIN_COMP_CTX_LEN = 2048
COMP_CTX_STEP = 4
# The default shorter prefill lengths (--short-prefill-lens): prefill_seq_len / 2, / 4, ... down to this floor, so
# a chunk (a prompt's tail, a chunk vLLM's budget cut short) is padded to under twice its tokens (above the floor).
# A chunk's time is close to linear in its length at Qwen2.5-VL-3B widths (docs/performance.md, prefill lengths);
# below 32 the call's fixed cost dominates.
DEFAULT_SHORT_PREFILL_LEN = 32


@dataclass(frozen=True)
class TargetDefaults:
    """What ``export --target`` changes: the default prefill length, the step of the compute context ladder and the
    dtype the weights are stored in."""

    prefill_seq_len: int
    comp_ctx_step: int
    weight_dtype: str = "float32"


# The card's programs run chunks of 128 (QEfficient's default) and each compute context length is a program to
# compile and load, hence steps of 4. ONNX Runtime on a CPU has neither limit: it spends less per token in longer
# chunks (Qwen2.5-VL-3B widths: 7.1 ms of CPU per token in a 2048-token chunk against 7.9 in chunks of 128), a shorter
# prompt or tail still runs in the short lengths (halved down to 32), and a length costs nothing to add, so steps of
# 2 (a 64-token tail at slot 2048 read 4096 slots in 0.36-0.48 s instead of 8192 in 0.64-1.09 s); see
# docs/performance.md, time to first token.
# The card compiles fp16 (-convert-to-fp16) from whatever the graph stores, so a card export stores fp16 weights: half
# the disk and the load. ONNX Runtime computes in fp32 from fp32 weights.
TARGETS = {"card": TargetDefaults(prefill_seq_len=128, comp_ctx_step=COMP_CTX_STEP, weight_dtype="float16"),
           "cpu": TargetDefaults(prefill_seq_len=2048, comp_ctx_step=2, weight_dtype="float32")}



def _check_dimension(symbol: str, value: object, context: str) -> int:
    """A bound dimension must be a positive Python/NumPy integer (never a bool or float)."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise ValueError(
            f"{context}: symbol {symbol!r} is bound to {value!r} ({type(value).__name__}); "
            "bind every symbol to a positive integer"
        )
    number = int(value)
    if number < 1:
        raise ValueError(f"{context}: symbol {symbol!r} is bound to {number}; dimensions must be >= 1")
    return number


def check_frames_per_call(value: object, name: str = "frames per call") -> int:
    """``value`` as an int when it is a positive whole number of temporal patches per encoder call; else a
    ValueError that names it as the caller spells it (``name``: a flag, a field).

    The one check of F: the export's options, the encoder graph's symbols and the host's vision pipeline call it.
    """
    if isinstance(value, bool) or int(value) != value or value < 1:
        raise ValueError(f"{name} must be a positive integer (temporal patches per encoder call), got {value!r}")
    return int(value)


def check_frame_size(height: int, width: int, factor: int, *, exported: bool = False) -> None:
    """Raise a ValueError suggesting the nearest valid size unless ``height`` and ``width`` are both positive
    multiples of ``factor`` = patch_size * merge_size (one merged token covers factor x factor pixels).

    The one check of a frame size the encoder sees: the export's ``--height``/``--width``, the processor's
    exported sizes (``exported``: worded as a size an export holds) and the patches cut from frames.
    """
    if height < 1 or width < 1 or height % factor or width % factor:
        nearest = f"{max(factor, round(height / factor) * factor)}x{max(factor, round(width / factor) * factor)}"
        if exported:
            raise ValueError(f"frame size {height}x{width} must be positive multiples of patch_size*merge_size="
                             f"{factor}; use e.g. {nearest}")
        raise ValueError(f"frame size {height}x{width} is not a positive multiple of patch_size*merge_size = "
                         f"{factor}; use e.g. {nearest}")


@dataclass(frozen=True)
class PruningTarget:
    """One video shape a pruning graph is compiled for: frames of ``height`` x ``width`` pixels (what the
    encoder sees), padded to a bucket of ``frames`` sampled frames (``--frames``)."""

    height: int
    width: int
    frames: int

    def __post_init__(self) -> None:
        for label in ("height", "width", "frames"):
            _check_dimension(label, getattr(self, label), "PruningTarget")

    def to_dict(self) -> dict[str, int]:
        return {"height": self.height, "width": self.width, "frames": self.frames}


@dataclass(frozen=True)
class EncoderTarget:
    """One encoder call shape: ``frames_per_call`` temporal patches of ``height`` x ``width`` pixels."""

    height: int
    width: int
    frames_per_call: int

    def __post_init__(self) -> None:
        for label in ("height", "width", "frames_per_call"):
            _check_dimension(label, getattr(self, label), "EncoderTarget")

    def to_dict(self) -> dict[str, int]:
        return {"height": self.height, "width": self.width, "frames_per_call": self.frames_per_call}


@dataclass(frozen=True)
class Specialization:
    """A named binding of ONNX dimension symbols to integers; ``serves`` lists the vision targets it covers."""

    name: str
    symbols: Mapping[str, int]
    serves: tuple[PruningTarget | EncoderTarget, ...] = field(default=())

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"a specialization needs a non-empty string name, got {self.name!r}")
        if not self.symbols:
            raise ValueError(f"specialization {self.name!r} binds no symbols; pass at least one symbol value")
        checked = {
            str(symbol): _check_dimension(str(symbol), value, f"specialization {self.name!r}")
            for symbol, value in self.symbols.items()
        }
        # A private dict copy: callers cannot change a specialization after it was validated.
        object.__setattr__(self, "symbols", checked)
        object.__setattr__(self, "serves", tuple(self.serves))


def comp_ctx_lengths(requested: Sequence[int] | None, ctx_len: int, prefill_seq_len: int,
                     step: int = COMP_CTX_STEP) -> tuple[int, ...]:
    """The export's compute context lengths, ascending and ending at ``ctx_len``; ``()`` when that is the only
    one (the graph then reads all of ``ctx_len`` and has no ``comp_ctx_lengths`` input).

    ``requested`` (``--ctx-lengths``): lengths in ``[prefill_seq_len, ctx_len]``; ``ctx_len`` is added when
    missing (every position must have a length). None: ``ctx_len / step**k`` down to ``DEFAULT_MIN_COMP_CTX_LEN``.
    Example: ``comp_ctx_lengths(None, 32768, 128) == (2048, 8192, 32768)``.
    """
    if requested is None:
        lengths, length = [], ctx_len
        while length >= DEFAULT_MIN_COMP_CTX_LEN and length >= prefill_seq_len:
            lengths.append(length)
            if length % step:
                break
            length //= step
        requested = lengths or [ctx_len]
    lengths = sorted({_check_dimension("a compute context length", n, "--ctx-lengths") for n in requested})
    outside = [n for n in lengths if not prefill_seq_len <= n <= ctx_len]
    if outside:
        raise ValueError(f"--ctx-lengths {outside} lie outside [prefill_seq_len={prefill_seq_len}, ctx_len={ctx_len}]"
                         f"; a length must hold one prefill chunk and fit the KV cache: use values in that range")
    if lengths[-1] != ctx_len:
        lengths.append(ctx_len)
    return tuple(lengths) if len(lengths) > 1 else ()


def short_prefill_lens(requested: Sequence[int] | None, prefill_seq_len: int) -> tuple[int, ...]:
    """The shorter prefill lengths besides ``prefill_seq_len``, ascending (``--short-prefill-lens``).

    Each lies in ``[2, prefill_seq_len)`` (length 1 is decode's); ``requested`` None: ``prefill_seq_len`` halved
    while the half is a whole number of at least ``DEFAULT_SHORT_PREFILL_LEN``. Example:
    ``short_prefill_lens(None, 128) == (32, 64)``.
    """
    if requested is None:
        lengths, length = [], prefill_seq_len
        while length % 2 == 0 and length // 2 >= DEFAULT_SHORT_PREFILL_LEN:
            length //= 2
            lengths.append(length)
        return tuple(sorted(lengths))
    lengths = sorted({_check_dimension("a short prefill length", n, "--short-prefill-lens") for n in requested})
    outside = [n for n in lengths if not 2 <= n < prefill_seq_len]
    if outside:
        raise ValueError(f"--short-prefill-lens {outside} lie outside [2, prefill_seq_len={prefill_seq_len}): a short "
                         "length is below the full chunk and above decode's 1; use values in that range")
    return tuple(lengths)


def chunk_seq_len(scheduled: int, prefill_seq_len: int, short_lens: Sequence[int] = ()) -> int:
    """The prefill length a chunk of ``scheduled`` tokens runs in: the shortest of ``short_lens`` and
    ``prefill_seq_len`` holding it (the chunk is padded to it). Example: ``chunk_seq_len(34, 128, (32,)) == 128``."""
    if not 1 <= scheduled <= prefill_seq_len:
        raise ValueError(f"chunk of {scheduled} tokens exceeds the prefill length {prefill_seq_len}"
                         if scheduled > prefill_seq_len else f"a prefill chunk needs at least one token, got {scheduled}")
    return min(n for n in (*short_lens, prefill_seq_len) if n >= scheduled)


def call_len_refusal(seq_len: int, prefill_lens: Sequence[int]) -> str | None:
    """Why a language-graph call of ``seq_len`` tokens has no specialization (one line), or None.

    ``prefill_lens``: the export's prefill lengths, ascending (``LanguageShape.prefill_lens``; empty: not known, no
    refusal); one token is decode's. The card runs a call only in a specialization of exactly its shape, so a
    shorter chunk is padded to the shortest length holding it (:func:`chunk_seq_len`) before it is sent: a host
    session refuses the unpadded call as the card would, rather than run a graph the card has not got.
    Example: ``call_len_refusal(50, (32, 128))`` names 128, the length to pad to.
    """
    if not prefill_lens or seq_len == 1 or seq_len in prefill_lens:
        return None
    lengths = ", ".join(str(n) for n in prefill_lens)
    longest = prefill_lens[-1]
    if seq_len > longest:
        return (f"a language-graph call of {seq_len} tokens is longer than the export's prefill length {longest} "
                f"(its prefill specializations take {lengths} tokens, decode 1); cut the prompt into chunks of at "
                f"most {longest} tokens, as the engines do, or re-export with --prefill-seq-len {seq_len}")
    return (f"a language-graph call of {seq_len} tokens has no specialization: the export's prefill lengths are "
            f"{lengths} (decode 1); pad the chunk to {chunk_seq_len(seq_len, longest, prefill_lens[:-1])} tokens "
            "(ids past its end any, positions -1), the shortest length holding it, as the engines do, or "
            f"re-export with --short-prefill-lens including {seq_len}")


def _per_comp_ctx_len(specs: list[Specialization], lengths: Sequence[int]) -> list[Specialization]:
    """Each entry once per compute context length (``comp_ctx_len`` bound, ``_<len>`` in its name); as given
    without lengths."""
    return [Specialization(f"{spec.name}_{n}", {**spec.symbols, COMP_CTX_SYMBOL: n})
            for spec in specs for n in lengths] if lengths else specs


def language_specializations(
    prefill_seq_len: int,
    ctx_len: int,
    user_vision_size: int | None = None,
    batch_size: int = 1,
    full_batch_size: int | None = None,
    decode_batch_size: int | None = None,
    comp_ctx_lengths: Sequence[int] = (),
    short_prefill_lens: Sequence[int] = (),
    logits_rows: bool = False,
) -> list[Specialization]:
    """``[Prefill, Decode]`` for the language graph, both with ``vision_size = user_vision_size``.

    ``user_vision_size`` defaults to ``prefill_seq_len``: a chunk of ``seq_len`` tokens holds
    at most ``seq_len`` media tokens, so that many rows always suffice and fewer would not.
    With ``prefill_seq_len == 1`` the two entries coincide and only ``Decode`` is returned.

    ``full_batch_size`` (continuous batching; the graph was exported with ``batch_index``) adds
    that symbol to both entries, sets the prefill ``batch_size`` to 1 and the decode
    ``batch_size`` to ``decode_batch_size`` (default ``full_batch_size``). Then a one-token
    prefill still needs its own batch-1 entry unless the decode batch is 1 too.

    ``comp_ctx_lengths`` (from :func:`comp_ctx_lengths`; empty: none): every entry once per length, the
    prefill ones too (a chunk early in a long context then reads only the slots it can see).
    ``short_prefill_lens`` (from :func:`short_prefill_lens`): a prefill entry ``Prefill<n>`` per shorter length
    ``n`` after ``Prefill``, the same window (``vision_size = user_vision_size``: a chunk's own rows only, at most
    ``n``, zero-padded; the retained window keeps one size across entries).
    ``logits_rows`` (the graph takes ``logits_rows``): every entry binds ``num_logits`` to 1, the card computing a
    chunk's logits as before (a 0-row entry, which would spare it the LM head on the chunks before a prompt's last,
    waits for a check that qaic-compile takes a zero-sized dimension).
    """
    context = "language_specializations"
    prefill_seq_len = _check_dimension("prefill_seq_len", prefill_seq_len, context)
    ctx_len = _check_dimension("ctx_len", ctx_len, context)
    batch_size = _check_dimension("batch_size", batch_size, context)
    cb = _continuous_batching_sizes(batch_size, full_batch_size, decode_batch_size)
    if user_vision_size is None:
        user_vision_size = prefill_seq_len
    user_vision_size = _check_dimension("user_vision_size", user_vision_size, "language_specializations")

    if prefill_seq_len >= ctx_len:
        raise ValueError(
            f"prefill_seq_len={prefill_seq_len} must be smaller than ctx_len={ctx_len}; "
            "raise --ctx-len or lower --prefill-seq-len"
        )
    if user_vision_size < prefill_seq_len:
        raise ValueError(
            f"user_vision_size={user_vision_size} is smaller than prefill_seq_len={prefill_seq_len}: "
            "a chunk can hold at most seq_len media tokens, so vision_size must be >= seq_len; "
            f"use user_vision_size >= {prefill_seq_len} (or leave it unset)"
        )
    if user_vision_size >= ctx_len:
        raise ValueError(
            f"user_vision_size={user_vision_size} must be smaller than ctx_len={ctx_len}; "
            "lower user_vision_size or raise --ctx-len"
        )

    if comp_ctx_lengths and tuple(comp_ctx_lengths)[-1] != ctx_len:
        raise ValueError(f"compute context lengths {list(comp_ctx_lengths)} must end at ctx_len={ctx_len}")
    shared = {"batch_size": batch_size, "ctx_len": ctx_len, "vision_size": user_vision_size,
              **({NUM_LOGITS_SYMBOL: 1} if logits_rows else {})}
    short = [n for n in short_prefill_lens if n != prefill_seq_len]
    if any(not 2 <= n < prefill_seq_len for n in short):
        raise ValueError(f"short prefill lengths {list(short)} must lie in [2, prefill_seq_len={prefill_seq_len})")
    if cb is None:
        decode = Specialization(DECODE_NAME, {**shared, "seq_len": 1})
        if prefill_seq_len == 1:
            return _per_comp_ctx_len([decode], comp_ctx_lengths)
        prefill = [Specialization(prefill_name(n, prefill_seq_len), {**shared, "seq_len": n})
                   for n in (prefill_seq_len, *short)]
        return _per_comp_ctx_len([*prefill, decode], comp_ctx_lengths)

    full, decode_batch = cb
    shared["full_batch_size"] = full
    prefill = [Specialization(prefill_name(n, prefill_seq_len), {**shared, "batch_size": 1, "seq_len": n})
               for n in (prefill_seq_len, *short)]
    decode = Specialization(DECODE_NAME, {**shared, "batch_size": decode_batch, "seq_len": 1})
    if prefill[0].symbols == decode.symbols:
        return _per_comp_ctx_len([decode], comp_ctx_lengths)
    return _per_comp_ctx_len([*prefill, decode], comp_ctx_lengths)


def prefill_name(seq_len: int, prefill_seq_len: int) -> str:
    """``Prefill`` for the full chunk length, ``Prefill<seq_len>`` for a shorter one."""
    return PREFILL_NAME if seq_len == prefill_seq_len else f"{PREFILL_NAME}{seq_len}"


def _continuous_batching_sizes(
    batch_size: int, full_batch_size: int | None, decode_batch_size: int | None
) -> tuple[int, int] | None:
    """``(full_batch_size, decode batch)`` when continuous batching is asked for, else None."""
    context = "language_specializations"
    if full_batch_size is None:
        if decode_batch_size is not None:
            raise ValueError(
                f"decode_batch_size={decode_batch_size} needs continuous batching; also pass full_batch_size "
                "(the KV cache rows) or drop decode_batch_size"
            )
        return None
    full = _check_dimension("full_batch_size", full_batch_size, context)
    if batch_size != 1:
        raise ValueError(
            f"batch_size={batch_size} with full_batch_size={full}: continuous batching prefills one request per "
            "call (batch_size 1) and decodes up to full_batch_size rows; leave batch_size at 1"
        )
    decode = full if decode_batch_size is None else _check_dimension("decode_batch_size", decode_batch_size, context)
    if decode > full:
        raise ValueError(
            f"decode_batch_size={decode} exceeds full_batch_size={full}: a decode call's rows need distinct KV "
            f"cache rows; use decode_batch_size <= {full}"
        )
    return full, decode


def vision_specializations(
    entries: Iterable[tuple[PruningTarget | EncoderTarget, Mapping[str, int]]],
) -> list[Specialization]:
    """De-duplicate per-target vision symbol bindings, keeping which targets each one serves.

    ``entries`` pairs each target with the symbols its family computed (encoder: ``grid_h``, ``grid_w``,
    ``grid_height``, ``merged_rows``, ...; pruning: ``frame_bucket``, ``bucket_tokens``). Identical bindings
    collapse into one specialization, in first-seen order; names follow QEfficient: ``Vision`` when there is
    one, else ``Vision_0``, ``Vision_1``... (for the encoder and the pruning graphs alike).
    """
    # Keyed by the sorted binding (so symbol order does not matter); the first-seen dict is kept for output.
    groups: dict[tuple[tuple[str, int], ...], tuple[dict[str, int], list[PruningTarget | EncoderTarget]]] = {}
    first_keys: set[str] | None = None
    for target, symbols in entries:
        if not isinstance(target, (PruningTarget, EncoderTarget)):
            raise ValueError(f"vision entries pair a PruningTarget or EncoderTarget with its symbols, got {target!r}")
        checked = Specialization(VISION_NAME, symbols).symbols
        keys = set(checked)
        if first_keys is None:
            first_keys = keys
        elif keys != first_keys:
            raise ValueError(
                f"vision target {target} binds symbols {sorted(keys)} but earlier targets bind "
                f"{sorted(first_keys)}; one graph needs the same symbols in every specialization"
            )
        _, served = groups.setdefault(tuple(sorted(checked.items())), (dict(checked), []))
        if target not in served:
            served.append(target)
    if not groups:
        raise ValueError("no vision targets given; pass at least one (resolution, frames) entry")

    def name(index: int) -> str:
        return VISION_NAME if len(groups) == 1 else f"{VISION_NAME}_{index}"

    return [
        Specialization(name(i), symbols, tuple(targets)) for i, (symbols, targets) in enumerate(groups.values())
    ]


def specialization_for_target(specs: Sequence[Specialization], target: PruningTarget | EncoderTarget
                              ) -> Specialization:
    """The vision specialization compiled for ``target``; ValueError listing what exists otherwise."""
    for spec in specs:
        if target in spec.serves:
            return spec
    available = [t.to_dict() for spec in specs for t in spec.serves]
    raise ValueError(
        f"no vision specialization serves {target.to_dict()}; compiled targets are {available}. "
        "Re-export with this resolution/frame bucket, or pick one of those"
    )


def manifest_entries(specs: Sequence[Specialization]) -> list[dict]:
    """JSON-ready records: each specialization's name, symbols and the targets it serves."""
    return [
        {
            "name": spec.name,
            "symbols": dict(spec.symbols),
            "serves": [target.to_dict() for target in spec.serves],
        }
        for spec in specs
    ]


def default_sampled_frame_buckets(max_frames: int, temporal_patch_size: int) -> tuple[int, ...]:
    """Frame buckets in sampled frames up to ``max_frames``: 1, 2, 4, ... temporal patches, then ``max_frames``.

    Example: ``max_frames=48``, temporal patch 2 -> ``(2, 4, 8, 16, 32, 48)``.
    """
    _check_dimension("max_frames", max_frames, "default_sampled_frame_buckets")
    if max_frames % temporal_patch_size:
        raise ValueError(f"--max-frames {max_frames} must be a multiple of temporal_patch_size {temporal_patch_size}")
    patches = max_frames // temporal_patch_size
    buckets, bucket = [], 1
    while bucket < patches:
        buckets.append(bucket)
        bucket *= 2
    return tuple(b * temporal_patch_size for b in (*buckets, patches))
