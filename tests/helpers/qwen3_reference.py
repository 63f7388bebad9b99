"""Transformers as the referee for one video and a question, for the families with Qwen3-VL's layout, and the
end-to-end checks their tests share.

The reference prompt ids are built here from the tokenizer, transformers' ``replace_video_token`` (Qwen3-VL's
processor, which Qwen3.5 uses too) and the HF frame sampler's indices, not by the package. ``hf_reference``
runs transformers' own vision tower and text model by hand on the REAL pruned layout: EVS (or vLLM's VidCom2)
over the tower's merged rows (and, where the tower has them, its deepstack levels: ``[merger | deepstack]``, as
vLLM scores Qwen3-VL), the kept rows at the pruned prompt's pads (the deepstack rows through
``visual_pos_masks``/``deepstack_visual_embeds``), explicit 3-row positions (``get_rope_index`` of the unpruned
prompt restricted to the kept tokens), greedy with transformers' ``DynamicCache``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import types
from pathlib import Path

import numpy as np
import torch
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
from transformers.video_utils import VideoMetadata

from qeff_evs import cli, evs
from qeff_evs.bench.hf_reference import greedy_by_hand
from qeff_evs.runtime.engine.request import PromptPiece
from qeff_evs.runtime.engine.serving import ServeRequest
from qeff_evs.runtime.inputs.synthetic import moving_square_video
from helpers.pruning_oracles import vllm_vidcom2_mask
from helpers.top_logits import assert_top_logits_match


def hf_video_ids(tokenizer, config, grid_thw, frame_indices: list[int], fps: float) -> list[int]:
    """``Qwen3VLProcessor.replace_video_token`` on a stand-in (its video processor needs torchvision)."""
    vision = config.vision_config
    stand_in = types.SimpleNamespace(
        video_processor=types.SimpleNamespace(merge_size=vision.spatial_merge_size,
                                              temporal_patch_size=vision.temporal_patch_size),
        vision_start_token="<|vision_start|>", vision_end_token="<|vision_end|>", video_token="<|video_pad|>")
    stand_in._calculate_timestamps = functools.partial(Qwen3VLProcessor._calculate_timestamps, stand_in)
    metadata = VideoMetadata(total_num_frames=max(frame_indices) + 1, fps=fps, frames_indices=list(frame_indices))
    text = Qwen3VLProcessor.replace_video_token(
        stand_in, {"video_grid_thw": torch.tensor([list(grid_thw)]), "video_metadata": [metadata]}, 0)
    return tokenizer.encode(text, add_special_tokens=False)


def split_template(tokenizer, question: str) -> tuple[list[int], list[int]]:
    """The chat template for one video and ``question``, split at the video pad: ids before and after."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": question}]}],
        tokenize=False, add_generation_prompt=True)
    before, after = text.split("<|video_pad|>")
    return tokenizer.encode(before, add_special_tokens=False), tokenizer.encode(after, add_special_tokens=False)


def our_pieces(before: list[int], after: list[int]) -> list[PromptPiece]:
    return [PromptPiece(ids=tuple(before)), PromptPiece(media_item=0), PromptPiece(ids=tuple(after))]


@dataclasses.dataclass
class Reference:
    ids: list[int]  # the prompt transformers sees (pruned layout when q > 0)
    positions: np.ndarray  # (3, N)
    kept: np.ndarray  # the video's kept merged-token indices
    tokens: list[int]
    first_logits: torch.Tensor


@torch.no_grad()
def hf_reference(model, tokenizer, question: str, video, indices, fps, q: float, steps: int,
                 method: str = "evs") -> Reference:
    """Transformers' vision tower, EVS (or vLLM's VidCom2) on its rows, and its text model over the pruned layout."""
    config = model.config
    merge = config.vision_config.spatial_merge_size
    before, after = split_template(tokenizer, question)
    grid = tuple(video.grid_thw)
    tower = model.model.visual(video.pixel_values, grid_thw=torch.tensor([grid]))
    merged, levels = tower.pooler_output, list(getattr(tower, "deepstack_features", None) or ())
    scored = torch.cat([merged, *levels], dim=-1)
    if q == 0:
        mask = torch.ones(merged.shape[0], dtype=torch.bool)
    elif method == "vidcom2":
        mask = vllm_vidcom2_mask(scored, grid, merge, q)
    else:
        mask = evs.retention_mask(scored, grid, merge, q)
    video_ids = hf_video_ids(tokenizer, config, grid, indices, fps)
    keep = np.ones(len(video_ids), dtype=bool)
    keep[np.asarray(video_ids) == config.video_token_id] = mask.numpy()
    unpruned = torch.tensor([before + video_ids + after])
    keep_t = torch.tensor([True] * len(before) + keep.tolist() + [True] * len(after))
    token_types = torch.zeros_like(unpruned, dtype=torch.int32)
    token_types[unpruned == config.video_token_id] = 2
    unpruned_positions, _ = model.model.get_rope_index(unpruned, mm_token_type_ids=token_types,
                                                       video_grid_thw=torch.tensor([list(grid)]))
    ids, positions = unpruned[:, keep_t], unpruned_positions[:, :, keep_t]

    is_video = ids == config.video_token_id
    embeds = model.model.language_model.embed_tokens(ids).clone()
    embeds[is_video] = merged[mask]
    deepstack = dict(visual_pos_masks=is_video, deepstack_visual_embeds=[level[mask] for level in levels]) \
        if levels else {}
    first_logits, tokens = greedy_by_hand(model, embeds, positions, int(unpruned_positions.max()) + 1, steps,
                                          **deepstack)
    return Reference(ids[0].tolist(), positions[:, 0].numpy(), torch.nonzero(mask).reshape(-1).numpy(), tokens,
                     first_logits)


@torch.no_grad()
def hf_generate(model, tokenizer, question: str, video, indices, fps, steps: int):
    """Transformers' own ``generate`` (greedy, no stop) on the unpruned prompt."""
    config = model.config
    before, after = split_template(tokenizer, question)
    ids = before + hf_video_ids(tokenizer, config, tuple(video.grid_thw), indices, fps) + after
    ids_t = torch.tensor([ids])
    token_types = torch.zeros_like(ids_t, dtype=torch.int32)
    token_types[ids_t == config.video_token_id] = 2
    out = model.generate(input_ids=ids_t, attention_mask=torch.ones_like(ids_t), mm_token_type_ids=token_types,
                         pixel_values_videos=video.pixel_values, video_grid_thw=torch.tensor([list(video.grid_thw)]),
                         max_new_tokens=steps, min_new_tokens=steps, do_sample=False, output_logits=True,
                         return_dict_in_generate=True)
    return ids, out.sequences[0, ids_t.shape[1]:].tolist(), out.logits[0][0]


# --------------------------------------------------------------------------------------------------
# The checks the e2e tests of these families share (test_e2e_qwen3_5.py, test_e2e_moe.py)

# Continuous-batching requests: two clips, three questions, four prompt lengths.
CB_REQUESTS = {"a": ("long", "What happens in this video?"), "b": ("short", "What happens in this video?"),
               "c": ("short", "Describe the video in detail."), "d": ("long", "Where")}


def assert_chunked_run_equals(engine, video, ref: Reference, tokenizer, question: str, seq_len: int,
                              atol: float) -> None:
    """The engine's prompt (ids, int64 positions, kept indices) and greedy run in chunks of ``seq_len`` equal
    ``ref``; the chunk boundaries fall inside the video placeholder."""
    prompt = engine.prepare(our_pieces(*split_template(tokenizer, question)), [video])
    assert prompt.ids.tolist() == ref.ids
    np.testing.assert_array_equal(prompt.positions, ref.positions)
    np.testing.assert_array_equal(prompt.encoded[0].kept_indices, ref.kept)
    # Chunk boundaries fall inside the video placeholder (a layer state crosses them mid-video).
    placeholder = prompt.placeholders[0]
    cuts = range(seq_len, len(ref.ids), seq_len)
    assert any(placeholder.offset < cut < placeholder.offset + placeholder.length for cut in cuts)
    result = engine.generate(prompt, eos_ids=())
    assert result.num_prefill_chunks == -(-len(ref.ids) // seq_len) >= 2
    assert result.generated_token_ids == ref.tokens
    assert_top_logits_match(result.prefill_top_logits, ref.first_logits, atol)


def add_cb_requests(engine, model, tokenizer, clips, known: dict, q: float, steps: int) -> dict[str, list[int]]:
    """Add ``CB_REQUESTS`` to a serving engine; returns each request's transformers tokens on it alone
    (``known``: references already computed, by (clip, question))."""
    expected, lengths = {}, set()
    for request_id, (clip, question) in CB_REQUESTS.items():
        video, indices, fps = clips[clip]
        ref = known.get((clip, question)) or hf_reference(model, tokenizer, question, video, indices, fps, q, steps)
        expected[request_id] = ref.tokens
        lengths.add(len(ref.ids))
        engine.add_request(ServeRequest(request_id, our_pieces(*split_template(tokenizer, question)), [video],
                                        max_new_tokens=steps))
    assert len(lengths) == 4
    return expected


def qeff_evs_run(bundle, clip, question: str, steps: int, folder: Path, capsys, *flags: str) -> dict:
    """``qeff-evs run --json`` (the CLI, its own prompt and stop ids) on ``clip`` saved as .npy: its JSON."""
    path = folder / "clip.npy"
    np.save(path, moving_square_video(clip.frames, clip.height, clip.width, seed=clip.seed))
    capsys.readouterr()
    code = cli.main(["run", str(bundle.export_dir), "--video", str(path), "--prompt", question,
                     "--max-new-tokens", str(steps), *flags, "--json"])
    assert code == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def until_stop(tokens: list[int], stops) -> list[int]:
    """``tokens`` up to and including the first stop token (what a run that stops there generates)."""
    stops = set(stops)
    return tokens[: next((i + 1 for i, t in enumerate(tokens) if t in stops), len(tokens))]
