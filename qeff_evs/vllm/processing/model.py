"""The model classes vLLM sees for an export: interfaces only, registered under our own names.

vLLM resolves ``config.json``'s ``architectures`` to a model class and inspects it (multimodal,
M-RoPE, EVS support) in every process; our worker runs the ONNX / QAIC / torch sessions and never
instantiates these. They are registered under qeff-evs's own architecture names (the export's
``config.json`` names them), not over Hugging Face's: registering is process-global, and taking
Hugging Face's architecture would change what any other vLLM engine in the same process builds for a
real checkpoint. Each class carries the multimodal processor that sizes EVS placeholders. There is one
class per registered model family (``interface_class``), named after its ``serving_architecture``.
"""

from __future__ import annotations

import functools

from torch import nn

from qeff_evs.models.protocol import ModelFamily
from qeff_evs.models.registry import family_classes
from qeff_evs.vllm.processing.processor import QeffEvsDummyInputs, QeffEvsProcessingInfo, QeffEvsProcessor
from qeff_evs.vllm.surface import MULTIMODAL_REGISTRY
from qeff_evs.vllm.surface import ModelRegistry

_with_our_processor = MULTIMODAL_REGISTRY.register_processor(
    QeffEvsProcessor, info=QeffEvsProcessingInfo, dummy_inputs=QeffEvsDummyInputs)


class _ExportInterface(nn.Module):
    """What vLLM's config inspection reads; the worker never builds or runs it."""

    supports_multimodal = True
    supports_multimodal_pruning = True
    supports_mrope = True
    family: type[ModelFamily]  # set on each family's class

    def __init__(self, *, vllm_config=None, prefix: str = ""):
        super().__init__()

    @classmethod
    def get_placeholder_str(cls, modality: str, i: int) -> str | None:
        return cls.family.token_strings.block(modality)

    # The graphs run in qeff-evs's worker; nothing may call the torch side of this interface.
    def embed_input_ids(self, input_ids, *args, **kwargs):
        _never_run()

    def forward(self, input_ids, positions, *args, **kwargs):
        _never_run()

    def compute_logits(self, hidden_states):
        _never_run()


def _never_run():
    raise RuntimeError("qeff-evs exports run in the qeff-evs worker (QEFF_EVS_BACKEND), not as a torch module")


@functools.cache
def interface_class(family: type[ModelFamily]) -> type[_ExportInterface]:
    """The interface class of a qeff-evs export of ``family`` (one per family and process)."""
    name = family.serving_architecture
    cls = type(name, (_ExportInterface,), {"__doc__": f"A qeff-evs {family.model_type} export.", "family": family,
                                           "__module__": __name__, "__qualname__": name})
    return _with_our_processor(cls)


def register_models() -> None:
    """Register each family's class under its export architecture name (vLLM loads plugins once per process)."""
    for family in family_classes():
        ModelRegistry.register_model(family.serving_architecture, interface_class(family))
