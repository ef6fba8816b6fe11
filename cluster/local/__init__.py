"""The local launcher: every worker a process on this machine (cluster/launcher.py)."""
