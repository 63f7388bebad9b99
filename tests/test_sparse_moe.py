"""The static sparse block (``qeff_evs.models.sparse_moe``) against transformers' own sparse blocks.

transformers' blocks (Qwen3-VL-MoE's, and Qwen3.5-MoE's with its gated shared expert) loop over the experts the
data hit; every expert form here must give their output within fp32 rounding, for prefill-like and decode-like
token counts, eagerly and as an ONNX Runtime graph traced once and run at other shapes (the ``hit`` form's slot
count follows the call's token count, never the data). No NonZero in the graph.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from transformers import Qwen3_5MoeTextConfig, Qwen3VLMoeTextConfig
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock
from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeTextSparseMoeBlock

from qeff_evs.export.node_precision import router_paths
from qeff_evs.models.sparse_moe import EXPERT_FORMS, HIT, SparseMoe, hit_slots

ATOL = 1e-5  # the block's outputs are O(1): fp32 rounding of a different summation order
EXPERTS, TOP_K, HIDDEN = 8, 2, 32
WIDTHS = dict(hidden_size=HIDDEN, moe_intermediate_size=24, num_experts=EXPERTS, num_experts_per_tok=TOP_K)
BLOCKS = {
    "qwen3_vl_moe": lambda: Qwen3VLMoeTextSparseMoeBlock(Qwen3VLMoeTextConfig(**WIDTHS)),
    "qwen3_5_moe": lambda: Qwen3_5MoeSparseMoeBlock(Qwen3_5MoeTextConfig(**WIDTHS, shared_expert_intermediate_size=24)),
}


@pytest.fixture(scope="module", params=sorted(BLOCKS))
def block(request) -> torch.nn.Module:
    torch.manual_seed(0)
    module = BLOCKS[request.param]().eval()
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.normal_(0.0, 0.2)
    return module


def hidden_states(batch: int, seq: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(batch, seq, HIDDEN, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("form", EXPERT_FORMS)
@pytest.mark.parametrize("shape", [(1, 1), (4, 1), (1, 16), (2, 40)])
def test_every_form_equals_transformers(block, form, shape):
    hidden = hidden_states(*shape)
    with torch.no_grad():
        expected = block(hidden)
        ours = SparseMoe(block, form)(hidden)
    assert ours.shape == expected.shape
    torch.testing.assert_close(ours, expected, atol=ATOL, rtol=0)


def test_routing_is_transformers_router(block):
    hidden = hidden_states(1, 16).reshape(-1, HIDDEN)
    with torch.no_grad():
        _, weights, experts = block.gate(hidden)
        routing = SparseMoe(block).routing(hidden)
    torch.testing.assert_close(routing.weights, weights, atol=0, rtol=0)
    assert torch.equal(routing.experts, experts)


class HitWithSlots(torch.nn.Module):
    """The ``hit`` block's output and its slot count, so the graph shows how many experts it ran."""

    def __init__(self, block: torch.nn.Module) -> None:
        super().__init__()
        self.sparse = SparseMoe(block, HIT)

    def forward(self, hidden: torch.Tensor):
        return self.sparse(hidden), hit_slots(hidden.reshape(-1, HIDDEN), TOP_K, EXPERTS)


def test_hit_form_exports_statically_and_runs_as_many_experts_as_the_shape_allows(block, tmp_path):
    path = tmp_path / "hit.onnx"
    torch.onnx.export(HitWithSlots(block), (hidden_states(1, 16),), str(path), input_names=["hidden"],
                      output_names=["out", "slots"], dynamic_axes={"hidden": {0: "batch", 1: "seq"}},
                      opset_version=17, dynamo=False)
    graph = onnx.load(str(path))
    ops = {node.op_type for node in graph.graph.node}
    assert "NonZero" not in ops and "Loop" not in ops and "If" not in ops
    # The router is found for the card's node-precision file (the slot TopK over hit counts is not a router).
    (router,) = router_paths(graph)
    producers = {name: node.op_type for node in graph.graph.node for name in node.output}
    assert [producers[name] for name in router] == ["MatMul", "Softmax", "Cast", "TopK", "ReduceSum", "Div"]
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for (batch, seq), slots in {(1, 1): TOP_K, (3, 1): 3 * TOP_K, (1, 16): EXPERTS, (2, 40): EXPERTS}.items():
        hidden = hidden_states(batch, seq, seed=batch * 100 + seq)
        out, ran = session.run(None, {"hidden": hidden.numpy()})
        assert int(ran) == slots
        with torch.no_grad():
            np.testing.assert_allclose(out, block(hidden).numpy(), atol=ATOL, rtol=0)
