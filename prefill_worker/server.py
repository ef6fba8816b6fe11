"""A prefill worker process: takes remote-prefill requests from decode workers over
ZMQ, computes prompt KV with chunked prefill, pushes it through the KV transport,
and reports each request's end to the decode worker that asked.

Failures (workers/loop.py): a step that fails (RequestsFailed) ends the jobs it
names with `prefill_done` carrying the error (their decode workers prefill those
prompts themselves), and the worker goes on. Anything worse ends every job that way,
and the process, for a restart.
"""

from __future__ import annotations

import logging

import zmq

from engine.errors import RequestsFailed
from prefill_worker.remote_prefill import PrefillWorkerCore
from protocol import Abort, Message, Peers, PrefillDone, RemotePrefill, Stats, StatsReply, WorkerStats, encode
from security import DeploymentSecret
from workers.config import WorkerConfig
from workers.control import ControlChannel
from workers.loop import WorkerLoop, run_worker
from workers.start import engine_and_transport

logger = logging.getLogger(__name__)


class PrefillWorker(WorkerLoop):
    def __init__(self, name: str, core: PrefillWorkerCore, host: str = "127.0.0.1",
                 stall_timeout_s: float | None = None, stall_grace_s: float = 2.0,
                 secret: DeploymentSecret | None = None) -> None:
        super().__init__(name, host, stall_timeout_s, stall_grace_s, secret)
        self.core = core
        self.origin: dict[str, tuple[zmq.Socket, bytes]] = {}  # request id -> decode worker
        self.decode_workers: set[str] = set()  # KV destinations, by transport agent name

    def set_peers(self, msg: Peers) -> list[str]:
        """The decode workers' transport metadata. A new blob under a known name is a
        restarted worker (the transport replaces it); a name left out is gone: writes
        to it fail now, and the jobs for it end at their next step. Every handshake is
        made here, not on the first write; returns the peers whose handshake failed
        (their writes will fail, and their requests be prefilled locally)."""
        transport, cold, names = self.core.transport, [], set()
        for metadata in msg.decode:
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

    def runnable(self) -> bool:
        # Not jobs computed and only waiting for their writes to be acknowledged: they
        # wait on the decode worker.
        return self.core.engine.has_runnable()

    def pending(self) -> bool:
        """Prompts running or queued in the engine (the stall watchdog's question);
        not jobs only waiting for their writes to be acknowledged (the transport's
        timeout bounds those)."""
        return self.core.engine.has_runnable()

    def handle(self, sender: bytes, msg: Message, sock: zmq.Socket) -> None:
        if isinstance(msg, RemotePrefill):
            try:
                self.core.submit(msg)
            except ValueError as exc:
                self.send(sock, sender, encode(PrefillDone(request_id=msg.request_id, error=str(exc),
                                                           refused_epoch=msg.epoch)))
                return
            self.origin[msg.request_id] = (sock, sender)
        elif isinstance(msg, Abort):
            self.core.abort(msg.request_id)
        elif isinstance(msg, Stats):
            self.send(sock, sender, encode(StatsReply(seq=msg.seq, stats=self.stats())))

    def stats(self) -> WorkerStats:
        core = self.core
        return self.worker_stats(core.engine.stats(), core.steps, core.transport, jobs=len(core.jobs),
                                 prefills=core.stats["prefills"], blocks_written=core.stats["blocks_written"],
                                 failed=core.stats["failed"], refused=core.stats["refused"],
                                 tokens_computed=core.stats["tokens_computed"])

    def check_engine(self) -> None:
        self.core.engine.check_health()

    def step(self) -> None:
        stats = self.core.stats
        written, computed = stats["blocks_written"], stats["tokens_computed"]
        try:
            results = self.core.step()
        except RequestsFailed as exc:
            # The step is void: its prompts end with the error (their decode workers
            # prefill them locally); the others compute it again next time.
            logger.warning("%s: %s", self.name, exc)
            for request_id in exc.request_ids:
                self.core.fail(request_id, f"the prefill step failed: {exc}")
            self.step_failed(exc)  # several in a row: the device is broken (fatal)
            return
        if stats["tokens_computed"] != computed:
            self.step_succeeded()
        if stats["tokens_computed"] != computed or stats["blocks_written"] != written or results:
            self.progressed()
        for r in results:
            origin = self.origin.pop(r.request_id, None)
            if origin is not None:
                self.send(*origin, encode(r))

    def fail_all(self, error: str, fail_over: bool) -> None:
        """The worker gives up: every decode worker waiting on one of its jobs hears
        that it failed, and prefills the prompt itself."""
        for request_id, (sock, sender) in self.origin.items():
            self.send_now(sock, sender, encode(PrefillDone(request_id=request_id, error=error)))


def serve(config: WorkerConfig, control: ControlChannel) -> None:
    """Worker entry point: start (sockets on config.host), report ready on `control`,
    get peers, run (workers/control.py)."""
    engine, transport = engine_and_transport(config)
    worker = PrefillWorker(config.name, PrefillWorkerCore(engine, transport), config.host, config.stall_timeout_s,
                           config.stall_grace_s, config.secret)
    run_worker(worker, control, transport)
