"""A torch.distributed Store that only this deployment can use: the nccl transport's
rendezvous when the deployment has a secret.

torch's TCPStore authenticates nobody: whoever reaches its port can list, read,
overwrite and delete keys, and so hijack or poison the rendezvous of a pairwise group.
Here the receiver runs a StoreServer, a thread with a CURVE ROUTER behind a PlaneGuard
(security/: only clients holding the deployment's client key get a message through),
and every party, the receiver included, reaches it through an AuthStore: a
torch.distributed.Store whose calls travel over CURVE DEALERs, msgpack-encoded.

gloo and NCCL call a store from threads of their own (a group's rendezvous, NCCL's
lazily made communicators): each calling thread gets its own socket, and each call its
own request id, so the late answer to a call that timed out is recognised and dropped.
A blocking call (get or wait on a key not set yet) is answered by the server when the
key arrives; the client gives up after its timeout, the server forgets the call once
that has passed too.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from datetime import timedelta
from typing import Any

import msgpack
import zmq
from torch.distributed import DistStoreError, Store

from security import DeploymentSecret, PlaneGuard, connect_securely, serve_securely

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 1 << 20  # rendezvous values are addresses and NCCL ids: tiny
POLL_S = 0.1  # how often a waiting call or the server looks at its stop flag
_BLOCKING = frozenset({"get", "wait", "multi_get"})


class StoreServer:
    """The keys of one receiver's rendezvous, served on `host` to this deployment only.
    Requests are [id, op, *args]; answers [id, ok, value or error]."""

    def __init__(self, host: str, secret: DeploymentSecret, name: str) -> None:
        self._ctx = zmq.Context()
        self._guard = PlaneGuard(self._ctx, secret, f"{name}-kv-store")  # before the bind
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        serve_securely(self._sock, secret)
        self.port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{self.port}"
        self._guard.watch(self._sock)
        self._guard.start()
        self._data: dict[str, bytes] = {}
        # Blocking calls waiting for their keys: (deadline, client, request id, op, keys).
        self._waiting: list[tuple[float, bytes, int, str, list[str]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{name}-kv-store", daemon=True)
        self._thread.start()

    @property
    def refused(self) -> int:
        """Peers refused so far (no key of this deployment)."""
        return self._guard.refused

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._guard.close()
        self._sock.close(0)
        self._ctx.term()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if self._sock.poll(int(POLL_S * 1000)):  # int: pyzmq truncates a float alike
                    self._serve(self._sock.recv_multipart())
                now = time.monotonic()
                self._waiting = [w for w in self._waiting if w[0] > now]  # their callers gave up
        except zmq.ContextTerminated:
            pass
        except Exception:  # logged, not silent: every later rendezvous would hang
            logger.exception("the KV rendezvous store failed")

    def _serve(self, frames: list[bytes]) -> None:
        if len(frames) != 2:
            return
        client, body = frames
        try:
            request = msgpack.unpackb(body, raw=False)
            req_id, op, args = request[0], request[1], request[2:]
            if not isinstance(req_id, int) or not isinstance(op, str):
                raise ValueError("not a store request")
        except Exception as exc:
            logger.warning("dropped a malformed KV store request: %s", exc)
            return
        try:
            if op in _BLOCKING:
                keys, timeout_ms = [_str(k) for k in ([args[0]] if op == "get" else args[0])], args[1]
                self._waiting.append((time.monotonic() + timeout_ms / 1000, client, req_id, op, keys))
            else:
                self._answer(client, req_id, True, self._apply(op, args))
        except Exception as exc:  # a bad call by a member: it gets the error, the store goes on
            self._answer(client, req_id, False, f"{op}: {type(exc).__name__}: {exc}")
        self._wake()

    def _apply(self, op: str, args: list[Any]) -> Any:
        data = self._data
        if op == "set":
            data[_str(args[0])] = _bytes(args[1])
        elif op == "add":
            key = _str(args[0])
            value = int(data.get(key, b"0")) + int(args[1])
            data[key] = str(value).encode()  # as TCPStore keeps it: get() reads the decimal
            return value
        elif op == "compare_set":  # HashStore's semantics
            key, expected, desired = _str(args[0]), _bytes(args[1]), _bytes(args[2])
            if (key not in data and expected == b"") or data.get(key) == expected:
                data[key] = desired
                return desired
            return data.get(key, expected)
        elif op == "check":
            return all(_str(k) in data for k in args[0])
        elif op == "delete_key":
            return data.pop(_str(args[0]), None) is not None
        elif op == "num_keys":
            return len(data)
        elif op == "append":
            key = _str(args[0])
            data[key] = data.get(key, b"") + _bytes(args[1])
        elif op == "multi_set":
            keys, values = list(args[0]), list(args[1])
            if len(keys) != len(values):
                raise ValueError(f"{len(keys)} keys, {len(values)} values")
            data.update((_str(k), _bytes(v)) for k, v in zip(keys, values))
        else:
            raise ValueError(f"unknown operation {op!r}")
        return None

    def _wake(self) -> None:
        """Answer the blocking calls whose keys have all arrived."""
        still = []
        for waiting in self._waiting:
            _, client, req_id, op, keys = waiting
            if all(k in self._data for k in keys):
                value = (self._data[keys[0]] if op == "get" else
                         [self._data[k] for k in keys] if op == "multi_get" else None)
                self._answer(client, req_id, True, value)
            else:
                still.append(waiting)
        self._waiting = still

    def _answer(self, client: bytes, req_id: int, ok: bool, value: Any) -> None:
        try:
            self._sock.send_multipart([client, msgpack.packb([req_id, ok, value], use_bin_type=True)],
                                      zmq.NOBLOCK)
        except zmq.Again:  # that client is gone or not reading: its call times out
            pass


def _str(key: Any) -> str:
    if not isinstance(key, str):
        raise TypeError(f"a key is a string, not {type(key).__name__}")
    return key


def _bytes(value: Any) -> bytes:
    if isinstance(value, str):
        return value.encode()
    if not isinstance(value, bytes):
        raise TypeError(f"a value is bytes, not {type(value).__name__}")
    return value


class AuthStore(Store):
    """A client of a StoreServer, usable wherever torch takes a Store (PrefixStore,
    ProcessGroupGloo, ProcessGroupNCCL), from any thread. Its timeout (set_timeout, as
    for any Store) bounds every call; a call past it raises DistStoreError."""

    def __init__(self, address: str, secret: DeploymentSecret, timeout_s: float) -> None:
        super().__init__()
        self.set_timeout(timedelta(seconds=timeout_s))
        self.address = address
        self._secret = secret
        self._ctx = zmq.Context()
        self._lock = threading.Lock()  # guards the fields below
        self._sockets: dict[int, zmq.Socket] = {}  # calling thread -> its DEALER
        self._busy: set[int] = set()  # threads inside a call: their socket is theirs to close
        self._ids = itertools.count(1)
        self._clones: list[AuthStore] = []
        self._closed = False

    # ------------------------------------------------------------------ Store's verbs
    # The names C++ calls through torch's Python-store trampoline (getNumKeys, deleteKey)
    # and the ones Python callers use (num_keys, delete_key) both work.

    def set(self, key: str, value: bytes | str) -> None:
        self._call("set", key, _bytes(value))

    def get(self, key: str) -> bytes:
        return self._call("get", key, self._timeout_ms(None))

    def add(self, key: str, value: int) -> int:
        return self._call("add", key, int(value))

    def compare_set(self, key: str, expected_value: bytes | str, desired_value: bytes | str) -> bytes:
        return self._call("compare_set", key, _bytes(expected_value), _bytes(desired_value))

    def check(self, keys: list[str]) -> bool:
        return self._call("check", list(keys))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._call("wait", list(keys), self._timeout_ms(timeout), timeout=timeout)

    def deleteKey(self, key: str) -> bool:  # noqa: N802 (the trampoline's name)
        return self._call("delete_key", key)

    delete_key = deleteKey

    def getNumKeys(self) -> int:  # noqa: N802 (the trampoline's name)
        return self._call("num_keys")

    num_keys = getNumKeys

    def append(self, key: str, value: bytes | str) -> None:
        self._call("append", key, _bytes(value))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._call("multi_get", list(keys), self._timeout_ms(None))

    def multi_set(self, keys: list[str], values: list[bytes | str]) -> None:
        self._call("multi_set", list(keys), [_bytes(v) for v in values])

    def has_extended_api(self) -> bool:
        return True  # append, multi_get, multi_set

    def clone(self) -> AuthStore:
        # The Python object must outlive every C++ use of it: it stays here until close().
        twin = AuthStore(self.address, self._secret, self._default_timeout().total_seconds())
        with self._lock:
            self._clones.append(twin)
        return twin

    # ------------------------------------------------------------------ plumbing

    def _default_timeout(self) -> timedelta:
        """What set_timeout set last (torch's, or ours in __init__)."""
        return self.timeout  # type: ignore[attr-defined]  # Store.timeout is a runtime property torch's stubs omit

    def _timeout_ms(self, timeout: timedelta | None) -> int:
        return int((self._default_timeout() if timeout is None else timeout).total_seconds() * 1000)

    def _call(self, op: str, *args: Any, timeout: timedelta | None = None) -> Any:
        timeout_s = (self._default_timeout() if timeout is None else timeout).total_seconds()
        ident = threading.get_ident()
        with self._lock:
            if self._closed:
                raise DistStoreError(f"the KV rendezvous store at {self.address} is closed")
            sock = self._sockets.get(ident)
            if sock is None:
                sock = self._sockets[ident] = self._ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                connect_securely(sock, self._secret)
                sock.connect(self.address)
            self._busy.add(ident)
            req_id = next(self._ids)
        try:
            sock.send(msgpack.packb([req_id, op, *args], use_bin_type=True))
            end = time.monotonic() + timeout_s
            while True:
                left = end - time.monotonic()
                if left <= 0:
                    raise DistStoreError(f"the KV rendezvous store at {self.address} did not answer {op} "
                                         f"{args[0] if args else ''!r} within {timeout_s:g} s")
                if self._closed:
                    raise DistStoreError(f"the KV rendezvous store at {self.address} was closed during {op}")
                if sock.poll(int(min(left, POLL_S) * 1000)):
                    answer = msgpack.unpackb(sock.recv(), raw=False)
                    if answer[0] != req_id:
                        continue  # the late answer to a call of this thread that timed out
                    if not answer[1]:
                        raise DistStoreError(f"the KV rendezvous store refused {answer[2]}")
                    return answer[2]
        finally:
            with self._lock:
                self._busy.discard(ident)
                if self._closed:
                    self._sockets.pop(ident).close(0)
                    self._term_if_done()

    def close(self) -> None:
        """Close every socket no call is using; a call in progress stops within POLL_S
        and closes its own. Later calls raise DistStoreError."""
        with self._lock:
            self._closed = True
            for ident in [i for i in self._sockets if i not in self._busy]:
                self._sockets.pop(ident).close(0)
            self._term_if_done()
            clones, self._clones = self._clones, []
        for twin in clones:
            twin.close()

    def _term_if_done(self) -> None:
        if not self._sockets and not self._ctx.closed:
            self._ctx.term()
