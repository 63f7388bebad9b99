"""The checkpoint reader (``qeff_evs.models.checkpoint.open_weights``): every family's tensors under the module's
names, fp32 and exact, from what save_pretrained writes and from the layouts releases use, one tensor at a time.

The reference is transformers' own load (``from_pretrained``, fp32) of the checkpoint save_pretrained wrote; each
layout is that checkpoint rewritten by the test's own helper (``helpers/release_layouts.py``, safetensors' writer):
bf16 in three shards with an index, fp16, Qwen2.5-VL under the module's names, Qwen3-VL-MoE's experts fused and
transposed (its bf16 release) or per expert (its FP8 release), Qwen3.5-MoE's fused, Nemotron-H's vision norm under the
name vLLM also reads (its bf16 release). save_pretrained writes Nemotron-H under its release's names (``backbone``,
RADIO's blocks with their fused ``qkv``, experts one by one, ``mlp1``): the reader splits, stacks and renames them. A
layout in a narrower dtype is compared with the reference rounded to that dtype (bf16/fp16 -> fp32 is exact).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

from qeff_evs.models.checkpoint import load_checkpoint, load_config, model_from_weights, open_weights
from qeff_evs.models.registry import shipped_family_names
from qeff_evs.models.tiny import save_tiny_checkpoint
from helpers.release_layouts import (
    experts_split, experts_transposed, module_names_qwen2_5, read_all, rename, rewrite, to_dtype,
)

FAMILIES = shipped_family_names()
# Nemotron-H with a Mamba2, an MoE and an attention layer (its experts are what its names stack) and, as the Omni
# release has, a (tiny) Parakeet audio tower, which its release names ``sound_encoder``.
SAVED_OVERRIDES = {"nemotron_h_omni": {"text_layers": 3, "audio_token_id": 5, "audio_config": dict(
    hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, subsampling_conv_channels=8,
    num_mel_bins=16, projection_hidden_size=48, projection_bias=False)}}


def fused(tensors):
    """Qwen3.5-MoE's per-expert tensors fused as transformers' module holds them (the inverse of experts_split)."""
    out, experts = {}, {}
    for name, tensor in tensors.items():
        head, sep, tail = name.partition(".mlp.experts.")
        if not sep:
            out[name] = tensor
            continue
        expert, kind = tail.split(".")[:2]
        experts.setdefault((head, kind), {})[int(expert)] = tensor
    for (head, kind), by_expert in experts.items():
        stacked = torch.stack([by_expert[e] for e in sorted(by_expert)])
        out[f"{head}.mlp.experts.{kind}"] = stacked
    gate_up = {}
    for name in [n for n in out if n.endswith("experts.gate_proj") or n.endswith("experts.up_proj")]:
        gate_up.setdefault(name.rsplit(".", 1)[0], {})[name.rsplit(".", 1)[1]] = out.pop(name)
    for head, parts in gate_up.items():
        out[f"{head}.gate_up_proj"] = torch.cat([parts["gate_proj"], parts["up_proj"]], dim=1)
    return out


# layout -> (tensor transform, shards, dtype the reference is rounded to); family-specific ones name the family.
LAYOUTS = {
    "bf16_sharded": (to_dtype(torch.bfloat16), 3, torch.bfloat16),
    "fp16": (to_dtype(torch.float16), 1, torch.float16),
}
RELEASE_LAYOUTS = {
    ("qwen2_5_vl", "module_names"): (module_names_qwen2_5, 1, torch.float32),
    ("qwen3_vl_moe", "fused_transposed_bf16"): (lambda t: experts_transposed(to_dtype(torch.bfloat16)(t)), 2,
                                                torch.bfloat16),
    ("qwen3_vl_moe", "per_expert"): (experts_split, 1, torch.float32),
    ("qwen3_5_moe", "fused"): (fused, 1, torch.float32),
    ("nemotron_h_omni", "vision_projector_norm_bf16"): (
        lambda t: rename(r"^vision_final_layernorm\.", "vision_projector.vision_final_layernorm.")(
            to_dtype(torch.bfloat16)(t)), 2, torch.bfloat16),
}
CASES = ([(family, "saved") for family in FAMILIES] + [(f, layout) for f in FAMILIES for layout in LAYOUTS]
         + list(RELEASE_LAYOUTS))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """``saved(family)``: (folder, transformers' fp32 state dict of it), made once per family."""
    made = {}

    def get(family: str):
        if family not in made:
            folder = save_tiny_checkpoint(family, tmp_path_factory.mktemp(family) / "saved", seed=5,
                                          **SAVED_OVERRIDES.get(family, {}))
            made[family] = folder, load_checkpoint(folder).model.state_dict()
        return made[family]
    return get


def layout_folder(saved, family: str, layout: str, tmp_path: Path) -> tuple[Path, torch.dtype]:
    folder, _ = saved(family)
    if layout == "saved":
        return folder, torch.float32
    transform, shards, dtype = LAYOUTS.get(layout) or RELEASE_LAYOUTS[(family, layout)]
    return rewrite(folder, tmp_path / layout, transform, shards), dtype


def open_files(folder: Path) -> int:
    """How many of this process's file descriptors are files of ``folder``."""
    fds = Path("/proc/self/fd")
    return sum(1 for fd in fds.iterdir() if os.path.realpath(fd).startswith(str(folder)))


@pytest.mark.parametrize("family, layout", CASES)
def test_reader_equals_transformers(saved, family, layout, tmp_path):
    folder, dtype = layout_folder(saved, family, layout, tmp_path)
    reference = saved(family)[1]
    weights = open_weights(folder)
    assert set(weights.names()) == set(reference) and weights.quantization is None
    for name, expected in reference.items():
        assert weights.shape(name) == tuple(expected.shape), name
        tensor = weights.tensor(name)
        if not expected.is_floating_point():  # an index buffer (RADIO's summary_idxs) reads as stored
            assert tensor.dtype == expected.dtype and torch.equal(tensor, expected), name
            continue
        assert tensor.dtype == torch.float32 and torch.equal(tensor, expected.to(dtype).float()), name
    assert open_files(folder) > 0
    weights.close()
    assert open_files(folder) == 0


def test_the_layouts_are_the_releases(saved, tmp_path):
    # What the cases above read is what releases hold: save_pretrained writes Qwen2.5-VL under its release names and
    # Qwen3.5-MoE per expert; the rewritten Qwen3-VL-MoE holds (experts, hidden, 2 * moe) as its bf16 release does.
    assert any(n.startswith("visual.") for n in read_all(saved("qwen2_5_vl")[0]))
    assert any(".mlp.experts.0.gate_proj.weight" in n for n in read_all(saved("qwen3_5_moe")[0]))
    folder, _ = layout_folder(saved, "qwen3_vl_moe", "fused_transposed_bf16", tmp_path)
    text = load_config(folder).text_config
    gate_up = next(t for n, t in read_all(folder).items() if n.endswith("experts.gate_up_proj"))
    assert gate_up.shape == (text.num_experts, text.hidden_size, 2 * text.moe_intermediate_size)
    # Nemotron-H: the names its release and vLLM's loader use, none of the module's.
    nemotron = read_all(saved("nemotron_h_omni")[0])
    for stored in ("language_model.backbone.layers.1.mixer.experts.0.up_proj.weight",
                   "vision_model.radio_model.model.blocks.0.attn.qkv.weight", "mlp1.1.weight",
                   "sound_encoder.encoder.layers.0.self_attn.q_proj.weight", "sound_projection.linear1.weight"):
        assert stored in nemotron, stored
    assert not any(".q_proj." in n and n.startswith("vision_model.") for n in nemotron)


def test_tied_embeddings_read_from_the_embedding(tmp_path):
    folder = save_tiny_checkpoint("qwen2_5_vl", tmp_path / "tied", seed=2, tie_word_embeddings=True,
                                  text_config={"tie_word_embeddings": True})
    assert not any("lm_head" in n for n in read_all(folder))
    with open_weights(folder) as weights:
        assert torch.equal(weights.tensor("lm_head.weight"), weights.tensor("model.language_model.embed_tokens.weight"))


def test_in_memory_model_from_the_reader(saved):
    folder, reference = saved("qwen3_vl_moe")
    model, quantization = model_from_weights(folder, load_config(folder))
    hf = load_checkpoint(folder).model
    assert quantization is None
    state = model.state_dict()
    assert all(torch.equal(state[n], t) for n, t in reference.items())
    assert all(torch.equal(b, dict(hf.named_buffers())[n]) for n, b in model.named_buffers())


def test_a_split_tensor_of_the_wrong_size_is_refused(saved, tmp_path):
    qkv = "vision_model.radio_model.model.blocks.1.attn.qkv.weight"
    folder = rewrite(saved("nemotron_h_omni")[0], tmp_path / "damaged",
                     lambda t: {n: v[:-3] if n == qkv else v for n, v in t.items()})
    with pytest.raises(ValueError, match=re.escape(
            f"stores {qkv} as [93, 32], but the model's vision_model.encoder.layer.1.attention.q_proj.weight is "
            "[32, 32], one of 3 equal parts of it along its first axis")):
        open_weights(folder)


@pytest.mark.parametrize("damage, message", [
    (lambda t: {n: v for n, v in t.items() if "layers.1.self_attn.q_proj.weight" not in n},
     re.escape("lacks 1 of the model's tensors (model.language_model.layers.1.self_attn.q_proj.weight)")),
    (lambda t: {n: v[:-1] if n == "lm_head.weight" else v for n, v in t.items()},
     r"stores lm_head.weight as \[(\d+), 64\], but the model's lm_head.weight is \[(\d+), 64\]; the checkpoint "
     "does not match its config.json"),
])
def test_a_checkpoint_that_does_not_match_is_refused(saved, tmp_path, damage, message):
    folder = rewrite(saved("qwen3_vl")[0], tmp_path / "damaged", damage)
    with pytest.raises(ValueError, match=message) as refused:
        open_weights(folder)
    assert "\n" not in str(refused.value)
