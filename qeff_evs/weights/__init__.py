"""A checkpoint's weights as stored: its safetensors files, read one tensor at a time, and the quantized formats we
dequantize ourselves (no quantization package).

Below ``models`` in the import order (docs/design.md#layout-and-import-order): this package knows files, dtypes and
quantization formats, never a model family.

* ``shards``: the folder's safetensors files (index, headers), tensors read by stored name;
* ``quantization``: the folder's quantization record and the format that reads it (or a one-line refusal);
  ``linear_format`` is what each format fills in, and ``fp8``, ``compressed_tensors``, ``awq``, ``gptq`` (with
  ``int_packing``) are the formats: their config, unpacking and dequantization as pure functions;
* ``stored``: the folder as float tensors by name, a quantized linear as its dequantized ``weight``;
* ``name_map``: how a family's stored names become its module's (renames, experts fused), as data the family
  declares; ``module_weights``: the reader under the module's names (``models.checkpoint.open_weights`` builds it).
"""
