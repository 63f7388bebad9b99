"""The serving engine: many requests at once, each getting exactly the tokens it gets alone.

Every request below is also run by itself through the single-request ``Engine`` over the same
export (one language call per prefill chunk of ``prefill_seq_len``, no other request in the KV
cache); that run is the reference. The serving engine, with token budgets small enough that
prefill chunks of new requests interleave with the decodes of running ones, must produce the same
greedy tokens for every request, free every encoder output when the requests are done, encode a
video shared by two live requests once, and reject a request that can never run without
disturbing the others.

Decode logits of a continuous-batching call against batch-1 decode logits (1e-4) are checked in
``tests/test_continuous_batching.py`` (``test_continuous_batching_decode_equals_each_request_alone``);
here the same property shows up end to end as identical greedy tokens.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch

from qeff_evs import cli
from qeff_evs.export.pipeline import ExportOptions, export_checkpoint
from qeff_evs.models.protocol import MediaInput
from qeff_evs.models.pruning import VideoPruning
from qeff_evs.models.tiny import save_tiny_checkpoint
from qeff_evs.runtime.engine.single_request import Engine, EngineConfig
from qeff_evs.runtime.engine.request import PromptPiece
from qeff_evs.models.qwen_vl import QWEN_TOKENS
from qeff_evs.runtime.inputs.prompt import chat_pieces as user_turn_pieces
from qeff_evs.runtime.builders import stop_ids
from qeff_evs.runtime.export_bundle import ExportBundle, open_export
from qeff_evs.runtime.media import image_from_array, video_from_file
from qeff_evs.runtime.sessions import sessions_for
from qeff_evs.runtime.engine.scheduler import FinishReason, SchedulerConfig
from qeff_evs.runtime.engine.executor import media_hash
from qeff_evs.runtime.engine.serving import ServeRequest, ServingEngine
from qeff_evs.runtime.inputs.synthetic import moving_square_video

FULL_BATCH = 4
PREFILL = 16
CTX_LEN = 192
# Small enough that a new request's prefill chunk shares a step with the running requests' decodes.
TOKEN_BUDGET = 20
ENCODER_ROWS = 100

# Merged tokens per temporal patch: 112x112 -> 4x4, 112x168 -> 4x6 (Qwen2.5: 14 px patches);
# 128x128 -> 4x4, 128x192 -> 4x6 (Qwen3: 16 px patches). Frames 2 give the T=1 grid images use.
EXPORTS = {
    "qwen2_5_vl": ExportOptions(0.5, (2, 4, 8), ((112, 112), (112, 168)), PREFILL, CTX_LEN,
                                full_batch_size=FULL_BATCH),
    "qwen3_vl": ExportOptions(0.5, (2, 4, 8), ((128, 128), (128, 192)), PREFILL, CTX_LEN,
                              full_batch_size=FULL_BATCH),
}
WORDS = ("what", "moves", "here", "the", "square", "left", "right", "colour", "12", "7", "frame", "why")


# --------------------------------------------------------------------------------------------------
# Sessions that record what the engine asks of them (delegation, no class swapping)


class CountingVision:
    """Counts media items encoded, keyed by the pixels each was given."""

    def __init__(self, inner):
        self.inner = inner
        self.runs: list[int] = []  # hash of each encoded item's pixel_values

    def encode(self, media, kept: int):
        self.runs.append(hash(np.ascontiguousarray(media.pixel_values.numpy()).tobytes()))
        return self.inner.encode(media, kept)


class RecordingLanguage:
    """Logs each prefill and decode call so a test can see which steps mixed them."""

    def __init__(self, inner):
        self.inner = inner
        self.calls: list[tuple[str, int]] = []  # ("prefill", cache row) | ("decode", number of rows)

    @property
    def shape(self):
        return self.inner.shape

    def reset(self) -> None:
        self.inner.reset()

    def run(self, step):
        return self.inner.run(step)

    def prefill(self, cache_row: int, step):
        self.calls.append(("prefill", cache_row))
        return self.inner.prefill(cache_row, step)

    def decode(self, rows, pad_token_id: int = 0):
        self.calls.append(("decode", len(rows)))
        return self.inner.decode(rows, pad_token_id)


# --------------------------------------------------------------------------------------------------
# One export per family, opened once; a reference engine per backend


@dataclass
class Served:
    bundle: ExportBundle
    folder: Path
    reference: dict[str, tuple] = field(default_factory=dict)  # backend -> (vision, language) sessions

    @property
    def q(self) -> float:
        return self.bundle.manifest.video_pruning_rate

    def alone(self, request: ServeRequest, backend: str = "ort") -> list[int]:
        """The request run by itself through the single-request engine."""
        if backend not in self.reference:
            self.reference[backend] = sessions_for(self.bundle, backend)
        vision, language = self.reference[backend]
        m = self.bundle.manifest
        config = EngineConfig(m.prefill_seq_len, m.ctx_len, m.user_vision_size, m.video_pruning_rate,
                              max_new_tokens=request.max_new_tokens)
        engine = Engine(self.bundle.family, vision, language, config)
        prompt = engine.prepare(list(request.pieces), list(request.media))
        return engine.generate(prompt, eos_ids=stop_ids(self.bundle)).generated_token_ids

    def engine(self, backend: str = "ort", budget: int = TOKEN_BUDGET, encoder_rows: int = ENCODER_ROWS,
               max_num_seqs: int = FULL_BATCH) -> tuple[ServingEngine, CountingVision, RecordingLanguage]:
        vision, language = sessions_for(self.bundle, backend)
        vision, language = CountingVision(vision), RecordingLanguage(language)
        m = self.bundle.manifest
        config = EngineConfig(m.prefill_seq_len, m.ctx_len, m.user_vision_size, m.video_pruning_rate)
        scheduler = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                                    prefill_seq_len=m.prefill_seq_len, ctx_len=m.ctx_len,
                                    encoder_compute_budget=encoder_rows, encoder_cache_size=encoder_rows)
        return (ServingEngine(self.bundle.family, vision, language, config, scheduler, stop_ids(self.bundle)),
                vision, language)


def export_family(family: str, tmp_path_factory) -> Served:
    folder = tmp_path_factory.mktemp(f"serve_{family}")
    checkpoint = save_tiny_checkpoint(family, folder / "checkpoint", seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        export_checkpoint(checkpoint, folder / "export", EXPORTS[family])
    return Served(open_export(folder / "export"), folder)


@pytest.fixture(scope="module")
def q25(tmp_path_factory) -> Served:
    return export_family("qwen2_5_vl", tmp_path_factory)


@pytest.fixture(scope="module")
def q3(tmp_path_factory) -> Served:
    return export_family("qwen3_vl", tmp_path_factory)


# --------------------------------------------------------------------------------------------------
# Random requests: videos and images of random sizes, random questions, random arrival steps


def chat_pieces(tokenizer, kinds: Sequence[str], question: str) -> list[PromptPiece]:
    """The chat template for ``kinds`` media then ``question``, split at its media pads."""
    return user_turn_pieces(tokenizer, [{"type": kind} for kind in kinds] + [{"type": "text", "text": question}],
                            QWEN_TOKENS)


def random_video(served: Served, rng: np.random.Generator, seed: int) -> MediaInput:
    frames = int(rng.integers(2, 11))  # sampled to 2, 4 or 8 frames
    height, width = int(rng.integers(90, 140)), int(rng.integers(90, 220))
    path = served.folder / f"video_{seed}.npy"
    np.save(path, moving_square_video(frames, height, width, seed=seed))
    return video_from_file(path, served.bundle)


def random_image(served: Served, rng: np.random.Generator) -> MediaInput:
    height, width = int(rng.integers(80, 130)), int(rng.integers(80, 200))
    return image_from_array(rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8), served.bundle)


def random_question(rng: np.random.Generator) -> str:
    return " ".join(rng.choice(WORDS, size=int(rng.integers(1, 16))).tolist()) + "?"


@dataclass(frozen=True)
class Arrival:
    step: int
    request: ServeRequest


def random_requests(served: Served, count: int, seed: int, max_arrival: int = 30,
                    max_new_tokens: int = 8) -> list[Arrival]:
    """``count`` requests: a video, an image, both, or a video shared with an earlier request."""
    rng = np.random.default_rng(seed)
    tokenizer = served.bundle.tokenizer
    arrivals, videos = [], []
    for number in range(count):
        shape = rng.choice(["video", "image", "both", "shared"], p=[0.45, 0.2, 0.2, 0.15])
        if shape == "shared" and videos:
            media = [videos[int(rng.integers(len(videos)))]]
        elif shape == "image":
            media = [random_image(served, rng)]
        else:
            media = [random_video(served, rng, seed=1000 * seed + number)]
            videos.append(media[0])
            if shape == "both":
                media.append(random_image(served, rng))
        kinds = [m.kind for m in media]
        request = ServeRequest(f"r{number}", chat_pieces(tokenizer, kinds, random_question(rng)), media,
                               max_new_tokens=int(rng.integers(1, max_new_tokens + 1)))
        arrivals.append(Arrival(int(rng.integers(0, max_arrival)), request))
    return arrivals


@dataclass
class ServeLog:
    tokens: dict[str, list[int]] = field(default_factory=dict)
    finished: dict[str, FinishReason] = field(default_factory=dict)
    mixed_steps: int = 0  # steps that ran prefill chunks and decodes together
    widest_decode: int = 0  # most requests in one decode call
    steps: int = 0


def serve(engine: ServingEngine, language: RecordingLanguage, arrivals: Sequence[Arrival],
          on_step=None) -> ServeLog:
    """Add each request at its arrival step (between steps) and step until everything finished."""
    queue = sorted(arrivals, key=lambda a: a.step)
    log = ServeLog()
    step = 0
    while queue or engine.has_unfinished():
        while queue and queue[0].step <= step:
            engine.add_request(queue.pop(0).request)
        if on_step is not None:
            on_step(engine, step)
        if engine.has_unfinished():
            language.calls.clear()
            for event in engine.step():
                log.tokens.setdefault(event.request_id, []).append(event.token_id)
                if event.finish_reason is not None:
                    assert event.request_id not in log.finished, f"{event.request_id} finished twice"
                    log.finished[event.request_id] = event.finish_reason
            kinds = {kind for kind, _ in language.calls}
            log.mixed_steps += kinds == {"prefill", "decode"}
            log.widest_decode = max([n for kind, n in language.calls if kind == "decode"] + [log.widest_decode])
            log.steps += 1
        step += 1
        assert step < 5000, "the engine stopped making progress"
    return log


def assert_engine_is_empty(engine: ServingEngine) -> None:
    assert not engine.has_unfinished()
    assert engine.scheduler.cache.is_empty, f"encoder cache still holds {len(engine.scheduler.cache)} entries"
    assert engine.encoder_outputs == {}, f"encoder outputs still stored: {sorted(engine.encoder_outputs)}"
    assert engine.live == {}


def assert_each_as_alone(served: Served, arrivals: Sequence[Arrival], log: ServeLog, backend: str = "ort",
                         skip: frozenset[str] = frozenset()) -> None:
    for arrival in arrivals:
        rid = arrival.request.request_id
        if rid in skip:
            continue
        alone = served.alone(arrival.request, backend)
        assert log.tokens.get(rid) == alone, f"{rid}: served {log.tokens.get(rid)} vs alone {alone}"
        assert rid in log.finished, rid


# --------------------------------------------------------------------------------------------------
# Every request gets exactly its tokens when served together with the others


def test_sixteen_random_requests_equal_each_request_alone_qwen2_5(q25):
    arrivals = random_requests(q25, 16, seed=0, max_arrival=10, max_new_tokens=12)
    kinds = [tuple(m.kind for m in a.request.media) for a in arrivals]
    assert ("image",) in kinds and ("video",) in kinds and ("video", "image") in kinds
    assert len({a.request.media[0].grid_thw for a in arrivals}) >= 4  # several frame counts and sizes
    assert len({a.step for a in arrivals}) >= 6  # requests arrive while others run

    engine, vision, language = q25.engine()
    log = serve(engine, language, arrivals)

    assert log.mixed_steps > 0, "no step ran a prefill chunk and decodes together: raise the load"
    assert log.widest_decode >= 3, "requests never decoded together"
    assert set(log.finished) == {a.request.request_id for a in arrivals}
    assert_each_as_alone(q25, arrivals, log)
    assert_engine_is_empty(engine)
    distinct = {media_hash(m, VideoPruning("evs", q25.q)) for a in arrivals for m in a.request.media}
    assert len(vision.runs) >= len(distinct)


def test_qwen3_requests_equal_each_request_alone(q3):
    arrivals = random_requests(q3, 8, seed=1, max_arrival=12)
    assert {m.kind for a in arrivals for m in a.request.media} == {"video", "image"}
    engine, _, language = q3.engine()
    log = serve(engine, language, arrivals)
    assert log.mixed_steps > 0
    assert_each_as_alone(q3, arrivals, log)
    assert_engine_is_empty(engine)


@pytest.fixture
def one_torch_thread():
    """Eager tiny matmuls on a busy 2-core box: 2 intra-op threads take ~1000x longer than one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_torch_backend_requests_equal_each_request_alone(q25, one_torch_thread):
    arrivals = random_requests(q25, 5, seed=2, max_arrival=6)
    engine, _, language = q25.engine("torch")
    log = serve(engine, language, arrivals)
    assert log.mixed_steps > 0
    assert_each_as_alone(q25, arrivals, log, backend="torch")
    assert_engine_is_empty(engine)


# --------------------------------------------------------------------------------------------------
# Aborts, rejections, shared media


def test_abort_in_the_middle_of_a_prefill_leaves_the_others_unchanged(q25):
    arrivals = random_requests(q25, 6, seed=3, max_arrival=4)
    victim = max(arrivals, key=lambda a: a.step).request  # arrives last, so others are decoding by then
    aborted = []

    def abort_mid_prefill(engine: ServingEngine, step: int) -> None:
        if aborted or victim.request_id not in engine.live:
            return
        computed = engine.scheduler.num_computed_tokens(victim.request_id)
        if 0 < computed < len(engine.live[victim.request_id].plan.ids):
            aborted.append(len(engine.live))
            engine.abort(victim.request_id)

    engine, _, language = q25.engine()
    log = serve(engine, language, arrivals, on_step=abort_mid_prefill)
    assert aborted, "the victim was never caught mid-prefill"
    assert aborted[0] > 1, "nobody else was running when the victim was aborted"
    assert victim.request_id not in log.finished and victim.request_id not in log.tokens
    assert_each_as_alone(q25, arrivals, log, skip=frozenset({victim.request_id}))
    assert_engine_is_empty(engine)


def test_aborting_every_request_empties_the_encoder_cache(q25):
    arrivals = random_requests(q25, 4, seed=4, max_arrival=1)
    engine, _, _ = q25.engine(budget=64)
    for arrival in arrivals:
        engine.add_request(arrival.request)
    engine.step()
    engine.step()
    assert not engine.scheduler.cache.is_empty  # something was encoded and is held
    for arrival in arrivals:
        engine.abort(arrival.request.request_id)
    assert_engine_is_empty(engine)


def test_cache_is_empty_when_the_last_request_finishes_on_its_first_token(q25):
    """max_new_tokens=1: the request ends in the step that ran its last prefill chunk."""
    rng = np.random.default_rng(5)
    pieces = chat_pieces(q25.bundle.tokenizer, ["video"], "what?")
    # Three tokens after the video: its placeholder ends in the last prefill chunk, so the cached
    # output is released in the very step that finishes the request.
    pieces[-1] = PromptPiece(ids=pieces[-1].ids[:3])
    one = ServeRequest("one", pieces, [random_video(q25, rng, seed=50)], max_new_tokens=1)
    engine, _, language = q25.engine()
    log = serve(engine, language, [Arrival(0, one)])
    assert log.tokens[one.request_id] == q25.alone(one)
    assert log.finished[one.request_id] is FinishReason.LENGTH
    assert_engine_is_empty(engine)


def test_requests_that_can_never_run_are_rejected_while_the_others_proceed(q25):
    arrivals = random_requests(q25, 4, seed=6, max_arrival=3)
    rng = np.random.default_rng(6)
    small = random_image(q25, rng)
    np.save(q25.folder / "big.npy", moving_square_video(8, 110, 170, seed=66))
    big_video = video_from_file(q25.folder / "big.npy", q25.bundle)
    assert q25.bundle.family.merged_grid(big_video.grid_thw) == (4, 4, 6)  # K = 48 rows at q = 0.5
    too_long = ServeRequest("too-long", chat_pieces(q25.bundle.tokenizer, ["image"], " ".join(["square"] * CTX_LEN)),
                            [small], max_new_tokens=4)
    too_big = ServeRequest("too-big", chat_pieces(q25.bundle.tokenizer, ["video"], "what?"), [big_video],
                           max_new_tokens=2)

    engine, _, language = q25.engine(encoder_rows=40)
    rejected = []

    def add_bad_ones(engine: ServingEngine, step: int) -> None:
        if step != 2:
            return
        for bad, message in ((too_long, r"ctx_len is 192"), (too_big, r"48 embedding rows.*encoder cache \(40")):
            with pytest.raises(ValueError, match=message):
                engine.add_request(bad)
            rejected.append(bad.request_id)
        # A duplicate id is refused too, and the original keeps running.
        live = next(iter(engine.live))
        with pytest.raises(ValueError, match="already"):
            engine.add_request(engine.live[live].request)

    log = serve(engine, language, arrivals, on_step=add_bad_ones)
    assert rejected == ["too-long", "too-big"]
    assert set(log.finished) == {a.request.request_id for a in arrivals}
    assert_each_as_alone(q25, arrivals, log)
    assert_engine_is_empty(engine)


def test_same_video_in_two_concurrent_requests_is_encoded_once(q25):
    rng = np.random.default_rng(7)
    shared = random_video(q25, rng, seed=70)
    other = random_video(q25, rng, seed=71)
    tokenizer = q25.bundle.tokenizer
    requests = [ServeRequest("a", chat_pieces(tokenizer, ["video"], "what moves?"), [shared], max_new_tokens=3),
                ServeRequest("b", chat_pieces(tokenizer, ["video"], "why left right here?"), [shared],
                             max_new_tokens=5),
                ServeRequest("c", chat_pieces(tokenizer, ["video"], "what?"), [other], max_new_tokens=2)]
    engine, vision, language = q25.engine(budget=64)
    log = serve(engine, language, [Arrival(0, r) for r in requests])
    assert len(vision.runs) == 2 and len(set(vision.runs)) == 2
    assert_each_as_alone(q25, [Arrival(0, r) for r in requests], log)
    assert_engine_is_empty(engine)


# --------------------------------------------------------------------------------------------------
# The CLI: `qeff-evs run OUT --requests FILE.jsonl`


def test_cli_run_requests_prints_each_request_as_alone(q25, tmp_path, capsys):
    rng = np.random.default_rng(8)
    lines, alone = [], {}
    for number in range(4):
        path = tmp_path / f"clip{number}.npy"
        np.save(path, moving_square_video(int(rng.integers(4, 10)), int(rng.integers(90, 130)),
                                          int(rng.integers(90, 200)), seed=80 + number))
        question, new = random_question(rng), int(rng.integers(2, 7))
        lines.append({"id": f"cli-{number}", "prompt": question, "video": str(path), "max_new_tokens": new})
        video = video_from_file(path, q25.bundle)
        pieces = chat_pieces(q25.bundle.tokenizer, ["video"], question)
        alone[f"cli-{number}"] = q25.alone(ServeRequest(f"cli-{number}", pieces, [video], new))
    requests = tmp_path / "requests.jsonl"
    requests.write_text("\n".join(json.dumps(line) for line in lines) + "\n")

    capsys.readouterr()
    code = cli.main(["run", str(q25.bundle.export_dir), "--requests", str(requests),
                     "--max-num-batched-tokens", str(TOKEN_BUDGET), "--encoder-cache-rows", str(ENCODER_ROWS)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    out = captured.out
    printed = [json.loads(line) for line in out.splitlines() if line.strip()]
    assert sorted(p["id"] for p in printed) == sorted(alone)
    for entry in printed:
        assert entry["generated_token_ids"] == alone[entry["id"]], entry["id"]
        assert entry["finish_reason"] in {"eos", "length"}


def test_default_encoder_cache_holds_the_largest_exported_item(q25):
    from qeff_evs.models.pruning import VideoPruning
    from qeff_evs.runtime.builders import build_serving_engine, largest_item_rows

    largest = largest_item_rows(q25.bundle, VideoPruning("evs", q25.q))
    assert largest == 48 > TOKEN_BUDGET  # 8 frames at 112x168
    engine = build_serving_engine(q25.bundle, max_num_batched_tokens=TOKEN_BUDGET)
    assert engine.scheduler.config.encoder_cache_rows >= largest
    assert engine.scheduler.config.encoder_budget_rows >= largest
