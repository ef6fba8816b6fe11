"""A decode worker process: takes requests over ZMQ, hands long prompts to a prefill
worker (decode-first push), decodes with continuous batching, and sends every
request's new tokens after each step."""

from __future__ import annotations

import itertools
import logging
from multiprocessing.connection import Connection

import zmq

from cluster.config import ClusterConfig
from cluster.worker_loop import WorkerLoop, engine_and_transport
from decode_worker.remote_kv import DecodeWorkerCore
from engine.sampling_params import SamplingParams
from router.protocol import decode, encode

logger = logging.getLogger(__name__)


class DecodeWorker(WorkerLoop):
    def __init__(self, name: str, core: DecodeWorkerCore) -> None:
        super().__init__(name)
        self.core = core
        self.clients: dict[str, tuple[zmq.Socket, bytes]] = {}  # request id -> who asked
        self.sent: dict[str, int] = {}  # request id -> output tokens already sent
        self.prefill_of: dict[str, str] = {}  # request id -> prefill worker doing it
        self._prefill_order = itertools.cycle([])

    def set_prefill_workers(self, addresses: dict[str, str]) -> None:
        for name, address in addresses.items():
            self.connect(name, address)
        self._prefill_order = itertools.cycle(sorted(addresses))

    def busy(self) -> bool:
        return self.core.engine.has_unfinished()

    def handle(self, sender: bytes, msg: dict, sock: zmq.Socket) -> None:
        kind = msg["kind"]
        if kind == "generate":
            self._generate(sender, msg, sock)
        elif kind == "abort":
            self._abort(msg["id"])
        elif kind == "stats":
            self.send(sock, sender, encode("stats_reply", stats=self.stats()))
        elif kind == "prefill_done" and msg["error"]:
            logger.warning("prefill of %s failed on %s: %s", msg["id"], sender.decode(), msg["error"])
            self.core.prefill_failed(msg["id"])

    def _generate(self, sender: bytes, msg: dict, sock: zmq.Socket) -> None:
        request_id = msg["id"]
        try:
            params = SamplingParams(**msg["params"])
            remote = msg["remote"] and bool(self.dealers)
            rp = self.core.add_request(request_id, msg["prompt"], params, remote, msg["priority"])
        except (TypeError, ValueError) as exc:  # bad input: say so, keep serving
            self.send(sock, sender, encode("rejected", id=request_id, error=str(exc)))
            return
        self.clients[request_id] = (sock, sender)
        self.sent[request_id] = 0
        if rp is not None:
            prefill = next(self._prefill_order)
            self.prefill_of[request_id] = prefill
            self.dealers[prefill].send(encode(
                "prefill", id=request_id, prompt=rp.prompt_token_ids, peer=rp.peer, blocks=rp.block_ids,
                first=rp.first_block, epoch=rp.epoch, deadline=rp.deadline))

    def _abort(self, request_id: str) -> None:
        prefill = self.prefill_of.pop(request_id, None)
        if prefill is not None:
            self.dealers[prefill].send(encode("abort", id=request_id))
        self.core.abort(request_id)
        self._forget(request_id)

    def _forget(self, request_id: str) -> None:
        self.clients.pop(request_id, None)
        self.sent.pop(request_id, None)
        self.prefill_of.pop(request_id, None)

    def step(self) -> None:
        out = self.core.step()
        finished = {r.request_id for r in out.finished}
        for request in {r.request_id: r for r in out.advanced + out.finished}.values():
            client = self.clients.get(request.request_id)
            if client is None:
                continue
            new = request.output_token_ids[self.sent[request.request_id]:]
            self.sent[request.request_id] += len(new)
            done = request.request_id in finished
            self.send(*client, encode("tokens", id=request.request_id, tokens=new, finished=done,
                                      reason=request.status.value if done else "",
                                      cached=request.num_cached_tokens))
            if done:
                self._forget(request.request_id)

    def stats(self) -> dict:
        kv = self.core.engine.kv
        return {"name": self.name, "num_blocks": kv.pool.num_blocks, "free_blocks": kv.num_free_blocks,
                "running": len(self.core.engine.scheduler.running),
                "waiting": len(self.core.engine.scheduler.waiting),
                "waiting_for_kv": len(self.core.waiting_for_kv), **self.core.stats,
                "late_writes_dropped": self.core.transport.stats["late_writes_dropped"]}


def serve(config: ClusterConfig, index: int, control: Connection) -> None:
    """Process entry point: start, report ready on `control`, get peers, run."""
    name, engine, transport = engine_and_transport(config, "decode", index)
    worker = DecodeWorker(name, DecodeWorkerCore(engine, transport, config.prefill_deadline_s))
    control.send_bytes(encode("ready", name=name, address=worker.address, metadata=transport.metadata()))
    worker.set_prefill_workers(decode(control.recv_bytes())["prefill"])
    try:
        worker.run(control)
    finally:
        transport.close()
