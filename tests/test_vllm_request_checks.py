"""The frontend's request checks, on their own: what they refuse, what they let through.

``qeff_evs.vllm.engine.request_checks`` decides on what vLLM's frontend knows before any graph runs. The RoPE check
needs where a prompt's unpruned M-RoPE positions end, which the processor computes per media item
(``position_span``) and sums; here that sum is held to the worker's own prompt plan (``plan_prompt``'s
``decode_start``) for both families, videos of several lengths, images and prompts with several items.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.multimodal.processing")

from qeff_evs.models.pruning import VideoPruning  # noqa: E402
from qeff_evs.runtime.engine.executor import kept_count  # noqa: E402
from qeff_evs.runtime.engine.request import plan_prompt  # noqa: E402
from qeff_evs.runtime.inputs.prompt import chat_pieces  # noqa: E402
from qeff_evs.runtime.inputs.synthetic import moving_square_video  # noqa: E402
from qeff_evs.runtime.export_bundle import open_export  # noqa: E402
from qeff_evs.runtime.media import image_from_array, video_from_frames  # noqa: E402
from qeff_evs.vllm.processing.processor import position_span  # noqa: E402
from qeff_evs.vllm.engine.request_checks import (  # noqa: E402
    RequestLimits,
    media_count,
    positions_end,
    positions_problem,
    stray_media_pads,
)

LIMITS = RequestLimits({7: "<|image_pad|>", 8: "<|video_pad|>"}, rope_positions=100, max_model_len=64)


def test_stray_media_pads_outside_placeholders_are_named():
    assert stray_media_pads([1, 2, 8, 8, 8, 3], [(2, 3)], LIMITS) is None
    problem = stray_media_pads([1, 7, 2, 8, 8, 3, 8], [(3, 2)], LIMITS)
    assert problem.startswith("the prompt holds 2 media pad token(s) <|image_pad|> <|video_pad|>")
    assert "(at token 1, 6)" in problem


def test_media_count_names_both_sides():
    pads = {"video": (8, "<|video_pad|>"), "image": (7, "<|image_pad|>")}
    assert media_count([1, 8, 2, 7], {"video": 1, "image": 1}, pads) is None
    assert media_count([1, 8, 8, 2], {"video": 1}, pads).startswith(
        "1 video(s) attached but the prompt has 2 <|video_pad|>")
    assert "0 image(s) attached but the prompt has 1 <|image_pad|>" in media_count([7], {}, pads)
    assert "1 image(s) attached but the prompt has 0 <|image_pad|>" in media_count([1], {"image": 1}, pads)


def test_positions_problem_counts_generated_tokens_up_to_the_model_length():
    assert positions_problem(end=90, prompt_len=40, max_tokens=10, limits=LIMITS) is None  # last position 99
    problem = positions_problem(end=90, prompt_len=40, max_tokens=11, limits=LIMITS)
    assert "needs M-RoPE positions up to 100" in problem and "cover [0, 100)" in problem
    assert "ask for at most max_tokens=10," in problem and "--rope-positions >= 101" in problem
    # max_tokens None: up to max_model_len (64 - 40 = 24 new tokens), as vLLM caps it
    assert "plus 24 new tokens" in positions_problem(end=90, prompt_len=40, max_tokens=None, limits=LIMITS)
    assert "its prompt alone passes them" in positions_problem(end=120, prompt_len=40, max_tokens=1, limits=LIMITS)
    assert positions_problem(end=120, prompt_len=64, max_tokens=5, limits=LIMITS) is None  # vLLM refuses it next


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_positions_end_from_item_spans_is_the_plans_decode_start(family, served_export):
    """The frontend's sum (text tokens + each item's span) equals the worker's prompt plan, for every layout."""
    bundle = open_export(served_export(family)[1])
    (h0, w0), (h1, w1) = [(h, w) for h, w in bundle.manifest.resolutions]
    q = VideoPruning(bundle.manifest.video_pruning_method, bundle.manifest.video_pruning_rate)
    videos = [video_from_frames(moving_square_video(n, h, w, seed=n), {"total_num_frames": n, "fps": fps}, bundle)
              for n, h, w, fps in ((8, h0, w0, 2.0), (4, h1, w1, 2.0), (8, h1, w1, 0.25))]
    image = image_from_array(moving_square_video(1, h1, w1, seed=3)[0], bundle)
    video, picture, text = {"type": "video"}, {"type": "image"}, lambda s: {"type": "text", "text": s}
    prompts = [([video, text("one")], [videos[0]]), ([video, text("slow")], [videos[2]]),
               ([picture, text("an image")], [image]),
               ([text("first"), video, text("then"), picture, text("and"), video], [videos[1], image, videos[2]])]
    for content, media in prompts:
        pieces = chat_pieces(bundle.tokenizer, content)
        kept = [kept_count(bundle.family, m, q) for m in media]
        plan = plan_prompt(pieces, media, kept, bundle.family)
        spans = [position_span(bundle.family, m, k) for m, k in zip(media, kept)]
        placeholders = [(p.offset, p.length) for p in plan.placeholders]
        assert positions_end(len(plan.ids), placeholders, spans) == plan.decode_start
        assert stray_media_pads(plan.ids, placeholders, RequestLimits(
            {t: str(t) for t in bundle.family.special_tokens().media_pads}, None, 10**6)) is None
    if family == "qwen2_5_vl":  # temporal positions follow the timestamps: frames 4 s apart reach 8x as far as 2 fps
        dense = video_from_frames(moving_square_video(8, h1, w1, seed=8), {"total_num_frames": 8, "fps": 2.0}, bundle)
        assert spans[2] > 4 * position_span(bundle.family, dense, kept_count(bundle.family, dense, q))
