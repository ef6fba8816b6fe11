"""The local launcher (cluster/launcher.py's interface): worker processes on this
machine, supervised by a thread of `pdserve serve`, with the router in that process.
Nothing outlives the command, so it cannot detach."""

from __future__ import annotations

from cluster.config import ClusterConfig
from cluster.launcher import RouterHooks
from cluster.local.elastic import LocalPools
from cluster.local.supervisor import LocalSupervisor
from cluster.local.workers import LocalWorkers, start_workers


class LocalLauncher:
    restarts_workers = False  # an exited process stays down unless supervised
    detachable = False

    def check(self, config: ClusterConfig) -> None:
        """Nothing: the workers start here, beside this command, and one that cannot load
        the model fails the start."""

    def start(self, config: ClusterConfig) -> LocalWorkers:
        return start_workers(config)

    def pools(self, config: ClusterConfig, workers: LocalWorkers) -> LocalPools:
        return LocalPools(config, workers)

    def supervise(self, config: ClusterConfig, workers: LocalWorkers, router: RouterHooks) -> None:
        """Exited workers are reported, routed around, and started again (as Ray does)."""
        workers.supervisor = LocalSupervisor(config, workers, router.down, router.moved,
                                             max_restarts=config.local.max_restarts, silent=router.silent,
                                             stays_down=router.stays_down)
        workers.supervisor.start()

    def serve(self, config: ClusterConfig, detach: bool) -> None:
        """Serve until Ctrl-C (or SIGTERM), then stop the router and every worker."""
        # cluster/serve.py sits above the launchers (its build() picks this class), so
        # its HTTP server and build() are imported when serving, not with this module.
        from cluster.autoscale.run import start_planner
        from cluster.serve import HTTPServer, build, check_port_free, wait_for_signal

        if detach:
            raise ValueError("--detach needs launcher: ray (local workers end with this command)")
        check_port_free(config.router.host, config.router.port)
        workers, router = build(config)
        assert isinstance(workers, LocalWorkers)  # build() started them with launcher_for(config): this class
        http = planner = None
        try:
            http = HTTPServer(router, config.router.host, config.router.port)
            self.supervise(config, workers, RouterHooks.of(router.control))
            planner = start_planner(config, router)
            print(f"pdserve: serving {config.model} at {http.url}/v1 ({len(workers.prefill)} prefill + "
                  f"{len(workers.decode)} decode workers, {config.transport} transport, local launcher); "
                  "Ctrl-C stops", flush=True)
            wait_for_signal(http.alive)
        finally:
            if planner is not None:  # first: no scale request while the deployment stops
                planner.stop()
            # Before the HTTP server drains its requests (which may take a while): a
            # SIGTERM to the process group is killing the workers now, not crashing them.
            workers.stop_supervising()
            if http is not None:
                http.stop()
            workers.stop()
            print("pdserve: stopped", flush=True)

    def down(self, config: ClusterConfig) -> str:
        raise ValueError("a local deployment never runs detached: it stops with its `pdserve serve`")
