"""A checkpoint's weights as stored: its safetensors files, read one tensor at a time, and the quantized formats we
dequantize ourselves (no quantization package).

Below ``models`` in the import order (docs/design.md#layout-and-import-order): this package knows files, dtypes and
quantization formats, never a model family. ``shards`` reads tensors by stored name; ``quantization`` reads the
folder's quantization record and picks its format (``fp8``, ``compressed_tensors``, ``awq``, ``gptq``, each its
config, unpacking and dequantization as pure functions); ``stored`` shows the folder as float tensors by name (a
quantized linear as its dequantized ``weight``); ``name_map`` maps those names onto a module's state-dict names
(renames, fused experts) as a family declares them.
"""
