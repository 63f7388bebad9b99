"""vLLM's multimodal processor for a qeff-evs export: our preprocessing, our EVS placeholders.

vLLM's frontend calls this for every request with images or videos (``LLM.generate``'s
``multi_modal_data``, the OpenAI server's ``image_url`` / ``video_url``). It runs the same host logic as
``qeff-evs run``: a video's frames are the ones vLLM 0.32's processor would encode out of what vLLM's loader
(or the caller) delivered (the family's HF sampling rule, ``mm_processor_kwargs``, at most the export's
largest frame bucket), resized to HF's size where exported, else to the exported resolution closest in aspect
ratio; images likewise. Each video or image pad the chat template emits (the family's ``token_strings``)
becomes the family's placeholder sized by the served method's count K (``--video-pruning-method``,
``--video-pruning-rate``) before the encoder runs (e.g. Qwen3-VL: timestamps and the lumped layout). Everything a request can get
wrong is checked here, in the frontend, where an error becomes a 400 for that request: an exception
inside the worker would take vLLM's engine down. The processor also records where the prompt's unpruned
M-RoPE positions end (``POSITIONS_END``), so the platform's ``validate_request`` can check them against the
RoPE tables with the request's ``max_tokens``.

The processed fields (``pixel_values_videos``, ``video_grid_thw``, ``video_fps``, ``video_frame_times``, ``video_num_frames``,
``pixel_values``, ``image_grid_thw``) travel to our worker, which rebuilds the ``MediaInput`` with
:func:`media_from_fields`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
import torch
from transformers import BatchFeature

from qeff_evs.models.protocol import MediaInput, ModelFamily
from qeff_evs.models.pruning import PRUNING_METHODS, VideoPruning
from qeff_evs.runtime.engine.executor import kept_count, media_pruning
from qeff_evs.runtime.request_pruning import PruningRequest
from qeff_evs.runtime.sessions import runnable_methods
from qeff_evs.runtime.engine.request import PromptPiece, plan_prompt
from qeff_evs.runtime.builders import largest_image_rows, largest_item_rows, video_pruning
from qeff_evs.runtime.export_bundle import ExportBundle, open_export
from qeff_evs.runtime.media import image_from_array, video_from_frames
from qeff_evs.runtime.inputs.audio_features import USE_AUDIO_IN_VIDEO, audio_input, use_audio_in_video
from qeff_evs.runtime.inputs.video_io import DEFAULT_ARRAY_FPS
from qeff_evs.vllm.engine.limits import served_pruning
from qeff_evs.vllm.activation import active_backend
from qeff_evs.vllm.engine.request_checks import media_count, positions_end
from qeff_evs.vllm.surface import BaseDummyInputsBuilder, BaseMultiModalProcessor, BaseProcessingInfo
from qeff_evs.vllm.surface import MultiModalDataParser
from qeff_evs.vllm.surface import MultiModalFieldConfig
from qeff_evs.vllm.surface import MultiModalProcessorOnlyCache
from qeff_evs.vllm.surface import PromptReplacement, PromptUpdateDetails
from qeff_evs.vllm.surface import VLLMValidationError
from qeff_evs.vllm.surface import mm_input

# Key of the processed input (vLLM's ``MultiModalInput``) that carries the first M-RoPE position after the
# prompt to the platform's ``validate_request``: per-item fields do not reach it for items vLLM's processor
# cache already holds, and the check needs the request's max_tokens, which only it sees.
POSITIONS_END = "qeff_evs_positions_end"


# --- media <-> processed fields --------------------------------------------------------------------


def media_from_fields(fields: Mapping[str, Any], modality: str) -> MediaInput:
    """The ``MediaInput`` one processed item describes (``fields``: its ``MultiModalKwargsItem`` data), a video with
    the pruning its request chose. An item wholly inside a KV row's reused prefix comes without its pixels (vLLM's
    ``strip_covered_mm_data`` keeps only the ``keep_on_cpu`` fields: all but the pixels, see ``_get_mm_fields_config``):
    it is planned, never encoded, and its ``pixel_values`` are empty."""
    if modality == "video":
        pruning = VideoPruning(PRUNING_METHODS[int(fields["video_pruning_method"])],
                               float(fields["video_pruning_rate"]))
        return MediaInput(_pixels(fields, "pixel_values_videos"),
                          tuple(int(v) for v in fields["video_grid_thw"].tolist()), float(fields["video_fps"]),
                          tuple(float(t) for t in fields["video_frame_times"].tolist()), pruning=pruning,
                          frame_indices=tuple(int(i) for i in fields["video_frame_indices"].tolist()),
                          source_fps=float(fields["video_source_fps"]))
    if modality == "image":
        return MediaInput(_pixels(fields, "pixel_values"),
                          tuple(int(v) for v in fields["image_grid_thw"].tolist()), 1.0, (), kind="image")
    if modality == "audio":
        return MediaInput(_pixels(fields, "input_audio_features"),
                          tuple(int(v) for v in fields["audio_grid"].tolist()), float(fields["audio_sampling_rate"]),
                          (), kind="audio", clip_frames=tuple(int(n) for n in fields["audio_clip_frames"].tolist()))
    raise ValueError(f"qeff-evs exports take images, videos and audio, not {modality!r}")


def _pixels(fields: Mapping[str, Any], name: str) -> torch.Tensor:
    pixels = fields.get(name)
    return torch.empty(0) if pixels is None else pixels.to(torch.float32)



def _frames_and_metadata(item: Any) -> tuple[np.ndarray, dict]:
    """Decoded frames of one video item and vLLM's metadata for them: its loader's (``video_url``), the
    caller's (``LLM.generate`` with ``(frames, metadata)``), or, for bare frames, every frame of a clip at
    2 fps (what ``qeff-evs run`` takes a ``.npy`` for)."""
    frames, metadata = item if isinstance(item, tuple) else (item, None)
    frames = np.asarray(frames.cpu() if isinstance(frames, torch.Tensor) else frames)
    if not metadata:
        metadata = {"total_num_frames": len(frames), "fps": DEFAULT_ARRAY_FPS, "do_sample_frames": True}
    return frames, dict(metadata)


def _image_array(image: Any) -> np.ndarray:
    if hasattr(image, "convert"):  # PIL
        return np.asarray(image.convert("RGB"))
    array = np.asarray(image.cpu() if isinstance(image, torch.Tensor) else image)
    if array.ndim != 3 or array.shape[-1] != 3 or array.dtype != np.uint8:
        raise ValueError(f"an image must be RGB uint8 (H, W, 3) or a PIL image, got {array.dtype} {array.shape}")
    return array


def process_media(bundle: ExportBundle, videos: Sequence[Any], images: Sequence[Any],
                  video_kwargs: Mapping[str, Any] | None = None, served: RequestPruningBounds | None = None,
                  audios: Sequence[Any] = ()) -> BatchFeature:
    """Videos, images and audio clips -> the fields our worker reads; a ``ValueError`` naming what the export serves.
    ``video_kwargs``: the request's ``mm_processor_kwargs`` (the video processor's, and its own pruning:
    ``request_pruning.PRUNING_KEYS``); ``served``: the server's pruning and the bounds a request's choice keeps
    within (default: the export's pruning, no context bound); ``audios``: waveforms at the checkpoint's rate (vLLM's
    parser made them mono)."""
    served = served or RequestPruningBounds(video_pruning(bundle), None, PRUNING_METHODS)
    asked, video_kwargs = PruningRequest.split(video_kwargs)
    video_kwargs = {k: v for k, v in video_kwargs.items() if k != USE_AUDIO_IN_VIDEO}  # the prompt's, not frames'
    data: dict[str, torch.Tensor] = {}
    if videos:
        media = []
        for number, item in enumerate(videos):
            frames, metadata = _frames_and_metadata(item)
            try:
                if len(frames) == 0:
                    raise ValueError("no frame could be decoded from it; send a video file a decoder can read")
                video = video_from_frames(frames, metadata, bundle, mm_processor_kwargs=video_kwargs)
                bundle.manifest.check_video(video.grid_thw)
                video = dataclasses.replace(video, pruning=served.resolve(asked, bundle, video))
            except ValueError as error:
                raise ValueError(f"video {number}: {error}") from None
            media.append(video)
        data.update(pixel_values_videos=torch.cat([m.pixel_values for m in media]),
                    video_grid_thw=torch.tensor([m.grid_thw for m in media], dtype=torch.int64),
                    video_fps=torch.tensor([m.fps for m in media], dtype=torch.float64),
                    video_frame_times=torch.tensor([t for m in media for t in m.frame_times], dtype=torch.float64),
                    video_num_frames=torch.tensor([len(m.frame_times) for m in media], dtype=torch.int64),
                    video_frame_indices=torch.tensor([i for m in media for i in m.frame_indices], dtype=torch.int64),
                    video_num_indices=torch.tensor([len(m.frame_indices) for m in media], dtype=torch.int64),
                    video_source_fps=torch.tensor([m.source_fps for m in media], dtype=torch.float64),
                    video_pruning_rate=torch.tensor([m.pruning.rate for m in media], dtype=torch.float64),
                    video_pruning_method=torch.tensor([PRUNING_METHODS.index(m.pruning.method) for m in media],
                                                      dtype=torch.int64))
    if images:
        media = []
        for number, image in enumerate(images):
            try:
                media.append(image_from_array(_image_array(image), bundle, video_kwargs))
            except ValueError as error:
                raise ValueError(f"image {number}: {error}") from None
        data.update(pixel_values=torch.cat([m.pixel_values for m in media]),
                    image_grid_thw=torch.tensor([m.grid_thw for m in media], dtype=torch.int64))
    if audios:
        features = bundle.family.audio_features()
        if features is None:
            raise ValueError(f"this export ({bundle.family.name}) serves no audio; send images and videos")
        media = []
        for number, waveform in enumerate(audios):
            try:
                media.append(audio_input(np.asarray(waveform.cpu() if isinstance(waveform, torch.Tensor)
                                                    else waveform, dtype=np.float32), features))
            except ValueError as error:
                raise ValueError(f"audio {number}: {error}") from None
        data.update(input_audio_features=torch.cat([m.pixel_values for m in media]),
                    audio_grid=torch.tensor([m.grid_thw for m in media], dtype=torch.int64),
                    audio_sampling_rate=torch.tensor([m.fps for m in media], dtype=torch.float64),
                    audio_clip_frames=torch.tensor([n for m in media for n in m.clip_frames], dtype=torch.int64),
                    audio_num_clips=torch.tensor([len(m.clip_frames) for m in media], dtype=torch.int64),
                    audio_num_frames=torch.tensor([sum(m.clip_frames) for m in media], dtype=torch.int64))
    return BatchFeature(data)


def sound_after_videos(prompt_ids: Sequence[int], video_target: Sequence[int], audio_target: Sequence[int]
                       ) -> list[int]:
    """``use_audio_in_video``: the audio pad right after each video's text, where vLLM's Nemotron-H processor puts
    a video's sound (it re-encodes the prompt with ``<so_embedding>`` after every ``<video>``)."""
    ids, out, at = [int(i) for i in prompt_ids], [], 0
    video_target, audio_target = list(video_target), list(audio_target)
    while at < len(ids):
        if ids[at:at + len(video_target)] == video_target:
            out += video_target + audio_target
            at += len(video_target)
        else:
            out.append(ids[at])
            at += 1
    return out


@dataclass(frozen=True)
class RequestPruningBounds:
    """The server's pruning (a request's default) and what a request may choose within: ``max_model_len`` (the
    rates the RoPE tables cover in it) and the ``methods`` the workers run (``sessions.runnable_methods``)."""

    served: VideoPruning
    max_model_len: int | None
    methods: tuple[str, ...]

    def resolve(self, asked: PruningRequest, bundle: ExportBundle, video: MediaInput) -> VideoPruning:
        """The request's pruning of ``video``, a ValueError naming the bound."""
        pruning = asked.resolve(self.served, bundle.manifest, self.max_model_len,
                                bundle.family.merged_grid(video.grid_thw))
        if pruning.method not in self.methods:
            raise ValueError(f"video_pruning_method {pruning.method!r}: this server runs the {', '.join(self.methods)} "
                             "pruning graph(s) only (on the qaic backend, the --video-pruning-method it serves)")
        return pruning


def position_span(family: ModelFamily, media: MediaInput, kept: int) -> int:
    """M-RoPE positions one item's unpruned segment spans (the decode start of a prompt that is only it)."""
    return plan_prompt([PromptPiece(media_item=0)], [media], [kept], family).decode_start


@dataclass
class MediaPlaceholder(PromptUpdateDetails):
    """vLLM's replacement for one media item's pad token, plus the positions its segment spans.

    vLLM's processor cache keeps these replacements for items it has seen (their processed fields are
    not re-sent), so the span reaches :meth:`QeffEvsProcessor.apply` for every item of every request.
    """

    position_span: int = 0


# --- vLLM's processor interfaces -------------------------------------------------------------------


class _FramesWithMetadata(MultiModalDataParser):
    """Keeps each video's loader metadata with its frames through vLLM's processor cache.

    Bare frames (``LLM.generate`` with an array) get the metadata a ``.npy`` has for ``qeff-evs run``.
    """

    def _get_video_with_metadata(self, video):
        frames, metadata = super()._get_video_with_metadata(video)
        return frames, _frames_and_metadata((frames, metadata))[1]


class _ExactRate:
    """The resampler of our parser: audio at the checkpoint's rate passes; another rate is refused in one line
    (vLLM resamples with torchaudio, which this environment does not have and qeff-evs does not reimplement)."""

    def __init__(self, target_sr: int) -> None:
        self.target_sr = target_sr

    def resample(self, audio, *, orig_sr: float):
        if abs(float(orig_sr) - self.target_sr) > 1e-6:
            raise ValueError(f"audio sampled at {orig_sr:g} Hz: this model's audio encoder takes {self.target_sr} Hz "
                             f"and qeff-evs does not resample; send it at {self.target_sr} Hz (e.g. ffmpeg -i IN -ar "
                             f"{self.target_sr} OUT.wav)")
        return audio


class QeffEvsProcessingInfo(BaseProcessingInfo):
    @cached_property
    def bundle(self) -> ExportBundle:
        return open_export(self.ctx.model_config.model)

    def get_data_parser(self) -> MultiModalDataParser:
        features = self.bundle.family.audio_features()
        parser = _FramesWithMetadata(video_needs_metadata=True, expected_hidden_size=self._get_expected_hidden_size(),
                                     allow_missing_mm_embeddings=self.allow_missing_mm_embeddings,
                                     target_sr=None if features is None else features.sampling_rate,
                                     target_channels=None if features is None else 1)
        if features is not None:
            parser.audio_resampler = _ExactRate(features.sampling_rate)
        return parser

    @cached_property
    def pruning(self) -> VideoPruning:
        """The served ``--video-pruning-method`` and ``--video-pruning-rate`` (the platform checked them)."""
        return served_pruning(self.ctx.model_config.multimodal_config)

    @cached_property
    def request_pruning(self) -> RequestPruningBounds:
        """The served pruning, a request's default, and the bounds of a request's own (``request_pruning.py``)."""
        return RequestPruningBounds(self.pruning, self.ctx.model_config.max_model_len,
                                    runnable_methods(self.bundle, active_backend() or "ort", self.pruning.method))

    @cached_property
    def serves_audio(self) -> bool:
        """Whether this export encodes audio: a family with audio and a checkpoint with an audio config."""
        return self.bundle.family.audio_features() is not None

    def get_supported_mm_limits(self) -> Mapping[str, int | None]:
        audio = {"audio": None} if self.serves_audio else {}
        return {"image": None, "video": None, **audio}

    def get_mm_max_tokens_per_item(self, seq_len: int, mm_counts: Mapping[str, int]) -> Mapping[str, int]:
        """Encoder rows of the largest item the export serves (vLLM sizes its encoder cache with them): a request may
        choose rate 0, so the longest video unpruned. A modality the family does not serve has none: vLLM then never
        builds one to profile or measure (an EC producer encodes one dummy item of each listed modality), and a
        request with one still reaches the family's own refusal."""
        unpruned = VideoPruning(self.pruning.method, 0.0)
        # An audio clip of any length is served (cut into 30 s clips): as vLLM, its rows are bounded by seq_len.
        rows = {"video": largest_item_rows(self.bundle, unpruned), "image": largest_image_rows(self.bundle),
                "audio": seq_len}
        served = self.get_supported_mm_limits()
        return {modality: n for modality, n in rows.items() if modality in served}


class QeffEvsDummyInputs(BaseDummyInputsBuilder[QeffEvsProcessingInfo]):
    """The largest video and image the export serves (vLLM's profiling input)."""

    def get_dummy_text(self, mm_counts: Mapping[str, int]) -> str:
        tokens = self.info.bundle.family.token_strings
        return (tokens.video_block * mm_counts.get("video", 0) + tokens.image_block * mm_counts.get("image", 0)
                + tokens.audio * mm_counts.get("audio", 0))

    def get_dummy_mm_data(self, seq_len: int, mm_counts: Mapping[str, int], mm_options=None):
        m = self.info.bundle.manifest
        height, width = max(m.resolutions, key=lambda r: r[0] * r[1])
        video = np.zeros((m.max_frames, height, width, 3), dtype=np.uint8)
        image = np.zeros((height, width, 3), dtype=np.uint8)
        features = self.info.bundle.family.audio_features()
        audio = [] if features is None else \
            [np.zeros(int(features.clip_seconds * features.sampling_rate), dtype=np.float32)]  # one full clip
        return {"video": [video] * mm_counts.get("video", 0), "image": [image] * mm_counts.get("image", 0),
                "audio": audio * mm_counts.get("audio", 0)}


class QeffEvsProcessor(BaseMultiModalProcessor[QeffEvsProcessingInfo]):
    def _cached_apply_hf_processor(self, inputs, timing_ctx):
        """vLLM's, minus the API server's copy of the engine's processor cache.

        That copy marks an item as held by the engine as soon as it is processed; a request refused after
        processing (``validate_request``, and vLLM's own checks of sampling parameters) never reaches the
        engine, so the next request with the same media would be sent without its data and fail there (an
        HTTP 500 "multimodal cache miss"). Here every item's data is sent; the engine's cache still keys it.
        The in-process cache (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) holds the data itself and stays.
        """
        if inputs.cache is not None and not isinstance(inputs.cache, MultiModalProcessorOnlyCache):
            inputs = dataclasses.replace(inputs, cache=None)
        return super()._cached_apply_hf_processor(inputs, timing_ctx)

    def apply(self, inputs, timing_ctx):
        """vLLM's ``BaseMultiModalProcessor.apply`` (0.32), with our checks and the prompt's positions end; with
        ``use_audio_in_video`` (the server's ``--mm-processor-kwargs`` under the request's) each video's sound goes
        right after it, as vLLM's Nemotron-H processor lays it out."""
        family = self.info.bundle.family
        modalities = self._modalities()
        merged = self.info.ctx.model_config.get_multimodal_config().merge_mm_processor_kwargs(
            inputs.hf_processor_mm_kwargs)
        try:
            sound_in_video = use_audio_in_video(merged)
        except ValueError as error:
            raise VLLMValidationError(str(error), parameter="mm_processor_kwargs") from None
        if sound_in_video and "video" in inputs.mm_data_items:
            inputs = self._with_video_sound(inputs, family)
        pads = {modality: (family.prompt_target(modality), family.token_strings.pad(modality))
                for modality in modalities}
        problem = media_count(inputs.prompt, inputs.mm_data_items.get_all_counts(), pads)
        if problem:
            raise VLLMValidationError(problem, parameter="messages")

        mm_res = self._cached_apply_hf_processor(inputs, timing_ctx)
        with timing_ctx.record("apply_prompt_updates"):
            prompt_ids, mm_placeholders = self._maybe_apply_prompt_updates(mm_items=inputs.mm_data_items,
                                                                           mm_res=mm_res)
        items = [item for placed in mm_placeholders.values() for item in placed]
        result = mm_input(prompt_token_ids=prompt_ids, mm_kwargs=mm_res.kwargs, mm_hashes=mm_res.hashes,
                          mm_placeholders={modality: [item.to_range() for item in placed]
                                           for modality, placed in mm_placeholders.items()})
        spans = [mm_res.prompt_updates[item.modality][item.item_idx][0].content.position_span for item in items]
        result[POSITIONS_END] = positions_end(len(prompt_ids), [(i.start_idx, i.length) for i in items], spans)
        return result

    def _modalities(self) -> tuple[str, ...]:
        return ("video", "image", "audio") if self.info.serves_audio else ("video", "image")

    def _with_video_sound(self, inputs, family):
        """The prompt with an audio pad after each video's text; the videos' sounds must be the request's audio
        items (the chat API reads each ``video_url``'s audio track for them), one per video, as vLLM requires."""
        if not self.info.serves_audio:
            raise VLLMValidationError(f"use_audio_in_video: this export ({family.name}) serves no audio",
                                      parameter="mm_processor_kwargs")
        counts = inputs.mm_data_items.get_all_counts()
        if not counts.get("audio", 0):
            # vLLM's chat API reads a video_url's sound only when the request asks; its own fallback (the video's
            # bytes, kept by its nemotron_vl loader) decodes the sound at 22.05 kHz, a resampling not built here.
            raise VLLMValidationError(
                "use_audio_in_video: no sound came with the video(s): vLLM's chat API reads a video_url's audio track "
                "only when the request itself asks for it; pass mm_processor_kwargs {\"use_audio_in_video\": true} "
                "in the request (a server-wide --mm-processor-kwargs value does not make it read one)",
                parameter="mm_processor_kwargs")
        if counts.get("audio", 0) != counts.get("video", 0):
            raise VLLMValidationError(
                f"use_audio_in_video needs each video's sound: {counts.get('video', 0)} video(s) and "
                f"{counts.get('audio', 0)} audio item(s); send the videos as video_url through the chat API (their "
                "audio tracks are read from them) or pass one audio item per video", parameter="mm_processor_kwargs")
        prompt = sound_after_videos(inputs.prompt, family.prompt_target("video"), family.prompt_target("audio"))
        return dataclasses.replace(inputs, prompt=prompt)

    def _apply_hf_processor_main(self, mm_items, hf_kwargs: Mapping[str, object]) -> BatchFeature:
        # No Hugging Face processor runs: our host preprocessing does, on (frames, metadata) per video.
        def items(modality: str) -> list:
            return [mm_items[modality].get(i) for i in range(mm_items[modality].get_count())] \
                if modality in mm_items else []

        return process_media(self.info.bundle, items("video"), items("image"), hf_kwargs, self.info.request_pruning,
                             audios=items("audio"))

    def _get_mm_fields_config(self, hf_inputs: BatchFeature, hf_processor_mm_kwargs: Mapping[str, object]):
        # Every field but the pixels is kept on the host (keep_on_cpu): vLLM then sends it for an item its scheduler
        # will not encode (wholly inside a reused KV row's prefix), and the worker plans the item's segment from it.
        fields: dict[str, MultiModalFieldConfig] = {}
        if "video_grid_thw" in hf_inputs:
            grids = hf_inputs["video_grid_thw"]
            fields.update(pixel_values_videos=MultiModalFieldConfig.flat_from_sizes("video", grids.prod(-1)),
                          video_grid_thw=MultiModalFieldConfig.batched("video", keep_on_cpu=True),
                          video_fps=MultiModalFieldConfig.batched("video", keep_on_cpu=True),
                          video_frame_times=MultiModalFieldConfig.flat_from_sizes(
                              "video", hf_inputs["video_num_frames"], keep_on_cpu=True),
                          video_num_frames=MultiModalFieldConfig.batched("video", keep_on_cpu=True),
                          video_frame_indices=MultiModalFieldConfig.flat_from_sizes(
                              "video", hf_inputs["video_num_indices"], keep_on_cpu=True),
                          video_num_indices=MultiModalFieldConfig.batched("video", keep_on_cpu=True),
                          video_source_fps=MultiModalFieldConfig.batched("video", keep_on_cpu=True),
                          video_pruning_rate=MultiModalFieldConfig.batched("video", keep_on_cpu=True),
                          video_pruning_method=MultiModalFieldConfig.batched("video", keep_on_cpu=True))
        if "image_grid_thw" in hf_inputs:
            grids = hf_inputs["image_grid_thw"]
            fields.update(pixel_values=MultiModalFieldConfig.flat_from_sizes("image", grids.prod(-1)),
                          image_grid_thw=MultiModalFieldConfig.batched("image", keep_on_cpu=True))
        if "audio_grid" in hf_inputs:
            fields.update(input_audio_features=MultiModalFieldConfig.flat_from_sizes(
                              "audio", hf_inputs["audio_num_frames"]),
                          audio_grid=MultiModalFieldConfig.batched("audio", keep_on_cpu=True),
                          audio_sampling_rate=MultiModalFieldConfig.batched("audio", keep_on_cpu=True),
                          audio_clip_frames=MultiModalFieldConfig.flat_from_sizes(
                              "audio", hf_inputs["audio_num_clips"], keep_on_cpu=True),
                          audio_num_clips=MultiModalFieldConfig.batched("audio", keep_on_cpu=True),
                          audio_num_frames=MultiModalFieldConfig.batched("audio", keep_on_cpu=True))
        return fields

    def _get_prompt_updates(self, mm_items, hf_processor_mm_kwargs, out_mm_kwargs):
        bundle = self.info.bundle
        family, pruning = bundle.family, self.info.pruning
        tokens = family.special_tokens()

        def placeholder(modality: str, pad: int):
            def replacement(item_idx: int) -> MediaPlaceholder:
                media = media_from_fields(out_mm_kwargs[modality][item_idx].get_data(), modality)
                k = kept_count(family, media, media_pruning(media, pruning))
                ids = [int(i) for i in family.placeholder_ids(media, k)]
                return MediaPlaceholder(ids, PromptUpdateDetails.select_token_id(ids, pad).is_embed,
                                        position_span(family, media, k))
            return replacement

        return [PromptReplacement(modality=modality, target=list(family.prompt_target(modality)),
                                  replacement=placeholder(modality, tokens.media_pad(modality)))
                for modality in self._modalities()]

