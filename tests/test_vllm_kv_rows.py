"""The plugin scheduler's book of KV rows (``qeff_evs/vllm/engine/kv_rows.py``) over the engine's row choice
(``tests/test_row_history.py`` tests the choice itself): rows chosen for vLLM's requests, claims that lapse when
vLLM does not schedule them, histories left by freed requests (what they computed; nothing after a failure or with
reuse off), ``cache_salt`` and ``skip_reading_prefix_cache``. ``test_vllm_serve.py`` holds it to the tokens through
``vllm serve``."""

from __future__ import annotations

from types import SimpleNamespace

from qeff_evs.runtime.engine.row_history import RowChoice
from qeff_evs.vllm.engine.kv_rows import RowBook, media_spans

V = 9  # a media pad id: equal for any two videos of the same size


def request(request_id: str, tokens, video: str | None = None, salt: str | None = None, computed: int = 0):
    """What the book reads of a vLLM ``Request`` (a video's placeholder at tokens 2..4 when ``video`` names one)."""
    features = [] if video is None else [SimpleNamespace(identifier=video,
                                                         mm_position=SimpleNamespace(offset=2, length=3))]
    return SimpleNamespace(request_id=request_id, all_token_ids=list(tokens), mm_features=features, cache_salt=salt,
                           num_computed_tokens=computed)


TURN_1 = (1, 2, V, V, V, 3, 4, 5, 6)  # prompt (6 tokens) and answer (3 tokens: the last one never fed)


def finished_turn(book: RowBook, salt: str | None = None, failed: bool = False) -> int:
    first = request("turn 1", TURN_1[:6], "a", salt)
    book.claim(first)
    row = book.confirm(["turn 1"])["turn 1"]
    first.all_token_ids, first.num_computed_tokens = list(TURN_1), 8
    book.release(first, computed_known=not failed)
    return row


def test_a_follow_up_takes_its_conversations_row_and_reuses_what_turn_1_computed():
    book = RowBook(2, rewindable=True, reuse=True)
    row = finished_turn(book)
    follow_up = request("turn 2", TURN_1[:8] + (7, 8), "a")
    assert (book.claim(follow_up).row, book.claimed["turn 2"].prefix) == (row, 8)
    assert book.confirm(["turn 2"]) == {"turn 2": row}
    assert row not in book.histories  # overwritten from now on


def test_another_video_or_salt_reuses_the_text_before_it_or_nothing():
    book = RowBook(2, rewindable=True, reuse=True)
    finished_turn(book)
    assert book.claim(request("b", TURN_1[:8] + (7,), "b")).prefix == 0  # 2 of 8: not worth the row
    book.confirm([])
    assert book.claim(request("c", TURN_1[:8] + (7,), "a", salt="user 2")).prefix == 0
    salted = RowBook(1, rewindable=True, reuse=True)
    finished_turn(salted, salt="user 2")
    assert salted.claim(request("d", TURN_1[:8] + (7,), "a", salt="user 2")).prefix == 8


def test_a_claim_lapses_when_vllm_does_not_schedule_the_request():
    book = RowBook(1, rewindable=True, reuse=True)
    row = finished_turn(book)
    assert book.claim(request("x", TURN_1[:8] + (7,), "a")).prefix == 8
    assert book.confirm([]) == {}
    assert book.claimed == {} and row in book.histories  # the row still holds turn 1 for the next try


def test_nothing_is_reused_after_a_failure_with_reuse_off_or_skipping_the_cache():
    failed = RowBook(1, rewindable=True, reuse=True)
    finished_turn(failed, failed=True)
    assert failed.claim(request("x", TURN_1[:8] + (7,), "a")).prefix == 0
    off = RowBook(1, rewindable=True, reuse=False)
    finished_turn(off)
    assert off.claim(request("x", TURN_1[:8] + (7,), "a")).prefix == 0
    skip = RowBook(1, rewindable=True, reuse=True)
    finished_turn(skip)
    assert skip.claim(request("x", TURN_1[:8] + (7,), "a"), limit=0).prefix == 0


def test_a_row_that_cannot_rewind_is_reused_only_whole():
    book = RowBook(1, rewindable=False, reuse=True)
    finished_turn(book)
    assert book.claim(request("whole", TURN_1[:8] + (7,), "a")).prefix == 8
    book.confirm([])
    assert book.claim(request("part", TURN_1[:7] + (0, 7), "a")).prefix == 0


def test_claims_in_one_step_take_other_rows_and_a_passed_over_claim_lapses():
    """vLLM places waiting requests one at a time and appends each one it schedules to its running list: a claim of
    a request not in it by the next claim was passed over (budget, encoder cache) and holds no row."""
    book = RowBook(2, rewindable=True, reuse=True)
    assert book.claim(request("x", (1, 2, 3))).row == 0
    assert book.claim(request("y", (1, 2, 3)), scheduled={"x"}).row == 1
    assert book.claim(request("z", (1, 2, 3)), scheduled={"x", "y"}) is None  # no free row: vLLM has no block either
    assert book.claim(request("w", (1, 2, 3)), scheduled={"x"}).row == 1  # y was passed over
    assert book.confirm(["x", "w"]) == {"x": 0, "w": 1}


def test_a_scheduled_request_without_a_claim_gets_a_free_row():
    book = RowBook(2, rewindable=True, reuse=True)
    book.claim(request("x", (1, 2, 3)))
    assert book.confirm(["x", "unclaimed"]) == {"x": 0, "unclaimed": 1}


def test_an_instance_without_rows_places_nothing():
    book = RowBook(0, rewindable=True, reuse=False)  # an encoder-only instance: vLLM gives it no KV blocks
    assert book.claim(request("x", (1, 2, 3))) is None
    assert book.confirm(["x"]) == {}


def test_media_spans_are_in_prompt_order():
    features = [SimpleNamespace(identifier=i, mm_position=SimpleNamespace(offset=o, length=2)) for i, o in
                (("late", 9), ("early", 3))]
    spans = media_spans(SimpleNamespace(mm_features=features))
    assert [s.content_hash for s in spans] == ["early", "late"]


def test_a_row_a_hand_over_goes_into_is_held_until_vllm_schedules_its_request():
    """Prefill/decode disaggregation's decode side: vLLM claims a row, then parks the request until its KV arrives
    (no new claim when it schedules it later). The row stays the request's, other claims pass it by; a request that
    ends before its hand-over was written leaves a row holding nothing known."""
    book = RowBook(2, rewindable=True, reuse=True)
    waiting = request("remote", TURN_1[:6])
    assert book.claim(waiting).row == 0
    assert book.hold_for_pull("remote") == 0
    assert book.claim(request("other", (7, 8, 9)), scheduled=set()).row == 1  # the held row is not offered
    assert book.confirm(["other"]) == {"other": 1}
    book.pulled("remote")
    assert book.confirm(["remote"]) == {"remote": 0}  # scheduled steps later, without a claim: its own row
    waiting.num_computed_tokens = 6
    book.release(waiting)
    assert book.claim(request("follow-up", TURN_1[:6] + (4, 5)), scheduled={"other"}).prefix == 6

    aborted = request("aborted", TURN_1[:6])
    book.confirm([])
    book.claim(aborted, scheduled={"other"})
    row = book.hold_for_pull("aborted")
    aborted.num_computed_tokens = 5  # vLLM sets it before the KV arrives
    book.release(aborted)  # freed before its hand-over was written
    assert book.claim(request("again", TURN_1[:6] + (4,)), scheduled={"other"}) == RowChoice(row, 0)
