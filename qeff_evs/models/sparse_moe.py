"""The sparse MLP of the MoE families, computed as transformers computes it, with static shapes.

transformers' sparse block (``Qwen3VLMoeTextSparseMoeBlock``, ``Qwen3_5MoeSparseMoeBlock``; both 5.x):

* router: ``probs = softmax(hidden @ W_router.T, dtype=float32)``, the ``k`` largest, renormalised to sum 1
  (both configs always renormalise: neither has a ``norm_topk_prob`` switch), cast back to the hidden dtype;
* experts: 3-D parameters ``gate_up_proj (E, 2I, H)`` (gate rows first, then up) and ``down_proj (E, H, I)``;
  expert ``e`` computes ``down_proj[e] @ (act(gate) * up)``; a token's output is its experts' outputs summed
  with its routing weights;
* Qwen3.5-MoE adds a shared expert on every token, an MLP scaled by ``sigmoid(hidden @ w_shared_gate)``.

transformers loops over the experts some token hit (``nonzero``, then ``where`` per expert): shapes that depend
on the data, which a graph compiled per specialization cannot have. Here every form has static shapes:

* ``gathered`` (QEfficient's default): each token gathers its ``k`` experts' matrices and multiplies them:
  reads ``tokens x k`` expert matrices, does the active work only;
* ``dense``: every expert over every token, weighted by the routing matrix (zero where not chosen): reads each
  expert once, does ``E / k`` times the active work;
* ``hit``: the experts some token of the call chose, padded to ``min(E, tokens x k)`` slots (a bound fixed by the
  specialization's shape, never by the data), each over every token: a decode step of one row reads and runs
  exactly its ``k`` experts (the gathered form), a prefill chunk with ``tokens x k >= E`` runs every expert (the
  dense form). The padding slots are experts no token chose, whose routing weights are zero.

All three give transformers' sum up to fp32 rounding (only the order of the additions differs). The language graphs
use ``DEFAULT_EXPERT_FORM``, ``hit``: on the card every call is bound by the expert bytes it reads, and ``hit`` reads
the fewest in every specialization (docs/models.md, "MoE checkpoints"; ``benchmarks/moe_expert_forms.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

GATHERED, DENSE, HIT = "gathered", "dense", "hit"
EXPERT_FORMS = (GATHERED, DENSE, HIT)
DEFAULT_EXPERT_FORM = HIT


class Routing(NamedTuple):
    """Each token's chosen experts and their renormalised weights."""

    weights: torch.Tensor  # (tokens, k) in the hidden dtype, each row summing to 1
    experts: torch.Tensor  # (tokens, k) int64 expert ids, by descending router probability


class ExpertWeights(NamedTuple):
    """One sparse block's experts as transformers stores them.

    ``gated``: each expert is ``down @ (act(gate) * up)`` with ``gate_up`` holding the gate rows, then the up rows
    (Qwen's); without a gate (Nemotron-H's experts) it is ``down @ act(up)`` and ``gate_up`` holds the up rows only.
    """

    gate_up: torch.Tensor  # (E, 2I, H): gate rows, then up rows; (E, I, H) up rows when not gated
    down: torch.Tensor  # (E, H, I)
    act: Callable[[torch.Tensor], torch.Tensor]
    gated: bool = True


def route(hidden: torch.Tensor, router_weight: torch.Tensor, top_k: int) -> Routing:
    """transformers' top-k router over ``hidden (tokens, H)``: fp32 softmax, top-k, renormalised, hidden dtype."""
    logits = F.linear(hidden, router_weight)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top, experts = torch.topk(probs, top_k, dim=-1)
    top = top / top.sum(dim=-1, keepdim=True)
    return Routing(top.to(logits.dtype), experts)


def routing_matrix(routing: Routing, num_experts: int) -> torch.Tensor:
    """``(tokens, E)``: each token's weight on every expert, zero where it did not choose it."""
    zeros = torch.zeros(routing.weights.shape[0], num_experts, dtype=routing.weights.dtype,
                        device=routing.weights.device)
    return zeros.scatter(1, routing.experts, routing.weights)


def _activate(projected: torch.Tensor, act, gated: bool) -> torch.Tensor:
    if not gated:
        return act(projected)
    gate, up = projected.chunk(2, dim=-1)
    return act(gate) * up


def gathered_experts(hidden: torch.Tensor, routing: Routing, experts: ExpertWeights) -> torch.Tensor:
    """Each token through its own ``k`` gathered experts: ``(tokens, H)``."""
    gate_up = experts.gate_up[routing.experts]  # (tokens, k, 2I, H)
    down = experts.down[routing.experts]  # (tokens, k, H, I)
    projected = torch.matmul(gate_up, hidden[:, None, :, None]).squeeze(-1)  # (tokens, k, 2I)
    out = torch.matmul(down, _activate(projected, experts.act, experts.gated)[..., None]).squeeze(-1)  # (tokens, k, H)
    return (out * routing.weights[..., None]).sum(dim=1)


def _over_experts(hidden: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                  act, gated: bool = True) -> torch.Tensor:
    """Every expert of ``gate_up``/``down`` (a leading axis of ``slots``) over every token, summed with
    ``weights (tokens, slots)``."""
    projected = torch.matmul(hidden, gate_up.transpose(1, 2))  # (slots, tokens, 2I)
    out = torch.matmul(_activate(projected, act, gated), down.transpose(1, 2))  # (slots, tokens, H)
    return (out * weights.transpose(0, 1)[..., None]).sum(dim=0)


def dense_experts(hidden: torch.Tensor, routing: Routing, experts: ExpertWeights) -> torch.Tensor:
    """Every expert over every token, weighted by the routing matrix: ``(tokens, H)``."""
    weights = routing_matrix(routing, experts.gate_up.shape[0])
    return _over_experts(hidden, weights, experts.gate_up, experts.down, experts.act, experts.gated)


def hit_slots(hidden: torch.Tensor, top_k: int, num_experts: int) -> torch.Tensor:
    """How many experts the ``hit`` form runs for ``hidden (tokens, H)``: ``min(E, tokens x k)``, every expert the
    call can hit. Counted from the shape by a reduction, so a traced graph keeps it a function of its shape."""
    tokens = torch.ones_like(hidden[:, 0], dtype=torch.int64).sum()
    return torch.clamp(tokens * top_k, max=num_experts)


def hit_experts(hidden: torch.Tensor, routing: Routing, experts: ExpertWeights) -> torch.Tensor:
    """The experts some token chose (padded with unchosen ones to ``hit_slots``), each over every token."""
    num_experts, top_k = experts.gate_up.shape[0], routing.experts.shape[1]
    weights = routing_matrix(routing, num_experts)  # (tokens, E)
    chosen = torch.zeros_like(weights).scatter(1, routing.experts, 1.0).sum(dim=0)  # (E,) tokens per expert
    # Every chosen expert counts >= 1 and there are at most hit_slots of them, so all are among the slots.
    slots = torch.topk(chosen, hit_slots(hidden, top_k, num_experts)).indices
    return _over_experts(hidden, weights[:, slots], experts.gate_up[slots], experts.down[slots], experts.act,
                         experts.gated)


FORMS: dict[str, Callable[[torch.Tensor, Routing, ExpertWeights], torch.Tensor]] = {
    GATHERED: gathered_experts, DENSE: dense_experts, HIT: hit_experts}


def check_expert_form(form: str) -> str:
    if form not in FORMS:
        raise ValueError(f"unknown expert form {form!r}; expected one of {', '.join(EXPERT_FORMS)}")
    return form


def is_sparse_block(mlp: nn.Module) -> bool:
    """Whether a decoder layer's ``mlp`` is a transformers sparse block (router ``gate``, 3-D ``experts``)."""
    experts = getattr(mlp, "experts", None)
    return hasattr(getattr(mlp, "gate", None), "weight") and hasattr(experts, "gate_up_proj")


class SparseMoe(nn.Module):
    """One decoder layer's sparse MLP over ``(..., H)`` hidden states, sharing transformers' parameters.

    ``block`` is the layer's transformers sparse block (``is_sparse_block``); its shared expert and gate, when
    it has them (Qwen3.5-MoE), run on every token. ``expert_form``: one of ``EXPERT_FORMS``.
    """

    def __init__(self, block: nn.Module, expert_form: str = DEFAULT_EXPERT_FORM) -> None:
        super().__init__()
        if not is_sparse_block(block):
            raise ValueError(f"{type(block).__name__} is not a sparse MoE block (a router .gate and .experts with "
                             "3-D gate_up_proj/down_proj); pass a decoder layer's .mlp of an MoE checkpoint")
        self.block = block
        self.expert_form = check_expert_form(expert_form)
        self.top_k = int(block.gate.top_k)
        self.shared = getattr(block, "shared_expert", None)

    def routing(self, hidden: torch.Tensor) -> Routing:
        """The router's choice for ``hidden (tokens, H)``."""
        return route(hidden, self.block.gate.weight, self.top_k)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        shape = hidden.shape
        flat = hidden.reshape(-1, shape[-1])
        experts = self.block.experts
        out = FORMS[self.expert_form](flat, self.routing(flat),
                                      ExpertWeights(experts.gate_up_proj, experts.down_proj, experts.act_fn))
        if self.shared is not None:
            out = out + torch.sigmoid(self.block.shared_expert_gate(flat)) * self.shared(flat)
        return out.reshape(shape)
