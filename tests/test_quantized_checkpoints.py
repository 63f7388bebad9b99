"""Quantized releases read by qeff-evs itself (no quantization package): fine-grained FP8, FP8 compressed-tensors,
AWQ and GPTQ, every family, exported and run.

Each checkpoint is written by the test in its release's layout (``helpers/quant_packers.py``: the test's own
quantizer and bit packing, per-expert MoE tensors as releases store them), with beside it the same checkpoint's
weights dequantized to fp32 by the packer from the codes and scales it chose (never by unpacking what it wrote):

* the formats: every variant's dequantized weight is bit-equal to the packer's (FP8 blocks that do and do not
  divide the shape, scales in bf16/fp16/fp32; compressed-tensors per tensor, channel and block; AWQ; GPTQ sym and
  asym, act-order ``g_idx``, both zero conventions, 2/4/8 bits), and the unquantized tensors beside them read as
  stored (``modules_to_not_convert`` / ``ignore``);
* end to end, each format on each family (dense and MoE, per-expert tensors): the reader's module tensors equal
  transformers' load of the reference exactly; the quantized folder through ``qeff-evs export``'s streamed export
  (weights dequantized tensor by tensor) and the reference through transformers' own load and the in-memory export
  run the same clip at q 0 and 0.5: ids, kept tokens and greedy tokens equal, prefill top logits within 1e-5; the export records the source
  quantization in its manifest, and its config.json carries no quantization record, so vLLM sets up no quantized
  kernel for it (vLLM's own config builder says so, and does set one up when the record is put back);
* the in-memory load (``load_checkpoint``) of a quantized release builds its model from the reader, exactly;
* a format we do not read is refused in one line naming its quant_method and the ones we read;
* accelerate, gptqmodel and compressed-tensors are not installed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from qeff_evs.export.pipeline import ExportOptions, export_checkpoint
from qeff_evs.models.checkpoint import load_checkpoint, open_weights
from qeff_evs.models.pruning import VideoPruning
from qeff_evs.models.registry import family_class, shipped_family_names
from qeff_evs.models.tiny import save_tiny_checkpoint
from qeff_evs.runtime.builders import answer, engine_config
from qeff_evs.runtime.engine.single_request import Engine
from qeff_evs.runtime.export_bundle import open_export
from qeff_evs.runtime.inputs.synthetic import moving_square_video
from qeff_evs.runtime.media import video_from_file
from qeff_evs.runtime.sessions import sessions_for
from qeff_evs.weights.quantization import READ_METHODS
from qeff_evs.weights.stored import StoredWeights
from helpers.quant_packers import (
    awq_release, compressed_release, fp8_release, gptq_release, quantize_checkpoint, reader_folder,
)

TESTS = Path(__file__).parent
FAMILIES = shipped_family_names()
ATOL = 1e-5
RATES = (0.0, 0.5)
NEW_TOKENS = 6
QUESTION = "What happens in this video?"

# --------------------------------------------------------------------------------------------------
# the formats, tensor by tensor

VARIANTS = {
    "fp8_block_not_dividing_bf16": fp8_release((32, 48), torch.bfloat16),
    "fp8_block_dividing_fp16": fp8_release((16, 16), torch.float16),
    "fp8_block_larger_than_weight_fp32": fp8_release((128, 128), torch.float32),
    "compressed_tensor": compressed_release("tensor"),
    "compressed_channel_bf16": compressed_release("channel", torch.bfloat16),
    "compressed_block": compressed_release("block"),
    "awq": awq_release(16),
    "gptq_sym": gptq_release(16),
    "gptq_asym_act_order": gptq_release(16, sym=False, desc_act=True),
    "gptq_asym_v2": gptq_release(16, sym=False, checkpoint_format="gptq_v2"),
    "gptq_8bit_sym_act_order": gptq_release(16, bits=8, desc_act=True),
    "gptq_2bit_asym_v2_act_order": gptq_release(16, bits=2, sym=False, desc_act=True, checkpoint_format="gptq_v2"),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_format_dequantizes_exactly(variant, tmp_path):
    release = VARIANTS[variant]
    weight = torch.randn(96, 80, generator=torch.Generator().manual_seed(1)) * 0.05
    packed = release.pack(weight)
    kept = torch.randn(8, 80).to(torch.bfloat16)  # a module the release left unquantized (modules_to_not_convert)
    tensors = {**{f"layer.proj.{suffix}": t for suffix, t in packed.stored.items()},
               "layer.proj.bias": torch.randn(96).to(torch.float16), "visual.proj.weight": kept}
    stored = StoredWeights.open(reader_folder(tmp_path, release, tensors))
    assert stored.quantization.method == release.quantization_config["quant_method"]
    assert sorted(stored.names()) == ["layer.proj.bias", "layer.proj.weight", "visual.proj.weight"]
    assert stored.shape("layer.proj.weight") == (96, 80) and stored.is_quantized("layer.proj.weight")
    assert torch.equal(stored.read("layer.proj.weight"), packed.dequantized)
    assert torch.equal(stored.read("visual.proj.weight"), kept.float())
    assert not torch.equal(packed.dequantized, weight)  # the weight went through the format's rounding


REFUSED = {
    "bitsandbytes": ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method 'bitsandbytes'"),
    "mxfp4": ({"quant_method": "mxfp4"}, "quant_method 'mxfp4'"),
    "exl2": ({"quant_method": "exl2", "bits": 4.0}, "quant_method 'exl2'"),
    "unknown": ({"quant_method": "made-up"}, "quant_method 'made-up'"),
    "awq_gemv": ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "AWQ version 'gemv'"),
    "gptq_3bit": ({"quant_method": "gptq", "bits": 3, "group_size": 128, "sym": True}, "GPTQ with 3-bit weights"),
    "compressed_int4": ({"quant_method": "compressed-tensors", "format": "pack-quantized"},
                        "compressed-tensors format pack-quantized"),
}


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory) -> Path:
    return save_tiny_checkpoint("qwen3_vl", tmp_path_factory.mktemp("refused") / "ck", seed=0, text_layers=1,
                                vision_layers=1)


@pytest.mark.parametrize("case", REFUSED)
def test_a_format_we_do_not_read_is_refused_in_one_line(case, small_checkpoint, tmp_path):
    config, named = REFUSED[case]
    folder = shutil.copytree(small_checkpoint, tmp_path / "ck")
    record = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**record, "quantization_config": config}))
    with pytest.raises(ValueError) as refused:
        open_weights(folder)
    message = str(refused.value)
    assert named in message and "\n" not in message
    if case in ("bitsandbytes", "mxfp4", "exl2", "unknown"):
        assert f"it reads {', '.join(READ_METHODS)}" in message


def test_no_quantization_package_is_installed():
    for package in ("accelerate", "gptqmodel", "compressed_tensors", "auto_gptq", "awq"):
        assert importlib.util.find_spec(package) is None, package


# --------------------------------------------------------------------------------------------------
# end to end: each format on each family

# One variant of each format per family, rotated so that each variant runs end to end somewhere.
FORMATS = ("fp8", "compressed_tensors", "awq", "gptq")
ROTATION = {
    "fp8": ("fp8_block_not_dividing_bf16", "fp8_block_dividing_fp16", "fp8_block_larger_than_weight_fp32"),
    "compressed_tensors": ("compressed_channel_bf16", "compressed_tensor", "compressed_block"),
    "awq": ("awq",),
    "gptq": ("gptq_asym_act_order", "gptq_sym", "gptq_asym_v2", "gptq_8bit_sym_act_order"),
}
CASES = [(family, fmt, ROTATION[fmt][i % len(ROTATION[fmt])]) for i, family in enumerate(FAMILIES) for fmt in FORMATS]


def export_options(family: str, in_memory: bool) -> ExportOptions:
    side = family_class(family).preprocessing.patch_size * 2 * 2  # 2x2 merged tokens per temporal patch
    ctx_len = 192 if family == "nemotron_h_omni" else 64  # its prompt carries more template tokens per frame
    return ExportOptions(0.5, (4,), ((side, side),), prefill_seq_len=16, ctx_len=ctx_len,
                         video_pruning_methods=("evs",), full_batch_size=1,  # one KV row: vLLM serves it
                         in_memory=in_memory)


def export_quietly(checkpoint: Path, out: Path, family: str, in_memory: bool = False) -> Path:
    """The streamed export (the default: weights read by ``open_weights``), or the in-memory one (the model loaded
    by ``load_checkpoint``: transformers' own load for a float checkpoint)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        export_checkpoint(checkpoint, out, export_options(family, in_memory))
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """``saved(family)``: a tiny checkpoint as save_pretrained writes it, and a clip for its exports."""
    made = {}

    def get(family: str):
        if family not in made:
            folder = tmp_path_factory.mktemp(f"q_{family}")
            checkpoint = save_tiny_checkpoint(family, folder / "saved", seed=3, text_layers=2)
            clip = folder / "clip.npy"
            np.save(clip, moving_square_video(4, 40, 40, seed=4))
            made[family] = checkpoint, clip
        return made[family]
    return get


def runs(export: Path, clip: Path) -> list:
    """``qeff-evs run``'s answer on ``clip`` at each of ``RATES`` (one set of ONNX Runtime sessions)."""
    bundle = open_export(export)
    vision, language = sessions_for(bundle, "ort")
    video = video_from_file(clip, bundle)
    results = []
    for rate in RATES:
        config = engine_config(bundle, VideoPruning("evs", rate), max_new_tokens=NEW_TOKENS)
        results.append(answer(bundle, Engine(bundle.family, vision, language, config), video, QUESTION))
    return results


@pytest.fixture(scope="module")
def released(saved, tmp_path_factory):
    """``released(family, variant)``: (quantized checkpoint, its fp32 reference checkpoint, clip), made once."""
    made = {}

    def get(family: str, variant: str):
        if (family, variant) not in made:
            checkpoint, clip = saved(family)
            folder = tmp_path_factory.mktemp(f"{family}_{variant}")
            made[family, variant] = (*quantize_checkpoint(checkpoint, VARIANTS[variant], folder / "quantized",
                                                          folder / "reference"), clip)
        return made[family, variant]
    return get


@pytest.fixture(scope="module")
def exported(released):
    """``exported(family, variant)``: (quantized export, reference export, clip), made once per case: the quantized
    checkpoint through the streamed export (weights dequantized tensor by tensor), its reference through
    transformers' own load and the in-memory export."""
    made = {}

    def get(family: str, variant: str):
        if (family, variant) not in made:
            quantized, reference, clip = released(family, variant)
            made[family, variant] = (export_quietly(quantized, quantized.parent / "quantized_export", family),
                                     export_quietly(reference, reference.parent / "reference_export", family,
                                                    in_memory=True), clip)
        return made[family, variant]
    return get


@pytest.mark.parametrize("family, fmt, variant", CASES)
def test_a_quantized_release_exports_and_runs_as_its_dequantized_weights(released, exported, family, fmt, variant):
    # The weights first: every module tensor the reader gives equals transformers' load of the reference, exactly.
    quantized_checkpoint, reference_checkpoint, _ = released(family, variant)
    expected = load_checkpoint(reference_checkpoint).model.state_dict()
    with open_weights(quantized_checkpoint) as weights:
        assert weights.quantization.config == VARIANTS[variant].quantization_config
        assert set(weights.names()) == set(expected)
        assert all(torch.equal(weights.tensor(name), tensor) for name, tensor in expected.items())
    quantized, reference, clip = exported(family, variant)
    manifest = json.loads((quantized / "manifest.json").read_text())
    assert manifest["source_quantization"]["config"] == VARIANTS[variant].quantization_config
    assert json.loads((reference / "manifest.json").read_text())["source_quantization"] is None
    served = json.loads((quantized / "config.json").read_text())
    assert not {"quantization_config", "compression_config"} & (set(served) | set(served.get("text_config", {})))
    for rate, ours, expected in zip(RATES, runs(quantized, clip), runs(reference, clip)):
        assert ours.prompt_token_ids == expected.prompt_token_ids
        assert ours.kept_tokens_per_frame == expected.kept_tokens_per_frame
        if rate:
            assert sum(map(sum, ours.kept_tokens_per_frame)) < sum(map(sum, unpruned.kept_tokens_per_frame))
        unpruned = ours
        assert ours.generated_token_ids == expected.generated_token_ids
        assert [i for i, _ in ours.prefill_top_logits] == [i for i, _ in expected.prefill_top_logits]
        np.testing.assert_allclose([v for _, v in ours.prefill_top_logits],
                                   [v for _, v in expected.prefill_top_logits], rtol=0, atol=ATOL)


def test_the_in_memory_load_of_a_quantized_release(released):
    # load_checkpoint (the in-memory export's, the torch backend's) builds the model from the reader: a per-expert
    # FP8 MoE release that transformers 5.19 cannot load, dequantized exactly, its config without the record.
    quantized, reference, _ = released("qwen3_vl_moe", "fp8_block_not_dividing_bf16")
    loaded, expected = load_checkpoint(quantized), load_checkpoint(reference).model.state_dict()
    assert loaded.quantization.method == "fp8" and loaded.quantization.source == "config.json quantization_config"
    assert getattr(loaded.config, "quantization_config", None) is None
    state = loaded.model.state_dict()
    assert all(torch.equal(state[name], tensor) for name, tensor in expected.items())


def test_vllm_sets_up_no_quantized_kernel_for_the_export(exported, tmp_path):
    quantized, _, _ = exported("qwen3_vl", "fp8_block_dividing_fp16")
    # The control: the same export with the release's record put back into its config.json.
    recorded = shutil.copytree(quantized, tmp_path / "recorded")
    config = json.loads((recorded / "config.json").read_text())
    config["quantization_config"] = VARIANTS["fp8_block_dividing_fp16"].quantization_config
    (recorded / "config.json").write_text(json.dumps(config))
    result = tmp_path / "result.json"
    env = {k: v for k, v in os.environ.items() if k != "QEFF_EVS_BACKEND"}
    done = subprocess.run([sys.executable, str(TESTS / "vllm_quantization_child.py"), str(result), str(quantized),
                           str(recorded)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    outcome = json.loads(result.read_text())
    assert outcome[str(quantized)] == {"quantization": None}
    # With the record vLLM sets up its fp8 method (here it fails in its quantization package, which needs packages
    # this machine does not have); without it, nothing of that package runs.
    control = outcome[str(recorded)]
    assert control.get("quantization") == "fp8" or any("model_executor/layers/quantization" in frame
                                                       for frame in control["frames"]), control
