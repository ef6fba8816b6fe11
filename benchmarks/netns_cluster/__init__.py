"""A multi-host test bed on one machine: network namespaces joined by a bridge
(bed.py), and a Ray cluster across them (ray_hosts.py). CLI: `python -m
benchmarks.netns_cluster up --hosts 3` and `down`."""
