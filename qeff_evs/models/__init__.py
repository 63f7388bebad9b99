"""Model families and the forward pieces both the exporter and the torch backend run.

``protocol`` is what a family implements (``ModelFamily``) and the types it speaks in; ``registry`` is
where each family module registers its class by ``model_type``; ``qwen_vl`` is the base the Qwen-VL
families share, and each family is one module of its own. ``language`` (the language-graph step),
``attention`` (segment attention of the vision towers), ``kv_cache`` (the slot KV cache) and
``graph_io`` (every graph's I/O names and shared constants) are the pieces the ONNX graphs are traced
from. ``checkpoint`` is the one loading path every Hugging Face checkpoint folder takes; ``tiny`` builds
small random checkpoints of any family that tests save and load back through it.
"""
