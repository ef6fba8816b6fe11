"""The router's workers of both pools, by name: their clients (router/worker_client.py),
the tasks reading from them while the app runs, their supervision (ping, check), and
the decode pool's routing policy (router/routing.py), whose prefix indexes are keyed by
the same names.

Who calls what: the Router builds the pool, starts and stops it with the app, and
asks it for the decode workers that may take each prompt (`ranked`, then `picked`);
the router's control (router/control.py) adds, drains, moves and removes workers.
Everything here runs on the router's event loop (or before it runs), so there is no
locking.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import zmq.asyncio

from protocol import WorkerStats
from router.adapters import Adapter
from router.errors import APIError
from router.metrics import RouterMetrics
from router.routing import Ranking, RoutingPolicy
from router.worker_client import WorkerClient
from security import DeploymentSecret

ROLES = ("decode", "prefill")


class WorkerPool:
    def __init__(self, ctx: zmq.asyncio.Context, routing: RoutingPolicy, metrics: RouterMetrics, timeout_s: float,
                 block_size: int, secret: DeploymentSecret | None = None) -> None:
        """timeout_s: router.worker_timeout_s; block_size: the decode workers' KV block
        size; secret: the deployment's, for every worker's socket (router/worker_client.py)."""
        self.ctx, self.routing, self.metrics, self.timeout_s = ctx, routing, metrics, timeout_s
        self.block_size, self.secret = block_size, secret
        # name -> client, in the order they joined (the routing policy's order too)
        self.decode: dict[str, WorkerClient] = {}
        self.prefill: dict[str, WorkerClient] = {}
        self._readers: dict[str, asyncio.Task] = {}  # name -> its read_forever task, while the app runs
        self._running = False
        # Every stats reply of every worker, as it comes, and every worker that left (role,
        # name): the router's latency predictor.
        self.on_stats: Callable[[str, str, WorkerStats], None] = lambda role, name, stats: None
        self.on_removed: Callable[[str, str], None] = lambda role, name: None

    # --- who is there -------------------------------------------------------------------

    def listed(self) -> list[tuple[WorkerClient, str]]:
        """Every worker with its role ("decode" | "prefill"), the decode pool first."""
        return [(w, "decode") for w in self.decode.values()] + [(w, "prefill") for w in self.prefill.values()]

    def find(self, name: str) -> WorkerClient | None:
        return self.decode.get(name) or self.prefill.get(name)

    def get(self, name: str) -> WorkerClient:
        client = self.find(name)
        if client is None:
            raise LookupError(f"the router has no worker named {name}")
        return client

    def silent(self) -> set[str]:
        """The workers declared dead for their silence alone (router/health.py)."""
        return {w.name for w, _ in self.listed() if w.health.silent}

    def kv_pool_tokens(self) -> list[int]:
        """Tokens each decode worker's KV pool holds, of those whose stats reply said."""
        return [w.num_kv_blocks * self.block_size for w in self.decode.values() if w.num_kv_blocks]

    # --- routing ------------------------------------------------------------------------

    def serving(self) -> bool:
        """Whether some decode worker is live and takes new requests (not draining)."""
        return any(w.alive and not w.draining for w in self.decode.values())

    def prefill_serving(self) -> bool:
        """Whether some prefill worker is live and takes new prompts."""
        return any(w.alive and not w.draining for w in self.prefill.values())

    def ranked(self, tokens: list[int], lora: Adapter | None = None) -> Ranking:
        """Every decode worker that may take the prompt (live, not draining), the routing
        policy's choice first, with its tokens that worker probably has cached; 503 if
        none. `lora`: the adapter it runs with (its blocks chain from the adapter's root,
        and workers holding it are preferred). Nothing is recorded until picked()."""
        loads = {w.name: w.load for w in self.decode.values() if w.alive and not w.draining}
        if not loads:
            raise self.no_live_worker()
        if lora is None:
            return self.routing.rank(tokens, loads)
        holders = {w.name for w in self.decode.values() if lora.name in w.loras}
        return self.routing.rank(tokens, loads, lora.root, holders)

    def picked(self, name: str, ranking: Ranking, lora: Adapter | None = None) -> WorkerClient:
        """The prompt goes to `name` (one of ranking's): the routing policy records it
        (and that the worker holds `lora` from now on: it reads it for this request); its client."""
        self.routing.picked(name, ranking)
        client = self.decode[name]
        if lora is not None:
            client.loras.add(lora.name)
        return client

    def live_prefill(self) -> list[str]:
        """The prefill workers that take new prompts."""
        return [w.name for w in self.prefill.values() if w.alive and not w.draining]

    def no_live_worker(self) -> APIError:
        why = "; ".join(f"{w.name} {'is being drained (scaled down)' if w.alive else w.down_reason}"
                        for w in self.decode.values())
        return APIError(503, f"no decode worker is alive ({why}); retry later", kind="service_unavailable")

    # --- joining and leaving ------------------------------------------------------------

    def add(self, role: str, name: str, address: str) -> WorkerClient:
        """A client for a worker that serves now (its peers know it)."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
        if self.find(name) is not None:
            raise ValueError(f"the router already has a worker named {name}")
        client = WorkerClient(self.ctx, name, address, self.timeout_s, self.secret)
        client.on_stats = lambda stats: self.on_stats(role, name, stats)
        if role == "decode":
            self.decode[name] = client
            self.routing.add(name)
            client.on_kv_events = lambda events, reset: self.routing.kv_events(name, events, reset)
        else:
            self.prefill[name] = client
        if self._running:
            self._readers[name] = asyncio.create_task(client.read_forever())
        self.publish_sizes()
        return client

    def remove(self, name: str) -> str:
        """The worker left its pool: forget it (any request still on it fails over); its role."""
        client = self.get(name)
        role = "decode" if name in self.decode else "prefill"
        if role == "decode":
            del self.decode[name]
            self.routing.remove(name)
        else:
            del self.prefill[name]
        reader = self._readers.pop(name, None)
        if reader is not None:
            reader.cancel()
        client.close()
        self.metrics.forget_worker(name, role)
        self.on_removed(role, name)
        self.publish_sizes()
        return role

    def moved(self, name: str, address: str) -> None:
        """Restarted at `address`, with an empty cache (nothing if scaled away meanwhile)."""
        client = self.find(name)
        if client is None:
            return
        client.move(address)
        if name in self.decode:
            self.routing.forget(name)

    def drain(self, name: str) -> None:
        """No new request goes to the worker (a decode worker's running ones go on)."""
        self.get(name).draining = True
        self.publish_sizes()

    # --- the app's lifetime -------------------------------------------------------------

    def start(self) -> None:
        """On the event loop, as the app starts: read from every worker until stop()."""
        self._running = True
        self._readers = {w.name: asyncio.create_task(w.read_forever()) for w, _ in self.listed()}

    def stop(self) -> None:
        self._running = False
        for task in self._readers.values():
            task.cancel()
        self._readers = {}

    async def monitor(self, interval_s: float) -> None:
        """Supervise every worker for the app's lifetime: ping each every interval_s,
        declare the silent ones dead (router/health.py)."""
        while True:
            for w, _ in self.listed():
                w.ping()
            await asyncio.sleep(interval_s)
            for w, _ in self.listed():
                w.check()
            self.publish_live()

    async def stats_of(self, clients: list[WorkerClient]) -> list[WorkerStats | None]:
        """Each worker's stats reply, asked now and side by side; None for one the
        router holds dead (it would only time out) or that did not answer in time."""
        return await asyncio.gather(*(w.stats() if w.alive else _nothing() for w in clients))

    # --- metrics ------------------------------------------------------------------------

    def publish_live(self) -> None:
        """Each worker's health, as the router sees it now, into the metrics."""
        self.metrics.set_live({n: w.alive for n, w in self.decode.items()},
                              {n: w.alive for n, w in self.prefill.items()})

    def publish_sizes(self) -> None:
        for role, pool in (("decode", self.decode), ("prefill", self.prefill)):
            self.metrics.pool_workers.labels(role=role).set(sum(1 for w in pool.values() if not w.draining))


async def _nothing() -> None:
    return None
