"""Prompt planning rejects media references it cannot honour, instead of leaving holes in the prompt."""

import pytest
import torch

from qeff_evs.models.protocol import MediaInput
from qeff_evs.models.qwen2_5_vl import Qwen2_5_VLFamily
from qeff_evs.models.tiny import build_tokenizer, tiny_config
from qeff_evs.runtime.engine.request import PromptPiece, plan_prompt


@pytest.fixture(scope="module")
def family():
    return Qwen2_5_VLFamily(tiny_config("qwen2_5_vl", build_tokenizer()))


def video(grid=(2, 4, 4)) -> MediaInput:
    t, h, w = grid
    return MediaInput(torch.zeros(t * h * w, 1176), grid, fps=2.0)


def test_a_media_item_used_twice_is_an_error(family):
    pieces = [PromptPiece(ids=(1,)), PromptPiece(media_item=0), PromptPiece(ids=(2,)), PromptPiece(media_item=0)]
    with pytest.raises(ValueError, match="media item 0 appears twice"):
        plan_prompt(pieces, [video()], [4], family)


def test_an_unknown_media_item_is_an_error(family):
    with pytest.raises(ValueError, match="names media item 1, but the request has 1 items"):
        plan_prompt([PromptPiece(media_item=1)], [video()], [4], family)


def test_an_unused_media_item_is_an_error(family):
    with pytest.raises(ValueError, match="exactly once"):
        plan_prompt([PromptPiece(ids=(1,)), PromptPiece(media_item=0)], [video(), video()], [4, 4], family)


def test_the_same_pixels_twice_as_two_items_plan_two_placeholders(family):
    pieces = [PromptPiece(media_item=0), PromptPiece(ids=(7,)), PromptPiece(media_item=1)]
    plan = plan_prompt(pieces, [video(), video()], [4, 4], family)
    assert [(p.offset, p.length) for p in plan.placeholders] == [(0, 4), (5, 4)]
