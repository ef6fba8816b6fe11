"""A prefill worker process: takes remote-prefill requests from decode workers over
ZMQ, computes prompt KV with chunked prefill, pushes it through the KV transport,
and reports each request's end to the decode worker that asked."""

from __future__ import annotations

import logging

import zmq

from cluster.config import ClusterConfig
from cluster.control import ControlChannel
from cluster.worker_loop import WorkerLoop, engine_and_transport
from prefill_worker.remote_prefill import PrefillWorkerCore, RemotePrefill
from router.protocol import encode

logger = logging.getLogger(__name__)


class PrefillWorker(WorkerLoop):
    def __init__(self, name: str, core: PrefillWorkerCore, host: str = "127.0.0.1") -> None:
        super().__init__(name, host)
        self.core = core
        self.origin: dict[str, tuple[zmq.Socket, bytes]] = {}  # request id -> decode worker
        self.decode_workers: set[str] = set()  # KV destinations, by transport agent name

    def set_peers(self, msg: dict) -> list[str]:
        """The decode workers' transport metadata. A new blob under a known name is a
        restarted worker (the transport replaces it); a name left out is gone: writes
        to it fail now, and the jobs for it end at their next step. Every handshake is
        made here, not on the first write; returns the peers whose handshake failed
        (their writes will fail, and their requests be prefilled locally)."""
        transport, cold, names = self.core.transport, [], set()
        for metadata in msg["decode"]:
            name = None
            try:  # one bad or unreachable peer must not take this worker down
                name = transport.add_peer(metadata)
                names.add(name)
                transport.warm_up(name)
            except Exception as exc:
                logger.warning("%s: no KV handshake with decode worker %s: %s", self.name, name, exc)
                cold.append(name or "(unusable metadata)")
        for name in self.decode_workers - names:
            logger.warning("%s: decode worker %s is gone", self.name, name)
            try:
                transport.peer_gone(name)
            except Exception as exc:
                logger.warning("%s: dropping %s: %s", self.name, name, exc)
        for name in self.decode_workers | names:  # jobs for a dead or replaced session end now
            self.core.fail_jobs_for(name)
        self.decode_workers = names
        return cold

    def busy(self) -> bool:
        return bool(self.core.jobs)

    def handle(self, sender: bytes, msg: dict, sock: zmq.Socket) -> None:
        if msg["kind"] == "prefill":
            rp = RemotePrefill(msg["id"], msg["prompt"], msg["peer"], msg["blocks"], msg["first"],
                               msg["epoch"], msg["deadline"], msg["session"])
            try:
                self.core.submit(rp)
            except ValueError as exc:
                self.send(sock, sender, encode("prefill_done", id=rp.request_id, error=str(exc),
                                               compute_s=0.0, transfer_s=0.0, bytes=0))
                return
            self.origin[rp.request_id] = (sock, sender)
        elif msg["kind"] == "abort":
            self.core.abort(msg["id"])
        elif msg["kind"] == "stats":
            kv = self.core.engine.kv
            self.send(sock, sender, encode("stats_reply", seq=msg["seq"], stats={
                "name": self.name, "num_blocks": kv.pool.num_blocks, "free_blocks": kv.num_free_blocks,
                "jobs": len(self.core.jobs), **self.core.stats}, kv_events=[], kv_reset=False))

    def step(self) -> None:
        for r in self.core.step():
            origin = self.origin.pop(r.request_id, None)
            if origin is not None:
                self.send(*origin, encode("prefill_done", id=r.request_id, error=r.error or "",
                                          compute_s=r.compute_s, transfer_s=r.transfer_s,
                                          bytes=r.bytes_written))


def serve(config: ClusterConfig, index: int, control: ControlChannel, host: str = "127.0.0.1") -> None:
    """Worker entry point: start (sockets on `host`), report ready on `control`, get
    peers, run (cluster/control.py)."""
    name, engine, transport = engine_and_transport(config, "prefill", index, host)
    worker = PrefillWorker(name, PrefillWorkerCore(engine, transport), host)
    worker.serve(control, transport)
