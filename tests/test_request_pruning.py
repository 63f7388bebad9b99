"""A request's own pruning: ``video_pruning_rate``, ``video_pruning_method``, ``max_video_tokens``.

The rate ``max_video_tokens`` picks is checked against vLLM's own count rules (``compute_retained_tokens_count`` of
``video_prune/evs.py`` and ``video_prune/vidcom2.py``): it keeps at most N tokens, and one ulp less would keep more.
Through the serving engine (``qeff-evs run --requests``), requests on one video at their own settings, run at once,
each give the tokens of ``qeff-evs run`` at that setting alone.
"""

from __future__ import annotations

import json
import math

import pytest

from qeff_evs.manifest import read_manifest
from qeff_evs.models.pruning import VideoPruning
from qeff_evs.runtime.builders import answer, build_engine, build_serving_engine, video_pruning
from qeff_evs.runtime.export_bundle import open_export
from qeff_evs.runtime.media import video_from_file
from qeff_evs.runtime.request_pruning import PruningRequest, rate_for_at_most
from qeff_evs.runtime.requests_jsonl import Conversations, requests_from_jsonl

vllm_evs = pytest.importorskip("vllm.multimodal.video_prune.evs")
vllm_vidcom2 = pytest.importorskip("vllm.multimodal.video_prune.vidcom2")
VLLM_COUNT = {"evs": vllm_evs.compute_retained_tokens_count, "vidcom2": vllm_vidcom2.compute_retained_tokens_count}


@pytest.mark.parametrize("method", ["evs", "vidcom2"])
def test_max_video_tokens_rate_is_the_smallest_that_keeps_at_most_n(method):
    count = VLLM_COUNT[method]
    checked = 0
    for tokens_per_frame in (1, 4, 16, 49, 256, 1024):
        for frames in (1, 2, 3, 7, 8, 16, 48):
            total = tokens_per_frame * frames
            floor = count(tokens_per_frame, frames, math.nextafter(1.0, 0.0))
            for n in sorted({floor - 1, floor, floor + 1, total // 3, total // 2, total - 1, total, total + 5, 1000, 4097}):
                if n < floor:
                    with pytest.raises(ValueError, match=f"keeps at least {floor} with {method}"):
                        rate_for_at_most(method, n, tokens_per_frame, frames)
                    continue
                q = rate_for_at_most(method, n, tokens_per_frame, frames)
                assert 0.0 <= q < 1.0 and count(tokens_per_frame, frames, q) <= n, (method, tokens_per_frame, frames, n)
                if q > 0.0:
                    assert count(tokens_per_frame, frames, math.nextafter(q, 0.0)) > n, (tokens_per_frame, frames, n)
                checked += 1
    assert checked > 300


@pytest.fixture(scope="module")
def served(served_export):
    return served_export("qwen2_5_vl")[1]


def test_request_choices_resolve_within_the_export(served):
    m = read_manifest(served)
    default = VideoPruning("evs", 0.5)
    grid = (4, 4, 4)  # 4 temporal patches of 16 tokens
    resolve = lambda **kw: PruningRequest.split(kw)[0].resolve(default, m, 256, grid)  # noqa: E731
    assert resolve() == default
    assert resolve(video_pruning_rate=0) == VideoPruning("evs", 0.0)
    assert resolve(video_pruning_method="vidcom2") == VideoPruning("vidcom2", 0.5)
    assert resolve(video_pruning_rate=0.75, video_pruning_method="vidcom2") == VideoPruning("vidcom2", 0.75)
    # max_video_tokens only raises the rate: 40 of 64 tokens at the default 0.5 keeps 32 already
    assert resolve(max_video_tokens=40) == default
    tight = resolve(max_video_tokens=20)
    assert tight.method == "evs" and tight.kept_token_count(16, 4) == 20 and tight.rate > 0.5
    assert resolve(video_pruning_rate=0, max_video_tokens=64) == VideoPruning("evs", 0.0)


@pytest.mark.parametrize("kwargs, says", [
    ({"video_pruning_method": "tome"}, "video_pruning_method: video pruning method 'tome' is not one this export"),
    ({"video_pruning_rate": 1.0}, "video_pruning_rate:"),
    ({"video_pruning_rate": "high"}, "video_pruning_rate must be a number in [0, 1)"),
    ({"video_pruning_rate": 0.99}, "but the export's RoPE tables cover"),
    ({"max_video_tokens": 0}, "max_video_tokens must be an integer >= 1"),
    ({"max_video_tokens": 10}, "max_video_tokens=10: this video (4 temporal patches of 4x4 tokens) keeps at least 16"),
])
def test_request_choices_past_the_export_name_the_bound(served, kwargs, says):
    m = read_manifest(served)
    with pytest.raises(ValueError) as error:
        PruningRequest.split(kwargs)[0].resolve(VideoPruning("evs", 0.5), m, 256, (4, 4, 4))
    assert says in str(error.value)


def test_requests_jsonl_pruning_fields_equal_runs_at_those_settings(served, tmp_path):
    """Four requests on one clip through the serving engine at once (rows shared, prefills interleaved): each at
    its own setting gives the tokens of ``qeff-evs run`` at that setting."""
    from qeff_evs.bench.serving import write_video
    from qeff_evs.runtime.inputs.synthetic import moving_square_video

    clip = write_video(tmp_path / "clip.mkv", moving_square_video(8, 120, 120, seed=3), fps=2)
    bundle = open_export(served)
    prompt = "What happens in this video?"
    lines = [{"id": "default", "video": str(clip), "prompt": prompt},
             {"id": "q0", "video": str(clip), "prompt": prompt, "video_pruning_rate": 0},
             {"id": "vidcom2", "video": str(clip), "prompt": prompt,
              "mm_processor_kwargs": {"video_pruning_rate": 0.75, "video_pruning_method": "vidcom2"}},
             {"id": "at_most", "video": str(clip), "prompt": prompt, "max_video_tokens": 20}]
    path = tmp_path / "requests.jsonl"
    path.write_text("\n".join(json.dumps({**line, "max_new_tokens": 6}) for line in lines))
    default = video_pruning(bundle)
    parsed = requests_from_jsonl(path, bundle, default)
    engine = build_serving_engine(bundle, "ort", 4, 16, None, pruning=default)
    chats = Conversations(bundle)
    for line in parsed:
        engine.add_request(chats.first_turn(line))
    served_tokens = engine.run_to_completion()
    video = video_from_file(clip, bundle)
    t, h, w = bundle.family.merged_grid(video.grid_thw)
    at_most = VideoPruning("evs", rate_for_at_most("evs", 20, h * w, t))
    settings = {"default": default, "q0": VideoPruning(default.method, 0.0),
                "vidcom2": VideoPruning("vidcom2", 0.75), "at_most": at_most}
    prompt_lengths = set()
    for request_id, pruning in settings.items():
        expected = answer(bundle, build_engine(bundle, "ort", max_new_tokens=6, pruning=pruning), video, prompt)
        assert served_tokens[request_id] == expected.generated_token_ids, request_id
        prompt_lengths.add(len(expected.prompt_token_ids))
    assert at_most.kept_token_count(h * w, t) <= 20 < VideoPruning("evs", 0.5).kept_token_count(h * w, t)
    assert len(prompt_lengths) == 4  # four settings, four placeholder sizes
