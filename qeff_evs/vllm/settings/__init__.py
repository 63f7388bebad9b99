"""Every vLLM engine argument and sampling parameter: honoured or refused, one line each."""
