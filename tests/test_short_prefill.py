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
from qeff_evs.runtime.backends.base import LanguageInputs
from qeff_evs.runtime.builders import engine_config
from qeff_evs.runtime.engine.single_request import Engine
from qeff_evs.runtime.engine.window import prefill_chunks
from qeff_evs.runtime.export_bundle import open_export
from qeff_evs.runtime.inputs.prompt import video_question_pieces
from qeff_evs.runtime.media import video_from_file
from qeff_evs.runtime.sessions import language_session, sessions_for
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


def test_the_default_cut_pads_no_chunk_by_more_than_the_shortest_length():
    """The engine's default cut: full chunks, then a tail padded by at most the shortest length (else cut again at the
    longest length it holds); every prompt covered in order; without shorter lengths, today's cut every chunk."""
    lengths = (32, 64, 128, 256, 512, 1024)
    assert prefill_chunks(1058, 2048, lengths) == [(0, 1024), (1024, 34)]  # not one chunk padded to 2048
    assert prefill_chunks(2082, 2048, lengths) == [(0, 2048), (2048, 34)]
    assert prefill_chunks(100, 128, (32, 64)) == [(0, 100)]  # 28 padded: one call
    assert prefill_chunks(65, 128, (32, 64)) == [(0, 64), (64, 1)]  # 63 padded would be more than a 32-token call
    for total in range(1, 700):
        chunks = prefill_chunks(total, 256, lengths[:3])
        assert [c for c, _ in chunks] == list(np.cumsum([0] + [n for _, n in chunks])[:-1])
        assert sum(n for _, n in chunks) == total
        assert all(chunk_seq_len(n, 256, lengths[:3]) - n <= 32 for _, n in chunks), total
        assert prefill_chunks(total, 32) == cuts(total, 32)


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


def text_call(n: int, shape) -> LanguageInputs:
    """A call of ``n`` text tokens at KV slots 0.. (its window all zeros)."""
    positions = np.broadcast_to(np.arange(n, dtype=np.int64), (4, 1, n)).copy()
    window = np.zeros((1, shape.vision_size, shape.hidden), np.float32)
    extras = {name: np.zeros((levels, 1, shape.vision_size, shape.hidden), np.float32)
              for name, levels in shape.extras.items()}
    return LanguageInputs(np.full((1, n), 5, np.int64), positions, window, extras, np.zeros((1, 1), np.int64), 0)


CALL_LENGTHS = (1, 5, 8, 12, 24, 25, 32, 33)  # the export takes 8, 24, 32 and decode's 1


def accepted_lengths(language) -> tuple[set[int], dict[int, str]]:
    """The lengths of ``CALL_LENGTHS`` a language session runs, and the refusal of each other one."""
    runs, refusals = set(), {}
    for n in CALL_LENGTHS:
        try:
            language.run(text_call(n, language.shape))
            runs.add(n)
        except ValueError as error:
            refusals[n] = str(error)
    return runs, refusals


@pytest.mark.parametrize("backend", ["ort", "torch"])
def test_host_sessions_refuse_a_length_the_export_has_not(short_export, backend):
    """A custom engine that calls the language session with an unpadded chunk is refused as the card refuses it
    (the next test), before the graph runs: a length between two prefill lengths, and one past the longest."""
    language = language_session(open_export(short_export), backend)
    assert language.shape.prefill_lens == (8, 24, 32)
    runs, refusals = accepted_lengths(language)
    assert runs == {1, 8, 24, 32}
    assert refusals[12] == (
        "a language-graph call of 12 tokens has no specialization: the export's prefill lengths are 8, 24, 32 "
        "(decode 1); pad the chunk to 24 tokens (ids past its end any, positions -1), the shortest length holding "
        "it, as the engines do, or re-export with --short-prefill-lens including 12")
    assert refusals[5].startswith("a language-graph call of 5 tokens has no specialization") and "pad the chunk to 8 " \
        in refusals[5]
    assert refusals[33] == (
        "a language-graph call of 33 tokens is longer than the export's prefill length 32 (its prefill "
        "specializations take 8, 24, 32 tokens, decode 1); cut the prompt into chunks of at most 32 tokens, as the "
        "engines do, or re-export with --prefill-seq-len 33")
    before = {name: np.array(value) for name, value in language.state.items()}
    with pytest.raises(ValueError, match="call of 25 tokens"):
        language.run(text_call(25, language.shape))
    for name, value in language.state.items():  # refused before the graph ran: no slot written
        np.testing.assert_array_equal(value, before[name], err_msg=name)


def test_the_fake_card_takes_the_same_lengths(short_export, tmp_path, card):
    """The fake card, whose program matches each call's shapes against the compiled ones, runs the lengths the host
    sessions run and refuses the others (its own message, listing what was compiled)."""
    language = language_session(open_export(for_the_card(short_export, tmp_path)), "qaic")
    runs, refusals = accepted_lengths(language)
    assert runs == {1, 8, 24, 32}
    assert all("no compiled specialization" in message for message in refusals.values())
