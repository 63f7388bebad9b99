"""Adapters over vLLM's own multimodal types (vLLM itself is an optional import)."""
