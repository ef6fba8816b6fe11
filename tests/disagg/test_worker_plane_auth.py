"""A served deployment's worker plane admits only holders of its secret: a forged
`Generate` sent straight to a decode worker's socket (from a plain ZMQ socket, or
with another deployment's CURVE keys), or a forged KV `written` to its transport's
control socket, is never acted on, and is counted in the worker's stats (/status);
the worker keeps serving requests that come through the router."""

from __future__ import annotations

import json
import time
import urllib.request

import msgpack
import pytest
import zmq

from cluster.local.workers import LocalWorkers
from protocol import Generate, encode
from protocol.kv_control import Written
from security import DeploymentSecret, connect_securely
from tests.disagg.conftest import Served

PARAMS = {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def served(pd_server: Served) -> tuple[str, LocalWorkers]:
    return pd_server.base, pd_server.workers


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.loads(response.read())


def complete(base: str, prompt: str) -> dict:
    request = urllib.request.Request(f"{base}/v1/completions", json.dumps({"prompt": prompt, **PARAMS}).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def decode_stats(base: str) -> dict:
    return get(f"{base}/status")["decode_workers"][0]["stats"]


def stranger(ctx: zmq.Context, address: str, key: DeploymentSecret | None) -> zmq.Socket:
    """A DEALER that looks like the router (or a prefill worker) in every way but the
    secret: none, or another deployment's."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, b"prefill-0")
    if key is not None:
        connect_securely(sock, key)
    sock.connect(address)
    return sock


@pytest.mark.timeout(240)
def test_forged_messages_to_a_decode_worker_are_never_acted_on(served) -> None:
    base, workers = served
    assert complete(base, "Hello there")["usage"]["completion_tokens"] == 4  # serving, through the router
    status = get(f"{base}/status")
    address = status["decode_workers"][0]["address"]
    before = decode_stats(base)
    assert before["refused_peers"] == 0
    control = msgpack.unpackb(workers.decode[0].metadata, raw=False)["control"]  # its KV control socket

    ctx = zmq.Context()
    try:
        keys = [None, DeploymentSecret.new()]
        forgers = [stranger(ctx, address, key) for key in keys]
        for i, sock in enumerate(forgers):  # a long one, kept running if ever taken
            sock.send(encode(Generate(request_id=f"forged-{i}", prompt=list(range(3, 40)),
                                      params=dict(PARAMS, max_tokens=500), remote=False)))
        kv = [stranger(ctx, control, key) for key in keys]
        for sock in kv:
            sock.send(encode(Written(xfer=1, req="forged", epoch=1, blocks=[1], runs=[(1, 1)],
                                     pieces=[(0, 0, 2, 1)])))
        end = time.monotonic() + 3.0
        while time.monotonic() < end:
            assert not any(sock.poll(50) for sock in forgers + kv), "a stranger got a reply"
        after = decode_stats(base)
        # Never acted on: nothing admitted, run or prefilled for them.
        assert after["local"] == before["local"] and after["remote"] == before["remote"]
        assert after["running"] == after["waiting"] == 0 and after["free_blocks"] == after["num_blocks"]
        # Both sockets refused both strangers (each may retry its handshake: at least).
        assert after["refused_peers"] >= len(forgers) + len(kv)
        assert get(f"{base}/status")["prefill_workers"][0]["stats"]["refused_peers"] == 0
    finally:
        ctx.destroy(0)
    # The worker serves on, through the router.
    out = complete(base, "The worker keeps serving " * 3)
    assert out["usage"]["completion_tokens"] == 4 and out["choices"][0]["finish_reason"] == "length"
    last = decode_stats(base)
    assert last["local"] + last["remote"] == before["local"] + before["remote"] + 1
