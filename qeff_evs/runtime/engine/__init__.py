"""The engine: window arithmetic, prompt plans, prefill/decode call assembly, scheduler, encoder cache, engines."""
