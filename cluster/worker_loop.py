"""The event loop every worker process runs: ZMQ messages in, one engine step, repeat."""

from __future__ import annotations

import logging
import signal
import threading

import zmq

from cluster.config import ClusterConfig
from cluster.control import STOP, ControlChannel
from engine.engine_core import EngineCore
from kv_transfer import KVTransport, TransportConfig, create_transport
from kv_transfer.messages import MessageError
from router.protocol import decode, encode

logger = logging.getLogger(__name__)

def engine_and_transport(config: ClusterConfig, role: str, index: int,
                         host: str = "127.0.0.1") -> tuple[str, EngineCore, KVTransport]:
    """A worker's name, its engine (cache placed where the transport reaches it) and its
    transport (cache registered, control socket on `host`)."""
    name = f"{role}-{index}"
    transport = create_transport(config.transport, name, TransportConfig(host=host))
    engine = EngineCore(config.engine_config(role), transport.allocate_kv_cache)
    transport.register_kv_cache(engine.kv_cache, config.model)
    return name, engine, transport


IDLE_POLL_MS = 10  # how long an idle worker waits for a message before looking again


class WorkerLoop:
    """Subclasses implement set_peers(), handle() and step(), and say when they have work."""

    def __init__(self, name: str, host: str = "127.0.0.1") -> None:
        self.name = name
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        # A peer restarted under the same name takes its routing id over at once.
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.address = f"tcp://{host}:{self.sock.bind_to_random_port(f'tcp://{host}')}"
        self.dealers: dict[str, zmq.Socket] = {}  # peer name -> our socket to it
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)

    def connect(self, peer: str, address: str) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTING_ID, self.name.encode())
        sock.connect(address)
        self.dealers[peer] = sock
        self.poller.register(sock, zmq.POLLIN)
        return sock

    def disconnect(self, peer: str) -> None:
        sock = self.dealers.pop(peer, None)
        if sock is not None:
            self.poller.unregister(sock)
            sock.close(0)

    def set_peers(self, msg: dict) -> list[str]:
        """Apply a "peers" message (router/protocol.py): once before run(), and again
        whenever the launcher's supervisor reports a peer dead (left out) or restarted
        (back, with a new address and transport metadata). Makes the KV handshakes;
        returns the peers whose handshake failed."""
        raise NotImplementedError

    def serve(self, control: ControlChannel, transport: KVTransport) -> None:
        """The worker's life on its control channel (cluster/control.py): report ready,
        take the first peers and make every handshake, report serving, run until told
        to stop; then close the transport."""
        try:
            control.send_bytes(encode("ready", name=self.name, address=self.address, metadata=transport.metadata()))
            first = control.recv_bytes()
            if first == STOP:  # stopped before it served
                self.close()
                return
            cold = self.set_peers(decode(first))
            control.send_bytes(encode("serving", cold=cold))
            self.run(control)
        finally:
            transport.close()

    def handle(self, sender: bytes, msg: dict, reply: zmq.Socket) -> None:
        raise NotImplementedError

    def step(self) -> None:
        raise NotImplementedError

    def busy(self) -> bool:
        raise NotImplementedError

    def run(self, control: ControlChannel) -> None:
        """Until the launcher says stop (or closes the control channel); a "peers"
        message on it meanwhile goes to set_peers()."""
        # Ctrl-C reaches the whole process group; the launcher decides when we stop.
        # Under Ray the loop runs in an actor's thread, where signals cannot be set (and
        # Ray, not a terminal, owns the actor process's signals).
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        while True:
            if control.poll():
                try:
                    message = control.recv_bytes()
                except EOFError:  # the launcher is gone
                    break
                if message == STOP:
                    break
                self.set_peers(decode(message))
            for sock, _ in self.poller.poll(0 if self.busy() else IDLE_POLL_MS):
                self._drain(sock)
            self.step()
        self.close()

    def _drain(self, sock: zmq.Socket) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if sock is self.sock:
                sender = frames[0]
            else:  # a peer we connected to: name it
                sender = next(name for name, s in self.dealers.items() if s is sock).encode()
            body = frames[-1]
            try:
                msg = decode(body)
            except MessageError as exc:
                logger.warning("%s dropped a message: %s", self.name, exc)
                continue
            self.handle(sender, msg, sock)

    def send(self, sock: zmq.Socket, sender: bytes, body: bytes) -> None:
        """Reply on the socket the peer spoke on (ROUTER: addressed by its routing id)."""
        if sock is self.sock:
            sock.send_multipart([sender, body])
        else:
            sock.send(body)

    def close(self) -> None:
        for sock in self.dealers.values():
            sock.close(0)
        self.sock.close(0)
        self.ctx.term()
