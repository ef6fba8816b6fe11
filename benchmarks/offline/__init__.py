"""Offline engine benchmarks (engine.LLM, EngineCore; no router): one script per table,
run through `python -m benchmarks.offline NAME`. throughput/, roofline/ and structured_bench/
are the parts of offline_throughput.py, the roofline report and structured.py."""
