"""benchmarks/elastic/autoscale.py's parts: the three-phase trace (trace.py), one `pdserve serve`
deployment per arm (deployment.py), its workers counted while it serves (watch.py), the
arms and the scripted one's scale calls (arms.py), and the summary and table (report.py)."""
