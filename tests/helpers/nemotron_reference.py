"""vLLM 0.32's Nemotron-H vision-language code and transformers' model as the referees of the Nemotron-H tests.

vLLM's modules for this model (``transformers_utils/processors/nano_nemotron_vl.py`` and
``model_executor/models/nano_nemotron_vl.py``) import torchvision, which this environment lacks, so the functions
the tests need are read out of the installed files with ``ast`` (annotations and decorators dropped, bodies
unchanged) and executed here with stand-ins for the objects they read (``self``, the config, the processor):

* ``video_to_pixel_values`` (+ the size rule and the resize it calls): the pixels vLLM's processor makes;
* ``NanoNemotronVLMultiModalProcessor._get_prompt_repl_video``: the ids a ``<video>`` becomes before encoding
  (the lumped EVS placeholder);
* ``NemotronH_Nano_VL_V2._process_video_input`` and ``_create_final_video_embeddings``: EVS over the tubelets'
  rows with vLLM's own ``compute_retention_mask`` and the video's final embeddings (text of its separators and
  markers, its kept rows), given the rows the vision tower made.

``hf_reference`` runs transformers' ``NemotronH_Omni_Reasoning_V3`` by hand on what vLLM's functions chose:
its vision features, the kept rows at the pruned prompt's ``<image>`` tokens, its language model greedy over its
own cache.
"""

from __future__ import annotations

import ast
import dataclasses
import math
import types
from pathlib import Path
from typing import Any

import numpy as np
import torch
import vllm
from vllm.lora.layers.base import BaseLayerWithLoRA
from vllm.model_executor.models.utils import _merge_multimodal_embeddings
from vllm.multimodal.processing.processor import PromptReplacement, PromptUpdateDetails, cached_encode
from vllm.multimodal.video_prune import evs as vllm_evs

from qeff_evs.models.nemotron_h_omni import patches_to_frames

VLLM_DIR = Path(vllm.__file__).parent
PROCESSOR_FILE = VLLM_DIR / "transformers_utils/processors/nano_nemotron_vl.py"
MODEL_FILE = VLLM_DIR / "model_executor/models/nano_nemotron_vl.py"


class _NoAnnotations(ast.NodeTransformer):
    def visit_arg(self, node):
        node.annotation = None
        return node

    def visit_FunctionDef(self, node):
        node.returns = None
        node.decorator_list = []
        self.generic_visit(node)
        return node


def load_defs(path: Path, wanted: dict[str, str | None], namespace: dict[str, Any]) -> dict[str, Any]:
    """Execute the functions ``wanted`` (name -> enclosing class, or None) of ``path`` in ``namespace``."""
    tree = ast.parse(path.read_text())
    bodies = {None: tree.body, **{n.name: n.body for n in tree.body if isinstance(n, ast.ClassDef)}}
    defs = []
    for name, owner in wanted.items():
        (node,) = [n for n in bodies[owner] if isinstance(n, ast.FunctionDef) and n.name == name]
        defs.append(_NoAnnotations().visit(node))
    exec(compile(ast.fix_missing_locations(ast.Module(body=defs, type_ignores=[])), str(path), "exec"), namespace)
    return {name: namespace[name] for name in wanted}


PROCESSOR = load_defs(PROCESSOR_FILE, {
    "calculate_timestamps": None, "_bicubic_resize_and_normalize": None, "_compute_aspect_preserving_size": None,
    "get_video_target_size_and_feature_size": None, "video_to_pixel_values": None,
    "get_video_repl": "NanoNemotronVLProcessor",
}, {"math": math, "torch": torch, "np": np, "PromptUpdateDetails": PromptUpdateDetails})
INTERNVL_FILE = VLLM_DIR / "transformers_utils/processors/internvl.py"
# InternVL's tiler (pure Python), then the Nemotron-H processor's image functions that call it.
TILER = load_defs(INTERNVL_FILE, {
    "find_closest_aspect_ratio": None, "get_internvl_target_ratios": None, "calculate_internvl_targets": None,
}, {})
IMAGES = load_defs(PROCESSOR_FILE, {
    "_pil_to_nhwc_tensor": None, "dynamic_preprocess": None, "get_num_image_tokens": "BaseNanoNemotronVLProcessor",
    "get_image_repl": "NanoNemotronVLProcessor",
}, {"np": np, "torch": torch, "_bicubic_resize_and_normalize": PROCESSOR["_bicubic_resize_and_normalize"],
    "IMG_CONTEXT": "<image>", "IMG_START": "<img>", "IMG_END": "</img>", "cached_encode": cached_encode,
    "PromptUpdateDetails": PromptUpdateDetails, **TILER})
MODEL = load_defs(MODEL_FILE, {
    "_get_prompt_repl_video": "NanoNemotronVLMultiModalProcessor", "_process_video_input": "NemotronH_Nano_VL_V2",
    "_create_final_video_embeddings": "NemotronH_Nano_VL_V2",
}, {"math": math, "torch": torch, "cast": lambda _, value: value, "NemotronHForCausalLM": None,
    "BaseLayerWithLoRA": BaseLayerWithLoRA,
    "_merge_multimodal_embeddings": _merge_multimodal_embeddings, "PromptReplacement": PromptReplacement,
    "cached_encode": cached_encode, "get_video_target_size_and_feature_size":
        PROCESSOR["get_video_target_size_and_feature_size"],
    "compute_retained_tokens_count": vllm_evs.compute_retained_tokens_count,
    "compute_retention_mask": vllm_evs.compute_retention_mask})


def get_video_repl(**kwargs) -> PromptUpdateDetails:
    """vLLM's ``NanoNemotronVLProcessor.get_video_repl`` (a classmethod: ``cls`` is unused)."""
    return PROCESSOR["get_video_repl"](None, **kwargs)


@dataclasses.dataclass(frozen=True)
class VllmSettings:
    """What vLLM's processor reads from a Nemotron-H checkpoint's config (its remote-code config's fields)."""

    patch_size: int
    downsample_ratio: float
    temporal_patch_size: int
    target_patches: int
    keep_aspect: bool
    norm_mean: tuple[float, ...]
    norm_std: tuple[float, ...]

    @classmethod
    def of(cls, config, preprocessor: dict) -> "VllmSettings":
        return cls(config.vision_config.patch_size, config.downsample_ratio, config.video_temporal_patch_size,
                   preprocessor["video_target_num_patches"], preprocessor["video_maintain_aspect_ratio"],
                   tuple(preprocessor["norm_mean"]), tuple(preprocessor["norm_std"]))


def vllm_pixels(frames: np.ndarray, settings: VllmSettings) -> torch.Tensor:
    """vLLM's ``video_to_pixel_values``: ``(T, H, W, 3)`` uint8 frames -> ``(T, 3, h, w)`` float32."""
    return PROCESSOR["video_to_pixel_values"](
        frames, input_size=None, video_target_num_patches=settings.target_patches,
        video_maintain_aspect_ratio=settings.keep_aspect, patch_size=settings.patch_size,
        downsample_ratio=settings.downsample_ratio, norm_mean=torch.Tensor(settings.norm_mean).reshape(1, 3, 1, 1),
        norm_std=torch.Tensor(settings.norm_std).reshape(1, 3, 1, 1))


def _marker_ids(tokenizer) -> dict[str, list[int]]:
    return {name: tokenizer.encode(text, add_special_tokens=False)
            for name, text in (("_img_start_token_ids", "<img>"), ("_img_end_token_ids", "</img>"),
                               ("_img_context_token_ids", "<image>"))}


def vllm_placeholder_ids(tokenizer, frames: np.ndarray, metadata: dict, settings: VllmSettings,
                         q: float) -> list[int]:
    """What vLLM's processor replaces a ``<video>`` with before encoding (``_get_prompt_repl_video``)."""
    markers = _marker_ids(tokenizer)
    hf_processor = types.SimpleNamespace(
        config=types.SimpleNamespace(patch_size=settings.patch_size, downsample_ratio=settings.downsample_ratio),
        video_target_num_patches=settings.target_patches, video_maintain_aspect_ratio=settings.keep_aspect,
        num_image_token=None, video_temporal_patch_size=settings.temporal_patch_size, tokenizer=tokenizer,
        get_video_repl=get_video_repl, **markers)
    stand_in = types.SimpleNamespace(info=types.SimpleNamespace(
        get_tokenizer=lambda: tokenizer,
        ctx=types.SimpleNamespace(get_mm_config=lambda: types.SimpleNamespace(video_pruning_rate=q))))
    replacement = MODEL["_get_prompt_repl_video"](stand_in, {"video": [(frames, metadata)]}, hf_processor,
                                                  {"video_num_patches": torch.tensor([len(frames)])})
    assert replacement.target == tokenizer.encode("<video>", add_special_tokens=False)
    return list(replacement.replacement(0).full)


@dataclasses.dataclass
class VllmVideo:
    """What vLLM's model makes of one video's tower rows: the kept rows' per-tubelet counts, the retention mask and
    the video's final embeddings and ids (its separators, markers and kept rows)."""

    mask: torch.Tensor
    tokens_per_tubelet: list[int]
    ids: list[int]
    embeddings: torch.Tensor


def vllm_video(model, tokenizer, rows: torch.Tensor, pixels: torch.Tensor, metadata: dict, settings: VllmSettings,
               q: float) -> VllmVideo:
    """``_process_video_input`` on ``rows`` (the tower's rows, ``(T*h*w, hidden)``), its tower run replaced by
    them; ``pixels`` ``(frames, 3, H, W)`` as vLLM's processor made them; ``model``: transformers' (its embeddings)."""
    seen: dict[str, Any] = {}

    def final_embeddings(video_embeddings, num_tokens_per_frame, frames_indices, frame_duration_ms,
                         video_temporal_patch_size=1):
        seen.update(rows=video_embeddings, counts=num_tokens_per_frame)
        vllm_model = types.SimpleNamespace(
            model_config=None, _img_start_token_ids=markers["_img_start_token_ids"],
            _img_end_token_ids=markers["_img_end_token_ids"], _img_context_token_ids=markers["_img_context_token_ids"],
            get_language_model=lambda: types.SimpleNamespace(
                model=types.SimpleNamespace(embed_tokens=model.get_input_embeddings())))
        namespace = MODEL["_create_final_video_embeddings"].__globals__
        namespace["cached_tokenizer_from_config"] = lambda _: tokenizer
        namespace["NanoNemotronVLProcessor"] = types.SimpleNamespace(get_video_repl=get_video_repl)
        seen["ids"] = get_video_repl(
            tokens_per_frame=num_tokens_per_frame, frames_indices=frames_indices, frame_duration_ms=frame_duration_ms,
            tokenizer=tokenizer, video_temporal_patch_size=video_temporal_patch_size, **{
                k.lstrip("_"): v for k, v in markers.items()}).full
        return MODEL["_create_final_video_embeddings"](vllm_model, video_embeddings, num_tokens_per_frame,
                                                       frames_indices, frame_duration_ms,
                                                       video_temporal_patch_size=video_temporal_patch_size)

    markers = _marker_ids(tokenizer)
    stand_in = types.SimpleNamespace(
        video_temporal_patch_size=settings.temporal_patch_size, video_pruning_rate=q,
        config=types.SimpleNamespace(downsample_ratio=settings.downsample_ratio, patch_size=settings.patch_size),
        _extract_video_embeddings_temporal=lambda _: (rows,), _process_image_input=lambda _: (rows,),
        _create_final_video_embeddings=final_embeddings)
    video_input = {"pixel_values_flat": pixels, "num_patches": torch.tensor([pixels.shape[0]]),
                   "frames_indices": torch.tensor(metadata["frames_indices"]),
                   "frame_duration_ms": torch.tensor([int(1000 / metadata["fps"])])}
    (embeddings,) = MODEL["_process_video_input"](stand_in, video_input)
    t = len(seen["counts"])
    mask = torch.ones(rows.shape[0], dtype=torch.bool)
    if q > 0:
        mask = vllm_evs.compute_retention_mask(rows, (t, *_merged_hw(rows.shape[0] // t, pixels, settings)), 1, q)
    assert torch.equal(seen["rows"], rows[mask])
    return VllmVideo(mask, list(seen["counts"]), list(seen["ids"]), embeddings)


def _merged_hw(tokens: int, pixels: torch.Tensor, settings: VllmSettings) -> tuple[int, int]:
    rows = int(pixels.shape[-2] * settings.downsample_ratio // settings.patch_size)
    cols = int(pixels.shape[-1] * settings.downsample_ratio // settings.patch_size)
    assert rows * cols == tokens
    return rows, cols


def prompt_with_video(tokenizer, question: str) -> tuple[list[int], list[int]]:
    """The chat template for one video and ``question`` tokenized whole (as vLLM tokenizes a rendered prompt), split
    around the ``<video>`` target tokens: ``(ids before, ids after)``."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": question}]}],
        tokenize=False, add_generation_prompt=True)
    ids = tokenizer.encode(text, add_special_tokens=False)
    target = tokenizer.encode("<video>", add_special_tokens=False)
    (at,) = [i for i in range(len(ids)) if ids[i:i + len(target)] == target]
    return ids[:at], ids[at + len(target):]


@dataclasses.dataclass
class Reference:
    ids: list[int]  # the prompt with the video's real (pruned) layout
    kept: np.ndarray  # the video's kept row indices
    tokens: list[int]
    first_logits: torch.Tensor


@torch.no_grad()
def hf_reference(model, tokenizer, question: str, video, q: float, steps: int) -> Reference:
    """transformers' tower on ``video``'s frames, vLLM's EVS on its rows, vLLM's layout, transformers' language model
    greedy over its own cache on the kept rows."""
    config = model.config
    frames = patches_to_frames(torch.as_tensor(video.pixel_values), video.grid_thw, config.video_temporal_patch_size,
                               config.vision_config.patch_size)
    rows = model.get_video_features(frames).pooler_output
    rows = rows.reshape(-1, rows.shape[-1])
    t, h, w = video.grid_thw[0], video.grid_thw[1] // 2, video.grid_thw[2] // 2
    mask = torch.ones(rows.shape[0], dtype=torch.bool) if q == 0 else \
        vllm_evs.compute_retention_mask(rows, (t, h, w), 1, q)
    counts = mask.reshape(t, h * w).sum(dim=1).tolist()
    markers = {k.lstrip("_"): v for k, v in _marker_ids(tokenizer).items()}
    video_ids = get_video_repl(tokens_per_frame=counts, frames_indices=list(video.frame_indices),
                               frame_duration_ms=int(1000 / video.source_fps), tokenizer=tokenizer,
                               video_temporal_patch_size=config.video_temporal_patch_size, **markers).full
    before, after = prompt_with_video(tokenizer, question)
    ids = torch.tensor([before + list(video_ids) + after])
    embeds = model.get_input_embeddings()(ids).clone()
    embeds[ids == config.image_token_id] = rows[mask]
    first, tokens = greedy(model.language_model, embeds, steps)
    return Reference(ids[0].tolist(), torch.nonzero(mask).reshape(-1).numpy(), tokens, first)


@torch.no_grad()
def greedy(language_model, embeds: torch.Tensor, steps: int) -> tuple[torch.Tensor, list[int]]:
    """transformers' NemotronH language model greedy by hand over its own cache (Mamba2 states and KV)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=language_model.config)
    out = language_model(inputs_embeds=embeds, past_key_values=cache, use_cache=True)
    first = out.logits[0, -1]
    tokens = [int(first.argmax())]
    for _ in range(1, steps):
        out = language_model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=cache, use_cache=True)
        tokens.append(int(out.logits[0, -1].argmax()))
    return first, tokens


# ---- images (vLLM 0.34's tiler mode) ---------------------------------------------------------------


def vllm_image_pixels(image, tile_size: int, max_tiles: int, settings: VllmSettings) -> torch.Tensor:
    """vLLM's ``dynamic_preprocess`` of a PIL image: its tiles ``(N, 3, S, S)`` float32, the thumbnail last (its CPU
    normalisation, the path our frames follow)."""
    return IMAGES["dynamic_preprocess"](
        image, image_size=tile_size, max_num_tiles=max_tiles, use_thumbnail=True,
        norm_mean=torch.Tensor(settings.norm_mean).reshape(1, 3, 1, 1),
        norm_std=torch.Tensor(settings.norm_std).reshape(1, 3, 1, 1))


def vllm_image_ids(tokenizer, width: int, height: int, tile_size: int, max_tiles: int, settings: VllmSettings
                   ) -> list[int]:
    """What vLLM's processor replaces an ``<image>`` with: ``get_image_repl`` of ``get_num_image_tokens``."""
    rows_per_tile = int((tile_size // settings.patch_size) ** 2 * settings.downsample_ratio ** 2)
    processor = types.SimpleNamespace(image_size=tile_size, use_thumbnail=True, num_image_token=rows_per_tile,
                                      tokenizer=tokenizer, **_marker_ids(tokenizer))
    feature_size = IMAGES["get_num_image_tokens"](processor, image_width=width, image_height=height,
                                                  max_num_tiles=max_tiles)
    return list(IMAGES["get_image_repl"](processor, feature_size, None).full)


def hf_image_rows(model, tiles: torch.Tensor) -> torch.Tensor:
    """transformers' rows of an image's tiles: its RADIO tower on each tile (the image patch projection), then
    ``project_vision_features``; tile by tile, raster inside each."""
    patch = model.config.vision_config.patch_size
    features = model.vision_model(tiles).features
    rows = model.project_vision_features(features, tiles.shape[-2] // patch, tiles.shape[-1] // patch)
    return rows.reshape(-1, rows.shape[-1])


def hf_video_block(model, tokenizer, video, q: float) -> tuple[list[int], torch.Tensor, np.ndarray]:
    """A video's ids as vLLM's ``get_video_repl`` writes them for the rows vLLM's EVS keeps at ``q`` of
    transformers' tower rows, those rows, and their indices."""
    config = model.config
    frames = patches_to_frames(torch.as_tensor(video.pixel_values), video.grid_thw,
                               config.video_temporal_patch_size, config.vision_config.patch_size)
    video_rows = model.get_video_features(frames).pooler_output.reshape(-1, config.text_config.hidden_size)
    t, h, w = video.grid_thw[0], video.grid_thw[1] // 2, video.grid_thw[2] // 2
    mask = torch.ones(video_rows.shape[0], dtype=torch.bool) if q == 0 else \
        vllm_evs.compute_retention_mask(video_rows, (t, h, w), 1, q)
    counts = mask.reshape(t, h * w).sum(dim=1).tolist()
    markers = {k.lstrip("_"): v for k, v in _marker_ids(tokenizer).items()}
    repl = list(get_video_repl(tokens_per_frame=counts, frames_indices=list(video.frame_indices),
                               frame_duration_ms=int(1000 / video.source_fps), tokenizer=tokenizer,
                               video_temporal_patch_size=config.video_temporal_patch_size, **markers).full)
    return repl, video_rows[mask], torch.nonzero(mask).reshape(-1).numpy()


@torch.no_grad()
def hf_reference_images(model, tokenizer, question: str, images: list[tuple[torch.Tensor, list[int]]], video,
                        q: float, steps: int) -> Reference:
    """transformers on a user turn of ``images`` (each its tiles and vLLM's ids for it), then ``video`` (or None),
    then ``question``: the chat template tokenized whole, each ``<image>`` and ``<video>`` replaced as vLLM replaces
    them, the image rows at their pads, the video's kept rows (vLLM's EVS at ``q``) at its own; transformers'
    language model greedy over its own cache."""
    config = model.config
    content = [{"type": "image"}] * len(images) + ([{"type": "video"}] if video is not None else [])
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": content + [{"type": "text", "text": question}]}], tokenize=False,
        add_generation_prompt=True)
    ids = tokenizer.encode(text, add_special_tokens=False)
    image_id, video_ids = config.image_token_id, tokenizer.encode("<video>", add_special_tokens=False)
    rows, kept = [], np.zeros(0, dtype=np.int64)
    out, at, next_image = [], 0, 0
    while at < len(ids):
        if ids[at] == image_id:
            tiles, repl = images[next_image]
            next_image += 1
            out += repl
            rows.append(hf_image_rows(model, tiles))
            at += 1
        elif video is not None and ids[at:at + len(video_ids)] == video_ids:
            repl, video_rows, kept = hf_video_block(model, tokenizer, video, q)
            out += repl
            rows.append(video_rows)
            at += len(video_ids)
        else:
            out.append(ids[at])
            at += 1
    prompt = torch.tensor([out])
    embeds = model.get_input_embeddings()(prompt).clone()
    embeds[prompt == image_id] = torch.cat(rows)
    first, tokens = greedy(model.language_model, embeds, steps)
    return Reference(out, kept, tokens, first)


# ---- audio (vLLM 0.34's Parakeet extractor; transformers' audio tower) -------------------------------

AUDIO = load_defs(PROCESSOR_FILE, {"get_audio_repl": "NanoNemotronVLProcessor"}, {
    "AUDIO_START": "<so_start>", "AUDIO_END": "<so_end>", "AUDIO_CONTEXT": "<so_embedding>",
    "cached_encode": cached_encode, "PromptUpdateDetails": PromptUpdateDetails})


def vllm_extractor(sound_config):
    """vLLM's ``ParakeetExtractor`` over a checkpoint's sound config, eager (its ``torch.compile`` steps off: the
    same ops, no compiler in the tests)."""
    torch._dynamo.config.disable = True
    from vllm.model_executor.models.parakeet import ParakeetExtractor

    return ParakeetExtractor(sound_config)


def vllm_audio_ids(tokenizer, extractor, waveform: np.ndarray) -> list[int]:
    """What vLLM's processor replaces a ``<so_embedding>`` with: ``get_audio_repl`` of the waveform."""
    processor = types.SimpleNamespace(audio_extractor=extractor, tokenizer=tokenizer)
    return list(AUDIO["get_audio_repl"](processor, waveform).full)


def hf_audio_rows(model, extractor, waveform: np.ndarray) -> torch.Tensor:
    """transformers' audio tower and projector on vLLM's features of ``waveform``, clip by clip, each clip's rows
    cut to the count vLLM keeps (``_process_audio_input``: the subsampled length of its mask; transformers' own
    ``get_audio_features`` keeps one row more when the frames are a multiple of 8)."""
    features = extractor([waveform])
    rows = []
    for clip, mask in zip(features["input_audio_features"], features["feature_attention_mask"]):
        hidden = model.audio_tower(input_features=clip[None], attention_mask=mask[None].long()).last_hidden_state
        keep = int(model.audio_tower._get_subsampling_output_length(mask.sum()[None]).item())
        rows.append(model.embed_audio(hidden)[0, :keep])
    return torch.cat(rows)


@torch.no_grad()
def hf_reference_turn(model, tokenizer, extractor, question: str, parts: list[tuple[str, Any]], q: float,
                      steps: int, sound_after_video: np.ndarray | None = None) -> Reference:
    """transformers on one user turn of ``parts`` (``("image", (tiles, vLLM ids))``, ``("audio", waveform)``,
    ``("video", MediaInput)``, in order) then ``question``: the chat template rendered whole, each placeholder
    replaced as vLLM replaces it; ``sound_after_video`` (``use_audio_in_video``): a ``<so_embedding>`` put right
    after the ``<video>`` as vLLM's ``apply`` puts it, then that waveform's block. Image, audio and kept video rows
    at their pads; transformers' language model greedy over its own cache."""
    config = model.config
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": kind} for kind, _ in parts] + [{"type": "text", "text": question}]}],
        tokenize=False, add_generation_prompt=True)
    if sound_after_video is not None:
        text = text.replace("<video>", "<video><so_embedding>")
        video_at = [i for i, (kind, _) in enumerate(parts) if kind == "video"][0]
        parts = parts[:video_at + 1] + [("audio", sound_after_video)] + parts[video_at + 1:]
    ids = tokenizer.encode(text, add_special_tokens=False)
    image_id, audio_id = config.image_token_id, config.audio_token_id
    video_ids = tokenizer.encode("<video>", add_special_tokens=False)
    out, image_rows, audio_rows, kept = [], [], [], np.zeros(0, dtype=np.int64)
    remaining = list(parts)
    at = 0
    while at < len(ids):
        kind = remaining[0][0] if remaining else None
        if kind == "image" and ids[at] == image_id:
            tiles, repl = remaining.pop(0)[1]
            out += repl
            image_rows.append(hf_image_rows(model, tiles))
            at += 1
        elif kind == "audio" and ids[at] == audio_id:
            waveform = remaining.pop(0)[1]
            out += vllm_audio_ids(tokenizer, extractor, waveform)
            audio_rows.append(hf_audio_rows(model, extractor, waveform))
            at += 1
        elif kind == "video" and ids[at:at + len(video_ids)] == video_ids:
            repl, video_rows, kept = hf_video_block(model, tokenizer, remaining.pop(0)[1], q)
            out += repl
            image_rows.append(video_rows)  # video rows sit at the image context token, as vLLM puts them
            at += len(video_ids)
        else:
            out.append(ids[at])
            at += 1
    assert not remaining, f"the rendered prompt lacks placeholders for {[kind for kind, _ in remaining]}"
    prompt = torch.tensor([out])
    embeds = model.get_input_embeddings()(prompt).clone()
    if image_rows:
        embeds[prompt == image_id] = torch.cat(image_rows)
    if audio_rows:
        embeds[prompt == audio_id] = torch.cat(audio_rows)
    first, tokens = greedy(model.language_model, embeds, steps)
    return Reference(out, kept, tokens, first)
