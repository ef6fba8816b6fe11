"""The one interface both launchers offer, and `launcher_for`, which picks one by name.

A launcher starts a config's workers (local processes, cluster/local/; or Ray actors,
cluster/ray/), supervises them for the router, and serves the whole deployment for
`pdserve serve`. Who calls what: cluster/serve.py's `build` calls `start`, builds the
router on the workers' addresses, and (for a launcher whose workers come back on their
own) `supervise`; `pdserve serve` calls `check` then `serve`, `pdserve down` calls
`down`. Ray is imported only when its launcher is picked.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from cluster.config import ClusterConfig
from security import DeploymentSecret

if TYPE_CHECKING:
    from cluster.elastic import PoolBackend
    from router.control import RouterControl

# config.launcher (one of cluster.config.LAUNCHERS) -> "module:class", imported when picked.
LAUNCHER_CLASSES = {"local": "cluster.local.launcher:LocalLauncher", "ray": "cluster.ray.launcher:RayLauncher"}


class RouterHooks:
    """What a supervisor tells the router about workers of either pool; both are called
    from the supervisor's threads (the router's own methods hop onto its event loop)."""

    def __init__(self, down: Callable[[str], None], moved: Callable[[str, str], None],
                 silent: Callable[[], set[str]] = set,
                 stays_down: Callable[[str, str], None] = lambda name, why: None) -> None:
        self.down = down  # (name): declared dead; a decode worker's requests fail over
        self.moved = moved  # (name, new ZMQ address): restarted there
        self.silent = silent  # (): the workers the router declared dead for their silence: maybe hung
        self.stays_down = stays_down  # (name, why): no restart will come (its 503s say why)

    @classmethod
    def of(cls, control: RouterControl) -> RouterHooks:
        """The hooks of a router's control (router/control.py RouterControl)."""
        return cls(control.worker_down, control.worker_moved, control.silent, control.worker_stays_down)


class NamedWorker(Protocol):
    @property
    def name(self) -> str: ...  # "decode-0", "prefill-1": the router's name for it

    @property
    def address(self) -> str: ...  # its ZMQ address, once ready


class Workers(Protocol):
    """A started set of workers, every one serving (its KV handshakes made)."""

    @property
    def decode(self) -> Sequence[NamedWorker]: ...

    @property
    def prefill(self) -> Sequence[NamedWorker]: ...

    @property
    def secret(self) -> DeploymentSecret | None:
        """The deployment's secret, made when they were started: the router needs it to
        reach them (security/)."""

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the supervision first (a worker stopped now is not a crash), then every
        worker, and free what they held (shared memory, Ray's placement groups)."""


class Launcher(Protocol):
    # Whether a crashed worker comes back without us (Ray restarts the actor): such
    # workers are supervised as soon as the router exists, or a restart would never be
    # wired back in. A local process stays down unless `serve` supervises it.
    restarts_workers: bool
    # Whether its deployment can outlive `pdserve serve` (--detach, then `pdserve down`).
    detachable: bool

    def check(self, config: ClusterConfig) -> None:
        """Before anything starts, where `pdserve serve` runs: raise ConfigError for what
        would otherwise fail only inside a started worker (Ray: the model directory)."""

    def start(self, config: ClusterConfig) -> Workers:
        """Start every worker, tell each its peers, and return once all serve; raises,
        after stopping whatever started, if any fails."""

    def pools(self, config: ClusterConfig, workers: Workers) -> PoolBackend:
        """What grows and shrinks these workers' pools at runtime (cluster/elastic.py)."""

    def supervise(self, config: ClusterConfig, workers: Workers, router: RouterHooks) -> None:
        """Watch the workers from a thread: report one that dies to its peers and the
        router, and wire it back in once it serves again. `workers.stop()` ends it."""

    def serve(self, config: ClusterConfig, detach: bool) -> None:
        """`pdserve serve`: workers and router, until Ctrl-C or SIGTERM; with detach
        (only if detachable), return once the deployment serves."""

    def down(self, config: ClusterConfig) -> str:
        """`pdserve down` (only if detachable): stop the running deployment; its URL.
        LookupError if none runs."""


def launcher_for(config: ClusterConfig) -> Launcher:
    """A new launcher of the config's kind (its module imported now, if not yet)."""
    module, _, name = LAUNCHER_CLASSES[config.launcher].partition(":")
    return getattr(importlib.import_module(module), name)()
