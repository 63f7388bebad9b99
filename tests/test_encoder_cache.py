"""Encoder cache: holders, release and drain, revival, eviction, and its life inside the scheduler."""

from __future__ import annotations

import random

import numpy as np
import pytest

from qeff_evs.runtime.engine.encoder_cache import EncoderCache
from qeff_evs.runtime.engine.scheduler import MediaPlacement, RequestSpec, Scheduler, SchedulerConfig
from qeff_evs.runtime.engine.window import Placeholder

# --- the cache alone -------------------------------------------------------------------------------


def test_entry_lives_while_any_holder_holds_it():
    cache = EncoderCache(10)
    cache.store("v", 4, ("A", 0))
    assert cache.hold("v", ("B", 2), 4)
    cache.release("v", ("A", 0))
    assert cache.holders("v") == {("B", 2)} and cache.drain_released() == []
    cache.release("v", ("B", 2))
    assert cache.held_rows == 0 and cache.stored_rows == 4 and "v" in cache
    assert cache.drain_released() == ["v"] and cache.is_empty


def test_released_entry_is_revived_by_a_new_holder_before_the_drain():
    cache = EncoderCache(10)
    cache.store("v", 4, ("A", 0))
    cache.release_request("A")
    assert cache.hold("v", ("B", 0), 4)
    assert cache.drain_released() == [] and cache.holders("v") == {("B", 0)}


def test_same_request_holding_a_video_twice_keeps_it_until_both_items_let_go():
    cache = EncoderCache(10)
    cache.store("v", 3, ("A", 0))
    assert cache.hold("v", ("A", 1), 3)
    assert cache.held_items("A") == {0: "v", 1: "v"}
    cache.release("v", ("A", 0))
    assert cache.held_rows == 3
    cache.release("v", ("A", 1))
    assert cache.held_rows == 0 and cache.held_items("A") == {}


def test_released_rows_are_reclaimed_oldest_first():
    cache = EncoderCache(10)
    cache.store("a", 4, ("A", 0))
    cache.store("b", 4, ("B", 0))
    cache.release_request("A")
    cache.release_request("B")
    assert cache.free_rows == 10 and cache.can_store(10) and not cache.can_store(11)
    cache.store("c", 5, ("C", 0))  # needs 5 of the 8 released rows: evicts "a" only
    assert "a" not in cache and "b" in cache and cache.stored_rows == 9
    assert not cache.hold("a", ("D", 0), 4)  # evicted: must be encoded again
    assert cache.drain_released() == ["a", "b"] and len(cache) == 1 and "c" in cache


def test_full_cache_refuses_and_errors_name_the_problem():
    cache = EncoderCache(6)
    cache.store("a", 4, ("A", 0))
    assert not cache.can_store(3)
    with pytest.raises(ValueError, match="needs 3 rows but only 2 of 6 are free"):
        cache.store("b", 3, ("B", 0))
    with pytest.raises(ValueError, match="already has 'a'"):
        cache.store("a", 4, ("B", 0))
    with pytest.raises(ValueError, match="expects 5 rows for content hash 'a'"):
        cache.hold("a", ("B", 0), 5)
    with pytest.raises(ValueError, match="does not hold 'a'"):
        cache.release("a", ("B", 0))
    with pytest.raises(ValueError, match="capacity must be >= 1"):
        EncoderCache(0)


# --- the cache inside the scheduler ----------------------------------------------------------------


def config(**overrides) -> SchedulerConfig:
    values = dict(max_num_batched_tokens=8, max_num_seqs=3, prefill_seq_len=8, ctx_len=64,
                  encoder_compute_budget=12, encoder_cache_size=12)
    values.update(overrides)
    return SchedulerConfig(**values)


def item(content_hash: str, offset: int, length: int) -> MediaPlacement:
    return MediaPlacement(content_hash, Placeholder(offset, length))


def advance(s: Scheduler, token: int = 3):
    out = s.schedule()
    s.update_from_output(out, {rid: token for rid in out.sampling_request_ids})
    return out


def test_shared_video_is_encoded_once_while_both_requests_hold_it_and_again_after():
    s = Scheduler(config(max_num_batched_tokens=8, prefill_seq_len=4))
    s.add_request(RequestSpec("A", 12, (item("v", 2, 6),), max_new_tokens=1))
    s.add_request(RequestSpec("B", 12, (item("v", 4, 6),), max_new_tokens=1))
    encoded = [e.content_hash for e in advance(s).encoder_inputs]  # A [0, 4) needs v; B [0, 4) not yet
    out = s.schedule()  # A [4, 8) and B [4, 8) both read v
    assert s.cache.holders("v") == {("A", 0), ("B", 0)} and out.encoder_inputs == ()
    s.update_from_output(out, {})
    assert s.cache.holders("v") == {("B", 0)}  # A is past [2, 8), B is not past [4, 10)
    while s.has_unfinished_requests():
        encoded += [e.content_hash for e in advance(s).encoder_inputs]
    assert encoded == ["v"]
    advance(s)
    assert s.cache.is_empty
    s.add_request(RequestSpec("C", 12, (item("v", 0, 6),), max_new_tokens=1))
    assert [e.content_hash for e in advance(s).encoder_inputs] == ["v"]  # freed, so encoded anew


def test_aborting_the_only_holder_frees_the_entry():
    s = Scheduler(config(max_num_batched_tokens=4, prefill_seq_len=4))
    s.add_request(RequestSpec("A", 20, (item("v", 1, 10),)))
    s.add_request(RequestSpec("B", 20, (item("v", 1, 10),)))
    advance(s)
    assert s.cache.holders("v") == {("A", 0)}  # B not admitted: the budget went to A
    s.abort_request("A")
    out = s.schedule()
    assert out.free_encoder_hashes == () and s.cache.holders("v") == {("B", 0)}  # B revived it
    assert [e.content_hash for e in out.encoder_inputs] == []
    s.update_from_output(out, {})
    s.abort_request("B")
    assert advance(s).free_encoder_hashes == ("v",) and s.cache.is_empty


@pytest.mark.parametrize("seed", range(40))
def test_cache_is_empty_after_every_request_finishes_or_aborts(seed):
    rng = random.Random(seed)
    s = Scheduler(config(max_num_batched_tokens=rng.randint(3, 10), prefill_seq_len=rng.randint(2, 8)))
    pool = {f"v{i}": rng.randint(1, 12) for i in range(4)}
    for n in range(rng.randint(2, 7)):
        prompt = rng.randint(14, 40)
        names = rng.sample(sorted(pool), rng.randint(0, 2))
        media, at = [], rng.randint(0, 2)
        for name in names:
            mask = None
            if rng.random() < 0.5:  # a placeholder with text around its rows
                mask = np.r_[np.zeros(2, bool), np.ones(pool[name], bool), np.zeros(1, bool)]
            length = pool[name] if mask is None else len(mask)
            if at + length <= prompt:
                media.append(MediaPlacement(name, Placeholder(at, length, mask)))
                at += length + rng.randint(0, 2)
        s.add_request(RequestSpec(f"r{n}", prompt, tuple(media), max_new_tokens=rng.randint(1, 4)))
    runner: dict[str, int] = {}
    while s.has_unfinished_requests():
        if rng.random() < 0.1:
            s.abort_request(f"r{rng.randrange(7)}")
        out = s.schedule()
        for h in out.free_encoder_hashes:
            del runner[h]
        for e in out.encoder_inputs:
            assert e.content_hash not in runner
            runner[e.content_hash] = e.num_rows
        assert sum(runner.values()) <= 12 and s.cache.held_rows <= 12
        s.update_from_output(out, {rid: 3 for rid in out.sampling_request_ids})
    for h in s.schedule().free_encoder_hashes:
        del runner[h]
    assert s.cache.is_empty and not runner
