"""Row reuse in the serving engine: a request placed in a KV row that holds its first tokens starts there.

(docs/serving.md#conversations-row-reuse.)

The reference for every request is the same request on an engine with row reuse off (which computes every prompt
from slot 0; ``test_kv_zero_once.py`` shows a used row then equals a fresh one): tokens exactly equal, the logits
each token was sampled from within 1e-4. Beside the tokens, each test asserts how many prompt tokens the row held
(``num_cached_tokens``, against a common prefix the test computes itself on the real token ids), where the first
prefill chunk starts, how many graph calls the prompt took and how many times the vision side ran.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import pytest

from qeff_evs import cli
from qeff_evs.models.pruning import VideoPruning
from qeff_evs.runtime.backends.base import close_session
from qeff_evs.runtime.builders import engine_config, largest_item_rows, stop_ids
from qeff_evs.runtime.engine.request import PromptPiece
from qeff_evs.runtime.engine.scheduler import SchedulerConfig
from qeff_evs.runtime.engine.serving import ServeRequest, ServingEngine
from qeff_evs.runtime.engine.single_request import Engine
from qeff_evs.runtime.export_bundle import open_export
from qeff_evs.runtime.inputs.prompt import video_question_pieces
from qeff_evs.runtime.inputs.synthetic import moving_square_video
from qeff_evs.runtime.media import video_from_file
from qeff_evs.runtime.requests_jsonl import Conversations, JsonlRequest
from qeff_evs.runtime.sessions import sessions_for

NEW_TOKENS = 8
ATOL = 1e-4


# --------------------------------------------------------------------------------------------------
# Sessions that record what the engine asks of them (delegation)


class CountingVision:
    def __init__(self, inner):
        self.inner = inner
        self.encoded = 0

    def encode(self, media, pruning):
        self.encoded += 1
        return self.inner.encode(media, pruning)

    def close(self) -> None:
        close_session(self.inner)


class CallLog:
    """A language session that records, per request, its prefill chunks and the logits each of its tokens came from."""

    def __init__(self, inner):
        self.inner = inner
        self.executor = None  # set once the engine exists: maps a KV row to the request in it
        self.chunks: dict[str, list[tuple[int, int]]] = {}  # request -> (first slot, tokens) per prefill call
        self.logits: dict[str, list[np.ndarray]] = {}

    @property
    def shape(self):
        return self.inner.shape

    def reset(self) -> None:
        self.inner.reset()

    def close(self) -> None:
        close_session(self.inner)

    def _request(self, row: int):
        return next(r for r in self.executor.requests.values() if r.cache_row == row)

    def prefill(self, cache_row: int, step):
        logits = self.inner.prefill(cache_row, step)
        request = self._request(cache_row)
        slots = step.position_ids[0, 0]
        first, count = int(slots[0]), int((slots >= 0).sum())
        self.chunks.setdefault(request.request_id, []).append((first, count))
        if first + count == request.num_prompt_tokens:
            self.logits.setdefault(request.request_id, []).append(np.array(logits).reshape(-1))
        return logits

    def decode(self, rows, pad_token_id: int = 0):
        logits = self.inner.decode(rows, pad_token_id)
        for row, values in zip(rows, logits):
            self.logits.setdefault(self._request(row.cache_row).request_id, []).append(np.array(values).reshape(-1))
        return logits


@dataclass
class Served:
    """One engine's run: tokens and cached-token counts per request."""

    engine: ServingEngine
    vision: CountingVision
    language: CallLog
    tokens: dict[str, list[int]] = field(default_factory=dict)
    cached: dict[str, int] = field(default_factory=dict)
    encodes: dict[str, int] = field(default_factory=dict)  # vision runs while the request was the one added last

    def run(self, request: ServeRequest) -> list[int]:
        """Add ``request`` and step until nothing is left."""
        before = self.vision.encoded
        self.engine.add_request(request)
        self.drain()
        self.encodes[request.request_id] = self.vision.encoded - before
        return self.tokens[request.request_id]

    def drain(self, on_finish=None) -> None:
        while self.engine.has_unfinished():
            for event in self.engine.step():
                self.tokens.setdefault(event.request_id, []).append(event.token_id)
                if event.finish_reason is not None:
                    self.cached[event.request_id] = event.num_cached_tokens
                    if on_finish is not None:
                        on_finish(event.request_id)

    def close(self) -> None:
        self.engine.close()


def open_engine(bundle, reuse: bool = True, rows: int = 2, budget: int = 64, backend: str = "ort") -> Served:
    vision, language = sessions_for(bundle, backend)
    vision, language = CountingVision(vision), CallLog(language)
    m = bundle.manifest
    config = engine_config(bundle)
    encoder_rows = max(budget, largest_item_rows(bundle, VideoPruning(config.video_pruning_method, 0.0)))
    scheduler = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=rows, prefill_seq_len=m.prefill_seq_len,
                                ctx_len=m.ctx_len, encoder_compute_budget=encoder_rows,
                                encoder_cache_size=encoder_rows, row_reuse=reuse)
    engine = ServingEngine(bundle.family, vision, language, config, scheduler, stop_ids(bundle))
    language.executor = engine.executor
    return Served(engine, vision, language)


@dataclass
class Family:
    """One family's export, a clip, and a reuse-off engine whose runs are the references."""

    bundle: object
    video_path: Path
    fresh: Served
    folder: Path
    references: dict[str, tuple[list[int], list[np.ndarray]]] = field(default_factory=dict)
    prompts: dict[tuple, list[int]] = field(default_factory=dict)

    @property
    def video(self):
        return video_from_file(self.video_path, self.bundle)

    def reference(self, request: ServeRequest) -> tuple[list[int], list[np.ndarray]]:
        """``request`` alone on the reuse-off engine: its tokens and the logits they were sampled from."""
        key = request.request_id
        if key not in self.references:
            alone = replace(request, request_id=f"fresh-{key}")
            tokens = self.fresh.run(alone)
            self.references[key] = (tokens, self.fresh.language.logits[alone.request_id])
        return self.references[key]

    def real_ids(self, request: ServeRequest) -> list[int]:
        """The prompt's ids with every placeholder in its real layout (the single-request engine encodes)."""
        key = (tuple(request.pieces), self.fresh.engine.executor.media_hashes(request.media))
        if key not in self.prompts:
            engine = Engine(self.bundle.family, self.fresh.vision.inner, self.fresh.language.inner,
                            engine_config(self.bundle))
            self.prompts[key] = engine.prepare(list(request.pieces), list(request.media)).ids.tolist()
        return self.prompts[key]

    def different(self, token: int) -> int:
        """A text token other than ``token``."""
        a, b = self.bundle.tokenizer.encode("A B", add_special_tokens=False)[:2]
        return a if token != a else b

    def clip(self, seed: int):
        path = self.folder / f"clip_{seed}.npy"
        np.save(path, moving_square_video(8, 120, 200, seed=seed))
        return video_from_file(path, self.bundle)


@pytest.fixture(scope="module")
def families(served_export, video_npy, tmp_path_factory):
    made: dict[str, Family] = {}

    def get(name: str) -> Family:
        if name not in made:
            bundle = open_export(served_export(name)[1])
            made[name] = Family(bundle, video_npy, open_engine(bundle, reuse=False),
                                tmp_path_factory.mktemp(f"reuse_{name}"))
        return made[name]
    yield get
    for family in made.values():
        family.fresh.close()


def question(bundle, text: str, video, request_id: str, max_new_tokens: int = NEW_TOKENS) -> ServeRequest:
    pieces = video_question_pieces(bundle.tokenizer, text, bundle.family.token_strings)
    return ServeRequest(request_id, pieces, [video], max_new_tokens)


def extended(request: ServeRequest, request_id: str, ids, max_new_tokens: int = NEW_TOKENS) -> ServeRequest:
    """``request``'s prompt followed by ``ids``: a follow-up built token by token."""
    return ServeRequest(request_id, [*request.pieces, PromptPiece(ids=tuple(int(i) for i in ids))], request.media,
                        max_new_tokens)


def common_prefix(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def assert_as_fresh(family: Family, served: Served, request: ServeRequest) -> None:
    tokens, logits = family.reference(request)
    rid = request.request_id
    assert served.tokens[rid] == tokens, f"{rid}: with reuse {served.tokens[rid]}, fresh {tokens}"
    got = served.language.logits[rid]
    assert len(got) == len(logits)
    for step, (a, b) in enumerate(zip(got, logits)):
        np.testing.assert_allclose(a, b, rtol=0, atol=ATOL, err_msg=f"{rid}: logits of token {step}")


def assert_computed_from(served: Served, rid: str, prefix: int, prompt_len: int, chunk: int) -> None:
    """The prompt ran from ``prefix``: its first chunk starts there, the chunks cover the rest once, one call each."""
    chunks = served.language.chunks[rid]
    assert chunks[0][0] == prefix
    assert sum(n for _, n in chunks) == prompt_len - prefix
    assert len(chunks) == math.ceil((prompt_len - prefix) / chunk)


# --------------------------------------------------------------------------------------------------
# A follow-up in the same row


@pytest.mark.parametrize("name", ["qwen2_5_vl", "qwen3_vl"])
def test_follow_up_computes_only_what_its_row_lacks(families, name):
    """Follow-ups in one row, each built on what the row holds then: the prefix ends exactly at a chunk boundary,
    inside the previous answer, and at the row's end (the whole history, then a new question)."""
    family = families(name)
    bundle, chunk = family.bundle, family.bundle.manifest.prefill_seq_len
    served = open_engine(bundle)
    first = question(bundle, "What moves here?", family.video, "turn-1")
    answer = served.run(first)
    assert served.cached["turn-1"] == 0 and served.encodes["turn-1"] == 1
    assert len(answer) == NEW_TOKENS
    before, video = first.pieces[0], first.pieces[1]
    placeholder = served.engine.executor.plan(first.pieces, first.media).placeholders[0]
    video_end = placeholder.offset + placeholder.length
    tail = list(bundle.tokenizer.encode(" and why?", add_special_tokens=False))

    def after_video(rid: str, ids) -> ServeRequest:
        return ServeRequest(rid, [before, video, PromptPiece(ids=tuple(int(i) for i in ids))], first.media,
                            NEW_TOKENS)

    held = family.real_ids(first) + answer[:-1]  # the row holds every fed token: the last sampled one was not fed
    last_sampled = answer[-1]
    for rid in ("at-boundary", "inside-answer", "whole-history"):
        if rid == "at-boundary":
            cut = max(b for b in range(chunk, len(held), chunk) if b > video_end)  # a chunk starts exactly there
        elif rid == "inside-answer":
            cut = previous_prompt + 2
        else:
            cut = len(held)
        ids = held[video_end:cut] + ([last_sampled] if cut == len(held) else [family.different(held[cut])]) + tail
        follow_up = after_video(rid, ids)
        served.run(follow_up)
        follow_up_ids = family.real_ids(follow_up)
        assert common_prefix(held, follow_up_ids) == cut  # the test's own count of what the row holds of it
        assert served.cached[rid] == cut, rid
        assert_computed_from(served, rid, cut, len(follow_up_ids), chunk)
        assert served.encodes[rid] == 0, f"{rid}: its video lies inside the prefix, yet the vision side ran"
        assert_as_fresh(family, served, follow_up)
        previous_prompt = len(follow_up_ids)
        held, last_sampled = follow_up_ids + served.tokens[rid][:-1], served.tokens[rid][-1]
    served.close()


@pytest.mark.parametrize("name", ["qwen2_5_vl", "qwen3_vl"])
def test_prefix_ending_inside_the_video_computes_the_video_tail(families, name):
    """A request left its row inside its video (aborted there); the same request again starts there and encodes the
    video to feed the tail. Qwen3-VL: where the cut lies, the provisional layout has frame markers but the real one
    has kept rows, so the scheduler must encode the item although the chunk starts past the provisional pads."""
    family = families(name)
    bundle = family.bundle
    served = open_engine(bundle)
    request = question(bundle, "What moves here?", family.video, "aborted")
    plan = served.engine.executor.plan(request.pieces, request.media)
    provisional = plan.placeholders[0]
    real_ids = family.real_ids(request)
    pads = set(bundle.family.special_tokens().media_pads)
    is_pad = np.isin(real_ids[provisional.offset:provisional.offset + provisional.length], list(pads))
    # Past the provisional layout's pads (Qwen2.5: the middle of its pads), with real rows still ahead.
    lumped_end = provisional.leading_text + provisional.num_embeds
    cut = provisional.offset + (lumped_end + 1 if name == "qwen3_vl" else provisional.length // 2)
    assert is_pad[cut - provisional.offset:].any()
    if name == "qwen3_vl":
        assert provisional.is_embed is not None and not provisional.is_embed[cut - provisional.offset:].any()

    hashes = served.engine.executor.media_hashes(request.media)
    served.engine.add_planned(request.request_id, plan, request.media, hashes,
                              NEW_TOKENS, chunk_ends=(cut,), request=request)
    while served.engine.scheduler.num_computed_tokens("aborted") < cut:
        served.engine.step()
    assert served.engine.scheduler.num_computed_tokens("aborted") == cut
    served.engine.abort("aborted")

    again = replace(request, request_id="again")
    served.run(again)
    assert served.cached["again"] == cut
    assert served.language.chunks["again"][0][0] == cut
    assert served.encodes["again"] == 1  # the tail's rows come from the encoder again
    assert_as_fresh(family, served, again)
    served.close()


# --------------------------------------------------------------------------------------------------
# What must not be reused


def test_other_pruning_other_video_or_a_changed_message_reuse_nothing_past_the_difference(families):
    family = families("qwen2_5_vl")
    bundle = family.bundle
    served = open_engine(bundle, rows=1)  # one row: each request meets the previous one's history
    first = question(bundle, "What moves here?", family.video, "first")
    served.run(first)
    video_offset = served.engine.executor.plan(first.pieces, first.media).placeholders[0].offset
    other_clip = family.clip(seed=11)
    variants = [
        question(bundle, "What moves here?", replace(family.video, pruning=VideoPruning("evs", 0.75)), "rate"),
        question(bundle, "What moves here?", replace(family.video, pruning=VideoPruning("vidcom2", 0.5)), "method"),
        question(bundle, "What moves here?", other_clip, "video"),
    ]
    for request in variants:
        served.run(request)
        # Only the chat template's opening before the video is the same: the video and all after it are computed.
        assert served.cached[request.request_id] == video_offset, request.request_id
        assert served.encodes[request.request_id] == 1
        assert_computed_from(served, request.request_id, video_offset, len(family.real_ids(request)),
                             bundle.manifest.prefill_seq_len)
        assert_as_fresh(family, served, request)

    # A follow-up whose earlier question was edited: the row (which holds "video"'s request) is reused up to the edit.
    asked = variants[-1]
    held = family.real_ids(asked) + served.tokens["video"][:-1]
    edited = question(bundle, "What moved there?", other_clip, "edited")
    edited = extended(edited, "edited", served.tokens["video"] + bundle.tokenizer.encode("why?"))
    served.run(edited)
    first_difference = common_prefix(held, family.real_ids(edited))
    assert video_offset < first_difference < len(family.real_ids(asked)) - 1  # the edit lies after the video
    assert served.cached["edited"] == first_difference
    assert served.encodes["edited"] == 0
    assert_as_fresh(family, served, edited)
    served.close()


def test_qwen3_5_reuses_only_whole_histories(families):
    family = families("qwen3_5")
    bundle, chunk = family.bundle, family.bundle.manifest.prefill_seq_len
    served = open_engine(bundle, rows=1)
    first = question(bundle, "What moves here?", family.video, "first")
    answer = served.run(first)
    prompt_len = len(family.real_ids(first))
    tail = bundle.tokenizer.encode(" and why?", add_special_tokens=False)

    whole = extended(first, "whole", answer + tail)
    served.run(whole)
    assert served.cached["whole"] == prompt_len + len(answer) - 1  # everything the row holds
    assert_computed_from(served, "whole", prompt_len + len(answer) - 1, len(family.real_ids(whole)), chunk)
    assert served.encodes["whole"] == 0
    assert_as_fresh(family, served, whole)

    # Diverging inside what the row holds: its linear-attention state cannot be cut back, so nothing is reused.
    answer_2 = served.tokens["whole"]
    held_ids = family.real_ids(whole) + answer_2[:-1]
    parted = extended(whole, "parted", answer_2[:1] + [family.different(answer_2[1])] + tail)
    assert common_prefix(held_ids, family.real_ids(parted)) == len(family.real_ids(whole)) + 1
    served.run(parted)
    assert served.cached["parted"] == 0
    assert_computed_from(served, "parted", 0, len(family.real_ids(parted)), chunk)
    assert served.encodes["parted"] == 1
    assert_as_fresh(family, served, parted)
    served.close()


# --------------------------------------------------------------------------------------------------
# Conversations as a chat client sends them


def test_four_conversations_on_two_rows_are_exact(families):
    """A and B ask first; their follow-ups are queued as they finish, then C and D arrive; C's and D's follow-ups
    as they finish. Each follow-up meets its own conversation's row (the policy keeps it), and every request gets
    the tokens it gets on a fresh engine."""
    family = families("qwen2_5_vl")
    bundle = family.bundle
    clips = {name: family.clip(seed) for name, seed in zip("ABCD", (21, 22, 23, 24))}
    firsts = {name: JsonlRequest(name, f"What does square {name} do?", (clips[name],), NEW_TOKENS) for name in "ABCD"}
    chats = Conversations(bundle)
    served = open_engine(bundle, rows=2, budget=24)
    sent: dict[str, ServeRequest] = {}

    def send(request: ServeRequest) -> None:
        sent[request.request_id] = request
        served.engine.add_request(request)

    def on_finish(rid: str) -> None:
        if rid in "ABCD":
            send(chats.follow_up(JsonlRequest(rid + "2", "And then?", (), NEW_TOKENS, after=rid), served.tokens[rid]))
        if {"A2", "B2"} <= sent.keys() and "C" not in sent:
            send(chats.first_turn(firsts["C"]))
            send(chats.first_turn(firsts["D"]))

    send(chats.first_turn(firsts["A"]))
    send(chats.first_turn(firsts["B"]))
    served.drain(on_finish)

    assert set(served.tokens) == set(sent) == {"A", "B", "C", "D", "A2", "B2", "C2", "D2"}
    for rid, request in sent.items():
        assert_as_fresh(family, served, request)
    video_offset = served.engine.executor.plan(sent["A"].pieces, sent["A"].media).placeholders[0].offset
    for name in "ABCD":
        turn_1, follow_up = family.real_ids(sent[name]), family.real_ids(sent[name + "2"])
        held = turn_1 + served.tokens[name][:-1]
        # A and B start in empty rows; C and D in rows other conversations left: only the template's opening is
        # the same there.
        assert served.cached[name] == (0 if name in "AB" else video_offset)
        # At least the whole first prompt (the tiny model's random answer need not re-tokenize to its own ids).
        assert served.cached[name + "2"] == common_prefix(held, follow_up) >= len(turn_1)
    assert served.vision.encoded == 4  # each clip once: every follow-up's video lies inside its prefix
    served.close()


def test_cli_follow_ups_reuse_their_row_and_the_switch_turns_it_off(families, tmp_path, capsys):
    family = families("qwen2_5_vl")
    export = family.bundle.export_dir
    clip = tmp_path / "clip.npy"
    np.save(clip, moving_square_video(8, 120, 200, seed=31))
    lines = [{"id": "a", "prompt": "What moves?", "video": str(clip), "max_new_tokens": NEW_TOKENS},
             {"id": "b", "prompt": "Where to?", "video": str(clip), "max_new_tokens": 3},
             {"id": "a2", "after": "a", "prompt": "Why?", "max_new_tokens": NEW_TOKENS},
             {"id": "a3", "after": "a2", "prompt": "Sure?", "max_new_tokens": 4}]
    requests = tmp_path / "requests.jsonl"
    requests.write_text("\n".join(json.dumps(line) for line in lines) + "\n")

    def run(*flags) -> dict[str, dict]:
        capsys.readouterr()
        assert cli.main(["run", str(export), "--requests", str(requests), *flags]) == 0
        return {entry["id"]: entry for entry in map(json.loads, capsys.readouterr().out.splitlines())}

    reused, computed = run(), run("--no-row-reuse")
    assert {rid: e["generated_token_ids"] for rid, e in reused.items()} == \
        {rid: e["generated_token_ids"] for rid, e in computed.items()}
    assert all(e["num_cached_tokens"] == 0 for e in computed.values())
    assert reused["a"]["num_cached_tokens"] == 0
    assert 0 < reused["a2"]["num_cached_tokens"] < reused["a3"]["num_cached_tokens"]
    assert all(e["time_to_first_token_s"] > 0 for e in (*reused.values(), *computed.values()))


def test_a_follow_up_line_is_checked(families, tmp_path):
    from qeff_evs.runtime.requests_jsonl import requests_from_jsonl

    family = families("qwen2_5_vl")
    clip = tmp_path / "clip.npy"
    np.save(clip, moving_square_video(4, 120, 200, seed=32))
    first = {"id": "a", "prompt": "What?", "video": str(clip)}
    cases = [({"id": "b", "after": "z", "prompt": "Why?"}, r"'after' names 'z'"),
             ({"id": "b", "after": "a", "prompt": "Why?", "video": str(clip)}, r"drop \['video'\]"),
             ({"id": "a", "after": "a", "prompt": "Why?"}, r"'a' is used by an earlier line")]
    for line, message in cases:
        path = tmp_path / "requests.jsonl"
        path.write_text(json.dumps(first) + "\n" + json.dumps(line) + "\n")
        with pytest.raises(ValueError, match=message):
            requests_from_jsonl(path, family.bundle)


# --------------------------------------------------------------------------------------------------
# Every backend keeps the row between requests


@pytest.fixture
def card(monkeypatch):
    from test_qaic_session import FakeDevice, build_fake_sdk

    fake = FakeDevice()
    rt, api = build_fake_sdk(fake)
    monkeypatch.setitem(sys.modules, "qaicrt", rt)
    monkeypatch.setitem(sys.modules, "QAicApi_pb2", api)
    return fake


@pytest.mark.parametrize("backend", ["torch", "qaic"])
def test_every_backend_keeps_the_row_for_a_follow_up(backend, families, tmp_path, card):
    from test_kv_zero_once import for_the_card

    family = families("qwen2_5_vl")
    bundle = open_export(for_the_card(family.bundle.export_dir, tmp_path)) if backend == "qaic" else family.bundle
    runs = {}
    for reuse in (True, False):
        served = open_engine(bundle, reuse=reuse, backend=backend)
        first = question(bundle, "What moves here?", video_from_file(family.video_path, bundle), "first")
        answer = served.run(first)
        follow_up = extended(first, "follow-up", answer + bundle.tokenizer.encode(" why?", add_special_tokens=False))
        served.run(follow_up)
        runs[reuse] = served
        served.close()
    reused, fresh = runs[True], runs[False]
    assert reused.tokens == fresh.tokens
    assert reused.cached["follow-up"] == len(family.real_ids(first)) + len(reused.tokens["first"]) - 1
    assert fresh.cached["follow-up"] == 0
    assert reused.language.chunks["follow-up"][0][0] == reused.cached["follow-up"]
    # The card keeps KV in fp16 (custom_io.yaml): an answer token's keys written by a decode step (with reuse) and
    # by a prefill chunk (without) round apart at fp16's precision, so its logits agree to that, its tokens exactly.
    atol = 5e-3 if backend == "qaic" else ATOL
    for a, b in zip(reused.language.logits["follow-up"], fresh.language.logits["follow-up"], strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=atol)
