"""One named test per vLLM / QEfficient defect not reproduced
(docs/design.md#differences-from-vllm-and-qefficient-on-purpose).

Each test shows our result equal to an independent reference (transformers' ``get_rope_index``,
or hand-worked numbers where transformers 5.x itself disagrees with vLLM's rule) and, where vLLM
0.32.0's own ``vllm.multimodal.video_prune.evs.recompute_mrope_positions`` runs on CPU, that vLLM
gives a different answer on the same case.

How vLLM is driven here: its model modules (``vllm.model_executor.models.qwen3_vl`` /
``qwen2_5_vl``) cannot be imported in this environment (they need torchvision / einops), so the
position channels they attach to each item's encoder rows are rebuilt here the way they build
them: Qwen3-VL videos as ``_get_expanded_positions`` does (``[t, h, w, is_vision_start,
is_video]`` over the whole placeholder: the video's own unpruned positions restricted to the kept
tokens), images and Qwen2.5-VL videos with vLLM's own ``compute_mrope_for_media`` (as
``_postprocess_image_embeds_evs`` / ``_postprocess_video_embeds_evs`` call it), and all of them
concatenated to bf16 embeddings and read back with ``.long()``, as vLLM stores them.
The V1 runner's loop is reproduced around the real ``recompute_mrope_positions``: per chunk, every
item whose placeholder overlaps the window contributes its rows ``[max(c - offset, 0),
min(c - offset + n, length))``. The request's initial positions only matter before the first
media item (every call with media rewrites everything after its anchor), where vLLM's
``get_mrope_input_positions`` gives plain text positions, which is what the loop starts from.
``test_vllm_simulation_is_right_in_its_safe_case`` checks the harness: in vLLM's safe regime
(one video, one chunk, no outer markers, positions below 256) it reproduces the right answer.

Not applicable here: the 0.20-0.22 crash (``repl_token_ids`` created on the CPU next to CUDA
embeddings) has no counterpart, as the host builds ids and positions once and the vision
graph never embeds text; the PyTorch backend runs end to end on CPU in tests/test_e2e_qwen3.py.
"""

from __future__ import annotations

import functools
import types
import warnings
from dataclasses import dataclass

import numpy as np
import onnxruntime as ort
import pytest
import torch
from transformers import Qwen2_5_VLModel, Qwen3VLModel
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
from transformers.video_utils import VideoMetadata
from vllm.multimodal.video_prune.evs import compute_mrope_for_media, recompute_mrope_positions

from qeff_evs.export.language import export_language_graph
from qeff_evs.models.graph_io import language_io_names
from qeff_evs.models.language import language_spec
from qeff_evs.models.protocol import MediaInput
from qeff_evs.models.qwen2_5_vl import Qwen2_5_VLFamily
from qeff_evs.models.qwen3_vl import Qwen3_VLFamily
from qeff_evs.models.tiny import build_tiny_model, build_tokenizer, tiny_config
from qeff_evs.runtime.engine.steps import prefill_step
from qeff_evs.runtime.engine.request import EncodedMedia, PromptPiece, prepare_prompt

TEXT_IDS = (20, 400)
HIDDEN = 4  # fake vision rows for position-only cases
BF16_EXACT_LIMIT = 256  # bf16 has 8 significant bits: every integer up to 256 is exact, 257 is not


# --------------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def q3_config(tokenizer):
    return tiny_config("qwen3_vl", tokenizer)


@pytest.fixture(scope="module")
def q3_family(q3_config, tokenizer):
    return Qwen3_VLFamily(q3_config, tokenizer)


@pytest.fixture(scope="module")
def q3_hf(q3_config):
    """Only ``get_rope_index`` is used: it reads the config, never the weights."""
    return Qwen3VLModel(q3_config).eval()


@pytest.fixture(scope="module")
def q25_config(tokenizer):
    return tiny_config("qwen2_5_vl", tokenizer)


@pytest.fixture(scope="module")
def q25_hf(q25_config):
    return Qwen2_5_VLModel(q25_config).eval()


# --------------------------------------------------------------------------------------------------
# Qwen3-VL cases: the same prompt for us, transformers and vLLM


def hf_video_text(grid_thw, frame_indices: list[int], fps: float) -> str:
    """``Qwen3VLProcessor.replace_video_token`` on a stand-in (its video processor needs torchvision)."""
    stand_in = types.SimpleNamespace(
        video_processor=types.SimpleNamespace(merge_size=2, temporal_patch_size=2),
        vision_start_token="<|vision_start|>", vision_end_token="<|vision_end|>", video_token="<|video_pad|>")
    stand_in._calculate_timestamps = functools.partial(Qwen3VLProcessor._calculate_timestamps, stand_in)
    metadata = VideoMetadata(total_num_frames=max(frame_indices) + 1, fps=fps, frames_indices=list(frame_indices))
    grid = torch.tensor([list(grid_thw)])
    return Qwen3VLProcessor.replace_video_token(stand_in, {"video_grid_thw": grid, "video_metadata": [metadata]}, 0)


def token_types(ids: torch.Tensor, config) -> torch.Tensor:
    types_ = torch.zeros_like(ids, dtype=torch.int32)
    types_[ids == config.image_token_id] = 1
    types_[ids == config.video_token_id] = 2
    return types_


@dataclass
class Item:
    kind: str  # "video" | "image"
    grid_thw: tuple[int, int, int]  # patch grid
    kept: np.ndarray
    unpruned_ids: list[int]  # the item's own ids, unpruned (a video: its frames, no outer markers)
    keep: np.ndarray
    frame_times: tuple[float, ...] = ()

    @property
    def real_ids(self) -> list[int]:
        return np.asarray(self.unpruned_ids)[self.keep].tolist()

    def as_input(self) -> MediaInput:
        return MediaInput(torch.zeros(0), self.grid_thw, 2.0, self.frame_times, kind=self.kind)


def make_video(tokenizer, config, t: int, h: int, w: int, keep_fraction: float, seed: int) -> Item:
    """A video of ``t`` temporal patches on an ``h x w`` merged grid sampled at 2 fps; frame 0 and a
    random ``keep_fraction`` of the other tokens are kept (EVS-like)."""
    rng = np.random.default_rng(seed)
    indices = list(range(2 * t))
    ids = tokenizer.encode(hf_video_text((t, 2 * h, 2 * w), indices, 2.0), add_special_tokens=False)
    others = np.arange(h * w, t * h * w)
    chosen = rng.choice(others, int(len(others) * keep_fraction), replace=False) if len(others) else others
    kept = np.sort(np.concatenate([np.arange(h * w), chosen])).astype(np.int64)
    raster = np.zeros(t * h * w, dtype=bool)
    raster[kept] = True
    keep = np.ones(len(ids), dtype=bool)
    keep[np.asarray(ids) == config.video_token_id] = raster
    return Item("video", (t, 2 * h, 2 * w), kept, ids, keep, tuple(i / 2.0 for i in indices))


def make_image(config, h: int, w: int) -> Item:
    return Item("image", (1, 2 * h, 2 * w), np.arange(h * w, dtype=np.int64), [config.image_token_id] * (h * w),
                np.ones(h * w, dtype=bool))


@dataclass
class Case:
    """A Qwen3-VL prompt: segments of text ids and media items, optionally with the outer markers."""

    segments: list  # list[int] text or Item
    outer_markers: bool  # HF >= 5.10 / vLLM >= 0.26 keep the template's VS/VE around a video

    def _parts(self, config):
        vs, ve = config.vision_start_token_id, config.vision_end_token_id
        for seg in self.segments:
            if isinstance(seg, Item):
                wrap = self.outer_markers or seg.kind == "image"
                yield ([vs] if wrap else []), seg, ([ve] if wrap else [])
            else:
                yield seg, None, []

    @property
    def items(self) -> list[Item]:
        return [s for s in self.segments if isinstance(s, Item)]

    def ours(self, family):
        """Our prepared prompt (fake vision rows: positions do not depend on them)."""
        pieces, media, encoded = [], [], []
        for before, item, after in self._parts(family.config):
            if before:
                pieces.append(PromptPiece(ids=tuple(before)))
            if item is not None:
                pieces.append(PromptPiece(media_item=len(media)))
                media.append(item.as_input())
                rows = np.zeros((len(item.kept), HIDDEN), dtype=np.float32)
                encoded.append(EncodedMedia(rows, item.kept, {"deepstack_features": rows[None]}))
            if after:
                pieces.append(PromptPiece(ids=tuple(after)))
        return prepare_prompt(pieces, media, encoded, family)

    def real_ids(self, config) -> list[int]:
        ids = []
        for before, item, after in self._parts(config):
            ids += before + (item.real_ids if item else []) + after
        return ids

    def placeholders(self, config) -> list[tuple[int, int]]:
        """``(offset, length)`` of every item's placeholder in the real prompt, as vLLM registers it."""
        out, at = [], 0
        for before, item, after in self._parts(config):
            at += len(before)
            if item is not None:
                out.append((at, len(item.real_ids)))
                at += len(item.real_ids)
            at += len(after)
        return out

    def correct_positions(self, hf_model) -> np.ndarray:
        """Transformers' positions of the unpruned prompt, restricted to the kept tokens."""
        config = hf_model.config
        ids, keep = [], []
        for before, item, after in self._parts(config):
            ids += before
            keep += [True] * len(before)
            if item is not None:
                ids += item.unpruned_ids
                keep += item.keep.tolist()
            ids += after
            keep += [True] * len(after)
        ids_t = torch.tensor([ids])
        grids = {k: [list(i.grid_thw) for i in self.items if i.kind == k] for k in ("image", "video")}
        positions, _ = hf_model.get_rope_index(
            ids_t, mm_token_type_ids=token_types(ids_t, config),
            image_grid_thw=torch.tensor(grids["image"]) if grids["image"] else None,
            video_grid_thw=torch.tensor(grids["video"]) if grids["video"] else None)
        return positions[:, 0].numpy()[:, np.asarray(keep)]


def vllm_channels(item: Item, hf_model, bf16: bool = True) -> torch.Tensor:
    """The ``(5, L)`` position channels vLLM's Qwen3-VL attaches to an item's encoder rows."""
    config = hf_model.config
    if item.kind == "image":
        positions = compute_mrope_for_media(item.grid_thw, config.vision_config.spatial_merge_size)
        channels = torch.cat([positions, torch.zeros_like(positions[:, :1])], dim=1)
    else:
        ids = torch.tensor([item.unpruned_ids])
        alone, _ = hf_model.get_rope_index(ids, mm_token_type_ids=token_types(ids, config),
                                           video_grid_thw=torch.tensor([list(item.grid_thw)]))
        real = torch.tensor(item.real_ids)
        channels = torch.stack([*alone[:, 0][:, torch.from_numpy(item.keep)],
                                (real == config.vision_start_token_id).long(),
                                (real == config.video_token_id).long()], dim=1)
    if bf16:  # vLLM concatenates them to the bf16 embeddings, then reads them back with .long()
        embeds = torch.zeros(channels.shape[0], 8, dtype=torch.bfloat16)
        channels = torch.cat([embeds, channels], dim=1)[:, -5:]
    return channels.T.long()


def vllm_runner(ids: list[int], placeholders, channels: list[torch.Tensor], chunks, config):
    """V1's ``_gather_mm_embeddings`` + ``recompute_mrope_positions`` per step. Returns positions
    ``(3, N)`` or the exception vLLM raised."""
    ids_t = torch.tensor(ids)
    positions = torch.arange(len(ids)).expand(3, -1).clone()
    try:
        for c, n in chunks:
            slices = [ch[:, max(c - offset, 0):min(c - offset + n, length)]
                      for (offset, length), ch in zip(placeholders, channels)
                      if offset + length > c and offset < c + n]
            positions, _ = recompute_mrope_positions(ids_t, slices, positions, c, config.vision_start_token_id,
                                                     config.image_token_id, config.video_token_id)
    except (RuntimeError, IndexError) as error:  # vLLM crashes on some boundaries (reference notes §3.4)
        return error
    return positions.numpy()


def vllm_positions(case: Case, hf_model, chunks=None, bf16: bool = True):
    config = hf_model.config
    ids = case.real_ids(config)
    channels = [vllm_channels(item, hf_model, bf16) for item in case.items]
    return vllm_runner(ids, case.placeholders(config), channels, chunks or [(0, len(ids))], config)


def chunk_positions(prompt, chunks) -> np.ndarray:
    """Rows 1..3 of the language-graph inputs of every chunk, concatenated."""
    steps = [prefill_step(prompt, c, n, n, n, HIDDEN, {"deepstack_features": 1}) for c, n in chunks]
    return np.concatenate([s.position_ids[1:, 0, :n] for s, (_, n) in zip(steps, chunks)], axis=1)


def differs(vllm_result, correct: np.ndarray) -> bool:
    return isinstance(vllm_result, Exception) or not np.array_equal(vllm_result, correct)


def text(seed: int, n: int) -> list[int]:
    return [int(i) for i in np.random.default_rng(seed).integers(*TEXT_IDS, size=n)]


# --------------------------------------------------------------------------------------------------
# the harness itself


def test_vllm_simulation_is_right_in_its_safe_case(tokenizer, q3_config, q3_family, q3_hf):
    """One video, one chunk, no outer markers, small positions: vLLM's recompute gives the right
    positions here, so the differences below come from vLLM, not from the harness."""
    video = make_video(tokenizer, q3_config, t=4, h=2, w=3, keep_fraction=0.4, seed=1)
    case = Case([text(1, 5), video, text(2, 4)], outer_markers=False)
    correct = case.correct_positions(q3_hf)
    np.testing.assert_array_equal(vllm_positions(case, q3_hf), correct)
    np.testing.assert_array_equal(case.ours(q3_family).positions, correct)


# --------------------------------------------------------------------------------------------------
# bf16 positions


def test_positions_above_256_within_a_video_stay_exact(tokenizer, q3_config, q3_family, q3_hf):
    """vLLM stores each item's positions next to its bf16 embeddings; any placeholder-relative
    position above 256 comes back rounded (257 -> 256, 259 -> 260). Ours are int64 throughout."""
    video = make_video(tokenizer, q3_config, t=24, h=2, w=3, keep_fraction=0.5, seed=2)
    case = Case([text(3, 4), video, text(4, 3)], outer_markers=False)
    correct = case.correct_positions(q3_hf)
    prompt = case.ours(q3_family)
    assert prompt.positions.dtype == np.int64
    np.testing.assert_array_equal(prompt.positions, correct)

    offset, length = case.placeholders(q3_config)[0]
    local = torch.from_numpy(correct[:, offset:offset + length] - correct[0, offset])
    assert int(local.max()) > BF16_EXACT_LIMIT
    round_trip = local.to(torch.bfloat16).long()
    assert not torch.equal(round_trip, local)  # bf16 would change these positions (ours are exact, above) ...

    # ... and does in vLLM: the same recompute is right without the bf16 storage, wrong with it.
    np.testing.assert_array_equal(vllm_positions(case, q3_hf, bf16=False), correct)
    assert differs(vllm_positions(case, q3_hf, bf16=True), correct)


# --------------------------------------------------------------------------------------------------
# per-chunk re-anchoring (vLLM issue 48833)


@pytest.fixture(scope="module")
def one_video_case(tokenizer, q3_config):
    """vLLM's safe layout (no outer markers) so that its single-chunk answer is right."""
    video = make_video(tokenizer, q3_config, t=4, h=2, w=3, keep_fraction=0.4, seed=5)
    return Case([text(5, 6), video, text(6, 5)], outer_markers=False)


def boundaries_inside(case: Case, config) -> dict[str, int]:
    offset, length = case.placeholders(config)[0]
    ids = case.real_ids(config)
    starts = [i for i in range(offset, offset + length) if ids[i] == config.vision_start_token_id]
    ends = [i for i in range(offset, offset + length) if ids[i] == config.vision_end_token_id]
    return {
        "inside the first timestamp": offset + 2,
        "right after frame 0's vision_start": starts[0] + 1,
        "inside frame 0's pads": starts[0] + 2,
        "between frame 0 and frame 1": ends[0] + 1,
        "inside frame 2's timestamp": ends[1] + 3,
        "right after frame 2's vision_start": starts[2] + 1,
    }


def test_chunk_boundary_inside_the_placeholder(one_video_case, q3_config, q3_family, q3_hf):
    """vLLM re-derives the anchor of a media slice from the chunk start and loses it when the
    chunk starts inside a Qwen3-VL placeholder (or crashes, right after frame 0's vision_start).
    Ours slices the request's positions, so every boundary gives transformers' positions."""
    correct = one_video_case.correct_positions(q3_hf)
    prompt = one_video_case.ours(q3_family)
    total = len(prompt.ids)
    boundaries = boundaries_inside(one_video_case, q3_config)
    vllm_results = {}
    for name, cut in boundaries.items():
        chunks = [(0, cut), (cut, total - cut)]
        np.testing.assert_array_equal(chunk_positions(prompt, chunks), correct, err_msg=name)
        vllm_results[name] = vllm_positions(one_video_case, q3_hf, chunks)
    assert [name for name, result in vllm_results.items() if differs(result, correct)] == list(boundaries)
    # a negative anchor wraps around: a shape mismatch inside vLLM
    assert isinstance(vllm_results["right after frame 0's vision_start"], RuntimeError)


def test_positions_do_not_depend_on_chunking(one_video_case, tokenizer, q3_config, q3_family, q3_hf):
    """No per-chunk re-anchoring: over random chunkings our language-graph positions are one array
    (transformers'); vLLM's take several values for the same request."""
    rng = np.random.default_rng(0)
    image = make_image(q3_config, 2, 2)
    video = make_video(tokenizer, q3_config, t=3, h=2, w=2, keep_fraction=0.5, seed=8)
    cases = [one_video_case, Case([text(9, 5), one_video_case.items[0], text(10, 9), video, text(11, 3),
                                   image, text(12, 4)], outer_markers=True)]
    for case in cases:
        correct = case.correct_positions(q3_hf)
        prompt = case.ours(q3_family)
        total = len(prompt.ids)
        vllm_results = set()
        for _ in range(25):
            cuts = sorted(set(rng.integers(1, total, size=int(rng.integers(1, 6))).tolist()))
            edges = [0, *cuts, total]
            chunks = [(a, b - a) for a, b in zip(edges, edges[1:])]
            np.testing.assert_array_equal(chunk_positions(prompt, chunks), correct)
            result = vllm_positions(case, q3_hf, chunks)
            vllm_results.add("error" if isinstance(result, Exception) else result.tobytes())
        assert len(vllm_results) > 1


def test_two_media_in_one_chunk(tokenizer, q3_config, q3_family, q3_hf):
    """vLLM advances its cursor by each slice's length, ignoring the text between items, so the
    second item of a chunk is anchored to the wrong vision_start."""
    first = make_video(tokenizer, q3_config, t=3, h=2, w=2, keep_fraction=0.5, seed=11)
    second = make_video(tokenizer, q3_config, t=2, h=2, w=3, keep_fraction=0.5, seed=12)
    image = make_image(q3_config, 2, 3)
    for segments in ([text(13, 4), first, text(14, 6), second, text(15, 3)],
                     [text(13, 4), first, text(14, 6), image, text(15, 3)]):
        case = Case(segments, outer_markers=False)
        correct = case.correct_positions(q3_hf)
        prompt = case.ours(q3_family)
        np.testing.assert_array_equal(prompt.positions, correct)
        np.testing.assert_array_equal(chunk_positions(prompt, [(0, len(prompt.ids))]), correct)
        assert differs(vllm_positions(case, q3_hf), correct)


def test_outer_vision_start_is_kept(tokenizer, q3_config, q3_family, q3_hf):
    """With transformers >= 5.10 the template's <|vision_start|> stays before the per-frame
    expansion (vLLM >= 0.26 too); vLLM then anchors the video on that outer marker and shifts every
    position. Our prompt keeps the marker and its positions are transformers'."""
    video = make_video(tokenizer, q3_config, t=4, h=2, w=3, keep_fraction=0.4, seed=5)
    case = Case([text(5, 6), video, text(6, 5)], outer_markers=True)
    correct = case.correct_positions(q3_hf)
    prompt = case.ours(q3_family)
    offset, _ = case.placeholders(q3_config)[0]
    assert prompt.ids[offset - 1] == q3_config.vision_start_token_id  # the outer marker
    assert prompt.ids[offset + 1] != q3_config.vision_start_token_id  # then frame 0's timestamp
    np.testing.assert_array_equal(prompt.positions, correct)
    assert differs(vllm_positions(case, q3_hf), correct)
    # the same video without the outer markers is vLLM's safe case
    plain = Case([text(5, 6), video, text(6, 5)], outer_markers=False)
    np.testing.assert_array_equal(vllm_positions(plain, q3_hf), plain.correct_positions(q3_hf))


# --------------------------------------------------------------------------------------------------
# QEfficient's image_idx reset


@pytest.fixture(scope="module")
def language_session(tokenizer, tmp_path_factory):
    model = build_tiny_model("qwen3_vl", tokenizer, seed=0)
    path = tmp_path_factory.mktemp("q3_language") / "language.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        export_language_graph(model, path, media_token_ids=(model.config.image_token_id, model.config.video_token_id))
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]), language_spec(model)


def run_chunks(session, spec, steps, ctx_len: int = 64) -> tuple[np.ndarray, list[int]]:
    """Feed ``steps`` (dicts of input_ids, position_ids, vision_embeds, deepstack_features,
    image_idx or None = carry image_idx_output) through the raw ONNX graph with its KV cache."""
    inputs, outputs = language_io_names(spec.num_layers, spec.extras)
    kv = {name: np.zeros((1, spec.kv_heads, ctx_len, spec.head_dim), np.float32)
          for name in inputs if name.startswith("past_")}
    image_idx = np.zeros((1, 1), np.int64)
    carried, logits = [], None
    for step in steps:
        feeds = dict(kv, **{k: v for k, v in step.items() if k != "image_idx"})
        feeds["image_idx"] = image_idx if step["image_idx"] is None else step["image_idx"]
        result = dict(zip(outputs, session.run(None, feeds)))
        image_idx = result["image_idx_output"]
        carried.append(int(image_idx[0, 0]))
        logits = result["logits"]
        kv = {name: result[f"{name}_RetainedState"] for name in kv}
    return logits, carried


def test_image_idx_survives_a_text_only_chunk(language_session, tokenizer, q3_config, q3_family):
    """QEfficient's decoder sets image_idx_output = max(media index) + 1, which is 0 in a chunk
    without media tokens, so a host that carries it (upload every row once, chunk by chunk) reads
    the next image from row 0. Our graph returns image_idx + the chunk's media count: a text-only
    chunk passes image_idx through, and the carried loop equals the windowed one."""
    session, spec = language_session
    seq_len = 8
    a, b = make_image(q3_config, 2, 2), make_image(q3_config, 2, 3)
    case = Case([text(20, 3), a, text(21, 2 * seq_len), b, text(22, 3)], outer_markers=False)
    prompt = case.ours(q3_family)
    rng = np.random.default_rng(0)
    rows = [rng.normal(size=(len(item.kept), spec.hidden_size)).astype(np.float32) for item in case.items]
    for encoded, item_rows in zip(prompt.encoded, rows):
        encoded.rows, encoded.extras = item_rows, {"deepstack_features": -item_rows[None]}
    total = len(prompt.ids)
    chunks = [(c, min(seq_len, total - c)) for c in range(0, total, seq_len)]
    windowed = [prefill_step(prompt, c, n, seq_len, seq_len, spec.hidden_size, spec.extras) for c, n in chunks]
    pads = np.isin(prompt.ids, (q3_config.image_token_id, q3_config.video_token_id))
    assert any(not pads[c:c + n].any() for c, n in chunks[1:-1]), "the prompt needs a text-only chunk between media"

    # the windowed scheme (ours): each chunk carries its own rows, image_idx = 0
    def as_feeds(step, image_idx):
        return dict(input_ids=step.input_ids, position_ids=step.position_ids, vision_embeds=step.vision_embeds,
                    deepstack_features=step.extras["deepstack_features"], image_idx=image_idx)

    windowed_logits, _ = run_chunks(session, spec, [as_feeds(s, s.image_idx) for s in windowed])

    # QEfficient's host loop: every row uploaded once, image_idx carried from image_idx_output
    all_rows = np.concatenate(rows)[None]
    whole = [dict(as_feeds(s, None), vision_embeds=all_rows, deepstack_features=-all_rows[None]) for s in windowed]
    carried_logits, carried = run_chunks(session, spec, whole)
    media_per_chunk = [int(pads[c:c + n].sum()) for c, n in chunks]
    assert carried == np.cumsum(media_per_chunk).tolist()  # unchanged through text-only chunks
    np.testing.assert_allclose(carried_logits, windowed_logits, atol=1e-4, rtol=0)

    # what the reset would do: image B reads image A's rows, and the answer changes
    reset = [dict(step, image_idx=np.zeros((1, 1), np.int64)) if not pads[c:c + n].any() else step
             for step, (c, n) in zip(whole, chunks)]
    reset_logits, _ = run_chunks(session, spec, reset)
    assert np.abs(reset_logits - windowed_logits).max() > 1e-2


def test_image_idx_output_counts_the_chunks_media_tokens(language_session, q3_config):
    session, spec = language_session
    inputs, outputs = language_io_names(spec.num_layers, spec.extras)
    seq_len, vision_size, ctx_len = 6, 10, 16
    for media in (0, 3):
        ids = np.full((1, seq_len), 30, np.int64)
        ids[0, 1:1 + media] = q3_config.video_token_id
        feeds = {name: np.zeros((1, spec.kv_heads, ctx_len, spec.head_dim), np.float32)
                 for name in inputs if name.startswith("past_")}
        feeds.update(input_ids=ids, position_ids=np.arange(seq_len).reshape(1, 1, -1).repeat(4, 0),
                     vision_embeds=np.zeros((1, vision_size, spec.hidden_size), np.float32),
                     deepstack_features=np.zeros((spec.extras["deepstack_features"], 1, vision_size, spec.hidden_size), np.float32),
                     image_idx=np.array([[5]], np.int64))
        result = dict(zip(outputs, session.run(None, feeds)))
        assert int(result["image_idx_output"][0, 0]) == 5 + media


# --------------------------------------------------------------------------------------------------
# Qwen2.5-VL under EVS


def qwen2_5_case(config, grid_thw, fps: float, kept: np.ndarray):
    """text(3) VS video VE text(2): our prompt, and the real ids + vLLM's placeholder (the pads)."""
    family = Qwen2_5_VLFamily(config)
    vs, ve = config.vision_start_token_id, config.vision_end_token_id
    video = MediaInput(torch.zeros(0), grid_thw, fps)
    encoded = EncodedMedia(np.zeros((len(kept), HIDDEN), np.float32), kept)
    pieces = [PromptPiece(ids=tuple(text(30, 3) + [vs])), PromptPiece(media_item=0),
              PromptPiece(ids=tuple([ve] + text(31, 2)))]
    prompt = prepare_prompt(pieces, [video], [encoded], family)
    return prompt, (4, len(kept))


def vllm_qwen2_5_positions(config, prompt, placeholder, grid_thw, kept, second_per_grid: float):
    """vLLM's Qwen2.5-VL EVS path: ``compute_mrope_for_media`` with ``second_per_grid_ts.long()``,
    rows kept by the mask, stored next to bf16 embeddings, then one recompute over the prompt."""
    m = config.vision_config.spatial_merge_size
    spg = int(torch.tensor(second_per_grid).long())  # vLLM: second_per_grid_ts = second_per_grid_ts.long()
    media = compute_mrope_for_media(list(grid_thw), m, tokens_per_second=config.vision_config.tokens_per_second,
                                    video_second_per_grid=spg)[torch.from_numpy(kept)]
    stored = torch.cat([torch.zeros(len(kept), 8, dtype=torch.bfloat16), media], dim=1)[:, -4:]
    return vllm_runner(prompt.ids.tolist(), [placeholder], [stored.T.long()], [(0, len(prompt.ids))], config)


def test_qwen2_5_text_after_a_video_continues_at_max_plus_one(q25_config):
    """vLLM's EVS recompute puts the text after a Qwen2.5-VL video at ``base + merged width``,
    inside the video's own temporal range; without EVS vLLM (and we) use the block's max + 1.

    Hand-worked: 3 text tokens at 0..2, <|vision_start|> at 3, the video's block starts at s = 4.
    Grid (T=4, 2x3 merged), 2 fps: second_per_grid = 2 / 2 = 1, tokens_per_second = 2, so the
    temporal offsets are 0, 2, 4, 6; the block's max is 4 + 6 = 10, <|vision_end|> is at 11.
    vLLM: base + w = 4 + 3 = 7 for <|vision_end|>, which the video's own t = 8, 10 overtake."""
    grid = (4, 4, 6)
    kept = np.arange(24, dtype=np.int64)  # EVS keeping all: the offset bug is not about pruning
    prompt, placeholder = qwen2_5_case(q25_config, grid, 2.0, kept)
    end = placeholder[0] + placeholder[1]  # <|vision_end|>
    assert prompt.positions[:, end:].tolist() == [[11, 12, 13]] * 3
    assert prompt.decode_start == 14
    t_row = prompt.positions[0, placeholder[0]:end]
    assert sorted(set(t_row.tolist())) == [4, 6, 8, 10]
    vllm = vllm_qwen2_5_positions(q25_config, prompt, placeholder, grid, kept, 1.0)
    assert vllm[:, end].tolist() == [7, 7, 7]
    np.testing.assert_array_equal(vllm[:, :end], prompt.positions[:, :end])  # the video itself agrees


def test_qwen2_5_keeps_the_fraction_of_second_per_grid(q25_config, q25_hf):
    """At 4 fps second_per_grid is 2 / 4 = 0.5; vLLM's EVS path truncates it to 0 before
    multiplying, so every frame gets temporal offset 0. Ours keeps 0.5: offsets 0, 1, 2, 3, as in
    transformers' ``get_rope_index`` (which agrees with vLLM's max + 1 here: offsets stay below
    max(h, w) = 4)."""
    grid = (4, 8, 8)  # merged 4 x 4
    rng = np.random.default_rng(4)
    kept = np.sort(np.concatenate([np.arange(16), rng.choice(np.arange(16, 64), 20, replace=False)]))
    prompt, placeholder = qwen2_5_case(q25_config, grid, 4.0, kept)

    unpruned_prompt, _ = qwen2_5_case(q25_config, grid, 4.0, np.arange(64, dtype=np.int64))
    ids = torch.from_numpy(unpruned_prompt.ids)[None]
    types_ = (ids == q25_config.video_token_id).to(torch.int32) * 2
    hf_positions, _ = q25_hf.get_rope_index(ids, mm_token_type_ids=types_, video_grid_thw=torch.tensor([grid]),
                                            second_per_grid_ts=torch.tensor([0.5]))
    keep = np.ones(len(unpruned_prompt.ids), dtype=bool)
    raster = np.zeros(64, dtype=bool)
    raster[kept] = True
    keep[placeholder[0]:placeholder[0] + 64] = raster
    correct = hf_positions[:, 0].numpy()[:, keep]
    np.testing.assert_array_equal(prompt.positions, correct)
    video_t = prompt.positions[0, placeholder[0]:placeholder[0] + placeholder[1]] - placeholder[0]
    assert sorted(set(video_t.tolist())) == [0, 1, 2, 3]

    vllm = vllm_qwen2_5_positions(q25_config, prompt, placeholder, grid, kept, 0.5)
    vllm_t = vllm[0, placeholder[0]:placeholder[0] + placeholder[1]] - placeholder[0]
    assert sorted(set(vllm_t.tolist())) == [0]
    assert differs(vllm, correct)
