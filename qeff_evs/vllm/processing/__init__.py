"""vLLM's multimodal processing interface: prompts, placeholders and media as the export needs them."""
