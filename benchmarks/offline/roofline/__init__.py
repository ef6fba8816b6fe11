"""The roofline report (`python -m benchmarks.offline roofline`): analytic.py the floors, roofs.py the
devices' roofs, measure.py the engine's step times, report.py the table and JSON,
plots.py the pictures, cli.py the command line."""
