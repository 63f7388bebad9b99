"""The vLLM platform and worker: vLLM's scheduler decisions run on the export's sessions."""
