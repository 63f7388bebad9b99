"""Host-side runtime: video input and preprocessing, prompt layout, sessions and the chunked-prefill engine."""
