"""security/: the deployment secret's keys, and CURVE sockets that let only this
deployment's peers through (each other one refused, counted and logged)."""

from __future__ import annotations

import contextlib
import logging
import pickle
import socket
import time
from collections.abc import Iterator

import pytest
import zmq

from security import DeploymentSecret, PlaneGuard, connect_securely, serve_securely


def test_the_secret_never_shows_and_survives_pickling() -> None:
    secret = DeploymentSecret.new()
    assert secret.hex not in repr(secret) and secret.hex not in str(secret)
    assert pickle.loads(pickle.dumps(secret)) == secret == DeploymentSecret.from_hex(secret.hex)
    assert secret != DeploymentSecret.new()
    with pytest.raises(ValueError, match="64 hex digits"):
        DeploymentSecret.from_hex("not hex")
    with pytest.raises(ValueError, match="32 bytes"):
        DeploymentSecret(b"short")


def test_tags_prove_the_secret() -> None:
    secret, other = DeploymentSecret.new(), DeploymentSecret.new()
    tag = secret.tag(b"blob")
    assert secret.verify(b"blob", tag)
    assert not secret.verify(b"blob!", tag)
    assert not secret.verify(b"blob", other.tag(b"blob"))
    assert not secret.verify(b"blob", None)  # type: ignore[arg-type]  # a missing tag, as a bad peer sends it


def test_keys_differ_by_use_and_by_deployment() -> None:
    a, b = DeploymentSecret.new(), DeploymentSecret.new()
    assert len({a.server_public, a.client_public, b.server_public, b.client_public}) == 4
    assert zmq.curve_public(a.server_secret) == a.server_public


@pytest.fixture
def server() -> Iterator[tuple[zmq.Socket, PlaneGuard, str, DeploymentSecret]]:
    secret = DeploymentSecret.new()
    ctx = zmq.Context()
    guard = PlaneGuard(ctx, secret, "test-worker")
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    serve_securely(sock, secret)
    address = f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}"
    guard.watch(sock)
    guard.start()
    yield sock, guard, address, secret
    guard.close()
    sock.close(0)
    ctx.term()


def _client(ctx: zmq.Context, address: str, secret: DeploymentSecret | None,
            server_key: bytes | None = None) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if secret is not None:
        connect_securely(sock, secret)
    if server_key is not None:
        sock.curve_serverkey = server_key
    sock.connect(address)
    return sock


def _knock(sock: zmq.Socket, body: bytes) -> None:
    """A refused client's send, which must not wait: once its handshake has failed,
    libzmq may leave its DEALER with no pipe to queue on, and a blocking send then waits
    forever while it reconnects and is refused again (a CI run hung here 300 s)."""
    with contextlib.suppress(zmq.Again):
        sock.send(body, zmq.NOBLOCK)


def _received(sock: zmq.Socket, wait_ms: int = 1500) -> list[bytes]:
    got = []
    while sock.poll(wait_ms):
        got.append(sock.recv_multipart()[-1])
        wait_ms = 300
    return got


def test_only_this_deployments_clients_get_through(server, caplog: pytest.LogCaptureFixture) -> None:
    sock, guard, address, secret = server
    other = DeploymentSecret.new()
    ctx = zmq.Context()
    try:
        strangers = [_client(ctx, address, None),  # no CURVE at all
                     _client(ctx, address, other),  # another deployment's keys
                     # the server's public key, but not the deployment's client key
                     _client(ctx, address, other, server_key=secret.server_public)]
        with caplog.at_level(logging.WARNING, logger="security.curve"):
            for i, s in enumerate(strangers):
                _knock(s, b"forged %d" % i)
            member = _client(ctx, address, secret)
            member.send(b"hello")
            assert _received(sock) == [b"hello"]
        assert guard.refused >= len(strangers)
        assert any("refused a peer" in r.getMessage() for r in caplog.records)
        # Replies reach the member, and it stays connected.
        member.send(b"again")
        assert _received(sock) == [b"again"]
    finally:
        ctx.destroy(0)


def test_a_refusal_flood_is_logged_once_per_period(server, caplog: pytest.LogCaptureFixture) -> None:
    sock, guard, address, _ = server
    ctx = zmq.Context()
    try:
        with caplog.at_level(logging.WARNING, logger="security.curve"):
            strangers = [_client(ctx, address, DeploymentSecret.new()) for _ in range(20)]
            for s in strangers:
                _knock(s, b"x")
            assert _received(sock, 1000) == []
        assert guard.refused >= 20
        assert sum("refused a peer" in r.getMessage() for r in caplog.records) == 1
    finally:
        ctx.destroy(0)


def test_without_its_guard_a_server_admits_no_one(server) -> None:
    """A guard gone (closed, or its thread dead) must not leave the door open: libzmq
    then admits any client with the server key, unless the domain is enforced."""
    sock, guard, address, secret = server
    guard.close()
    ctx = zmq.Context()
    try:
        _knock(_client(ctx, address, DeploymentSecret.new(), server_key=secret.server_public), b"forged")
        _knock(_client(ctx, address, secret), b"member")  # no guard: not even a member gets in
        assert _received(sock, 1000) == []
    finally:
        ctx.destroy(0)


def test_a_connection_that_ends_mid_handshake_is_logged_but_not_counted_as_a_stranger(
        server, caplog: pytest.LogCaptureFixture) -> None:
    """The deployment's own clients end their handshakes this way when the server's
    process was stopped a while (SIGSTOP; repro f6): they are no strangers. A stranger's
    protocol failure still counts."""
    sock, guard, address, _ = server
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    with caplog.at_level(logging.INFO, logger="security.curve"):
        socket.create_connection((host, int(port))).close()
        deadline = time.monotonic() + 5
        while not any("ended during its CURVE handshake" in r.getMessage() for r in caplog.records):
            assert time.monotonic() < deadline, "the ended handshake was not logged"
            time.sleep(0.05)
    assert guard.refused == 0
    assert not any(r.levelno >= logging.WARNING for r in caplog.records)
    ctx = zmq.Context()
    try:
        stranger = _client(ctx, address, DeploymentSecret.new())  # kept: a socket collected is closed
        _knock(stranger, b"another deployment")
        deadline = time.monotonic() + 5
        while guard.refused == 0:
            assert time.monotonic() < deadline, "a stranger was not counted"
            time.sleep(0.05)
    finally:
        ctx.destroy(0)
