"""Nemotron-H's language graph: each decoder layer's RMSNorm, its mixer by the layer's kind, and the residual.

The kinds are those of the config's ``layers_block_type``: Mamba2 mixers (``linear_attention``: ``models.mamba2``'s
chunked scan and one-token recurrence over the retained ``conv_state.{i}`` and ``ssm_state.{i}``), attention without
positions (``full_attention``: the slot KV cache with the windowed vision rows), sparse MoE blocks (``moe``: Nemotron-H's
router and un-gated squared-ReLU experts by ``sparse_moe``'s expert forms) and plain MLPs (``mlp``: transformers' own).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from qeff_evs.models.language import LanguageGraph, LayerStep
from qeff_evs.models.mamba2 import Mamba2Step, state_names
from qeff_evs.models.sparse_moe import DEFAULT_EXPERT_FORM, FORMS, ExpertWeights, Routing, check_expert_form

MAMBA, ATTENTION, MOE, MLP = "linear_attention", "full_attention", "moe", "mlp"
LAYER_KINDS = (MAMBA, ATTENTION, MOE, MLP)
# The conv state is fp16 on the card like KV; the SSM state fp32 (node precision, as Qwen3.5's recurrent state).
CONV_PRECISION, SSM_PRECISION = "float16", "float32"


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
