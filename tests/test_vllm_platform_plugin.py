"""The plugin's switch and the platform's start-up refusals, without starting vLLM's engine.

vLLM resolves its platform once per process, so nothing here touches ``vllm.platforms.current_platform``:
the entry-point functions and the refusal rules are called directly. The engine-level refusal (vLLM
building its config and stopping) runs in a child process in ``test_vllm_plugin.py``.
"""

from __future__ import annotations

import dataclasses
import logging
from importlib.metadata import EntryPoint, entry_points

import pytest

from qeff_evs.manifest import read_manifest
from qeff_evs.vllm import plugin
from qeff_evs.vllm.engine.limits import ServingSettings, refusals


def test_entry_points_are_installed():
    platform = {ep.name: ep.value for ep in entry_points(group="vllm.platform_plugins")}
    general = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert platform.get("qeff_evs") == "qeff_evs.vllm.plugin:platform_plugin"
    assert general.get("qeff_evs") == "qeff_evs.vllm.plugin:register"


def test_plugin_is_inert_without_the_switch(monkeypatch):
    pytest.importorskip("vllm")
    from vllm import ModelRegistry

    monkeypatch.delenv(plugin.BACKEND_ENV, raising=False)
    assert plugin.platform_plugin() is None
    plugin.register()
    assert not any(a.startswith("QeffEvs") for a in ModelRegistry.get_supported_archs())


def test_unknown_backend_is_said_not_swallowed(monkeypatch, caplog):
    monkeypatch.setenv(plugin.BACKEND_ENV, "cuda")
    with caplog.at_level(logging.ERROR, logger="vllm.qeff_evs"):
        assert plugin.platform_plugin() is None
    assert "QEFF_EVS_BACKEND='cuda'" in caplog.text and "ort, openvino, openvino-bf16, qaic, torch" in caplog.text
    with pytest.raises(ValueError, match="not a qeff-evs backend"):
        plugin.register()


def test_a_second_out_of_tree_platform_is_named(monkeypatch, caplog):
    fake = [EntryPoint("qeff_evs", "qeff_evs.vllm.plugin:platform_plugin", "vllm.platform_plugins"),
            EntryPoint("qaic", "vllm_qaic.platform:register", "vllm.platform_plugins")]
    monkeypatch.setattr(plugin, "entry_points", lambda group: fake)
    monkeypatch.setenv(plugin.BACKEND_ENV, "ort")
    with caplog.at_level(logging.WARNING, logger="vllm.qeff_evs"):
        assert plugin.platform_plugin() == plugin.PLATFORM_CLASS
    assert "qaic (vllm_qaic.platform:register)" in caplog.text and "VLLM_PLUGINS=qeff_evs" in caplog.text


@pytest.fixture(scope="module")
def served_manifest(tiny_export):
    """The session export's manifest, as if exported with --full-batch-size 4."""
    m = read_manifest(tiny_export)
    return dataclasses.replace(m, max_video_pruning_rate=0.5, language_shape=dataclasses.replace(
        m.language_shape, full_batch_size=4, continuous_batching=True, rope_positions=512))


GOOD = ServingSettings(max_num_seqs=4, max_model_len=256, video_pruning_rate=0.5)


def test_settings_the_export_serves_pass(served_manifest):
    assert refusals(GOOD, served_manifest) == []
    assert refusals(dataclasses.replace(GOOD, max_num_seqs=1, max_model_len=64), served_manifest) == []
    # The rate and method are serve-time choices within what the export carries (vLLM's flags).
    for rate, method in ((None, "evs"), (0.0, "vidcom2"), (0.25, "vidcom2"), (0.5, "evs"), (0.5, "vidcom2")):
        settings = dataclasses.replace(GOOD, video_pruning_rate=rate, video_pruning_method=method)
        assert refusals(settings, served_manifest) == [], (rate, method)
    assert refusals(dataclasses.replace(GOOD, video_pruning_rate=0.75, max_model_len=128), served_manifest) == []


@pytest.mark.parametrize("change, expected", [
    (dict(max_num_seqs=8), "max_num_seqs 8 is above the export's full batch size 4 (its KV rows); pass --max-num-seqs 4"),
    (dict(max_model_len=257), "max_model_len 257 is above the export's ctx_len 256; pass --max-model-len 256"),
    (dict(video_pruning_rate=0.75), "video pruning rate 0.75 reaches M-RoPE positions up to 1024 in a context of 256 "
                                    "tokens (positions stay unpruned) but the export's RoPE tables cover 512 (sized "
                                    "for --max-video-pruning-rate 0.5); pass a rate of at most 0.5"),
])
def test_each_unservable_setting_is_one_line(served_manifest, change, expected):
    problems = refusals(dataclasses.replace(GOOD, **change), served_manifest)
    assert len(problems) == 1 and expected in problems[0]


def test_an_export_without_kv_rows_is_refused(tiny_export):
    problems = refusals(dataclasses.replace(GOOD, max_num_seqs=1), read_manifest(tiny_export))
    assert len(problems) == 1 and "re-export with --full-batch-size N" in problems[0]


def test_a_model_length_whose_positions_pass_the_rope_tables_is_refused(served_manifest):
    """Positions stay unpruned under EVS: 256 tokens at q = 0.5 may need positions up to 512."""
    short_tables = dataclasses.replace(served_manifest, language_shape=dataclasses.replace(
        served_manifest.language_shape, rope_positions=384))
    problems = refusals(GOOD, short_tables)
    assert len(problems) == 1 and "reaches M-RoPE positions up to 512" in problems[0]
    assert "cover 384" in problems[0] and "--max-video-pruning-rate" in problems[0]
    assert refusals(dataclasses.replace(GOOD, max_model_len=192), short_tables) == []


def test_a_method_the_export_does_not_carry_is_refused(served_manifest):
    evs_only = dataclasses.replace(served_manifest, video_pruning_methods=("evs",))
    problems = refusals(dataclasses.replace(GOOD, video_pruning_method="vidcom2"), evs_only)
    assert problems == ["video pruning method 'vidcom2' is not one this export carries (evs); pass "
                        "--video-pruning-method evs, or re-export with --video-pruning-methods including vidcom2"]
