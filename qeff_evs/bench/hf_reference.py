"""transformers as the referee of the QEfficient comparison: first-token logits and greedy tokens on the same inputs.

* Frames as images (QEfficient's prompt): transformers' own ``generate`` on the prompt ids, the images' pixel
  values and grids (``mm_token_type_ids`` marking image pads). For images transformers and vLLM place
  positions alike.
* The video (our prompt, q = 0): transformers' stock vision tower on the video's pixel values, its merged rows
  (and Qwen3-VL's deepstack rows) at the prompt's video pads, its text model run by hand at the prompt's M-RoPE
  positions: vLLM's, which transformers >= 5 does not give for the text after a Qwen2.5-VL video
  (docs/design.md#positions).
  Those positions come from ``qeff_evs.positions`` (held to vLLM's own functions in tests/test_positions.py);
  greedy decoding continues at their maximum + 1, as the end-to-end tests' references do.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class Reference:
    first_logits: np.ndarray = field(repr=False)  # (vocab,) float32
    tokens: list[int]


def load_reference_model(checkpoint, model_class):
    """The checkpoint as a user loads it in transformers: fp32, eval, its default attention."""
    return model_class.from_pretrained(checkpoint, dtype=torch.float32).eval()


@torch.no_grad()
def images_reference(model, input_ids: np.ndarray, pixel_values: np.ndarray, grids: np.ndarray,
                     steps: int) -> Reference:
    """transformers' ``generate`` (greedy, exactly ``steps`` tokens) on a prompt of images."""
    ids = torch.from_numpy(np.asarray(input_ids, dtype=np.int64))[None]
    token_types = (ids == model.config.image_token_id).to(torch.int32)  # 1: image
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=token_types,
                         pixel_values=torch.from_numpy(np.asarray(pixel_values, dtype=np.float32)),
                         image_grid_thw=torch.from_numpy(np.asarray(grids, dtype=np.int64)),
                         max_new_tokens=steps, min_new_tokens=steps, do_sample=False, output_logits=True,
                         return_dict_in_generate=True)
    return Reference(out.logits[0][0].float().numpy().copy(), out.sequences[0, ids.shape[1]:].tolist())


@torch.no_grad()
def video_reference(model, input_ids: np.ndarray, positions: np.ndarray, pixel_values, grid_thw,
                    steps: int) -> Reference:
    """The text model run by hand on one unpruned video prompt at ``positions`` ((3, N), vLLM's)."""
    config = model.config
    ids = torch.from_numpy(np.asarray(input_ids, dtype=np.int64))[None]
    tower = model.model.visual(torch.as_tensor(pixel_values, dtype=torch.float32),
                               grid_thw=torch.tensor([list(grid_thw)]))
    rows = tower.pooler_output
    levels = getattr(tower, "deepstack_features", None)
    is_video = ids == config.video_token_id
    if int(is_video.sum()) != rows.shape[0]:
        raise ValueError(f"the prompt holds {int(is_video.sum())} video pads but the tower gave {rows.shape[0]} rows")
    embeds = model.model.language_model.embed_tokens(ids).clone()
    embeds[is_video] = rows
    extra = {"visual_pos_masks": is_video, "deepstack_visual_embeds": list(levels)} if levels else {}
    position_ids = torch.from_numpy(np.asarray(positions, dtype=np.int64))[:, None]
    first, tokens = greedy_by_hand(model, embeds, position_ids, int(position_ids.max()) + 1, steps, **extra)
    return Reference(first.float().numpy().copy(), tokens)


@torch.no_grad()
def greedy_by_hand(model, embeds: torch.Tensor, position_ids: torch.Tensor, decode_start: int, steps: int,
                   **prompt_kwargs) -> tuple[torch.Tensor, list[int]]:
    """transformers' text model run by hand, greedy: the prompt's ``embeds`` ``(1, N, D)`` at ``position_ids``
    ``(3, 1, N)`` in one call (``prompt_kwargs``: e.g. its deepstack rows), then ``steps - 1`` tokens one at a
    time at ``decode_start``, ``decode_start + 1``, ..., over a ``DynamicCache``.

    Returns the prompt's last logits ``(vocab,)`` and the ``steps`` greedy tokens.
    """
    from transformers import DynamicCache

    text_model = model.model.language_model
    cache = DynamicCache(config=model.config.text_config)
    out = text_model(inputs_embeds=embeds, position_ids=position_ids, past_key_values=cache, use_cache=True,
                     **prompt_kwargs)
    first = model.lm_head(out.last_hidden_state[0, -1])
    tokens = [int(first.argmax())]
    for j in range(1, steps):
        step_positions = torch.full((3, 1, 1), decode_start + j - 1, dtype=torch.int64)
        out = text_model(inputs_embeds=text_model.embed_tokens(torch.tensor([[tokens[-1]]])),
                         position_ids=step_positions, past_key_values=cache, use_cache=True)
        tokens.append(int(model.lm_head(out.last_hidden_state[0, -1]).argmax()))
    return first, tokens


@dataclass(frozen=True)
class Fidelity:
    """One side's first-token logits and greedy tokens against transformers'."""

    max_abs_logit_diff: float
    logit_scale: float  # max |reference logit|, to read the difference against
    tokens_equal: bool
    first_divergence: int | None  # index of the first differing token, None when equal
    tokens: tuple[int, ...]
    reference_tokens: tuple[int, ...]

    def to_json(self) -> dict:
        return {"max_abs_logit_diff": self.max_abs_logit_diff, "logit_scale": self.logit_scale,
                "tokens_equal": self.tokens_equal, "first_divergence": self.first_divergence,
                "tokens": list(self.tokens), "reference_tokens": list(self.reference_tokens)}


def fidelity(logits: np.ndarray, tokens: list[int], reference: Reference) -> Fidelity:
    ours = np.asarray(logits, dtype=np.float64).reshape(-1)
    theirs = np.asarray(reference.first_logits, dtype=np.float64).reshape(-1)
    if ours.shape != theirs.shape:
        raise ValueError(f"logits of {ours.shape[0]} entries against a reference of {theirs.shape[0]}")
    diverge = next((i for i, (a, b) in enumerate(zip(tokens, reference.tokens)) if a != b), None)
    if diverge is None and len(tokens) != len(reference.tokens):
        diverge = min(len(tokens), len(reference.tokens))
    return Fidelity(float(np.abs(ours - theirs).max()), float(np.abs(theirs).max()), diverge is None, diverge,
                    tuple(int(t) for t in tokens), tuple(int(t) for t in reference.tokens))
