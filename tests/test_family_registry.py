"""A model family is one module: a third family registered here, from this file alone, exports and runs.

``SyntheticVLFamily`` is Qwen2.5-VL under other names: its own ``model_type`` (``synthetic_vl``), its
own transformers config and model classes (subclasses that transformers' Auto mappings do not know),
its own Hugging Face and serving architecture names. Registering it is the only step: nothing else in
the package is edited. Its tiny checkpoint is saved with ``save_pretrained`` and loaded back through
the registry lookup by ``model_type`` (the path a user's checkpoint takes), exported, and a video runs
through ONNX Runtime. The reference is the shipped Qwen2.5-VL family on the same weights (the session's
export, which ``test_e2e_qwen2_5`` checks against transformers): kept tokens, prompt ids, first-step
logits and greedy tokens must be identical, while every family name the export records is the new one.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from qeff_evs.models.checkpoint import detect_family, load_checkpoint
from qeff_evs.models.qwen2_5_vl import Qwen2_5_VLFamily
from qeff_evs.models.registry import family_class, family_names, register_family, unregister_family
from qeff_evs.models.tiny import save_tiny_checkpoint
from qeff_evs.runtime.builders import answer, build_engine
from qeff_evs.runtime.export_bundle import open_export
from qeff_evs.runtime.media import video_from_file

from conftest import CHECKPOINT_SEED
from helpers.exports import export_quietly


class SyntheticVLConfig(Qwen2_5_VLConfig):
    model_type = "synthetic_vl"


class SyntheticVLForConditionalGeneration(Qwen2_5_VLForConditionalGeneration):
    config_class = SyntheticVLConfig


class SyntheticVLFamily(Qwen2_5_VLFamily):
    """Qwen2.5-VL's layout, encoder and preprocessing under a family name of its own."""

    model_type = "synthetic_vl"
    hf_architectures = ("SyntheticVLForConditionalGeneration",)
    serving_architecture = "QeffEvsSyntheticVLForConditionalGeneration"
    hf_processor = "SyntheticVL"
    config_class = SyntheticVLConfig
    model_class = SyntheticVLForConditionalGeneration


@pytest.fixture(scope="module")
def synthetic_family():
    register_family(SyntheticVLFamily)
    yield SyntheticVLFamily
    unregister_family(SyntheticVLFamily.model_type)


@pytest.fixture(scope="module")
def synthetic_checkpoint(synthetic_family, tmp_path_factory):
    return save_tiny_checkpoint("synthetic_vl", tmp_path_factory.mktemp("synthetic_checkpoint"), seed=CHECKPOINT_SEED)


@pytest.fixture(scope="module")
def synthetic_export(synthetic_checkpoint, export_options, tmp_path_factory):
    return export_quietly(synthetic_checkpoint, tmp_path_factory.mktemp("synthetic_export"), export_options)


def test_registration_is_the_only_step(synthetic_family):
    assert family_names()[:2] == ("qwen2_5_vl", "qwen3_vl") and "synthetic_vl" in family_names()
    assert family_class("synthetic_vl") is SyntheticVLFamily


def test_registration_refuses_taken_or_missing_names(synthetic_family):
    class Clash(SyntheticVLFamily):
        serving_architecture = "QeffEvsClash"

    with pytest.raises(ValueError, match="model_type 'synthetic_vl'.*already registered by SyntheticVLFamily"):
        register_family(Clash)

    class Nameless(SyntheticVLFamily):
        model_type = "nameless_vl"
        serving_architecture = ""

    with pytest.raises(TypeError, match="does not declare serving_architecture"):
        register_family(Nameless)
    assert "nameless_vl" not in family_names()

    class Kindless(SyntheticVLFamily):  # a protocol method missing (what the streamed export stamps layers by)
        model_type = "kindless_vl"
        serving_architecture = "QeffEvsKindless"
        layer_kinds = None
        weight_names = None

    with pytest.raises(TypeError, match="does not declare weight_names, layer_kinds;"):
        register_family(Kindless)
    assert "kindless_vl" not in family_names()


def test_checkpoint_loads_through_the_registry(synthetic_checkpoint, tiny_checkpoint):
    """config.json's model_type picks the family, whose own classes read the folder (no Auto mapping)."""
    assert json.loads((synthetic_checkpoint / "config.json").read_text())["model_type"] == "synthetic_vl"
    assert detect_family(synthetic_checkpoint) == "synthetic_vl"
    loaded = load_checkpoint(synthetic_checkpoint)
    assert loaded.family == "synthetic_vl"
    assert type(loaded.config) is SyntheticVLConfig
    assert type(loaded.model) is SyntheticVLForConditionalGeneration
    # A renamed copy: the same weights as the shipped family's tiny checkpoint of the same seed.
    ours, theirs = loaded.model.state_dict(), load_checkpoint(tiny_checkpoint).model.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)


def test_export_records_the_new_family(synthetic_export):
    manifest = json.loads((synthetic_export / "manifest.json").read_text())
    assert manifest["family"] == "synthetic_vl"
    serving = json.loads((synthetic_export / "config.json").read_text())
    assert serving["model_type"] == "synthetic_vl"
    assert serving["architectures"] == ["QeffEvsSyntheticVLForConditionalGeneration"]
    bundle = open_export(synthetic_export)
    assert isinstance(bundle.family, SyntheticVLFamily)
    assert bundle.preprocess.family == "synthetic_vl"


def test_a_video_runs_as_through_the_family_it_copies(synthetic_export, tiny_export, video_npy, question):
    """ORT, the export's own q: the same kept tokens, prompt, first-step logits and greedy tokens."""
    results = {}
    for name, folder in (("synthetic", synthetic_export), ("qwen2_5_vl", tiny_export)):
        bundle = open_export(folder)
        engine = build_engine(bundle, "ort", max_new_tokens=8)
        results[name] = answer(bundle, engine, video_from_file(video_npy, bundle), question)
    ours, theirs = results["synthetic"], results["qwen2_5_vl"]
    assert ours.kept_tokens_per_frame == theirs.kept_tokens_per_frame
    assert sum(ours.kept_tokens_per_frame[0]) < 4 * 4 * 7  # q = 0.5 pruned the clip's merged grid
    assert ours.prompt_token_ids == theirs.prompt_token_ids
    np.testing.assert_allclose(ours.prefill_top_logits, theirs.prefill_top_logits, rtol=0, atol=1e-4)
    assert ours.generated_token_ids == theirs.generated_token_ids


def test_vllm_gets_an_interface_class_per_family(synthetic_family):
    pytest.importorskip("vllm")
    from qeff_evs.vllm.processing.model import interface_class

    cls = interface_class(SyntheticVLFamily)
    assert cls.__name__ == "QeffEvsSyntheticVLForConditionalGeneration" and cls.family is SyntheticVLFamily
    assert cls.get_placeholder_str("video", 0) == "<|vision_start|><|video_pad|><|vision_end|>"
    assert interface_class(Qwen2_5_VLFamily) is not cls


def test_export_help_names_every_shipped_family(capsys):
    """``qeff-evs export --help`` names each family qeff-evs ships by the model_type a checkpoint's config.json holds,
    read off the registry's table of modules (no family module imported for it) and equal to what they register."""
    from qeff_evs.cli import build_parser
    from qeff_evs.models.registry import SHIPPED_MODULES, family_classes, shipped_family_names

    registered = tuple(family.model_type for family in family_classes() if family.__module__ in SHIPPED_MODULES)
    assert shipped_family_names() == registered and len(registered) == len(SHIPPED_MODULES)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["export", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert f"model_type one of {', '.join(registered)})" in help_text
    assert "Qwen2.5-VL / Qwen3-VL" not in help_text
