"""Model families (Qwen2.5-VL, Qwen3-VL) and how their checkpoints are built and loaded.

`checkpoint` is the one loading path every Hugging Face checkpoint folder takes; `tiny` builds small
random checkpoints (real transformers classes, a real byte-level BPE tokenizer) that tests save to
disk and load back through that same path.
"""
