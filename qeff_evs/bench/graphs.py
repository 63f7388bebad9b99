"""The benchmarked graphs: a random-weight model of the configured widths, exported to ONNX and opened in ORT.

The model is built in memory (no checkpoint folder): the benchmark measures speed, not words, so
weights only need to be finite and of the right shapes. Three graphs come out of it: the encoder
(F temporal patches per call), the EVS graph and the language graph, whose ``vision_size`` symbol
lets one file serve both the ``user_vision_size`` way and the QEfficient way.
"""

from __future__ import annotations

import dataclasses
import gc
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from qeff_evs.bench.config import BenchConfig
from qeff_evs.bench.phase import Progress
from qeff_evs.bench.realistic import model_config
from qeff_evs.bench.sessions import open_inference_session
from qeff_evs.export.language import export_language_graph
from qeff_evs.export.vision import export_encoder_graph, export_evs_graph
from qeff_evs.models.language import language_spec
from qeff_evs.models.protocol import ModelFamily
from qeff_evs.models.registry import family_class, family_for_config
from qeff_evs.runtime.inputs.processor import VisionPreprocessSpec
from qeff_evs.manifest import LanguageShape
from qeff_evs.runtime.backends.ort import OrtEncoderSession, OrtEVSSession
from qeff_evs.runtime.backends.vision import VisionPipeline

# Uniform weights with the std of transformers' default normal init (0.02): torch's uniform_ is
# several times faster than normal_, which matters for a 150k x 2048 embedding on 2 cores.
WEIGHT_STD = 0.02
# Example frame grid (patches) for tracing the encoder and, merged over 2 temporal patches, the EVS graph.
EXAMPLE_GRID_HW = (8, 8)


def random_model(hf_config, family: str, seed: int) -> torch.nn.Module:
    """Real transformers model class with seeded uniform random weights (matrices), zero biases, unit norms."""
    from transformers.initialization import no_init_weights

    # transformers' own switch for skipping its (slow, normal_) init; we fill the weights below.
    with no_init_weights():
        model = family_class(family).model_class(hf_config)
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
    encoder: object  # ort.InferenceSession of the encoder graph
    evs: object  # ... of the EVS graph
    language: object | None  # None when the run measures no language phase
    files: dict[str, str]
    frames_per_call: int

    @property
    def merge_size(self) -> int:
        return self.family.normalized_config.merge_size

    def with_vision_size(self, vision_size: int) -> LanguageShape:
        return dataclasses.replace(self.language_shape, vision_size=vision_size)

    def vision_pipeline(self) -> VisionPipeline:
        """The runtime's vision side over the opened sessions: encoder calls of F patches, then EVS."""
        return VisionPipeline(self.family, OrtEncoderSession(self.encoder), OrtEVSSession(self.evs),
                              self.frames_per_call)


def build_graphs(config: BenchConfig, workdir: Path, progress: Progress, language: bool = True) -> BenchGraphs:
    """Build the random model, export its graphs under ``workdir`` and open them in ORT (the language
    graph only with ``language``: the vision phases do not run it)."""
    from qeff_evs.models.tiny import build_tokenizer

    workdir = Path(workdir)
    hf_config = model_config(config)
    progress(f"building a random {config.family} model ({config.widths} widths, {config.text_layers} text / "
             f"{config.vision_layers} vision layers)")
    model = random_model(hf_config, config.family, config.seed)
    # A family may tokenize prompt text of its own (timestamps); the tiny tokenizer serves for timing.
    family = family_for_config(hf_config, build_tokenizer(config.family))
    vc = family.normalized_config
    spec = language_spec(model)
    files = {
        "encoder": workdir / "vision" / "encoder.onnx",
        "evs": workdir / "vision" / "evs.onnx",
    }
    progress("exporting the encoder and EVS graphs")
    export_encoder_graph(family.encoder(model), EXAMPLE_GRID_HW, 2, files["encoder"], progress=lambda m: None)
    _, h, w = family.merged_grid((2, *EXAMPLE_GRID_HW))
    export_evs_graph(family.evs_selection(), (2, h, w), h * w, vc.vision_hidden, family.extras,
                     files["evs"], progress=lambda m: None)
    if language:
        progress("exporting the language graph")
        files["language"] = workdir / "language" / "language.onnx"
        export_language_graph(model, files["language"], media_token_ids=family.special_tokens().media_pads)
    del model
    gc.collect()

    progress("opening the graphs in ONNX Runtime")
    shape = LanguageShape(spec.num_layers, spec.kv_heads, spec.head_dim, spec.hidden_size, config.ctx_len,
                          config.vision_rows_per_chunk, dict(spec.extras))
    preprocess = VisionPreprocessSpec.for_family(
        config.family, patch_size=vc.patch_size, temporal_patch_size=vc.temporal_patch_size,
        merge_size=vc.merge_size)
    return BenchGraphs(
        family=family,
        hf_config=hf_config,
        preprocess=preprocess,
        language_shape=shape,
        encoder=open_inference_session(files["encoder"]),
        evs=open_inference_session(files["evs"]),
        language=open_inference_session(files["language"]) if language else None,
        files={name: str(path) for name, path in files.items()},
        frames_per_call=config.frames_per_call,
    )
