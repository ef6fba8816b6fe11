"""CURVE on the worker plane's ZMQ sockets, and the guard that refuses other peers.

Every server (bound) socket of a process uses the deployment's server key pair and every
client (connecting) socket its client key pair (secret.py); CurveZMQ encrypts each
connection and authenticates both ends. A client must know the server's public key to
start a handshake, but that alone is not proof: the PlaneGuard, one per ZMQ context
with a server socket, answers libzmq's ZAP requests (RFC 27) and admits only a client
presenting the deployment's client key. A peer without the secret never gets a message
through: its handshake fails (no server key) or is refused (wrong client key), and the
guard logs it (security/refusals.py: a flood cannot flood the log).
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Mapping
from errno import errorcode
from typing import Any

import zmq
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

from security.refusals import RefusalLog
from security.secret import DeploymentSecret

logger = logging.getLogger(__name__)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # where libzmq asks (RFC 27)
ZAP_DOMAIN = b"pdserve"
POLL_MS = 100  # how often the guard thread looks at its stop flag
# Handshakes that failed before any ZAP request: a protocol error (no server key, or no
# CURVE at all: a stranger), or the connection ending mid-handshake (its value an errno:
# a client that gave up waiting, as the deployment's own do while this process is
# stopped, or a port probe; no proof of a stranger, so not counted as one).
_FAILED_HANDSHAKE = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL


def serve_securely(sock: zmq.Socket, secret: DeploymentSecret) -> None:
    """Make `sock` a CURVE server of this deployment (before it binds)."""
    sock.curve_server = True
    sock.curve_secretkey = secret.server_secret
    sock.curve_publickey = secret.server_public
    sock.zap_domain = ZAP_DOMAIN
    # With no ZAP handler answering (the guard closed, or its thread gone) libzmq would
    # admit any client that knows the server key; enforced, it admits none.
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)


def connect_securely(sock: zmq.Socket, secret: DeploymentSecret) -> None:
    """Make `sock` a CURVE client of this deployment's servers (before it connects)."""
    sock.curve_serverkey = secret.server_public
    sock.curve_publickey = secret.client_public
    sock.curve_secretkey = secret.client_secret


class PlaneGuard:
    """The ZAP handler of one ZMQ context, in a thread of its own: admits this
    deployment's clients only, and logs and counts every peer refused. Create it before
    the context's server socket binds (so no handshake comes before it), watch() that
    socket, then start()."""

    def __init__(self, ctx: zmq.Context, secret: DeploymentSecret, name: str) -> None:
        self.name = name
        self._client_key = z85.decode(secret.client_public)
        self._zap = ctx.socket(zmq.REP)
        self._zap.setsockopt(zmq.LINGER, 0)
        self._zap.bind(ZAP_ENDPOINT)
        self._ctx = ctx
        self._monitors: list[tuple[zmq.Socket, zmq.Socket]] = []  # (watched, its monitor)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{name}-plane-guard", daemon=True)
        self._refusals = RefusalLog(logger)  # handshakes failed or denied
        self._ended = RefusalLog(logger, logging.INFO)  # connections that ended mid-handshake

    @property
    def refused(self) -> int:
        """Peers refused so far (handshakes failed or denied)."""
        return self._refusals.count

    def watch(self, sock: zmq.Socket) -> None:
        """Count and log the failed handshakes of `sock` (a server socket of this context)."""
        endpoint = f"inproc://plane-monitor-{uuid.uuid4().hex}"
        sock.monitor(endpoint, _FAILED_HANDSHAKE)
        monitor = self._ctx.socket(zmq.PAIR)
        monitor.setsockopt(zmq.LINGER, 0)
        monitor.connect(endpoint)
        self._monitors.append((sock, monitor))

    def start(self) -> PlaneGuard:
        self._thread.start()  # the sockets move to that thread (a start is a memory barrier)
        return self

    def close(self) -> None:
        """Stop the thread and close its sockets; before the context terminates."""
        if self._thread.is_alive():
            self._stop.set()
            self._thread.join()
        else:
            self._close_sockets()

    def _close_sockets(self) -> None:
        for _, monitor in self._monitors:
            monitor.close(0)
        self._monitors = []
        if not self._zap.closed:
            self._zap.close(0)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._zap, zmq.POLLIN)
        for _, monitor in self._monitors:
            poller.register(monitor, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                for sock, _ in poller.poll(POLL_MS):
                    if sock is self._zap:
                        self._answer(self._zap.recv_multipart())
                    else:
                        self._failed_handshake(parse_monitor_message(sock.recv_multipart()))
        except zmq.ContextTerminated:
            pass
        except Exception:  # the guard must not die silently: every later handshake would hang
            logger.exception("%s: the worker-plane guard failed", self.name)
        finally:
            self._close_sockets()

    def _answer(self, frames: list[bytes]) -> None:
        """One ZAP request: version, request id, domain, address, identity, mechanism,
        credentials (for CURVE: the client's public key)."""
        version, request_id = (frames + [b"", b""])[:2]
        ok = (len(frames) >= 7 and frames[5] == b"CURVE" and frames[6] == self._client_key)
        if not ok:
            address = frames[3].decode(errors="replace") if len(frames) > 3 else "?"
            self._refused(f"a peer at {address} presented a CURVE key that is not this deployment's")
        status = (b"200", b"OK") if ok else (b"400", b"not a peer of this deployment")
        self._zap.send_multipart([b"1.0", request_id, *status, b"", b""])

    def _failed_handshake(self, event: Mapping[str, Any]) -> None:
        endpoint = event["endpoint"].decode(errors="replace")
        if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
            self._refused(f"a connection to {endpoint} failed its CURVE handshake (no key of this deployment)")
            return
        errno = int(event["value"])
        self._ended.refused("%s: a connection to %s ended during its CURVE handshake (%s): a client that gave "
                            "up waiting (was this process stopped?) or a port probe", self.name, endpoint,
                            errorcode.get(errno, errno))

    def _refused(self, what: str) -> None:
        self._refusals.refused("%s refused a peer: %s", self.name, what)
