"""The parts of benchmarks/offline/offline_throughput.py, one job each; that script is the
command line and its docstring says what is measured and how."""



