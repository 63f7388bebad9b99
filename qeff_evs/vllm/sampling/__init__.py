"""Sampling on the host, with vLLM's semantics, from the logits the language graph returns."""
