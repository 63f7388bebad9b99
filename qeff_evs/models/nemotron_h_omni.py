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

Language graph (``NemotronHLanguageGraph``): attention layers over the slot KV cache with the windowed vision rows;
each Mamba2 layer through ``models.mamba2.Mamba2Step`` over its retained ``conv_state.{i}`` (fp16 on the card, like
KV) and ``ssm_state.{i}`` (fp32 on the card: node precision, as Qwen3.5's recurrent state); MoE layers by
``sparse_moe``'s expert forms (``hit``, the MoE work's measured choice) under Nemotron-H's router (sigmoid scores,
a correction bias for the choice only, group-limited top-k, renormalised weights times ``routed_scaling_factor``),
un-gated squared-ReLU experts and the shared expert. Prefill is unrolled for the compiled prefill length (the Mamba2
chunk loop, as Qwen3.5's Gated DeltaNet); row reuse follows Qwen3.5's rule (a state cannot be rewound).
"""

from __future__ import annotations

from collections.abc import Sequence
import math
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from transformers import NemotronH_Omni_Reasoning_V3_Config
from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
from transformers.models.nemotron_h_omni.modeling_nemotron_h_omni import NemotronH_Omni_Reasoning_V3

from qeff_evs import evs
from qeff_evs.manifest import LayerState, SpecialTokens
from qeff_evs.models.language import LanguageGraph, LayerStep
from qeff_evs.models.mamba2 import SSM_STATE, Mamba2Step, state_names
from qeff_evs.models.linear_attention import CONV_STATE
from qeff_evs.models.protocol import (
    AudioFeatures,
    ConfigPaths,
    ExtraRows,
    ImageTiling,
    MediaInput,
    MediaLayout,
    NormalizedConfig,
    audio_rows,
    TokenStrings,
    VideoPreprocessing,
)
from qeff_evs.models.pruning import PruningRanking, pruning_symbols
from qeff_evs.models.parakeet import AudioEncoder, audio_symbols
from qeff_evs.models.radio import RadioEncoder, encoder_host_inputs, encoder_symbols
from qeff_evs.models.registry import register_family
from qeff_evs.models.sparse_moe import DEFAULT_EXPERT_FORM, FORMS, ExpertWeights, Routing, check_expert_form
from qeff_evs.positions import MediaBlock
from qeff_evs.weights.name_map import EXPERT, FusedExperts, NameMap, Rename, SplitTensors

MAMBA, ATTENTION, MOE, MLP = "linear_attention", "full_attention", "moe", "mlp"
LAYER_KINDS = (MAMBA, ATTENTION, MOE, MLP)
# The conv state is fp16 on the card like KV; the SSM state fp32 (module docstring).
CONV_PRECISION, SSM_PRECISION = "float16", "float32"

# vLLM's processor strings (``transformers_utils/processors/nano_nemotron_vl.py``).
IMG_START, IMG_END, IMG_CONTEXT, VIDEO_TEXT = "<img>", "</img>", "<image>", "<video>"
SOUND_START, SOUND_END, SOUND_CONTEXT = "<so_start>", "<so_end>", "<so_embedding>"
IM_START, IM_END, END_OF_TEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
# The tiny tokenizer's special tokens. ``<video>`` is not one: the released tokenizer has no such token, and vLLM
# finds it in a prompt as the text's own tokens.
SPECIAL_TOKENS = (END_OF_TEXT, IM_START, IM_END, IMG_START, IMG_END, IMG_CONTEXT, SOUND_START, SOUND_END, SOUND_CONTEXT)
NEMOTRON_TOKENS = TokenStrings(image=IMG_CONTEXT, video=VIDEO_TEXT, image_block=IMG_CONTEXT, video_block=VIDEO_TEXT,
                               audio=SOUND_CONTEXT)

# ChatML turns; a video or image item renders as its placeholder text on its own line.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- else -%}"
    "{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'video' -%}"
    "{{- '<video>\\n' -}}"
    "{%- elif item['type'] == 'image' -%}"
    "{{- '<image>\\n' -}}"
    "{%- elif item['type'] in ('audio', 'input_audio', 'audio_url') -%}"
    "{{- '<so_embedding>\\n' -}}"
    "{%- elif item['type'] == 'text' -%}"
    "{{- item['text'] -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)

# The released video preprocessing (transformers' NemotronH_Omni_Reasoning_V3VideoProcessor defaults): 16-px
# patches, CLIP mean/std, frames resized to one aspect-kept tile near 1024 patches; tubelets of 2 frames.
VIDEO_PROCESSOR = "NemotronH_Omni_Reasoning_V3VideoProcessor"
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

# Tiny test models: widths, and Mamba2 steps that stay clear of transformers' prefill clamp (see mamba2.py).
INITIALIZER_RANGE = 0.3
TINY_DT_RANGE = (1e-2, 0.5)
TINY_DT_PROJECTION_SCALE = 0.1
# The projector's output layer scaled down: at INITIALIZER_RANGE its squared-ReLU rows come out with std ~30,
# which would swamp the text embeddings (std ~0.3) and every fp32 rounding with them.
TINY_PROJECTOR_SCALE = 0.03
TINY_TARGET_PATCHES = 24
TINY_TILE_SIZE = 64  # 4 x 4 patches, 4 rows per tile
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


def layer_kinds(config) -> list[str]:
    """Each decoder layer's kind (``layers_block_type``), checked."""
    text = config["text_config"] if isinstance(config, dict) else config.text_config
    kinds = list(text["layers_block_type"] if isinstance(text, dict) else text.layers_block_type)
    unknown = sorted(set(kinds) - set(LAYER_KINDS))
    if unknown:
        raise ValueError(f"layers_block_type holds {unknown}; a Nemotron-H layer is one of {LAYER_KINDS}")
    return kinds


def tiny_layer_kinds(layers: int) -> list[str]:
    """The tiny models' layers: Mamba2, MoE, attention, Mamba2, MLP, MoE, ... (two Mamba2 layers with an attention
    layer between them from 4 layers on); at least one attention layer (the KV slots live there)."""
    cycle = [MAMBA, MOE, ATTENTION, MAMBA, MLP, MOE]
    kinds = [cycle[i % len(cycle)] for i in range(layers)]
    if ATTENTION not in kinds:
        kinds[-1] = ATTENTION
    return kinds


def released_layer_kinds(layers: int) -> list[str]:
    """Nemotron 3 Nano's pattern (``MEMEM*EMEMEM*...``) cut to ``layers``, its last layer attention if the cut holds
    none (a bench model keeps one KV cache)."""
    pattern = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"
    kinds = [{"M": MAMBA, "E": MOE, "*": ATTENTION, "-": MLP}[c] for c in pattern[:layers]]
    if ATTENTION not in kinds:
        kinds[-1] = ATTENTION
    return kinds


# ---------------------------------------------------------------------------------------------
# The sparse MoE block


class NemotronMoe(nn.Module):
    """One NemotronH MoE block (``NemotronHMoE``) with static shapes, sharing its parameters.

    Router (fp32, as transformers and vLLM compute it): sigmoid scores; experts chosen by score plus
    ``e_score_correction_bias``, first limited to the ``topk_group`` best of ``n_group`` groups (a group scores its
    two best); weights are the chosen experts' *scores*, renormalised (``norm_topk_prob``) and times
    ``routed_scaling_factor``. Experts: ``down @ relu2(up @ x)``, no gate, by ``expert_form``; optional latent
    projections around them; the shared expert on every token.
    """

    def __init__(self, block: nn.Module, expert_form: str = DEFAULT_EXPERT_FORM) -> None:
        super().__init__()
        self.block = block
        self.expert_form = check_expert_form(expert_form)
        gate = block.gate
        self.top_k, self.groups, self.top_groups = int(gate.top_k), int(gate.num_group), int(gate.topk_group)
        self.num_experts = int(gate.num_experts)
        if self.num_experts % self.groups:
            raise ValueError(f"{self.num_experts} experts do not split into n_group={self.groups} groups")

    def routing(self, hidden: torch.Tensor) -> Routing:
        gate = self.block.gate
        scores = torch.sigmoid(F.linear(hidden.float(), gate.weight.float()))
        choice = scores + gate.e_score_correction_bias.float()
        if self.groups > 1:
            grouped = choice.reshape(-1, self.groups, self.num_experts // self.groups)
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
            kept = torch.zeros_like(group_scores).scatter(1, group_scores.topk(self.top_groups, dim=-1).indices, 1.0)
            allowed = kept[:, :, None].expand_as(grouped).reshape(-1, self.num_experts) > 0
            choice = torch.where(allowed, choice, torch.full((), float("-inf"), device=choice.device))
        experts = torch.topk(choice, self.top_k, dim=-1).indices
        weights = scores.gather(1, experts)
        if gate.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return Routing((weights * gate.routed_scaling_factor).to(hidden.dtype), experts)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        block, shape = self.block, hidden.shape
        flat = hidden.reshape(-1, shape[-1])
        experts = block.experts
        routed = FORMS[self.expert_form](block.fc1_latent_proj(flat), self.routing(flat),
                                         ExpertWeights(experts.up_proj, experts.down_proj, experts.act_fn, gated=False))
        out = block.fc2_latent_proj(routed) + block.shared_experts(flat)
        return out.reshape(shape)


# ---------------------------------------------------------------------------------------------
# The language graph


class _TextModel(nn.Module):
    """NemotronH's backbone under the names ``LanguageGraph`` reads (``embed_tokens``, ``layers``, ``norm``)."""

    def __init__(self, backbone: nn.Module) -> None:
        super().__init__()
        self.embed_tokens = backbone.embeddings
        self.layers = backbone.layers
        self.norm = backbone.norm_f


class NemotronHLanguageGraph(LanguageGraph):
    """Nemotron-H's language step (module docstring): each layer's norm, mixer and residual, the mixer by its kind.

    ``prefill_seq_len``: the compiled prefill length the Mamba2 chunk loop is unrolled for (a graph for export and
    the torch backend; chunks up to that length and decode). Without it each call picks its path by its own length
    (eager only). ``prefill_seq_len`` 1: a decode-only graph. ``expert_form`` (keyword): ``sparse_moe.EXPERT_FORMS``.
    """

    def __init__(self, hf_model: nn.Module, media_token_ids: Sequence[int] | None = None,
                 rope_positions: int | None = None, prefill_seq_len: int | None = None, *,
                 expert_form: str = DEFAULT_EXPERT_FORM):
        super().__init__(hf_model, media_token_ids, rope_positions)
        self.trace_seq_len = prefill_seq_len
        unrolled = None if prefill_seq_len == 1 else prefill_seq_len  # decode-only: the traced length picks
        kinds = layer_kinds(hf_model.config)
        layers = self.text_model.layers
        self.mamba = nn.ModuleDict({str(i): Mamba2Step(layers[i].mixer, prefill_seq_len=unrolled)
                                    for i, kind in enumerate(kinds) if kind == MAMBA})
        self.moe = nn.ModuleDict({str(i): NemotronMoe(layers[i].mixer, expert_form)
                                  for i, kind in enumerate(kinds) if kind == MOE})
        self.expert_form = expert_form

    @staticmethod
    def text_parts(hf_model: nn.Module) -> tuple[nn.Module, nn.Module]:
        language = getattr(hf_model, "language_model", None)
        if language is None or not hasattr(language, "model") or not hasattr(language, "lm_head"):
            raise ValueError(f"{type(hf_model).__name__} lacks .language_model (a NemotronHForCausalLM); pass the "
                             "transformers NemotronH_Omni_Reasoning_V3 model")
        return _TextModel(language.model), language.lm_head

    def decoder_layer(self, layer_idx: int, layer: nn.Module, hidden: torch.Tensor, step: LayerStep) -> torch.Tensor:
        key = str(layer_idx)
        normed = layer.norm(hidden.to(layer.norm.weight.dtype))
        if key in self.mamba:
            if torch.jit.is_tracing() and self.trace_seq_len is None:
                raise ValueError("a Nemotron-H language graph unrolls its prefill for one length: build it with "
                                 "prefill_seq_len (the compiled prefill length) before tracing it")
            conv, ssm = state_names(layer_idx)
            out = self.mamba[key](normed, step.slots, step.states[conv], step.states[ssm], step.batch_index)
            step.states[conv], step.states[ssm] = out.conv_state, out.ssm_state
            mixed = out.hidden_states
        elif key in self.moe:
            mixed = self.moe[key](normed)
        elif layer.block_type == ATTENTION:
            mixed = layer.mixer(hidden_states=normed, attention_mask=step.attention_mask,
                                past_key_values=step.cache)[0]
        else:
            mixed = layer.mixer(normed)
        return hidden + mixed


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

    # ---- tiny test checkpoints and realistic bench configs ----------------------------------------

    @classmethod
    def tiny_tokenizer(cls):
        from qeff_evs.models.tiny import train_tokenizer

        return train_tokenizer(SPECIAL_TOKENS, eos_token=IM_END, pad_token=END_OF_TEXT, chat_template=CHAT_TEMPLATE)

    @classmethod
    def tiny_config_kwargs(cls, tokenizer, text_layers: int = 6, vision_layers: int = 2) -> dict[str, Any]:
        ids = _tokenizer_ids(tokenizer)
        text = dict(
            vocab_size=len(tokenizer), hidden_size=64, layers_block_type=tiny_layer_kinds(text_layers),
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
            mamba_num_heads=4, mamba_head_dim=8, n_groups=2, ssm_state_size=8, conv_kernel=4, chunk_size=8,
            n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            moe_shared_expert_intermediate_size=32, n_group=2, topk_group=1, routed_scaling_factor=2.5,
            # the vision norm transformers and vLLM build for checkpoints with MTP layers (the released one's)
            num_nextn_predict_layers=1, max_position_embeddings=1024, initializer_range=INITIALIZER_RANGE,
            time_step_min=1e-4, eos_token_id=ids["eos"], bos_token_id=ids["pad"], pad_token_id=ids["pad"],
        )
        # max_img_size 256: a 16 x 16 position table, resampled for the tiny frames.
        vision = dict(hidden_size=32, num_hidden_layers=vision_layers, num_attention_heads=2, patch_size=16,
                      max_img_size=256, num_cls_tokens=2, num_registers=2, video_temporal_patch_size=2,
                      initializer_range=INITIALIZER_RANGE)
        # force_image_size and use_thumbnail: the tiler's settings, as released configs store them (transformers'
        # config keeps them as given)
        # A Parakeet encoder of two conformer blocks, 16 mel bins (the released sound_config's keys).
        audio = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, num_mel_bins=16,
                     subsampling_conv_channels=8, conv_kernel_size=9, projection_hidden_size=48,
                     projection_bias=False, sampling_rate=16000, initializer_range=INITIALIZER_RANGE)
        return dict(text_config=text, vision_config=vision, audio_config=audio, projector_hidden_size=48,
                    vision_hidden_size=32, video_temporal_patch_size=2, downsample_ratio=0.5,
                    image_token_id=ids["image"], video_token_id=ids["image"], audio_token_id=ids["audio"],
                    force_image_size=TINY_TILE_SIZE, use_thumbnail=True)

    @classmethod
    def prepare_tiny_model(cls, model, tokenizer) -> None:
        """Zero the output rows of the image markers (a random model would emit them, and an ``<image>`` fed back
        would be taken for a media row); scale the projector's output to the text embeddings' size
        (``TINY_PROJECTOR_SCALE``); give the Mamba2 heads steps in ``TINY_DT_RANGE`` with a small input dependence,
        so some heads remember and no step meets transformers' prefill clamp; make the MoE correction bias random
        (transformers' init is zero: a choice that ignored it would go unnoticed)."""
        ids = _tokenizer_ids(tokenizer)
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            markers = [ids[key] for key in ("image", "img_start", "img_end", "audio", "audio_start", "audio_end")]
            model.language_model.lm_head.weight[markers] = 0.0
            model.multi_modal_projector.linear_2.weight *= TINY_PROJECTOR_SCALE
            if model.embed_audio is not None:
                model.embed_audio.linear_2.weight *= TINY_PROJECTOR_SCALE
                for module in model.audio_tower.modules():  # running statistics a trained encoder would have
                    if isinstance(module, nn.BatchNorm1d):
                        module.running_mean.uniform_(-0.5, 0.5, generator=generator)
                        module.running_var.uniform_(0.5, 1.5, generator=generator)
            for layer in model.language_model.model.layers:
                if layer.block_type == MAMBA:
                    mixer = layer.mixer
                    heads = mixer.num_heads
                    low, high = (math.log(v) for v in TINY_DT_RANGE)
                    dt = torch.exp(torch.empty(heads).uniform_(low, high, generator=generator))
                    mixer.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
                    mixer.in_proj.weight[-heads:] *= TINY_DT_PROJECTION_SCALE
                elif layer.block_type == MOE:
                    layer.mixer.gate.e_score_correction_bias.copy_(
                        torch.empty(layer.mixer.gate.num_experts).uniform_(-0.5, 0.5, generator=generator))

    @classmethod
    def tiny_generation_config(cls, tokenizer):
        from transformers import GenerationConfig

        ids = _tokenizer_ids(tokenizer)
        return GenerationConfig(bos_token_id=ids["pad"], eos_token_id=[ids["eos"]], pad_token_id=ids["pad"],
                                do_sample=False)

    @classmethod
    def tiny_preprocessor_config(cls, config) -> dict[str, Any]:
        """transformers' video processor config keys (``video_preprocessor_config.json`` of the released folder)."""
        vision = config.vision_config
        return {"video_processor_type": VIDEO_PROCESSOR, "norm_mean": list(vision.norm_mean),
                "norm_std": list(vision.norm_std), "patch_size": vision.patch_size,
                "downsample_ratio": config.downsample_ratio, "video_target_num_patches": TINY_TARGET_PATCHES,
                "video_maintain_aspect_ratio": True}

    @classmethod
    def realistic_config_kwargs(cls, text_layers: int = 6, vision_layers: int = 4,
                                audio_layers: int = 0) -> dict[str, Any]:
        """Released widths; the ``<image>`` and ``<so_embedding>`` ids are the tiny tokenizer's, whose text the bench's
        prompts are made of (the frame separators and markers come from the tokenizer, the pads from the config: they
        must agree). ``audio_layers``: a Parakeet encoder of that depth (``realistic_audio_widths``); none for 0."""
        text, vision = cls.realistic_widths(text_layers, vision_layers)
        ids = _tokenizer_ids(cls.tiny_tokenizer())
        audio = {} if not audio_layers else dict(audio_config=cls.realistic_audio_widths(audio_layers),
                                                 audio_token_id=ids["audio"])
        return dict(text_config=text, vision_config=vision, projector_hidden_size=4096, vision_hidden_size=1280,
                    video_temporal_patch_size=2, downsample_ratio=0.5, image_token_id=ids["image"],
                    video_token_id=ids["image"], force_image_size=512, use_thumbnail=True, **audio)

    @classmethod
    def realistic_audio_widths(cls, layers: int) -> dict[str, Any]:
        """A Parakeet encoder at transformers' ``ParakeetEncoderConfig`` widths (Parakeet 0.6B: hidden 1024, 8 heads,
        FFN 4096, 80 mel bins, subsampling by 8 through 256 channels) with ``layers`` conformer blocks, its projector
        4096 wide as the vision one; the released Omni's own sound widths are not in our references."""
        return dict(hidden_size=1024, num_hidden_layers=layers, num_attention_heads=8, intermediate_size=4096,
                    num_mel_bins=80, subsampling_conv_channels=256, conv_kernel_size=9, projection_hidden_size=4096,
                    projection_bias=False, sampling_rate=16000)

    @classmethod
    def realistic_widths(cls, text_layers: int, vision_layers: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """Nemotron 3 Nano Omni 30B-A3B widths: the language model is Nemotron 3 Nano 30B-A3B's (its config.json as
        third parties quote it), the vision tower transformers' RADIO defaults (C-RADIO-H), with these depths."""
        text = dict(
            vocab_size=131072, hidden_size=2688, layers_block_type=released_layer_kinds(text_layers),
            num_attention_heads=32, num_key_value_heads=2, head_dim=128, intermediate_size=1856,
            mamba_num_heads=64, mamba_head_dim=64, n_groups=8, ssm_state_size=128, conv_kernel=4, chunk_size=128,
            n_routed_experts=128, num_experts_per_tok=6, moe_intermediate_size=1856,
            moe_shared_expert_intermediate_size=3712, n_group=1, topk_group=1, routed_scaling_factor=2.5,
            norm_topk_prob=True, layer_norm_epsilon=1e-5, max_position_embeddings=262144, tie_word_embeddings=False,
            num_nextn_predict_layers=0, eos_token_id=11,
        )
        vision = dict(hidden_size=1280, num_hidden_layers=vision_layers, num_attention_heads=16, patch_size=16,
                      max_img_size=2048, num_cls_tokens=3, num_registers=7, video_temporal_patch_size=2)
        return text, vision

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


def _tokenizer_ids(tokenizer) -> dict[str, int]:
    ids = {}
    for key, token in (("image", IMG_CONTEXT), ("img_start", IMG_START), ("img_end", IMG_END), ("eos", IM_END),
                       ("pad", END_OF_TEXT), ("audio", SOUND_CONTEXT), ("audio_start", SOUND_START),
                       ("audio_end", SOUND_END)):
        token_id = tokenizer.convert_tokens_to_ids(token)
        if token_id is None or (token_id == tokenizer.unk_token_id and token != tokenizer.unk_token):
            raise ValueError(f"tokenizer has no {token!r} token; build it with tiny.build_tokenizer('nemotron_h_omni')")
        ids[key] = int(token_id)
    return ids
