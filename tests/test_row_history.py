"""Row reuse bookkeeping: the reusable prefix of a request against a row's history, and the row choice."""

from __future__ import annotations

import random

import pytest

from qeff_evs.models.pruning import VideoPruning
from qeff_evs.runtime.engine.row_history import MediaSpan, RowChoice, RowHistory, choose_row, reusable_prefix

HALF, MOST = VideoPruning("evs", 0.5), VideoPruning("evs", 0.75)
VIDEO = MediaSpan(3, 6, "clip", HALF)
PROMPT = (1, 2, 3, 50, 50, 50, 50, 50, 50, 4, 5, 6)  # text, a 6-token video at [3, 9), the question


def history(ids, media=(VIDEO,), **kw) -> RowHistory:
    return RowHistory(tuple(ids), tuple(media), **kw)


def test_a_follow_up_reuses_the_whole_history():
    answer = (7, 8, 9)  # 9 was sampled last, never fed: the row holds 7, 8
    held = history(PROMPT + answer[:2])
    follow_up = PROMPT + answer + (10, 11)
    assert reusable_prefix(held, follow_up, [VIDEO]) == len(PROMPT) + 2


def test_the_same_prompt_again_leaves_its_last_token_to_compute():
    assert reusable_prefix(history(PROMPT + (7, 8)), PROMPT, [VIDEO]) == len(PROMPT) - 1


def test_a_changed_question_reuses_up_to_the_first_different_token():
    asked = PROMPT[:10] + (99, 6)
    assert reusable_prefix(history(PROMPT + (7,)), asked, [VIDEO]) == 10


def test_a_changed_earlier_message_reuses_nothing_past_it():
    changed = (1, 77) + PROMPT[2:]
    assert reusable_prefix(history(PROMPT), changed, [VIDEO]) == 1


@pytest.mark.parametrize("other", [
    MediaSpan(3, 6, "another clip", HALF),  # a different video
    MediaSpan(3, 6, "clip", MOST),  # another rate (of a count that happens to match)
    MediaSpan(3, 6, "clip", VideoPruning("vidcom2", 0.5)),  # another method
    MediaSpan(3, 5, "clip", HALF),  # another placeholder length
])
def test_differing_media_cut_the_prefix_at_their_placeholder_even_with_equal_ids(other):
    assert reusable_prefix(history(PROMPT + (7,)), PROMPT + (7, 8), [other]) == VIDEO.offset


def test_media_at_another_place_match_nothing_from_the_first_of_them():
    moved = MediaSpan(4, 6, "clip", HALF)
    ids = (1, 2, 3, 0) + PROMPT[3:]
    assert reusable_prefix(history(PROMPT), ids, [moved]) == 3


def test_media_where_the_history_had_text_cut_the_prefix():
    text_only = history(PROMPT + (7,), media=())
    assert reusable_prefix(text_only, PROMPT + (7, 8), [VIDEO]) == VIDEO.offset
    assert reusable_prefix(history(PROMPT + (7,)), PROMPT + (7, 8), []) == VIDEO.offset


def test_ids_inside_a_matching_placeholder_are_not_compared():
    provisional = PROMPT[:3] + (50, 50, 50, 60, 61, 62) + PROMPT[9:]  # e.g. Qwen3-VL's lumped split
    assert reusable_prefix(history(PROMPT + (7,)), provisional + (7, 8), [VIDEO]) == len(PROMPT) + 1


def test_a_prefix_may_end_inside_a_matching_video():
    aborted = history(PROMPT[:6])  # its request left inside the video
    assert reusable_prefix(aborted, PROMPT, [VIDEO]) == 6
    assert reusable_prefix(history(PROMPT), PROMPT[:6], [VIDEO]) == 5  # the new prompt ends there (one to compute)


def test_no_history_or_no_common_token_reuses_nothing():
    assert reusable_prefix(None, PROMPT, [VIDEO]) == 0
    assert reusable_prefix(history(()), PROMPT, [VIDEO]) == 0
    assert reusable_prefix(history((9,) + PROMPT[1:]), PROMPT, [VIDEO]) == 0
    assert reusable_prefix(history(PROMPT), PROMPT[:1], []) == 0


def test_a_row_that_cannot_rewind_is_reused_whole_or_not_at_all():
    held = history(PROMPT + (7, 8), rewindable=False)
    assert reusable_prefix(held, PROMPT + (7, 8, 9, 10), [VIDEO]) == len(PROMPT) + 2
    assert reusable_prefix(held, PROMPT + (7, 99, 10), [VIDEO]) == 0  # would need to cut the state back
    assert reusable_prefix(held, PROMPT + (7, 8), [VIDEO]) == 0  # nothing left to compute
    assert reusable_prefix(held, PROMPT + (7, 8, 9), [MediaSpan(3, 6, "clip", MOST)]) == 0


def _naive_prefix(held: RowHistory, ids, media) -> int:
    """Token by token: a position counts when it lies in a media item both have alike, or its ids match
    outside any media item."""
    same = set(held.media) & set(media)

    def item_at(i, spans):
        return next((s for s in spans if s.offset <= i < s.end), None)

    p = 0
    while p < min(len(held.token_ids), len(ids) - 1):
        mine, theirs = item_at(p, media), item_at(p, held.media)
        if mine is not None or theirs is not None:
            if mine is None or mine != theirs or mine not in same:
                break
        elif held.token_ids[p] != ids[p]:
            break
        p += 1
    return p if held.rewindable or p == len(held.token_ids) else 0


def test_reusable_prefix_agrees_with_a_token_by_token_walk():
    rng = random.Random(7)
    hashes = ["a", "b"]
    for _ in range(400):
        def stream():
            ids, media = [], []
            for _ in range(rng.randint(0, 4)):
                ids += [rng.randint(1, 3) for _ in range(rng.randint(0, 3))]
                if rng.random() < 0.5:
                    span = MediaSpan(len(ids), rng.randint(1, 3), rng.choice(hashes), rng.choice([HALF, MOST]))
                    media.append(span)
                    ids += [50] * span.length
            return ids, media

        ids, media = stream()
        held_ids, held_media = stream() if rng.random() < 0.5 else (list(ids), list(media))
        if held_ids and rng.random() < 0.5:
            held_ids = held_ids[:rng.randint(0, len(held_ids))]  # the request ended early
        held = RowHistory(tuple(held_ids), tuple(held_media), rewindable=rng.random() < 0.7)
        new_ids = ids + [rng.randint(1, 3) for _ in range(rng.randint(0, 2))]
        assert reusable_prefix(held, new_ids, media) == _naive_prefix(held, new_ids, media), (held, new_ids, media)


# --- which row ---------------------------------------------------------------------------------------------------


def test_a_follow_up_takes_its_conversation_row():
    rows = {0: None, 1: history(PROMPT + (7,), finished_at=3), 2: history((1, 2, 5, 5), media=(), finished_at=1)}
    assert choose_row(rows, PROMPT + (7, 8, 9), [VIDEO]) == RowChoice(1, len(PROMPT) + 1)


def test_the_longest_prefix_wins_among_rows_worth_reusing():
    rows = {0: history(PROMPT[:10]), 1: history(PROMPT + (7,))}
    assert choose_row(rows, PROMPT + (7, 8), [VIDEO]) == RowChoice(1, len(PROMPT) + 1)


def test_a_shared_template_opening_does_not_cost_another_conversation_its_video():
    other_video = MediaSpan(3, 6, "another clip", HALF)
    rows = {0: history(PROMPT + (7, 8)), 1: None}
    assert choose_row(rows, PROMPT, [other_video]) == RowChoice(1, 0)


def test_without_a_row_worth_reusing_the_least_recently_finished_goes_first():
    other_video = MediaSpan(3, 6, "another clip", HALF)
    rows = {0: history(PROMPT + (7, 8), finished_at=5), 1: history(PROMPT + (9,), finished_at=2),
            2: history(PROMPT, finished_at=4)}
    assert choose_row(rows, PROMPT, [other_video]) == RowChoice(1, 3)  # and it keeps the 3-token opening
    assert choose_row({4: history(PROMPT, finished_at=1), 2: history(PROMPT, finished_at=1)},
                      (9,), []) == RowChoice(2, 0)


def test_a_row_kept_whole_is_chosen_only_when_the_request_extends_it():
    rows = {0: history(PROMPT + (7,), rewindable=False, finished_at=1), 1: history(PROMPT[:4], finished_at=0)}
    assert choose_row(rows, PROMPT + (7, 8), [VIDEO]) == RowChoice(0, len(PROMPT) + 1)
    assert choose_row(rows, PROMPT + (8, 8), [VIDEO]) == RowChoice(1, 4)


def test_no_free_row_is_an_error():
    with pytest.raises(ValueError, match="no free KV row"):
        choose_row({}, PROMPT, [VIDEO])
    with pytest.raises(ValueError, match="media span"):
        MediaSpan(0, 0, "clip")
