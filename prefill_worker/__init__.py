"""The prefill worker: computes prompt KV and pushes it into decode workers' blocks."""
