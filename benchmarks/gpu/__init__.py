"""The sections of the GPU check, one module each; benchmarks/gpu_check.py is its
command line and says what every row checks."""
