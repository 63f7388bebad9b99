"""Nemotron-H vision-language family (``nemotron_h_omni``): NVIDIA's Nemotron 3 Nano Omni, pruned as vLLM prunes it.

transformers 5.19 reads these checkpoints as ``NemotronH_Omni_Reasoning_V3`` (vLLM 0.32 serves them with
``NemotronH_Nano_VL_V2``, ``model_executor/models/nano_nemotron_vl.py``): a RADIO vision tower, a pixel shuffle and an
MLP projector (``models.radio.RadioEncoder``), and a NemotronH language model whose layers are, as its config's
``layers_block_type`` lists them, Mamba2 mixers (``linear_attention``), attention without positions
(``full_attention``), sparse MoE blocks (``moe``) or plain MLPs (``mlp``), each behind its own RMSNorm and residual.

Video. Frames are resized to one tile of about ``video_target_num_patches`` patches (aspect kept; torch's
antialiased bicubic), grouped in tubelets of ``video_temporal_patch_size`` frames (the last padded by repeating its
last frame) and each tubelet becomes ``H/2 x W/2`` rows after the pixel shuffle. EVS prunes tubelets as vLLM does:
the tubelets are its frames, the shuffled grid its grid (``spatial_merge_size`` 1 there; a merge of 2 over the patch
grid here, the same rows), the count rule and the mask are ``evs.py``'s. vLLM refuses VidCom2 for this model; so does
the export (``pruning_methods``).

Prompt (vLLM's ``NanoNemotronVLProcessor.get_video_repl``): ``<video>`` in the prompt (several text tokens: the
tokenizer has no such token) becomes, per tubelet, a separator naming its frames and their times,
``"Frame 1 sampled at 0.00 seconds and frame 2 sampled at 0.50 seconds: "`` (``"\\n"`` before every tubelet but the
first; each frame's time is its source index times ``int(1000 / fps)`` ms, fps the source's), then ``<img>``, one
``<image>`` per kept row of the tubelet, ``</img>``. The separators and markers do not depend on how many rows a
tubelet keeps, so, as for Qwen3-VL, the placeholder is laid out before encoding with every kept row in the first
tubelet (vLLM's own dummy split, ``[K, 0, ..., 0]``) and rewritten to the real split after it, same length; with
nothing pruned (rate 0) it is the real layout from the start, as in vLLM.
Images, as vLLM 0.34 serves them in its tiler mode: cut into square tiles of ``force_image_size`` pixels
(``runtime/inputs/image_tiles.py``: at most ``max_num_tiles`` on the grid closest to the image's aspect, plus a
thumbnail), each tile one frame through the image encoder graph (RADIO's image patch projection, then the same
tower, shuffle and projector as tubelets) and ``(S/p)^2 / 4`` rows; the ``<image>`` of the prompt becomes ``<img>``,
every tile's rows in order, ``</img>`` (no marker between tiles). Never pruned. A checkpoint whose vision config asks
for vLLM's dynamic resolution (``vision_config.args.min_num_patches``) or lacks the tile settings has its images
refused in one line (``image_tiling``).
Audio, where the config has a ``sound_config``: the host computes each clip's log-mel features as vLLM's extractor
does (``runtime/inputs/audio_features.py``), the audio encoder graph runs Parakeet and the sound projector on one
clip padded to a length bucket (``models/parakeet.py``); an audio item becomes ``<so_start>``, one ``<so_embedding>``
per row of its clips, ``<so_end>``, never pruned. With ``use_audio_in_video`` each video's sound is such an item right
after its video block, as vLLM lays it out (no interleaving).

Positions. The language model reads none (no RoPE in its attention; Mamba2 orders tokens by its recurrence): the
only position the graph uses is the KV slot, the token's index in the pruned prompt, as vLLM's. The position
contract holds trivially (rows 1..3 of ``position_ids`` are the unpruned positions restricted to the kept tokens,
each tubelet a one-dimensional run, and the graph ignores them; ``rope`` False: no RoPE table, no bound).

Language graph (``NemotronHLanguageGraph``, ``models/nemotron_h_language.py``): attention layers over the slot KV cache with the windowed vision rows;
each Mamba2 layer through ``models.mamba2.Mamba2Step`` over its retained ``conv_state.{i}`` (fp16 on the card, like
KV) and ``ssm_state.{i}`` (fp32 on the card: node precision, as Qwen3.5's recurrent state); MoE layers by
``sparse_moe``'s expert forms (``hit``, the MoE work's measured choice) under Nemotron-H's router (sigmoid scores,
a correction bias for the choice only, group-limited top-k, renormalised weights times ``routed_scaling_factor``),
un-gated squared-ReLU experts and the shared expert. Prefill is unrolled for the compiled prefill length (the Mamba2
chunk loop, as Qwen3.5's Gated DeltaNet); row reuse follows Qwen3.5's rule (a state cannot be rewound).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn
from transformers import NemotronH_Omni_Reasoning_V3_Config
from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
from transformers.models.nemotron_h_omni.modeling_nemotron_h_omni import NemotronH_Omni_Reasoning_V3

from qeff_evs import evs
from qeff_evs.manifest import LayerState, SpecialTokens
from qeff_evs.models import nemotron_h_checkpoints as checkpoints
from qeff_evs.models.linear_attention import CONV_STATE
from qeff_evs.models.mamba2 import SSM_STATE
from qeff_evs.models.nemotron_h_language import (
    ATTENTION,
    CONV_PRECISION,
    MAMBA,
    SSM_PRECISION,
    NemotronHLanguageGraph,
    layer_kinds,
)
from qeff_evs.models.nemotron_h_tokens import (
    IMG_CONTEXT,
    IMG_END,
    IMG_START,
    NEMOTRON_TOKENS,
    SOUND_CONTEXT,
    SOUND_END,
    SOUND_START,
    VIDEO_PROCESSOR,
    VIDEO_TEXT,
)
from qeff_evs.models.protocol import (
    AudioFeatures,
    ConfigPaths,
    ExtraRows,
    ImageTiling,
    MediaInput,
    MediaLayout,
    NormalizedConfig,
    audio_rows,
    VideoPreprocessing,
)
from qeff_evs.models.pruning import PruningRanking, pruning_symbols
from qeff_evs.models.parakeet import AudioEncoder, audio_symbols
from qeff_evs.models.radio import RadioEncoder, encoder_host_inputs, encoder_symbols
from qeff_evs.models.registry import register_family
from qeff_evs.positions import MediaBlock
from qeff_evs.weights.name_map import EXPERT, FusedExperts, NameMap, Rename, SplitTensors


# The released video preprocessing (transformers' NemotronH_Omni_Reasoning_V3VideoProcessor defaults): 16-px
# patches, CLIP mean/std, frames resized to one aspect-kept tile near 1024 patches; tubelets of 2 frames.
TARGET_PATCHES = 1024
PREPROCESS_DEFAULTS = VideoPreprocessing(
    patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=tuple(OPENAI_CLIP_MEAN),
    image_std=tuple(OPENAI_CLIP_STD), min_pixels=4 * 16 * 16, max_pixels=TARGET_PATCHES * 16 * 16,
    video_processor=VIDEO_PROCESSOR, do_sample_frames=False, resampler="torch_antialias", patch_order="raster",
    target_patches=TARGET_PATCHES, keep_aspect=True,
)

# How the releases name the module's tensors (save_pretrained writes the same names back): transformers' conversion
# mappings for the checkpoint (``NemotronH_Omni_Reasoning_V3``), its language model (``nemotron_h``: ``backbone`` ->
# ``model``, experts stored one by one, stacked without concatenation) and its vision tower (``radio``, whose fused
# ``attn.qkv`` the module holds as q, k and v projections), each scoped to where its submodel sits; and the vision
# tower's final norm under the name vLLM also reads (``vision_projector.vision_final_layernorm``).
_PATCH_GENERATOR = r"^vision_model\.radio_model\.model\.patch_generator\."
WEIGHT_NAMES = NameMap(
    renames=(
        Rename(r"^language_model\.backbone\.", "language_model.model."),
        Rename(_PATCH_GENERATOR + r"video_embedder\.", "vision_model.embeddings.video_patch_projection."),
        Rename(_PATCH_GENERATOR + r"embedder\.", "vision_model.embeddings.patch_projection."),
        Rename(_PATCH_GENERATOR + r"pos_embed$", "vision_model.embeddings.position_embedding"),
        Rename(_PATCH_GENERATOR + r"cls_token\.token$", "vision_model.embeddings.cls_register_token"),
        Rename(r"^vision_model\.radio_model\.model\.blocks\.", "vision_model.encoder.layer."),
        Rename(r"^(vision_model\.encoder\.layer\.\d+)\.attn\.proj\.", r"\1.attention.o_proj."),
        Rename(r"^vision_model\.radio_model\.(input_conditioner\.|summary_idxs$)", r"vision_model.\1"),
        Rename(r"^vision_projector\.vision_final_layernorm\.", "vision_final_layernorm."),
        Rename(r"^mlp1\.0\.", "multi_modal_projector.layer_norm."),
        Rename(r"^mlp1\.1\.", "multi_modal_projector.linear_1."),
        Rename(r"^mlp1\.3\.", "multi_modal_projector.linear_2."),
        Rename(r"^sound_encoder\.encoder\.", "audio_tower."),
        Rename(r"^sound_projection\.norm\.", "embed_audio.layer_norm."),
        Rename(r"^sound_projection\.linear1\.", "embed_audio.linear_1."),
        Rename(r"^sound_projection\.linear2\.", "embed_audio.linear_2."),
    ),
    experts=tuple(FusedExperts(f"mixer.experts.{kind}", (f"mixer.experts.{EXPERT}.{kind}.weight",))
                  for kind in ("up_proj", "down_proj")),
    splits=(SplitTensors("attn.qkv", ("attention.q_proj", "attention.k_proj", "attention.v_proj")),),
)

# vLLM's default max_num_tiles (DEFAULT_NUM_TILES of its Nemotron-H processor)
DEFAULT_MAX_TILES = 12


class NemotronConfigPaths(ConfigPaths):
    """Where the config keeps what the pipeline reads; the merge size is the pixel shuffle's, the reciprocal of
    ``downsample_ratio``, and the rows' width is the language model's (the projector's output)."""

    def get(self, config: Any, name: str) -> Any:
        if name == "merge_size":
            ratio = super().get(config, name)
            return None if ratio is None else int(round(1 / float(ratio)))
        return super().get(config, name)


CONFIG_PATHS = NemotronConfigPaths(
    patch_size="vision_config.patch_size", temporal_patch_size="video_temporal_patch_size",
    merge_size="downsample_ratio", vision_hidden="text_config.hidden_size",
    num_layers="text_config.num_hidden_layers", hidden_size="text_config.hidden_size",
    vocab_size="text_config.vocab_size", kv_heads="text_config.num_key_value_heads",
    head_dim="text_config.head_dim", heads="text_config.num_attention_heads",
    max_positions="text_config.max_position_embeddings",
    image_token_id="image_token_id", video_token_id="video_token_id",
)


# ---------------------------------------------------------------------------------------------
# The prompt: vLLM's frame separators and the per-tubelet blocks


def frame_times_ms(video: MediaInput) -> int:
    """vLLM's frame duration in whole milliseconds, ``int(1000 / fps)`` of the source's rate."""
    if not video.source_fps > 0 or not video.frame_indices:
        raise ValueError("a Nemotron-H video prompt names each frame's source index and time: pass the sampled frames' "
                         "source indices and the source's frame rate (frame_indices, source_fps)")
    return int(1000.0 / float(video.source_fps))


def frame_separators(frame_indices: Sequence[int], duration_ms: int, temporal_patch_size: int) -> list[str]:
    """The text before each tubelet's ``<img>``: its frames' numbers and times (vLLM's ``get_video_repl``).

    Times are ``index * duration_ms / 1000`` printed ``.2f``; frame numbers count sampled frames from 1; a last
    tubelet short of frames names only the frames it has (the padding repeats its last frame unnamed).
    """
    times = [int(i) * duration_ms / 1000.0 for i in frame_indices]
    count, size = len(times), int(temporal_patch_size)
    if size == 1:
        return [("\n" if i else "") + f"Frame {i + 1} sampled at {t:.2f} seconds: " for i, t in enumerate(times)]
    separators = []
    for group, start in enumerate(range(0, count, size)):
        frames = [f"{'Frame' if j == 0 else 'frame'} {start + j + 1} sampled at {times[start + j]:.2f} seconds"
                  for j in range(size) if start + j < count]
        separators.append(("\n" if group else "") + " and ".join(frames) + ": ")
    return separators


@register_family
class NemotronHOmniFamily:
    """Nemotron-H vision-language checkpoints (``nemotron_h_omni``; module docstring)."""

    model_type = "nemotron_h_omni"
    hf_architectures = ("NemotronH_Omni_Reasoning_V3",)
    serving_architecture = "QeffEvsNemotronH_Omni_Reasoning_V3"
    hf_processor = "NemotronH_Omni_Reasoning_V3"
    config_class = NemotronH_Omni_Reasoning_V3_Config
    model_class = NemotronH_Omni_Reasoning_V3
    preprocessing = PREPROCESS_DEFAULTS
    token_strings = NEMOTRON_TOKENS
    config_paths: ClassVar[ConfigPaths] = CONFIG_PATHS
    extra_rows: ClassVar[tuple[ExtraRows, ...]] = ()
    pruning_methods: ClassVar[tuple[str, ...]] = ("evs",)  # vLLM refuses VidCom2 for this model
    modalities: ClassVar[tuple[str, ...]] = ("video", "image", "audio")
    rope: ClassVar[bool] = False
    weight_names: ClassVar[NameMap] = WEIGHT_NAMES

    def __init__(self, config, tokenizer=None) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.name = self.model_type
        self.extras: dict[str, int] = {}
        self.downsample = int(round(1 / float(config.downsample_ratio)))
        self.temporal_patch_size = int(config.video_temporal_patch_size)

    @property
    def normalized_config(self) -> NormalizedConfig:
        return self.config_paths.read(self.config)

    # ---- tiny test checkpoints and realistic bench configs (models/nemotron_h_checkpoints.py) ---------------

    tiny_tokenizer = staticmethod(checkpoints.tiny_tokenizer)
    tiny_config_kwargs = staticmethod(checkpoints.tiny_config_kwargs)
    prepare_tiny_model = staticmethod(checkpoints.prepare_tiny_model)
    tiny_generation_config = staticmethod(checkpoints.tiny_generation_config)
    tiny_preprocessor_config = staticmethod(checkpoints.tiny_preprocessor_config)
    realistic_config_kwargs = staticmethod(checkpoints.realistic_config_kwargs)
    realistic_audio_widths = staticmethod(checkpoints.realistic_audio_widths)
    realistic_widths = staticmethod(checkpoints.realistic_widths)

    # ---- one checkpoint ----------------------------------------------------------------------------

    def _tokenizer(self):
        if self.tokenizer is None:
            raise ValueError("the Nemotron-H prompt layout needs the checkpoint's tokenizer (its frame separators "
                             "and <img> markers)")
        return self.tokenizer

    def _ids(self, text: str) -> list[int]:
        return list(self._tokenizer().encode(text, add_special_tokens=False))

    def special_tokens(self) -> SpecialTokens:
        image = int(self.config.image_token_id)
        (start,), (end,) = self._ids(IMG_START), self._ids(IMG_END)
        eos = getattr(self.config.text_config, "eos_token_id", None)
        eos = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
        # Videos merge at the image pad too: vLLM fills a video's <image> tokens with its rows.
        audio = getattr(self.config, "audio_token_id", None)
        return SpecialTokens(image, image, int(start), int(end), eos,
                             None if self._audio_config() is None or audio is None else int(audio))

    def prompt_target(self, modality: str) -> tuple[int, ...]:
        if modality.startswith("video"):
            return tuple(self._ids(VIDEO_TEXT))
        if modality.startswith("audio"):
            return tuple(self._ids(SOUND_CONTEXT))
        return (int(self.config.image_token_id),)

    def video_block_ids(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return (), ()

    def merged_grid(self, grid_thw: Sequence[int]) -> tuple[int, int, int]:
        return evs.merged_grid(grid_thw, self.downsample)

    def encoder(self, model: nn.Module) -> RadioEncoder:
        return RadioEncoder.from_model(model)

    def pruning_ranking(self, method: str) -> PruningRanking:
        if method not in self.pruning_methods:
            raise ValueError(f"vLLM prunes Nemotron-H videos with {', '.join(self.pruning_methods)} only (it refuses "
                             f"{method!r} for this model); choose --video-pruning-methods evs")
        return PruningRanking(method)

    def language_graph(self, model: nn.Module, media_token_ids: Sequence[int] | None = None,
                       rope_positions: int | None = None, prefill_seq_len: int | None = None) -> NemotronHLanguageGraph:
        return NemotronHLanguageGraph(model, media_token_ids, rope_positions, prefill_seq_len)

    def layer_kinds(self) -> tuple[str, ...]:
        return tuple(layer_kinds(self.config))

    def kv_layers(self) -> tuple[int, ...]:
        layers = tuple(i for i, kind in enumerate(layer_kinds(self.config)) if kind == ATTENTION)
        if not layers:
            raise ValueError("this Nemotron-H config has no full_attention layer; the language graph keeps its KV "
                             "slots in the attention layers' caches, so give layers_block_type at least one")
        return layers

    def layer_states(self) -> tuple[LayerState, ...]:
        text = self.config.text_config
        mamba = tuple(i for i, kind in enumerate(layer_kinds(self.config)) if kind == MAMBA)
        inner = int(text.mamba_num_heads) * int(text.mamba_head_dim)
        conv_dim = inner + 2 * int(text.n_groups) * int(text.ssm_state_size)
        return (LayerState(CONV_STATE, mamba, (conv_dim, int(text.conv_kernel) - 1), CONV_PRECISION),
                LayerState(SSM_STATE, mamba, (int(text.mamba_num_heads), int(text.mamba_head_dim),
                                              int(text.ssm_state_size)), SSM_PRECISION))

    def _patch_width(self) -> int:
        vision = self.config.vision_config
        return self.temporal_patch_size * int(vision.num_channels) * int(vision.patch_size) ** 2

    def image_tiling(self) -> ImageTiling:
        """vLLM's tiler settings from the config (``force_image_size``, ``use_thumbnail``; ``max_num_tiles`` 12 unless
        a request or the server asks otherwise); ValueError where vLLM would not tile this checkpoint's images."""
        args = getattr(self.config.vision_config, "args", None) or {}
        if "min_num_patches" in args:
            raise ValueError("this checkpoint's vision_config.args sets min_num_patches: vLLM serves its images at "
                             "dynamic resolution, which qeff-evs does not build yet; send videos")
        size, thumbnail = getattr(self.config, "force_image_size", None), getattr(self.config, "use_thumbnail", None)
        if size is None or thumbnail is None:
            raise ValueError("this checkpoint's config has no force_image_size / use_thumbnail (vLLM's tile size and "
                             "thumbnail switch), so its images cannot be tiled as vLLM tiles them; add both to its "
                             "config.json and re-export, or send videos")
        return ImageTiling(int(size), int(self.config.vision_config.patch_size), DEFAULT_MAX_TILES, bool(thumbnail))

    def _audio_config(self):
        """The Parakeet settings: transformers' ``audio_config``, or ``sound_config`` as released configs and vLLM
        spell it (transformers' own config class renames it on load)."""
        audio = getattr(self.config, "audio_config", None)
        return audio if audio is not None else getattr(self.config, "sound_config", None)

    def audio_features(self) -> AudioFeatures | None:
        """vLLM's feature settings from the audio config; None for a checkpoint without one (it serves no audio, as
        in vLLM)."""
        audio = self._audio_config()
        if audio is None:
            return None
        read = (lambda key, default=None: audio.get(key, default)) if isinstance(audio, dict) else \
            (lambda key, default=None: getattr(audio, key, default))
        optional = {name: read(name) for name in ("hop_length", "win_length", "n_fft", "preemphasis")
                    if read(name) is not None}
        factor = int(read("subsampling_factor", 8))
        stages = factor.bit_length() - 1
        if factor != 1 << stages:
            raise ValueError(f"sound_config.subsampling_factor {factor} is not a power of 2 (Parakeet subsamples by "
                             "stride-2 stages); this checkpoint's audio cannot be encoded")
        return AudioFeatures(int(read("sampling_rate", 16000)), int(read("num_mel_bins")),
                             kernel=int(read("subsampling_conv_kernel_size", 3)),
                             stride=int(read("subsampling_conv_stride", 2)), stages=stages, **optional)

    def audio_encoder(self, model: nn.Module) -> AudioEncoder:
        return AudioEncoder(model)

    def audio_encoder_symbols(self, bucket_frames: int) -> dict[str, int]:
        features = self.audio_features()
        return audio_symbols(bucket_frames, features.kernel, features.stride, features.stages)

    def image_encoder(self, model: nn.Module) -> RadioEncoder:
        return RadioEncoder.from_model(model, image=True)

    def image_encoder_symbols(self, grid_hw: Sequence[int], frames: int) -> dict[str, int]:
        vision = self.config.vision_config
        return encoder_symbols(int(vision.num_channels) * int(vision.patch_size) ** 2, self.downsample, grid_hw, frames)

    def encoder_host_inputs(self, grid_hw: Sequence[int], frames: int) -> dict[str, np.ndarray]:
        return encoder_host_inputs(self.config.vision_config, self.downsample, grid_hw, frames)

    def encoder_symbols(self, grid_hw: Sequence[int], frames: int) -> dict[str, int]:
        return encoder_symbols(self._patch_width(), self.downsample, grid_hw, frames)

    def pruning_symbols(self, grid_hw: Sequence[int], bucket: int) -> dict[str, int]:
        _, h, w = self.merged_grid((1, *grid_hw))
        return pruning_symbols(h * w, bucket)

    def _audio_pad(self) -> int:
        pad = self.special_tokens().audio_pad
        if pad is None:
            raise ValueError("this checkpoint's config has no sound_config (audio_config) and audio_token_id: it "
                             "serves no audio, as in vLLM; send images or videos")
        return pad

    def _audio_ids(self, media: MediaInput) -> np.ndarray:
        """``<so_start>``, a pad per row of every clip, ``<so_end>``: vLLM's audio replacement."""
        features = self.audio_features()
        if features is None:
            raise ValueError("this checkpoint's config has no sound_config: it serves no audio, as in vLLM; send "
                             "images or videos")
        rows = audio_rows(features, media.clip_frames)
        return np.asarray([*self._ids(SOUND_START), *([self._audio_pad()] * rows), *self._ids(SOUND_END)],
                          dtype=np.int64)

    def _image_ids(self, media: MediaInput) -> np.ndarray:
        """``<img>``, a pad per row of every tile (the thumbnail's last), ``</img>``: vLLM's image replacement."""
        t, h, w = self.merged_grid(media.grid_thw)
        pads = [int(self.config.image_token_id)] * (t * h * w)
        return np.asarray([*self._ids(IMG_START), *pads, *self._ids(IMG_END)], dtype=np.int64)

    def _video_ids(self, video: MediaInput, rows_per_tubelet: Sequence[int]) -> np.ndarray:
        tokenizer = self._tokenizer()
        separators = frame_separators(video.frame_indices, frame_times_ms(video), self.temporal_patch_size)
        if len(separators) != len(rows_per_tubelet):
            raise ValueError(f"the video has {len(rows_per_tubelet)} tubelets but {len(video.frame_indices)} frame "
                             f"indices ({len(separators)} tubelets); pass every sampled frame's source index")
        # vLLM tokenizes the separators as one batch, each on its own (no special tokens), and the markers apart.
        encoded = tokenizer(separators, add_special_tokens=False, return_attention_mask=False)["input_ids"]
        start, end, image = self._ids(IMG_START), self._ids(IMG_END), int(self.config.image_token_id)
        if any(image in ids for ids in (*encoded, start, end)):
            raise ValueError(f"the tokenizer writes the config's image_token_id {image} in plain text (frame separators, "
                             f"{IMG_START}, {IMG_END}); the config's id must be the tokenizer's {IMG_CONTEXT}")
        parts = []
        for separator, rows in zip(encoded, rows_per_tubelet):
            parts += [*separator, *start, *([image] * int(rows)), *end]
        return np.asarray(parts, dtype=np.int64)

    def placeholder_ids(self, media: MediaInput, kept: int) -> np.ndarray:
        """vLLM's layout before encoding: every tubelet's rows when nothing is pruned, else all ``kept`` rows in the
        first tubelet (vLLM lumps them whenever EVS is on; it is on exactly when ``kept`` is below every row, up to a
        rate so small that ``1 - q`` rounds to 1)."""
        if media.kind == "image":
            return self._image_ids(media)
        if media.kind == "audio":
            return self._audio_ids(media)
        t, h, w = self.merged_grid(media.grid_thw)
        return self._video_ids(media, [h * w] * t if kept == t * h * w else [kept] + [0] * (t - 1))

    def video_layout(self, media: MediaInput, kept_indices: np.ndarray) -> MediaLayout:
        if media.kind == "audio":
            ids = self._audio_ids(media)
            return MediaLayout(ids, np.ones(len(ids), dtype=bool), (MediaBlock(int(np.sum(ids == self._audio_pad())),
                                                                               1, 1),))
        t, h, w = self.merged_grid(media.grid_thw)
        if media.kind == "image":
            ids = self._image_ids(media)
            # one run of pads, counted on like text (no positions are read)
            return MediaLayout(ids, np.ones(len(ids), dtype=bool), (MediaBlock(t * h * w, 1, 1),))
        unpruned = self._video_ids(media, [h * w] * t)
        keep = np.ones(len(unpruned), dtype=bool)
        mask = np.zeros(t * h * w, dtype=bool)
        mask[np.asarray(kept_indices, dtype=np.int64)] = True
        keep[unpruned == int(self.config.image_token_id)] = mask  # raster order, tubelet by tubelet
        # No positions are read (module docstring): each tubelet's rows count on like text.
        return MediaLayout(unpruned, keep, tuple(MediaBlock(h * w, 1, 1) for _ in range(t)))

    def hf_video_inputs(self, input_ids: torch.Tensor, video: MediaInput) -> dict[str, torch.Tensor]:
        """transformers' ``pixel_values_videos``: the frames ``(frames, C, H, W)`` the patches were cut from."""
        return {"pixel_values_videos": patches_to_frames(torch.as_tensor(video.pixel_values), video.grid_thw,
                                                         self.temporal_patch_size,
                                                         int(self.config.vision_config.patch_size))}


def patches_to_frames(pixel_values: torch.Tensor, grid_thw: Sequence[int], temporal_patch_size: int,
                      patch_size: int) -> torch.Tensor:
    """Raster tubelet patches ``(T*H*W, tp*C*p*p)`` back to frames ``(T*tp, C, H*p, W*p)``."""
    t, big_h, big_w = (int(v) for v in grid_thw)
    p, tp = patch_size, temporal_patch_size
    channels = pixel_values.shape[1] // (tp * p * p)
    x = pixel_values.reshape(t, big_h, big_w, tp, channels, p, p)
    return x.permute(0, 3, 4, 1, 5, 2, 6).reshape(t * tp, channels, big_h * p, big_w * p)
