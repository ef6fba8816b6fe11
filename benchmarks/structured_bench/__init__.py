"""The parts of benchmarks/structured.py: the schema, timing helpers and one module per section."""
