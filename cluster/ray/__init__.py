"""The Ray launcher: workers placed and restarted by Ray (cluster/launcher.py). Every
module here but resources.py imports Ray; only cluster/launcher.py's `launcher_for`
reaches them. `import ray` in these modules is the absolute import of Ray itself."""
