"""vLLM 0.32.0's own v1 ``Scheduler`` drives our engine.

vLLM's scheduler is built on CPU from a ``VllmConfig`` made in code over a tiny Qwen2.5-VL
checkpoint folder. vLLM's own Qwen2.5-VL model module cannot be imported here (it imports
transformers' torchvision-only image processor), so the config names a stand-in architecture
registered through vLLM's out-of-tree model API: a class that only declares multimodal support,
with a processing-info stub that tells vLLM the largest video (in encoder rows). Everything the
scheduler decides (chunk sizes, which video to encode when, chunks that split a video, decodes of
running requests beside new prefills, encoder-cache frees) is vLLM's own code.

The reference for every request is the single-request ``Engine`` on the same export, run alone:
greedy tokens must be equal.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("vllm.v1.core.sched.scheduler")

from torch import nn  # noqa: E402
from vllm import ModelRegistry  # noqa: E402
from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig  # noqa: E402
from vllm.multimodal import MULTIMODAL_REGISTRY  # noqa: E402
from vllm.multimodal.processing.context import BaseProcessingInfo  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from qeff_evs.models.pruning import VideoPruning  # noqa: E402
from qeff_evs.runtime.engine.executor import kept_count  # noqa: E402
from qeff_evs.runtime.engine.single_request import Engine, EngineConfig  # noqa: E402
from qeff_evs.runtime.engine.request import PromptPiece  # noqa: E402
from qeff_evs.runtime.export_bundle import open_export  # noqa: E402
from qeff_evs.runtime.media import video_from_file  # noqa: E402
from qeff_evs.runtime.sessions import sessions_for  # noqa: E402
from qeff_evs.runtime.inputs.synthetic import moving_square_video  # noqa: E402
from qeff_evs.vllm.engine.driver import VllmDriver  # noqa: E402

FULL_BATCH = 4
PREFILL = 16
CTX_LEN = 192
BLOCK = 16
# One request's chunk must fit one prefill call; small enough that prefills and decodes share steps.
TOKEN_BUDGET = PREFILL
MAX_VIDEO_ROWS = 64  # largest K vLLM is told a video can have (encoder budget and cache size)
STAND_IN = "QeffEvsStandInForVllmScheduler"
NEW_TOKENS = 6


class _VideoInfo(BaseProcessingInfo):
    def get_supported_mm_limits(self):
        return {"video": None}

    def get_mm_max_tokens_per_item(self, seq_len, mm_counts):
        return {"video": MAX_VIDEO_ROWS}


@MULTIMODAL_REGISTRY.register_processor(lambda info, dummy_inputs, **_: SimpleNamespace(info=info),
                                        info=_VideoInfo, dummy_inputs=lambda info: None)
class _StandInModel(nn.Module):
    """Declares what vLLM's config inspection reads; never instantiated or run."""

    supports_multimodal = True

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__()

    def embed_input_ids(self, input_ids):
        raise NotImplementedError

    def forward(self, input_ids, positions):
        raise NotImplementedError

    def compute_logits(self, hidden_states):
        raise NotImplementedError


@pytest.fixture(scope="module")
def stand_in_architecture():
    ModelRegistry.register_model(STAND_IN, _StandInModel)
    yield STAND_IN
    ModelRegistry.models.pop(STAND_IN, None)


def vllm_scheduler(checkpoint, architecture: str, block: int = BLOCK, prefix_caching: bool = False) -> Scheduler:
    model = ModelConfig(model=str(checkpoint), dtype="float32", seed=0, max_model_len=CTX_LEN,
                        skip_tokenizer_init=True, hf_overrides={"architectures": [architecture]},
                        mm_processor_cache_gb=0)
    cache = CacheConfig(block_size=block, enable_prefix_caching=prefix_caching)
    num_blocks = FULL_BATCH * CTX_LEN // block + 1
    cache.num_gpu_blocks = num_blocks
    config = VllmConfig(model_config=model, cache_config=cache, device_config=DeviceConfig(device="cpu"),
                        scheduler_config=SchedulerConfig(max_num_seqs=FULL_BATCH, max_num_batched_tokens=TOKEN_BUDGET,
                                                         max_model_len=CTX_LEN, enable_chunked_prefill=True,
                                                         is_encoder_decoder=False))
    # The KV blocks are only counted by the scheduler; our sessions own the real cache rows.
    kv = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["layer"], FullAttentionSpec(block_size=block, num_kv_heads=1, head_size=1,
                                                      dtype=torch.float32))])
    return Scheduler(vllm_config=config, kv_cache_config=kv, structured_output_manager=StructuredOutputManager(config),
                     block_size=block)


@pytest.fixture(scope="module")
def served(served_export, tmp_path_factory):
    checkpoint, export = served_export("qwen2_5_vl")
    return SimpleNamespace(checkpoint=checkpoint, folder=tmp_path_factory.mktemp("vllm_sched"),
                           bundle=open_export(export))


def pieces_for(tokenizer, question: str) -> list[PromptPiece]:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": question}]}],
        tokenize=False, add_generation_prompt=True)
    before, after = text.split("<|video_pad|>")
    return [PromptPiece(ids=tuple(tokenizer.encode(before, add_special_tokens=False))), PromptPiece(media_item=0),
            PromptPiece(ids=tuple(tokenizer.encode(after, add_special_tokens=False)))]


def export_config(manifest, **options) -> EngineConfig:
    """The engine settings the export was made for (chunk, context, window, pruning rate)."""
    return EngineConfig(manifest.prefill_seq_len, manifest.ctx_len, manifest.user_vision_size,
                        manifest.video_pruning_rate, **options)


def saved_video(served, name: str, frames: int, height: int = 112, width: int = 112, seed: int = 0):
    """A moving-square clip saved as ``.npy`` and read back the way a user's file is."""
    path = served.folder / f"{name}.npy"
    np.save(path, moving_square_video(frames, height, width, seed=seed))
    return video_from_file(path, served.bundle)


def test_vllm_scheduler_drives_engine_like_each_request_alone(served, stand_in_architecture):
    bundle, m = served.bundle, served.bundle.manifest
    config = export_config(m, max_new_tokens=NEW_TOKENS)
    shapes = [(8, 112, 112, "what moves here?"), (4, 112, 168, "the square"), (8, 112, 168, "why left or right"),
              (2, 112, 112, "colour?"), (4, 112, 112, "frame 7 why")]  # 5 requests > 4 KV rows
    requests = []
    for n, (frames, height, width, question) in enumerate(shapes):
        video = saved_video(served, f"video_{n}", frames, height, width, seed=n)
        assert kept_count(bundle.family, video, VideoPruning("evs", m.video_pruning_rate)) <= MAX_VIDEO_ROWS
        requests.append((f"r{n}", pieces_for(bundle.tokenizer, question), [video]))

    vision, language = sessions_for(bundle, "ort")
    alone = {}
    for request_id, pieces, media in requests:
        engine = Engine(bundle.family, vision, language, config)
        alone[request_id] = engine.generate(engine.prepare(pieces, media)).generated_token_ids

    scheduler = vllm_scheduler(served.checkpoint, stand_in_architecture)
    driver = VllmDriver(bundle.family, *sessions_for(bundle, "ort"), config)
    prompt_lens = {}
    for request_id, pieces, media in requests:
        request = driver.make_request(request_id, pieces, media, NEW_TOKENS)
        prompt_lens[request_id] = request.num_prompt_tokens
        scheduler.add_request(request)

    chunks: dict[str, list[tuple[int, int]]] = {}
    mixed_steps = split_videos = 0
    generated: dict[str, list[int]] = {}
    for _ in range(500):
        if not scheduler.has_unfinished_requests():
            break
        out = scheduler.schedule()
        computed = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        computed.update(zip(out.scheduled_cached_reqs.req_ids, out.scheduled_cached_reqs.num_computed_tokens))
        kinds = set()
        for request_id, scheduled in out.num_scheduled_tokens.items():
            is_prefill = computed[request_id] < prompt_lens[request_id]
            kinds.add(is_prefill)
            if is_prefill:
                chunks.setdefault(request_id, []).append((computed[request_id], scheduled))
                ph = driver.live[request_id].plan.placeholders[0]
                end = computed[request_id] + scheduled
                split_videos += ph.offset < end < ph.offset + ph.length
        mixed_steps += kinds == {True, False}
        runner_output = driver.execute(out)
        for engine_outputs in scheduler.update_from_output(out, runner_output).values():
            for o in engine_outputs.outputs:
                generated.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert not scheduler.has_unfinished_requests()

    # vLLM's scheduling really exercised the window path: chunks cover each prompt in order,
    # some chunk ends inside a video, and some step mixes prefill chunks with decodes.
    for request_id, request_chunks in chunks.items():
        starts = [c for c, _ in request_chunks] + [prompt_lens[request_id]]
        assert starts[0] == 0 and all(c + n == nxt for (c, n), nxt in zip(request_chunks, starts[1:]))
    assert set(chunks) == set(prompt_lens)
    assert split_videos > 0 and mixed_steps > 0

    assert generated == alone
    assert all(len(tokens) == NEW_TOKENS for tokens in generated.values())



def test_an_aborted_request_frees_its_row_and_encoder_entries_follow_vllms_cache(served, stand_in_architecture):
    """A client gone mid-generation: vLLM aborts the request; its KV row serves the next request, and the
    driver holds encoder outputs exactly while vLLM's encoder cache does (freed from vLLM's free list)."""
    from vllm.v1.request import RequestStatus

    bundle, m = served.bundle, served.bundle.manifest
    config = export_config(m)
    scheduler = vllm_scheduler(served.checkpoint, stand_in_architecture)
    driver = VllmDriver(bundle.family, *sessions_for(bundle, "ort"), config)
    # r0..r3 fill every KV row with long generations; r4 can only start in the row r0's abort frees.
    tokens = {f"r{n}": 40 if n < FULL_BATCH else NEW_TOKENS for n in range(FULL_BATCH + 1)}
    for n, request_id in enumerate(tokens):
        request = driver.make_request(request_id, pieces_for(bundle.tokenizer, f"clip {n}"),
                                      [saved_video(served, f"abort_{n}", 8 if n % 2 else 4, seed=10 + n)],
                                      tokens[request_id])
        scheduler.add_request(request)

    generated: dict[str, list[int]] = {}
    aborted = False
    others_when_r4_done = None
    for _ in range(500):
        if not scheduler.has_unfinished_requests():
            break
        out = scheduler.schedule()
        runner_output = driver.execute(out)
        assert set(driver.executor.encoder_outputs) <= set(scheduler.encoder_cache_manager.cached)
        assert sum(lv.cache_row is not None for lv in driver.live.values()) <= FULL_BATCH
        for engine_outputs in scheduler.update_from_output(out, runner_output).values():
            for o in engine_outputs.outputs:
                generated.setdefault(o.request_id, []).extend(o.new_token_ids)
        if others_when_r4_done is None and len(generated.get("r4", [])) == NEW_TOKENS:
            others_when_r4_done = [len(generated.get(f"r{n}", [])) for n in range(1, FULL_BATCH)]
        if not aborted and len(generated.get("r0", [])) >= 2:
            scheduler.finish_requests("r0", RequestStatus.FINISHED_ABORTED)
            aborted = True
    assert aborted and not scheduler.has_unfinished_requests()
    driver.execute(scheduler.schedule())  # the step that reports the last finishes
    assert "r0" not in driver.live and 2 <= len(generated["r0"]) < tokens["r0"]
    assert all(len(generated[r]) == tokens[r] for r in tokens if r != "r0")
    assert all(n < tokens["r1"] for n in others_when_r4_done)  # r4 ran while r1..r3 still held their rows


def test_a_request_the_worker_cannot_run_fails_alone(served, stand_in_architecture):
    """The second line (``qeff_evs.vllm.engine.scheduler``): should the worker fail on one request anyway (here: pixel rows
    of the wrong width, which the frontend would never let through, make ONNX Runtime raise), that request finishes
    with finish_reason "error" through vLLM's own FINISHED_ERROR path, and the others generate what they would alone."""
    from vllm.v1.engine import FinishReason

    from qeff_evs.models.protocol import MediaInput
    from qeff_evs.vllm.engine.scheduler import QeffEvsScheduler, RunnerOutput

    bundle, m = served.bundle, served.bundle.manifest
    config = export_config(m, max_new_tokens=NEW_TOKENS)
    good = [(f"good{n}", pieces_for(bundle.tokenizer, f"clip {n}"), [saved_video(served, f"alone_{n}", 4, seed=30 + n)])
            for n in range(2)]
    video = good[0][2][0]
    broken = MediaInput(torch.cat([video.pixel_values, torch.zeros(len(video.pixel_values), 1)], dim=1),
                        video.grid_thw, video.fps, video.frame_times)

    vision, language = sessions_for(bundle, "ort")
    alone = {}
    for request_id, pieces, media in good:
        engine = Engine(bundle.family, vision, language, config)
        alone[request_id] = engine.generate(engine.prepare(pieces, media)).generated_token_ids

    plain = vllm_scheduler(served.checkpoint, stand_in_architecture)
    scheduler = QeffEvsScheduler(vllm_config=plain.vllm_config, kv_cache_config=plain.kv_cache_config,
                                 structured_output_manager=plain.structured_output_manager, block_size=BLOCK)
    driver = VllmDriver(bundle.family, *sessions_for(bundle, "ort"), config)
    for request_id, pieces, media in [good[0], ("broken", good[0][1], [broken]), good[1]]:
        scheduler.add_request(driver.make_request(request_id, pieces, media, NEW_TOKENS))

    generated: dict[str, list[int]] = {}
    finished: dict[str, object] = {}
    reasons: dict[str, str] = {}
    for _ in range(300):
        if not scheduler.has_unfinished_requests():
            break
        out = scheduler.schedule()
        failed: dict[str, str] = {}
        logits = driver.step(out, failed)
        reasons.update(failed)
        sampled = {r: [int(np.argmax(row))] for r, row in logits.items()}
        for r, tokens in sampled.items():
            driver.accept(r, tokens)
        req_ids = list(out.num_scheduled_tokens)
        runner_output = RunnerOutput(req_ids=req_ids,
                                     sampled_token_ids=[sampled.get(r, []) for r in req_ids], failed=failed)
        for engine_outputs in scheduler.update_from_output(out, runner_output).values():
            for o in engine_outputs.outputs:
                generated.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finish_reason is not None:
                    finished[o.request_id] = o.finish_reason
    assert not scheduler.has_unfinished_requests()
    assert finished["broken"] == FinishReason.ERROR and "broken" in reasons and not generated.get("broken")
    assert "broken" not in driver.live
    assert {r: generated[r] for r in alone} == alone


def test_a_row_cut_inside_a_video_is_reused_up_to_the_cut(served, stand_in_architecture):
    """Row reuse through vLLM's scheduler (``QeffEvsScheduler``, the plugin's KV layout: one block per row): a request
    aborted mid-prefill, inside its video, leaves what it computed; the same prompt next starts there (vLLM's
    ``num_computed_tokens``), the video is encoded again for its tail rows, and the tokens equal the request alone.
    The same prompt about another video of the same size starts before that video."""
    from vllm.v1.request import RequestStatus

    from qeff_evs.vllm.engine.scheduler import QeffEvsScheduler

    bundle, m = served.bundle, served.bundle.manifest
    config = export_config(m, max_new_tokens=NEW_TOKENS)
    videos = [saved_video(served, f"cut_{n}", 8, seed=50 + n) for n in range(2)]
    pieces = pieces_for(bundle.tokenizer, "what moves here?")
    vision, language = sessions_for(bundle, "ort")
    alone = []
    for video in videos:
        engine = Engine(bundle.family, vision, language, config)
        alone.append(engine.generate(engine.prepare(pieces, [video])).generated_token_ids)

    plain = vllm_scheduler(served.checkpoint, stand_in_architecture, block=CTX_LEN, prefix_caching=True)
    plain.vllm_config.model_config.model = str(bundle.export_dir)  # the scheduler reads the export's manifest there
    scheduler = QeffEvsScheduler(vllm_config=plain.vllm_config, kv_cache_config=plain.kv_cache_config,
                                 structured_output_manager=plain.structured_output_manager, block_size=CTX_LEN)
    driver = VllmDriver(bundle.family, *sessions_for(bundle, "ort"), config)

    def run(request_id: str, video, abort_inside_video: bool = False):
        """Schedule one request to its end (or abort it once its computed tokens end inside its video): its first
        num_computed_tokens, the computed tokens when it ended, its generated tokens."""
        scheduler.add_request(driver.make_request(request_id, pieces, [video], NEW_TOKENS))
        placeholder = driver.live[request_id].plan.placeholders[0]
        start, generated = None, []
        for _ in range(200):
            if not scheduler.has_unfinished_requests():
                break
            out = scheduler.schedule()
            for new in out.scheduled_new_reqs:
                start = new.num_computed_tokens
                driver.live[new.req_id].cache_row = out.kv_rows[new.req_id]  # the worker's placement
            runner_output = driver.execute(out)
            for engine_outputs in scheduler.update_from_output(out, runner_output).values():
                for o in engine_outputs.outputs:
                    generated.extend(o.new_token_ids)
            request = scheduler.requests.get(request_id)
            if abort_inside_video and request is not None and \
                    placeholder.offset < request.num_computed_tokens < placeholder.offset + placeholder.length:
                computed = request.num_computed_tokens
                scheduler.finish_requests(request_id, RequestStatus.FINISHED_ABORTED)
                driver.execute(scheduler.schedule())  # the step that tells the worker
                return start, computed, generated
        assert not scheduler.has_unfinished_requests(), f"{request_id} did not finish in 200 steps"
        return start, None, generated

    first_start, cut, _ = run("aborted", videos[0], abort_inside_video=True)
    start, _, generated = run("again", videos[0])
    assert first_start == 0 and start == cut
    assert generated == alone[0]
    video_offset = driver.plan(pieces, [videos[1]]).placeholders[0].offset
    start, _, generated = run("other video", videos[1])
    assert start <= video_offset and generated == alone[1]
