"""vLLM's EC connector interface: an encoder instance ships kept rows to prefill instances."""
