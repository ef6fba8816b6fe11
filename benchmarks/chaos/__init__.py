"""Chaos and soak: run.py is the command line (`python -m benchmarks.chaos run`); its parts
are the deployment (deploy.py), the load (load.py), the fault schedule (faults.py), the
hostile input (attacks.py) and the targets (report.py). ray_recovery.py times a Ray
deployment's recovery from a killed worker."""
