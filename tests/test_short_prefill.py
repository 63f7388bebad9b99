"""Shorter prefill lengths (docs/design.md#specializations): a chunk that holds fewer tokens (a prompt's tail) runs in
the shortest prefill specialization holding it, with the window of its own vision rows, and gives what today's export
gives.

The reference is the session's export (``tiny_export``: one prefill length, 32, window 48), cut every 32 tokens.
The same checkpoint is exported again with ``--short-prefill-lens 8,24``; several chunkings of the same request
(the default cut, whose tail now runs at 24, and cuts of 5, 13 and 16 tokens) must give the same greedy
tokens and logits (1e-4), the same vision rows per chunk, and on the fake card run in the specializations of
those lengths.
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import numpy as np
import pytest

from qeff_evs.export.pipeline import export_checkpoint
from qeff_evs.manifest import read_manifest
from qeff_evs.runtime.builders import engine_config
from qeff_evs.runtime.engine.single_request import Engine
from qeff_evs.runtime.export_bundle import open_export
from qeff_evs.runtime.inputs.prompt import video_question_pieces
from qeff_evs.runtime.media import video_from_file
from qeff_evs.runtime.sessions import sessions_for
from qeff_evs.specializations import language_specializations, read_specializations_json, short_prefill_lens
from qeff_evs.specializations.sets import chunk_seq_len
from test_ctx_lengths import LogitsLog
from test_kv_zero_once import card, for_the_card  # noqa: F401 (card: the fake SDK fixture)

SHORT = (8, 24)  # the 84-token prompt's 20-token tail runs at 24; cuts of 5 at 8, of 13 and 16 at 24
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def short_export(tiny_checkpoint, export_options, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("short_prefill")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        export_checkpoint(tiny_checkpoint, folder, dataclasses.replace(export_options, short_prefill_lens=SHORT))
    return folder


def cuts(total: int, size: int) -> list[tuple[int, int]]:
    return [(start, min(size, total - start)) for start in range(0, total, size)]


def _generate(export: Path, backend: str, video_npy: Path, question: str, chunking: int | None):
    """(tokens, every logits array, vision rows per chunk, prompt length) of one request cut every ``chunking``
    tokens (None: the engine's default cut, every prefill_seq_len)."""
    bundle = open_export(export)
    vision, language = sessions_for(bundle, backend)
    log = LogitsLog(language)
    engine = Engine(bundle.family, vision, log, engine_config(bundle, max_new_tokens=NEW_TOKENS))
    pieces = video_question_pieces(bundle.tokenizer, question, bundle.family.token_strings)
    prompt = engine.prepare(pieces, [video_from_file(video_npy, bundle)])
    chunks = None if chunking is None else cuts(len(prompt.ids), chunking)
    result = engine.generate(prompt, eos_ids=(), chunks=chunks)
    engine.close()
    return result.generated_token_ids, log.logits, result.vision_rows_per_chunk, len(prompt.ids)


def test_lengths_and_specializations():
    assert short_prefill_lens(None, 128) == (32, 64)
    assert short_prefill_lens(None, 96) == (48,)
    assert short_prefill_lens(None, 32) == ()
    assert short_prefill_lens((16, 8, 16), 32) == (8, 16)
    with pytest.raises(ValueError, match=r"--short-prefill-lens \[1, 32\] lie outside \[2, prefill_seq_len=32\)"):
        short_prefill_lens((1, 32), 32)
    assert [chunk_seq_len(n, 32, SHORT) for n in (1, 8, 9, 24, 25, 32)] == [8, 8, 24, 24, 32, 32]
    with pytest.raises(ValueError, match="chunk of 33 tokens exceeds the prefill length 32"):
        chunk_seq_len(33, 32, SHORT)
    specs = language_specializations(32, 256, 48, short_prefill_lens=SHORT, comp_ctx_lengths=(64, 256))
    assert [(s.name, s.symbols["seq_len"], s.symbols["vision_size"]) for s in specs] == [
        ("Prefill_64", 32, 48), ("Prefill_256", 32, 48), ("Prefill8_64", 8, 48), ("Prefill8_256", 8, 48),
        ("Prefill24_64", 24, 48), ("Prefill24_256", 24, 48), ("Decode_64", 1, 48), ("Decode_256", 1, 48)]


def test_export_records_the_lengths(short_export, tiny_export):
    m = read_manifest(short_export)
    assert m.short_prefill_lens == SHORT and read_manifest(tiny_export).short_prefill_lens == ()
    named = read_specializations_json(short_export / m.files["language_specializations_named"])
    flat = read_specializations_json(short_export / m.files["language_specializations"])
    assert [s.name for s in named] == [s.name for s in flat] == ["Prefill", "Prefill8", "Prefill24", "Decode"]


@pytest.fixture(scope="module")
def today(tiny_export, video_npy, question):
    """The request on today's export (one prefill length), cut every 32 tokens."""
    return _generate(tiny_export, "ort", video_npy, question, None)


@pytest.mark.parametrize("chunking", [None, 5, 13, 16])
def test_any_chunking_gives_todays_tokens_and_logits(short_export, today, video_npy, question, chunking):
    ref_tokens, ref_logits, ref_rows, total = today
    tokens, logits, rows, _ = _generate(short_export, "ort", video_npy, question, chunking)
    assert tokens == ref_tokens
    assert sum(rows) == sum(ref_rows)  # each chunk sent its own rows: every kept row once
    # The last chunk's logits (the first token) and every decode step's: the last NEW_TOKENS calls.
    for got, want in zip(logits[-NEW_TOKENS:], ref_logits[-NEW_TOKENS:], strict=True):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    if chunking is None:  # the same cut: the same calls, the tail in a short length
        assert rows == ref_rows and len(logits) == len(ref_logits)
        for got, want in zip(logits, ref_logits):
            np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
        assert total % 32 and chunk_seq_len(total % 32, 32, SHORT) < 32  # the tail did run short


def test_a_graph_unrolled_for_one_length_refuses_short_lengths(served_export, tmp_path):
    checkpoint, export = served_export("qwen3_5")
    m = read_manifest(export)
    assert m.short_prefill_lens == ()
    options = dataclasses.replace(_served_options(m), short_prefill_lens=(8,))
    with pytest.raises(ValueError, match=r"--short-prefill-lens \[8\]: qwen3_5's language graph is unrolled for one "
                                         "prefill length"):
        export_checkpoint(checkpoint, tmp_path, options)


def _served_options(m):
    from qeff_evs.export.pipeline import ExportOptions

    return ExportOptions(m.video_pruning_rate, m.sampled_frame_buckets, m.resolutions, m.prefill_seq_len, m.ctx_len,
                         full_batch_size=m.language_shape.full_batch_size)


def test_the_fake_card_runs_the_tail_in_its_specialization(short_export, video_npy, question, tmp_path, card):
    export = for_the_card(short_export, tmp_path)
    tokens, _, _, total = _generate(export, "qaic", video_npy, question, None)
    assert len(tokens) == NEW_TOKENS
    prefill = [c.dims["input_ids"][1] for c in card.language_calls() if c.dims["input_ids"][1] > 1]
    assert prefill == [chunk_seq_len(n, 32, SHORT) for _, n in cuts(total, 32)]
    assert prefill[-1] in SHORT
