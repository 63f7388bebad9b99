"""Model families (Qwen2.5-VL, Qwen3-VL) and the forward pieces both the exporter and the torch backend run.

``protocol``/``family``/``registry`` and one module per family: layouts, placeholders, vision wrappers.
``language`` (the language-graph step), ``attention`` (segment attention of the vision towers),
``kv_cache`` (the slot KV cache) and ``graph_io`` (every graph's I/O names and shared constants) are the
pieces the ONNX graphs are traced from. ``checkpoint`` is the one loading path every Hugging Face
checkpoint folder takes; ``tiny`` builds small random checkpoints that tests save and load back through it.
"""
