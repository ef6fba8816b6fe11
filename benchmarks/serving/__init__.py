"""The served benchmark's parts: load generation (load.py), the router's /metrics
scraped around a run (metrics_scrape.py), summaries (report.py), an in-process cluster
(server.py) and the disaggregated-vs-colocated comparison (compare.py)."""
