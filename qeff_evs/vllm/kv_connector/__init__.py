"""vLLM's KV connector interface: prefill/decode disaggregation through qeff-evs's own connector."""
