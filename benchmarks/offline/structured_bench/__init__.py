"""The parts of benchmarks/offline/structured.py: the schema, timing helpers and one module per section."""
