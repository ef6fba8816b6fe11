"""Imported by the local workers' fork server only, first of its preloads
(cluster/local/fork_server.py): the server ignores SIGTERM.

`timeout`, `kill -TERM -PGID` and systemd signal the launcher's whole process group.
Had the server died with it, multiprocessing would report every worker as exited
with 255 (the server reports exit codes), not -SIGTERM, and the supervisor would take
a shutdown for crashes (cluster/local/supervisor.py). Each worker puts SIGTERM back to
its default (fork_server.in_environment), so the signal still ends the workers. The
server exits once the launcher and every worker are gone (multiprocessing's own rule).
"""

import signal

signal.signal(signal.SIGTERM, signal.SIG_IGN)
