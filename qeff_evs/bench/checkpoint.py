"""The benchmarked checkpoint: a real transformers model of released widths, random weights, saved as a user's is.

The bench measures speed, not words, so weights only need to be finite and of the right shapes: seeded
uniform matrices with the std of transformers' default init, zero biases, unit norms. The model is
written with ``save_pretrained`` beside a tokenizer and ``preprocessor_config.json``, and the export
pipeline reads that folder back (``qeff_evs.export.pipeline.export_checkpoint``), the path a user's
checkpoint takes. Widths: the family's released ones (``realistic.realistic_config``) at the configured
depths, or, for the smoke preset, the tiny test checkpoints'. The tokenizer is the family's tiny one (the
prompts are built from ids; a family may tokenize timestamps with it).
"""

from __future__ import annotations

import gc
import json
import math
import zlib
from pathlib import Path

import torch

from qeff_evs.bench.config import BenchConfig
from qeff_evs.bench.realistic import realistic_config
from qeff_evs.models.registry import family_class

# Uniform weights with the std of transformers' default normal init (0.02): torch's uniform_ is
# several times faster than normal_, which matters for a 150k x 2048 embedding on 2 cores.
WEIGHT_STD = 0.02


def model_config(config: BenchConfig):
    """The transformers config of the benchmarked model: realistic or tiny widths, the requested depths."""
    from qeff_evs.models.tiny import build_tokenizer, tiny_config

    if config.options.get("sound_seconds") and "audio" not in family_class(config.family).modalities:
        raise ValueError(f"--sound-seconds: {config.family} has no audio encoder; benchmark a sound track on "
                         "--family nemotron_h_omni")
    if config.widths == "realistic":
        # A sound track to benchmark (the pruning sweep's sound_seconds) needs an audio encoder, as deep as the tower.
        audio_layers = config.vision_layers if config.options.get("sound_seconds") else 0
        return realistic_config(config.family, text_layers=config.text_layers, vision_layers=config.vision_layers,
                                audio_layers=audio_layers)
    return tiny_config(config.family, build_tokenizer(config.family), text_layers=config.text_layers,
                       vision_layers=config.vision_layers)


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
        # Other 1-D parameters are norm weights (or made by their modules, as Gated DeltaNet's A_log).
        # transformers' RMSNorms create theirs filled, but torch's LayerNorm fills its weight through
        # nn.init, which no_init_weights skips: left uninitialised it can hold anything (1e38 was seen,
        # NaN vision rows), so fill it here.
        for module in model.modules():
            if isinstance(module, torch.nn.LayerNorm) and module.weight is not None:
                module.weight.fill_(1.0)
    return model.to(torch.float32).eval()


def save_checkpoint(config: BenchConfig, folder: Path, hf_config=None) -> Path:
    """Write the benchmarked model's checkpoint folder: config, safetensors, tokenizer, preprocessor config.
    ``hf_config``: the transformers config to build (default ``model_config(config)``), e.g. a sibling's widths."""
    from qeff_evs.models.tiny import build_tokenizer, preprocessor_config

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model = random_model(hf_config or model_config(config), config.family, config.seed)
    model.save_pretrained(folder, safe_serialization=True)
    build_tokenizer(config.family).save_pretrained(folder)
    (folder / "preprocessor_config.json").write_text(
        json.dumps(preprocessor_config(config.family, model.config), indent=2) + "\n")
    del model
    gc.collect()  # the export loads the folder again: do not hold two copies of the weights
    return folder


SHARD_BYTES = 2 << 30  # a random checkpoint's shard size, as released checkpoints shard (a few GB each)


def _random_tensor(name: str, shape: tuple[int, ...], seed: int, dtype: torch.dtype) -> torch.Tensor:
    """One tensor of a random checkpoint: matrices uniform with ``WEIGHT_STD``, biases 0, other vectors (norm scales,
    gates) 1. Seeded by the checkpoint's seed and the tensor's name, so it does not depend on the order written."""
    if len(shape) < 2:
        return torch.full(shape, 0.0 if name.endswith("bias") else 1.0, dtype=dtype)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    bound = WEIGHT_STD * math.sqrt(3.0)
    return torch.empty(shape, dtype=torch.float32).uniform_(-bound, bound, generator=generator).to(dtype)


# Qwen's "-FP8" releases (fine-grained FP8, blocks of 128 x 128) convert the decoder's linear layers and keep in bf16
# what their config's modules_to_not_convert lists: the vision tower, embeddings, lm_head, MoE routers, the shared
# expert's gate, Gated DeltaNet's small projections.
FP8_BLOCK = (128, 128)
FP8_NOT_CONVERTED = ("lm_head", "model.visual", "embed_tokens", "mlp.gate", "shared_expert_gate", "in_proj_a",
                     "in_proj_b", "conv1d")
FP8_MAX = 448.0  # float8_e4m3fn's largest value


def fp8_converted(name: str, shape: tuple[int, ...]) -> bool:
    """Whether an FP8 release stores tensor ``name`` in FP8 (a decoder linear's weight)."""
    return (len(shape) == 2 and name.endswith(".weight") and ".layers." in name
            and not any(f"{kept}." in name for kept in FP8_NOT_CONVERTED))


def fp8_blocks(weight: torch.Tensor, block: tuple[int, int] = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``(float8_e4m3fn weight, bf16 weight_scale_inv)`` as an FP8 release stores a linear: one scale per block (the
    block's largest magnitude over e4m3's largest value), the weight divided by it."""
    rows, cols = weight.shape
    grid = (math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    padded = torch.zeros(grid[0] * block[0], grid[1] * block[1])
    padded[:rows, :cols] = weight.float().abs()
    largest = padded.reshape(grid[0], block[0], grid[1], block[1]).amax(dim=(1, 3))
    scale = (largest.clamp(min=1e-12) / FP8_MAX).to(torch.bfloat16)
    spread = scale.float().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:rows, :cols]
    return (weight.float() / spread).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def fp8_quantization_config(block: tuple[int, int] = FP8_BLOCK) -> dict:
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block),
            "modules_to_not_convert": list(FP8_NOT_CONVERTED)}


def write_random_checkpoint(hf_config, family: str, folder: Path, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                            shard_bytes: int = SHARD_BYTES, progress=lambda message: None, fp8: bool = False) -> Path:
    """A checkpoint folder as released (config, safetensors shards in ``dtype`` with their index, tokenizer,
    preprocessor config) of random weights (``_random_tensor``), written shard by shard: it never holds more than one
    shard, so writing it needs no more memory than exporting it. Tied tensors are stored once, under their first name,
    as ``save_pretrained`` stores them. ``fp8``: as Qwen's "-FP8" releases, the decoder's linears in FP8 blocks with
    their bf16 scales (``fp8_blocks``, the same random weights before quantization) and ``quantization_config`` in
    config.json."""
    from safetensors.torch import save_file

    from qeff_evs.models.hollow import parameter_names
    from qeff_evs.models.tiny import build_tokenizer, preprocessor_config

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with torch.device("meta"):
        model = family_class(family).model_class(hf_config)
    shapes = {name: tuple(model.get_parameter(name).shape) for name in parameter_names(model).values()}
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        count = math.prod(shape) * (1 if fp8 and fp8_converted(name, shape) else torch.finfo(dtype).bits // 8)
        if shards[-1] and size + count > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += count
    weight_map, total = {}, 0
    for index, names in enumerate(shards, start=1):
        file = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name in names:
            tensor = _random_tensor(name, shapes[name], seed, dtype)
            if fp8 and fp8_converted(name, shapes[name]):
                tensors[name], tensors[f"{name}_scale_inv"] = fp8_blocks(tensor)
            else:
                tensors[name] = tensor
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
        weight_map.update({name: file for name in tensors})
        del tensors
        progress(f"random checkpoint: shard {index}/{len(shards)} written ({file})")
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    hf_config.dtype = dtype
    hf_config.save_pretrained(folder)
    if fp8:
        config = json.loads((folder / "config.json").read_text())
        config["quantization_config"] = fp8_quantization_config()
        (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    build_tokenizer(family).save_pretrained(folder)
    (folder / "preprocessor_config.json").write_text(
        json.dumps(preprocessor_config(family, hf_config), indent=2) + "\n")
    return folder
