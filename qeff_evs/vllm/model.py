"""The model classes vLLM sees for an export: interfaces only, registered under our own names.

vLLM resolves ``config.json``'s ``architectures`` to a model class and inspects it (multimodal,
M-RoPE, EVS support) in every process; our worker runs the ONNX / QAIC / torch sessions and never
instantiates these. They are registered under qeff-evs's own architecture names (the export's
``config.json`` names them), not over Hugging Face's: registering is process-global, and taking
``Qwen2_5_VLForConditionalGeneration`` would change what any other vLLM engine in the same process
builds for a real checkpoint. Each class carries the multimodal processor that sizes EVS placeholders.
"""

from __future__ import annotations

from torch import nn
from vllm import ModelRegistry
from vllm.multimodal import MULTIMODAL_REGISTRY

from qeff_evs.manifest import SERVING_ARCHITECTURES
from qeff_evs.vllm.processing import QeffEvsDummyInputs, QeffEvsProcessingInfo, QeffEvsProcessor

_with_our_processor = MULTIMODAL_REGISTRY.register_processor(
    QeffEvsProcessor, info=QeffEvsProcessingInfo, dummy_inputs=QeffEvsDummyInputs)


class _ExportInterface(nn.Module):
    """What vLLM's config inspection reads; the worker never builds or runs it."""

    supports_multimodal = True
    supports_multimodal_pruning = True
    supports_mrope = True

    def __init__(self, *, vllm_config=None, prefix: str = ""):
        super().__init__()

    @classmethod
    def get_placeholder_str(cls, modality: str, i: int) -> str | None:
        if modality.startswith("image"):
            return "<|vision_start|><|image_pad|><|vision_end|>"
        if modality.startswith("video"):
            return "<|vision_start|><|video_pad|><|vision_end|>"
        raise ValueError(f"qeff-evs exports take images and videos, not {modality!r}")

    # The graphs run in qeff-evs's worker; nothing may call the torch side of this interface.
    def embed_input_ids(self, input_ids, *args, **kwargs):
        _never_run()

    def forward(self, input_ids, positions, *args, **kwargs):
        _never_run()

    def compute_logits(self, hidden_states):
        _never_run()


def _never_run():
    raise RuntimeError("qeff-evs exports run in the qeff-evs worker (QEFF_EVS_BACKEND), not as a torch module")


@_with_our_processor
class QeffEvsQwen2_5_VL(_ExportInterface):
    """A qeff-evs Qwen2.5-VL export."""


@_with_our_processor
class QeffEvsQwen3_VL(_ExportInterface):
    """A qeff-evs Qwen3-VL export."""


MODEL_CLASSES = {"qwen2_5_vl": QeffEvsQwen2_5_VL, "qwen3_vl": QeffEvsQwen3_VL}


def register_models() -> None:
    """Register each family's class under its export architecture name (vLLM loads plugins once per process)."""
    for family, cls in MODEL_CLASSES.items():
        ModelRegistry.register_model(SERVING_ARCHITECTURES[family], cls)
