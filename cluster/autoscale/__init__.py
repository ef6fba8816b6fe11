"""Autoscaling: the `autoscale:` config section, the planner that decides how many
prefill and decode workers the load needs (and where the remote-prefill threshold
should sit), and the loop that runs it inside the deployment. The workers themselves
are added and removed by cluster/elastic.py; this package only decides."""
