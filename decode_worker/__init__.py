"""The decode worker: reserves blocks, receives prompt KV (or prefills locally), decodes."""
