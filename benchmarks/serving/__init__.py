"""Serving benchmarks, run through `python -m benchmarks.serving NAME`: serve.py (a load
generator against the HTTP endpoint), serve_compare.py (P5/P6 from two of its reports),
plane_latency.py, router_memory.py and protocol_codec.py. serve.py's parts: load
generation (load.py), the router's /metrics scraped around a run (metrics_scrape.py),
summaries (report.py), an in-process cluster (server.py) and the
disaggregated-vs-colocated comparison (compare.py, compare_inputs.py)."""
