"""Logits rows: a prefill chunk before the prompt's last computes no logits on the host backends.

The language graph takes ``logits_rows``, whose length (1 or 0) is how many logits each row gets; with 0 the LM head
runs on no rows and reads none of its ``vocab x hidden`` weights. The reference is the same export run the way the
card runs it, every chunk computing its logits row (``skips_unread_logits`` off): one call with each length must
leave the same KV cache and window bit for bit, and a request must give the same greedy tokens and logits (1e-4)
on ONNX Runtime and the PyTorch backend with its chunks before the last run with none. On the fake card every
specialization binds ``num_logits`` 1 and every call sends one row.
"""

from __future__ import annotations

import numpy as np
import pytest

from qeff_evs.manifest import read_manifest
from qeff_evs.models.graph_io import LOGITS_ROWS, NUM_LOGITS
from qeff_evs.runtime.builders import engine_config
from qeff_evs.runtime.engine.single_request import Engine
from qeff_evs.runtime.engine.steps import prefill_step
from qeff_evs.runtime.export_bundle import open_export
from qeff_evs.runtime.inputs.prompt import video_question_pieces
from qeff_evs.runtime.media import video_from_file
from qeff_evs.runtime.sessions import sessions_for
from qeff_evs.specializations import read_specializations_json
from test_ctx_lengths import LogitsLog
from test_kv_zero_once import card, for_the_card  # noqa: F401 (card: the fake SDK fixture)

NEW_TOKENS = 4


class RowsLog(LogitsLog):
    """Also keeps the length of ``logits_rows`` each call sent (spying on the inner session's ``_call``)."""

    def __init__(self, inner):
        super().__init__(inner)
        self.rows: list[int] = []
        call = inner._call

        def spy(inputs):
            self.rows.append(len(inputs[LOGITS_ROWS]))
            return call(inputs)
        inner._call = spy


def _generate(export, backend, video_npy, question, skip: bool):
    bundle = open_export(export)
    vision, language = sessions_for(bundle, backend)
    language.skips_unread_logits = skip  # off: every chunk computes its logits row, as on the card
    log = RowsLog(language)
    engine = Engine(bundle.family, vision, log, engine_config(bundle, max_new_tokens=NEW_TOKENS))
    prompt = engine.prepare(video_question_pieces(bundle.tokenizer, question, bundle.family.token_strings),
                            [video_from_file(video_npy, bundle)])
    result = engine.generate(prompt, eos_ids=())
    chunks = -(-len(prompt.ids) // bundle.manifest.prefill_seq_len)
    return result.generated_token_ids, log, chunks


def test_the_export_takes_logits_rows_and_the_card_binds_one(tiny_export):
    m = read_manifest(tiny_export)
    assert m.language_shape.logits_rows
    specs = read_specializations_json(tiny_export / m.files["language_specializations"])
    assert specs and all(s.symbols[NUM_LOGITS] == 1 for s in specs)


@pytest.mark.parametrize("backend", ["ort", "torch"])
def test_chunks_before_the_last_compute_no_logits_and_change_nothing(tiny_export, video_npy, question, backend):
    ref_tokens, ref, chunks = _generate(tiny_export, backend, video_npy, question, skip=False)
    tokens, got, _ = _generate(tiny_export, backend, video_npy, question, skip=True)
    assert chunks > 1 and ref.rows == [1] * (chunks + NEW_TOKENS - 1)
    assert got.rows == [0] * (chunks - 1) + [1] * NEW_TOKENS
    assert tokens == ref_tokens
    assert all(a.shape[1] == 0 for a in got.logits[:chunks - 1])
    for have, want in zip(got.logits[chunks - 1:], ref.logits[chunks - 1:], strict=True):
        np.testing.assert_allclose(have, want, atol=1e-4, rtol=0)


def test_one_call_with_no_logits_rows_leaves_the_same_state(tiny_export, video_npy, question):
    """The graph alone: one chunk with each length of logits_rows from zeroed buffers, every retained output equal."""
    bundle = open_export(tiny_export)
    vision, language = sessions_for(bundle, "ort")
    engine = Engine(bundle.family, vision, language, engine_config(bundle, max_new_tokens=1))
    prompt = engine.prepare(video_question_pieces(bundle.tokenizer, question, bundle.family.token_strings),
                            [video_from_file(video_npy, bundle)])
    shape, n = bundle.language_shape, bundle.manifest.prefill_seq_len
    states = {}
    for wants in (True, False):
        language.reset()
        step = prefill_step(prompt, 0, n, n, shape.vision_size, shape.hidden, shape.extras, wants_logits=wants)
        logits = language.run(step)
        assert logits.shape == (1, int(wants), shape.vocab)
        states[wants] = {name: value.copy() for name, value in language.state.items()}
    for name, value in states[True].items():
        np.testing.assert_array_equal(states[False][name], value, err_msg=name)


def test_the_fake_card_computes_every_chunks_logits(tiny_export, video_npy, question, tmp_path, card):
    export = for_the_card(tiny_export, tmp_path)
    tokens, log, chunks = _generate(export, "qaic", video_npy, question, skip=False)
    assert len(tokens) == NEW_TOKENS
    assert log.rows == [1] * (chunks + NEW_TOKENS - 1)
    assert all(list(c.dims[LOGITS_ROWS]) == [1] for c in card.language_calls())
