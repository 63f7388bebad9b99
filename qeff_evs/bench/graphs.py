"""The benchmarked graphs: a random-weight model of the configured widths, exported to ONNX and opened in ORT.

The model is built in memory (no checkpoint folder): the benchmark measures speed, not words, so
weights only need to be finite and of the right shapes. Three graphs come out of it: the
vision(+EVS) graph, the same vision graph with the EVS selection replaced by "the first K rows"
(the overhead baseline, ``baseline.FirstRowsVision``) and the language graph, whose ``vision_size`` symbol lets one file serve
both the ``user_vision_size`` way and the QEfficient way.
"""

from __future__ import annotations

import dataclasses
import gc
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from qeff_evs import evs
from qeff_evs.bench.baseline import FirstRowsVision
from qeff_evs.bench.config import BenchConfig
from qeff_evs.bench.realistic import realistic_config
from qeff_evs.bench.sessions import open_inference_session
from qeff_evs.export.language import export_language_graph
from qeff_evs.export.vision import export_vision_graph
from qeff_evs.models.language import language_spec
from qeff_evs.models.protocol import ModelFamily
from qeff_evs.models.registry import family_for_config, family_module
from qeff_evs.runtime.inputs.processor import VisionPreprocessSpec
from qeff_evs.manifest import LanguageShape

Progress = Callable[[str], None]

# Uniform weights with the std of transformers' default normal init (0.02): torch's uniform_ is
# several times faster than normal_, which matters for a 150k x 2048 embedding on 2 cores.
WEIGHT_STD = 0.02
# Example grid for tracing the vision graph: T > 1 and K < T*h*w so every EVS op is traced.
EXAMPLE_GRID = (2, 8, 8)


def model_config(config: BenchConfig):
    """The transformers config of the benchmarked model: realistic or tiny widths, the requested depths."""
    from qeff_evs.models.tiny import build_tokenizer, tiny_config

    if config.widths == "realistic":
        return realistic_config(config.family, text_layers=config.text_layers, vision_layers=config.vision_layers)
    vision = {"depth": config.vision_layers}
    if config.family == "qwen2_5_vl":
        vision["fullatt_block_indexes"] = [config.vision_layers - 1]
    return tiny_config(config.family, build_tokenizer(), text_config={"num_hidden_layers": config.text_layers},
                       vision_config=vision)


def random_model(hf_config, family: str, seed: int) -> torch.nn.Module:
    """Real transformers model class with seeded uniform random weights (matrices), zero biases, unit norms."""
    from transformers.initialization import no_init_weights

    # transformers' own switch for skipping its (slow, normal_) init; we fill the weights below.
    with no_init_weights():
        model = family_module(family).MODEL_CLASS(hf_config)
    model.tie_weights()  # tying lives in the skipped init
    generator = torch.Generator().manual_seed(seed)
    bound = WEIGHT_STD * math.sqrt(3.0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() >= 2:
                parameter.uniform_(-bound, bound, generator=generator)
            elif name.endswith("bias"):
                parameter.zero_()
            # 1-D non-bias parameters are norm weights, created as ones by their modules.
    return model.to(torch.float32).eval()


@dataclass
class BenchGraphs:
    """Exported graphs, open in ORT, with what the host needs to feed them."""

    family: ModelFamily
    hf_config: object
    preprocess: VisionPreprocessSpec
    language_shape: LanguageShape  # vision_size is per way; see with_vision_size
    vision: object  # ort.InferenceSession of the vision(+EVS) graph
    vision_without_evs: object  # the same graph with the first K rows instead of the EVS selection
    language: object
    files: dict[str, str]

    @property
    def merge_size(self) -> int:
        return int(self.hf_config.vision_config.spatial_merge_size)

    def with_vision_size(self, vision_size: int) -> LanguageShape:
        return dataclasses.replace(self.language_shape, vision_size=vision_size)


def build_graphs(config: BenchConfig, workdir: Path, progress: Progress) -> BenchGraphs:
    """Build the random model, export its three graphs under ``workdir`` and open them in ORT."""
    workdir = Path(workdir)
    hf_config = model_config(config)
    vc = hf_config.vision_config
    progress(f"building a random {config.family} model ({config.widths} widths, {config.text_layers} text / "
             f"{config.vision_layers} vision layers)")
    model = random_model(hf_config, config.family, config.seed)
    # Qwen3-VL's family tokenizes its timestamp text; the tiny tokenizer serves for timing.
    family = family_for_config(hf_config, _timestamp_tokenizer(config.family))
    spec = language_spec(model)
    example_k = evs.retained_token_count(*_example_tokens(vc.spatial_merge_size), 0.5)
    files = {
        "vision": workdir / "vision" / "vision.onnx",
        "vision_without_evs": workdir / "vision_without_evs" / "vision.onnx",
        "language": workdir / "language" / "language.onnx",
    }
    wrapper = family.vision_wrapper(model)
    progress("exporting the vision(+EVS) graph and its EVS-free twin")
    export_vision_graph(wrapper, EXAMPLE_GRID, example_k, files["vision"], progress=lambda m: None)
    twin = FirstRowsVision(wrapper)
    export_vision_graph(twin, EXAMPLE_GRID, example_k, files["vision_without_evs"], progress=lambda m: None)
    progress("exporting the language graph")
    export_language_graph(model, files["language"], media_token_ids=family.special_tokens().media_pads)
    del wrapper, twin, model
    gc.collect()

    progress("opening the graphs in ONNX Runtime")
    shape = LanguageShape(spec.num_layers, spec.kv_heads, spec.head_dim, spec.hidden_size, config.ctx_len,
                          config.vision_rows_per_chunk, spec.deepstack_levels)
    preprocess = VisionPreprocessSpec.for_family(
        config.family, patch_size=vc.patch_size, temporal_patch_size=vc.temporal_patch_size,
        merge_size=vc.spatial_merge_size)
    return BenchGraphs(
        family=family,
        hf_config=hf_config,
        preprocess=preprocess,
        language_shape=shape,
        vision=open_inference_session(files["vision"]),
        vision_without_evs=open_inference_session(files["vision_without_evs"]),
        language=open_inference_session(files["language"]),
        files={name: str(path) for name, path in files.items()},
    )


def _example_tokens(merge_size: int) -> tuple[int, int]:
    t, h, w = evs.merged_grid(EXAMPLE_GRID, merge_size)
    return h * w, t


def _timestamp_tokenizer(family: str):
    if family != "qwen3_vl":
        return None
    from qeff_evs.models.tiny import build_tokenizer

    return build_tokenizer()
