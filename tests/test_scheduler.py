"""The v1-style scheduler: hand-worked schedules, randomized invariants, rejections, aborts.

The randomized driver plays the runner: it keeps its own store of encoder outputs (free the
reported hashes, then encode the listed items, then run the chunks) and its own record of every
request's progress, so the checks do not read the scheduler's internals.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import pytest

from qeff_evs.runtime.engine.scheduler import (
    FinishReason,
    MediaPlacement,
    RequestSpec,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)
from qeff_evs.runtime.engine.window import Placeholder

EOS, STOP = 0, 1


def cfg(**overrides) -> SchedulerConfig:
    values = dict(max_num_batched_tokens=8, max_num_seqs=2, prefill_seq_len=4, ctx_len=64,
                  encoder_compute_budget=6, encoder_cache_size=6)
    values.update(overrides)
    return SchedulerConfig(**values)


def video(content_hash: str, offset: int, length: int, is_embed=None) -> MediaPlacement:
    return MediaPlacement(content_hash, Placeholder(offset, length, None if is_embed is None else np.asarray(is_embed)))


def chunks(out: SchedulerOutput) -> list[tuple[str, int, int, bool]]:
    return [(p.request_id, p.computed, p.scheduled, p.samples) for p in out.prefills]


def step(s: Scheduler, token: int = 5) -> tuple[SchedulerOutput, list]:
    out = s.schedule()
    finished = s.update_from_output(out, {rid: token for rid in out.sampling_request_ids})
    return out, finished


# --- hand-worked schedules ---------------------------------------------------------------------


def test_chunks_interleave_with_decodes_and_encoder_entry_is_freed_after_its_placeholder():
    s = Scheduler(cfg())
    s.add_request(RequestSpec("A", 10, (video("vA", 2, 5),), max_new_tokens=3))
    s.add_request(RequestSpec("B", 5, max_new_tokens=2))

    out, _ = step(s)
    assert chunks(out) == [("A", 0, 4, False), ("B", 0, 4, False)]
    assert [(e.request_id, e.item, e.content_hash, e.num_rows) for e in out.encoder_inputs] == [("A", 0, "vA", 5)]
    assert out.num_scheduled_tokens == 8 and out.decodes == ()

    out, _ = step(s)
    assert chunks(out) == [("A", 4, 4, False), ("B", 4, 1, True)]
    assert out.encoder_inputs == () and out.free_encoder_hashes == ()
    assert "vA" in s.cache and s.cache.held_items("A") == {}  # A passed [2, 7): released, not yet drained

    out, finished = step(s)
    assert [(d.request_id, d.computed, d.token_id) for d in out.decodes] == [("B", 5, 5)]
    assert chunks(out) == [("A", 8, 2, True)]
    assert out.free_encoder_hashes == ("vA",) and s.cache.is_empty
    assert [(f.request_id, f.reason) for f in finished] == [("B", FinishReason.LENGTH)]

    out, _ = step(s)
    assert out.finished_request_ids == ("B",)
    assert [d.request_id for d in out.decodes] == ["A"] and out.prefills == ()


def test_full_encoder_cache_cuts_the_chunk_before_the_placeholder():
    s = Scheduler(cfg(encoder_compute_budget=20))
    s.add_request(RequestSpec("A", 10, (video("vA", 2, 5),)))
    s.add_request(RequestSpec("B", 8, (video("vB", 1, 4),)))
    out, _ = step(s)
    # vB (4 rows) does not fit next to vA (5 of 6 rows): B only runs its token before the video.
    assert chunks(out) == [("A", 0, 4, False), ("B", 0, 1, False)]
    assert [e.content_hash for e in out.encoder_inputs] == ["vA"]
    out, _ = step(s)  # still held by A (its chunk [4, 8) ends past 7 only after this step)
    assert chunks(out) == [("A", 4, 4, False)]
    out, _ = step(s)  # vA released: B's video is encoded now, freeing first
    assert out.free_encoder_hashes == ("vA",)
    assert [e.content_hash for e in out.encoder_inputs] == ["vB"]
    assert chunks(out) == [("A", 8, 2, True), ("B", 1, 4, False)]


def test_encoder_compute_budget_limits_new_encodings_per_step():
    s = Scheduler(cfg(encoder_compute_budget=5, encoder_cache_size=20))
    s.add_request(RequestSpec("A", 6, (video("vA", 0, 5),)))
    s.add_request(RequestSpec("B", 6, (video("vB", 0, 5),)))
    out, _ = step(s)
    assert chunks(out) == [("A", 0, 4, False)]  # B's first token is its video: it waits, FCFS holds the queue
    out, _ = step(s)
    assert [e.content_hash for e in out.encoder_inputs] == ["vB"]
    assert chunks(out) == [("A", 4, 2, True), ("B", 0, 4, False)]


def test_window_over_text_of_a_placeholder_defers_encoding():
    s = Scheduler(cfg(max_num_batched_tokens=2, max_num_seqs=1, prefill_seq_len=2))
    # Qwen3-like placeholder: 2 timestamp tokens and a start marker before the first pad.
    mask = [False, False, False, True, True, True, False]
    s.add_request(RequestSpec("A", 9, (video("vA", 1, 7, mask),)))
    out, _ = step(s)
    assert chunks(out) == [("A", 0, 2, False)] and out.encoder_inputs == ()
    out, _ = step(s)
    assert chunks(out) == [("A", 2, 2, False)] and out.encoder_inputs == ()
    out, _ = step(s)  # [4, 6) holds the first pad (prompt index 4)
    assert [e.num_rows for e in out.encoder_inputs] == [3]


def test_same_video_in_two_requests_is_encoded_once():
    s = Scheduler(cfg(max_num_batched_tokens=16, prefill_seq_len=8))
    s.add_request(RequestSpec("A", 8, (video("v", 1, 4),)))
    s.add_request(RequestSpec("B", 8, (video("v", 3, 4),)))
    out, _ = step(s)
    assert [e.request_id for e in out.encoder_inputs] == ["A"]
    assert s.cache.holders("v") == frozenset() and "v" in s.cache  # both passed it in this step
    out, _ = step(s)
    assert out.free_encoder_hashes == ("v",)


def test_fcfs_head_of_line_blocks_later_requests():
    s = Scheduler(cfg(max_num_seqs=3))
    s.add_request(RequestSpec("A", 12, (video("vA", 0, 6),)))
    s.add_request(RequestSpec("B", 12, (video("vB", 0, 2),)))  # would fit the budget, but A is first
    s.add_request(RequestSpec("C", 3))
    out, _ = step(s)
    assert chunks(out) == [("A", 0, 4, False)]
    assert s.num_waiting == 2


def test_max_num_seqs_bounds_running_requests_and_slots_are_reused():
    s = Scheduler(cfg(max_num_batched_tokens=12, max_num_seqs=2))
    for rid in "ABC":
        s.add_request(RequestSpec(rid, 2, max_new_tokens=1))
    out, finished = step(s)
    assert [(p.request_id, p.cache_row) for p in out.prefills] == [("A", 0), ("B", 1)]
    assert {f.request_id for f in finished} == {"A", "B"}
    out, _ = step(s)
    assert [(p.request_id, p.cache_row) for p in out.prefills] == [("C", 0)]


def test_finish_reasons():
    s = Scheduler(cfg(max_num_batched_tokens=12, max_num_seqs=3))
    s.add_request(RequestSpec("eos", 2, max_new_tokens=5, eos_token_ids=frozenset({EOS})))
    s.add_request(RequestSpec("stop", 2, max_new_tokens=5, stop_token_ids=frozenset({STOP})))
    s.add_request(RequestSpec("len", 2, max_new_tokens=2, eos_token_ids=frozenset({EOS})))
    out = s.schedule()
    assert s.update_from_output(out, {"eos": 7, "stop": 7, "len": 7}) == []
    out = s.schedule()
    finished = s.update_from_output(out, {"eos": EOS, "stop": STOP, "len": STOP})
    assert [(f.request_id, f.output_token_ids, f.reason) for f in finished] == [
        ("eos", (7, EOS), FinishReason.EOS), ("stop", (7, STOP), FinishReason.STOP),
        ("len", (7, STOP), FinishReason.LENGTH)]
    assert not s.has_unfinished_requests()


def test_update_checks_which_requests_sample():
    s = Scheduler(cfg())
    s.add_request(RequestSpec("A", 6))
    out = s.schedule()
    with pytest.raises(ValueError, match="samples tokens for"):
        s.update_from_output(out, {"A": 3})  # [0, 4) of 6 samples nothing
    with pytest.raises(ValueError, match="has not been reported"):
        s.schedule()
    s.update_from_output(out, {})
    out = s.schedule()
    with pytest.raises(ValueError, match=r"samples tokens for \['A'\]"):
        s.update_from_output(out, {})


def test_chunk_ends_are_never_crossed_and_other_cuts_still_apply():
    s = Scheduler(cfg())
    s.add_request(RequestSpec("A", 10, chunk_ends=(3, 5, 10), max_new_tokens=1))
    assert [chunks(step(s)[0]) for _ in range(4)] == [
        [("A", 0, 3, False)], [("A", 3, 2, False)], [("A", 5, 4, False)], [("A", 9, 1, True)]]  # 5..10 > seq_len
    assert not s.has_unfinished_requests()

    # A budget cut inside a requested chunk resumes up to the same end.
    s = Scheduler(cfg(max_num_batched_tokens=3, max_num_seqs=1))
    s.add_request(RequestSpec("B", 10, chunk_ends=(4, 10), max_new_tokens=1))
    assert [chunks(step(s)[0]) for _ in range(4)] == [
        [("B", 0, 3, False)], [("B", 3, 1, False)], [("B", 4, 3, False)], [("B", 7, 3, True)]]


# --- row reuse ---------------------------------------------------------------------------------


def ids(n: int, start: int = 100) -> tuple[int, ...]:
    return tuple(range(start, start + n))


def test_a_follow_up_starts_where_its_row_ends_and_skips_the_video_inside():
    s = Scheduler(cfg(max_num_batched_tokens=8, max_num_seqs=2, prefill_seq_len=4))
    prompt = ids(10)
    s.add_request(RequestSpec("A", 10, (video("vA", 2, 5),), max_new_tokens=3, token_ids=prompt))
    s.add_request(RequestSpec("B", 3, max_new_tokens=1, token_ids=ids(3, 500)))
    while s.has_unfinished_requests():
        step(s, token=7)
    assert s.row_history(0).token_ids == prompt + (7, 7)  # the third 7 was sampled, never fed
    assert s.row_history(1).token_ids == ids(3, 500)  # B: its 3 prompt tokens; its one token was never fed
    s.add_request(RequestSpec("A2", 16, (video("vA", 2, 5),), max_new_tokens=1, token_ids=prompt + (7, 7, 7, 1, 2, 3)))
    out, _ = step(s)
    assert chunks(out) == [("A2", 12, 4, True)] and out.encoder_inputs == ()  # vA lies inside the 12 tokens
    assert out.prefills[0].cache_row == 0
    assert s.row_history(0).token_ids == prompt + (7, 7, 7, 1, 2, 3)  # A2 finished: the row holds its prompt now


def test_reuse_off_and_unknown_rows_start_from_token_0():
    for config, abort_mid_step in ((cfg(row_reuse=False), False), (cfg(), True)):
        s = Scheduler(config)
        s.add_request(RequestSpec("A", 6, max_new_tokens=2, token_ids=ids(6)))
        step(s)
        out = s.schedule()
        if abort_mid_step:
            s.abort_request("A")  # the runner may or may not run the scheduled chunk: trust nothing of row 0
        s.update_from_output(out, {} if abort_mid_step else {"A": 7})
        while s.has_unfinished_requests():
            step(s)
        assert s.row_history(0) is None
        s.add_request(RequestSpec("again", 6, max_new_tokens=1, token_ids=ids(6)))
        out, _ = step(s)
        assert chunks(out) == [("again", 0, 4, False)]


def test_a_prefix_inside_a_video_holds_the_item_for_the_tail():
    s = Scheduler(cfg(max_num_seqs=1))
    prompt = ids(10)
    spec = RequestSpec("A", 10, (video("vA", 2, 5),), max_new_tokens=1, token_ids=prompt)
    s.add_request(spec)
    step(s)  # [0, 4): inside the video
    s.abort_request("A")
    s.add_request(RequestSpec("B", 10, (video("vA", 2, 5),), max_new_tokens=1, token_ids=prompt))
    out, _ = step(s)
    assert chunks(out) == [("B", 4, 4, False)]
    assert out.encoder_inputs == () and "vA" in s.cache  # A's released entry, taken up again (B has passed it now)
    s = Scheduler(cfg(max_num_seqs=1))
    s.add_request(spec)
    step(s)
    s.abort_request("A")
    step(s)  # nothing runs; the released entry is drained
    s.add_request(RequestSpec("C", 10, (video("vA", 2, 5),), max_new_tokens=1, token_ids=prompt))
    out, _ = step(s)
    assert chunks(out) == [("C", 4, 4, False)] and [e.content_hash for e in out.encoder_inputs] == ["vA"]


def test_rows_that_cannot_rewind_are_reused_whole_or_not_at_all():
    s = Scheduler(cfg(max_num_seqs=1), rewindable_rows=False)
    s.add_request(RequestSpec("A", 6, max_new_tokens=2, token_ids=ids(6)))
    while s.has_unfinished_requests():
        step(s, token=7)
    assert s.row_history(0).token_ids == ids(6) + (7,) and not s.row_history(0).rewindable
    s.add_request(RequestSpec("cut", 8, max_new_tokens=1, token_ids=ids(6) + (8, 9)))
    out, finished = step(s)
    assert chunks(out) == [("cut", 0, 4, False)]
    while s.has_unfinished_requests():
        finished = step(s, token=7)[1]
    assert finished[0].num_cached_tokens == 0
    s.add_request(RequestSpec("whole", 10, max_new_tokens=1, token_ids=ids(6) + (8, 9, 1, 2)))
    out, finished = step(s)
    assert chunks(out) == [("whole", 8, 2, True)] and finished[0].num_cached_tokens == 8


# --- rejections --------------------------------------------------------------------------------


@pytest.mark.parametrize("spec, message", [
    (RequestSpec("long", 60, max_new_tokens=5), "needs 65 KV slots but ctx_len is 64"),
    (RequestSpec("big", 20, (video("huge", 2, 7),)), "has 7 embedding rows"),
    (RequestSpec("outside", 10, (video("v", 8, 4),)), "inside the 10-token prompt"),
    (RequestSpec("ids", 3, token_ids=(1, 2)), "2 token ids for a 3-token prompt"),
    (RequestSpec("overlap", 20, (video("v1", 2, 4), video("v2", 5, 2))), "not overlap"),
    (RequestSpec("empty", 0), "needs >= 1 token"),
    (RequestSpec("zero-new", 5, max_new_tokens=0), "max_new_tokens must be >= 1"),
    (RequestSpec("mismatch", 20, (video("same", 1, 3), video("same", 10, 4))), "has 4 rows here but 3"),
    (RequestSpec("ends-order", 10, chunk_ends=(5, 3, 10)), r"chunk_ends \[5, 3, 10\] must increase strictly"),
    (RequestSpec("ends-past", 10, chunk_ends=(4, 11)), r"within \(0, 10\]"),
    (RequestSpec("ends-zero", 10, chunk_ends=(0, 4)), "chunk_ends"),
])
def test_requests_that_can_never_run_are_rejected_while_others_proceed(spec, message):
    s = Scheduler(cfg())
    s.add_request(RequestSpec("ok", 6, (video("v0", 1, 3),), max_new_tokens=2))
    with pytest.raises(ValueError, match=message):
        s.add_request(spec)
    assert s.num_waiting == 1
    outputs = []
    while s.has_unfinished_requests():
        outputs.append(step(s)[1])
    assert [f.request_id for done in outputs for f in done] == ["ok"]


def test_row_count_conflict_with_a_live_request_and_duplicate_id_are_rejected():
    s = Scheduler(cfg())
    s.add_request(RequestSpec("A", 10, (video("v", 1, 3),)))
    with pytest.raises(ValueError, match="has 4 rows here but 3 elsewhere"):
        s.add_request(RequestSpec("B", 10, (video("v", 1, 4),)))
    with pytest.raises(ValueError, match="already waiting or running"):
        s.add_request(RequestSpec("A", 3))


@pytest.mark.parametrize("overrides, message", [
    (dict(max_num_batched_tokens=1, max_num_seqs=2), "below max_num_seqs"),
    (dict(prefill_seq_len=0), "prefill_seq_len must be >= 1"),
    (dict(encoder_cache_size=0), "encoder_cache_size must be >= 1"),
])
def test_bad_configs(overrides, message):
    with pytest.raises(ValueError, match=message):
        cfg(**overrides)


# --- aborts ------------------------------------------------------------------------------------


def test_abort_waiting_running_and_in_flight():
    s = Scheduler(cfg(max_num_seqs=1))
    s.add_request(RequestSpec("A", 12, (video("vA", 1, 5),)))
    s.add_request(RequestSpec("B", 3))
    s.add_request(RequestSpec("C", 3))
    assert s.abort_request("C").reason is FinishReason.ABORTED
    step(s)
    assert s.cache.held_items("A") == {0: "vA"}
    out = s.schedule()  # A's second chunk is in flight
    s.abort_request("A")
    assert s.cache.held_items("A") == {} and s.abort_request("A") is None
    assert s.update_from_output(out, {}) == []
    out, _ = step(s)
    assert out.free_encoder_hashes == ("vA",) and out.finished_request_ids == ("A",)
    assert chunks(out) == [("B", 0, 3, True)]  # the freed row goes to B


def test_abort_of_a_sampling_request_in_flight_ignores_its_token():
    s = Scheduler(cfg())
    s.add_request(RequestSpec("A", 3))
    s.add_request(RequestSpec("B", 3))
    out = s.schedule()
    s.abort_request("A")
    assert s.update_from_output(out, {"A": 9, "B": 9}) == []
    assert s.output_token_ids("B") == (9,)


# --- randomized schedules ----------------------------------------------------------------------


@dataclass
class Track:
    """The driver's own view of one request."""

    spec: RequestSpec
    computed: int = 0
    outputs: list[int] = field(default_factory=list)
    chunks: list[tuple[int, int]] = field(default_factory=list)
    admitted_at: int | None = None
    ended: FinishReason | None = None


def random_media(rng: random.Random, prompt: int, videos: dict[str, tuple[int, np.ndarray | None]],
                 max_rows: int) -> tuple[MediaPlacement, ...]:
    items, at = [], rng.randint(0, 3)
    for _ in range(rng.randint(0, 3)):
        if rng.random() < 0.4 and videos:
            name = rng.choice(sorted(videos))  # the same video again: must share one cache entry
        else:
            name = f"v{len(videos)}"
            length = rng.randint(1, max_rows + 4)
            mask = None
            if rng.random() < 0.5:
                mask = np.asarray([rng.random() < 0.6 for _ in range(length)], dtype=bool)
                mask[rng.randrange(length)] = True
                if mask.sum() > max_rows:
                    mask[np.flatnonzero(mask)[max_rows:]] = False
            elif length > max_rows:
                length = max_rows
            videos[name] = (length, mask)
        length, mask = videos[name]
        if at + length > prompt:
            break
        items.append(MediaPlacement(name, Placeholder(at, length, mask)))
        at += length + rng.randint(0, 3)
    return tuple(items)


def embed_positions(item: MediaPlacement) -> np.ndarray:
    ph = item.placeholder
    mask = np.ones(ph.length, bool) if ph.is_embed is None else ph.is_embed
    return ph.offset + np.flatnonzero(mask)


def run_random_schedule(seed: int) -> dict:
    rng = random.Random(seed)
    config = SchedulerConfig(
        max_num_batched_tokens=rng.randint(4, 24), max_num_seqs=rng.randint(1, 4),
        prefill_seq_len=rng.randint(2, 12), ctx_len=rng.randint(24, 60),
        encoder_compute_budget=rng.choice([None, rng.randint(6, 20)]), encoder_cache_size=rng.randint(8, 30))
    max_rows = min(config.encoder_cache_rows, config.encoder_budget_rows)
    s = Scheduler(config)
    videos: dict[str, tuple[int, np.ndarray | None]] = {}
    tracks: dict[str, Track] = {}
    add_order, admit_order = [], []
    store: dict[str, int] = {}  # the runner's encoder outputs: hash -> rows
    encodes: list[str] = []
    stats = dict(interleaved=0, encoder_cut=0, rejected=0, aborted=0, steps=0)
    to_add = rng.randint(3, 9)
    step_no = 0
    while to_add or s.has_unfinished_requests():
        step_no += 1
        assert step_no < 2000, "no progress"
        if to_add and rng.random() < 0.5:
            to_add -= 1
            rid = f"r{to_add}"
            prompt = rng.randint(1, config.ctx_len + 5)
            spec = RequestSpec(rid, prompt, random_media(rng, prompt, videos, max_rows + 2),
                               max_new_tokens=rng.randint(1, 6), eos_token_ids=frozenset({EOS}),
                               stop_token_ids=frozenset({STOP}))
            too_big = any(m.num_rows > max_rows for m in spec.media)
            if prompt + spec.max_new_tokens > config.ctx_len or too_big:
                with pytest.raises(ValueError):
                    s.add_request(spec)
                stats["rejected"] += 1
                continue
            s.add_request(spec)
            tracks[rid] = Track(spec)
            add_order.append(rid)
        live = [t for t in tracks.values() if t.ended is None]
        if live and rng.random() < 0.05:
            victim = rng.choice(live)
            assert s.abort_request(victim.spec.request_id).reason is FinishReason.ABORTED
            assert s.cache.held_items(victim.spec.request_id) == {}
            victim.ended = FinishReason.ABORTED
            stats["aborted"] += 1

        decoding = {rid for rid, t in tracks.items()
                    if t.ended is None and t.admitted_at is not None and t.computed >= t.spec.num_prompt_tokens}
        out = s.schedule()
        stats["steps"] += 1

        # Budgets and ordering.
        assert out.num_scheduled_tokens <= config.max_num_batched_tokens
        assert out.encoder_rows <= config.encoder_budget_rows
        assert s.cache.held_rows <= config.encoder_cache_rows
        assert {d.request_id for d in out.decodes} == decoding  # every decoder, one token, first
        assert len({p.cache_row for p in out.prefills} | {d.cache_row for d in out.decodes}) == len(out.prefills) + len(
            out.decodes)
        assert s.num_running <= config.max_num_seqs
        if out.decodes and out.prefills:
            stats["interleaved"] += 1
        budget = config.max_num_batched_tokens - len(out.decodes)
        for p in out.prefills:
            t = tracks[p.request_id]
            if t.admitted_at is None:
                t.admitted_at = out.step
                admit_order.append(p.request_id)
            assert p.computed == t.computed, "chunks must continue where the request stopped"
            assert 1 <= p.scheduled <= min(config.prefill_seq_len, budget)
            natural = min(t.spec.num_prompt_tokens - t.computed, budget, config.prefill_seq_len)
            if p.scheduled < natural:  # only an encoder limit may cut a chunk, right before a placeholder
                assert p.end in {m.placeholder.offset for m in t.spec.media}
                stats["encoder_cut"] += 1
            budget -= p.scheduled
            t.chunks.append((p.computed, p.scheduled))
            t.computed = p.end
            assert p.samples == (p.end == t.spec.num_prompt_tokens)
        for d in out.decodes:
            t = tracks[d.request_id]
            assert d.computed == t.computed == t.spec.num_prompt_tokens + len(t.outputs) - 1
            assert d.token_id == t.outputs[-1]
            t.computed += 1

        # The runner: free, encode, then every row a chunk needs must be there.
        for h in out.free_encoder_hashes:
            del store[h]
        for e in out.encoder_inputs:
            assert e.content_hash not in store, f"{e.content_hash} encoded twice while cached"
            store[e.content_hash] = e.num_rows
            encodes.append(e.content_hash)
        for p in out.prefills:
            for m in tracks[p.request_id].spec.media:
                pos = embed_positions(m)
                if ((pos >= p.computed) & (pos < p.end)).any():
                    assert m.content_hash in store, f"chunk of {p.request_id} needs {m.content_hash}"
        assert sum(store.values()) <= config.encoder_cache_rows

        live = [t for t in tracks.values() if t.ended is None]
        if live and rng.random() < 0.03:  # abort while the step is in flight
            victim = rng.choice(live)
            s.abort_request(victim.spec.request_id)
            victim.ended = FinishReason.ABORTED
            stats["aborted"] += 1
        sampled = {}
        for rid in out.sampling_request_ids:
            if tracks[rid].ended is None:
                sampled[rid] = rng.choice([EOS, STOP] + [7] * 12)
        finished = s.update_from_output(out, sampled)
        for rid, token in sampled.items():
            tracks[rid].outputs.append(token)
        for f in finished:
            t = tracks[f.request_id]
            expected = (FinishReason.EOS if t.outputs[-1] == EOS else FinishReason.STOP
                        if t.outputs[-1] == STOP else FinishReason.LENGTH)
            assert f.reason is expected and f.output_token_ids == tuple(t.outputs)
            t.ended = f.reason
        for rid, t in tracks.items():
            if t.ended is None and t.outputs:
                assert t.outputs[-1] not in (EOS, STOP) and len(t.outputs) < t.spec.max_new_tokens

    out = s.schedule()  # reports the last releases
    assert out.is_empty
    for h in out.free_encoder_hashes:
        del store[h]
    assert s.cache.is_empty and not store

    for rid, t in tracks.items():
        if t.ended is not FinishReason.ABORTED:  # every prompt token exactly once, in order
            covered = [i for c, n in t.chunks for i in range(c, c + n)]
            assert covered == list(range(t.spec.num_prompt_tokens))
        else:  # an aborted request stopped somewhere, but never skipped or repeated a token
            covered = [i for c, n in t.chunks for i in range(c, c + n)]
            assert covered == list(range(len(covered)))
        assert t.ended is not None
    assert admit_order == [rid for rid in add_order if rid in admit_order]  # first come, first served
    stats["encodes"] = len(encodes)
    return stats


def test_random_schedules_keep_every_invariant():
    totals: dict[str, int] = {}
    for seed in range(300):
        for key, value in run_random_schedule(seed).items():
            totals[key] = totals.get(key, 0) + value
    # The generator must actually exercise what the invariants are about.
    assert totals["interleaved"] > 100 and totals["encoder_cut"] > 20
    assert totals["rejected"] > 20 and totals["aborted"] > 20 and totals["encodes"] > 200
