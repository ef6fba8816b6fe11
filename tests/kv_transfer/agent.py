"""A transport agent in its own process, driven by msgpack commands over a pipe.

The test process plays the other side. Commands and replies are msgpack maps sent as
bytes (never pickled objects):
    {"op": "add_peer", "meta": bytes, "warm": bool} -> {"peer": name} | {"error": str}
    {"op": "write", "peer", "req", "epoch", "src", "dst", "deadline"[, "layers"]} -> {"xfer": id}
    {"op": "expect", "req", "epoch", "blocks", "deadline"}            -> {}
    {"op": "poll", "seconds": s}   poll for s seconds -> {"events": [...], "stats": {...}}
    {"op": "blocks", "ids": [...]} -> {"data": bytes} of those blocks
    {"op": "exit"}
"""

from __future__ import annotations

import dataclasses
import signal
import time
from multiprocessing.connection import Connection
from typing import Any

import msgpack
import torch

from kv_transfer import KVTransport, TransportConfig, create_transport
from kv_transfer.control import TAG
from security import DeploymentSecret

SHAPE = dict(num_blocks=64, layers=2, block_size=16, kv_heads=2, head_dim=32)


class Secured(str):
    """A transport's name, for a test whose agents hold a deployment secret (as launched
    workers do): Secured("nccl") == "nccl", and secret_of() finds the secret."""

    secret = DeploymentSecret(bytes(range(32)))


def secret_of(transport: str) -> DeploymentSecret | None:
    return getattr(transport, "secret", None)


def packed(meta: dict, transport: str) -> bytes:
    """A handshake map packed as its agent would, tagged with the transport's secret if
    it has one: a blob a peer of the same deployment could send (tests of what the
    handshake checks beyond the tag)."""
    secret = secret_of(transport)
    meta = {k: v for k, v in meta.items() if k != TAG}
    if secret is not None:
        meta[TAG] = secret.tag(msgpack.packb(meta, use_bin_type=True))
    return msgpack.packb(meta, use_bin_type=True)


def cpu_agent(transport: str, name: str, secret: DeploymentSecret | None = None) -> KVTransport:
    """A transport in this process, its (zeroed) CPU cache of SHAPE registered."""
    t = create_transport(transport, name, TransportConfig(timeout_s=5.0, cancel_grace_s=5.0, secret=secret))
    t.register_kv_cache(t.allocate_kv_cache(cache_shape(), torch.float32, "cpu"), "test-model")
    return t


def poll_both(sender: KVTransport, receiver: KVTransport, seconds: float) -> tuple[list, list]:
    """Each agent's events while both poll for `seconds`."""
    sent, received, end = [], [], time.monotonic() + seconds
    while time.monotonic() < end:
        sent += sender.poll()
        received += receiver.poll()
        time.sleep(0.002)
    return sent, received


def cache_shape(num_blocks: int = SHAPE["num_blocks"], block_size: int = SHAPE["block_size"]) -> tuple[int, ...]:
    return (num_blocks, SHAPE["kv_heads"], SHAPE["layers"], 2, block_size, SHAPE["head_dim"])


def fill(cache: torch.Tensor, seed: int) -> None:
    """Deterministic distinct contents, reproducible in the test process."""
    g = torch.Generator().manual_seed(seed)
    cache.copy_(torch.randn(cache.shape, generator=g, dtype=torch.float32).to(cache.dtype))


def event_dict(e: Any) -> dict[str, Any]:
    d = dataclasses.asdict(e)
    d["type"] = type(e).__name__
    if "blocks" in d:
        d["blocks"] = list(d["blocks"])
    return d


def run_agent(conn: Connection, transport: str, name: str, seed: int, timeout_s: float,
              grace_s: float, block_size: int, dtype: str, secret_hex: str | None = None) -> None:
    from kv_transfer import TransportConfig, create_transport

    # Forked by the workers' fork server, which ignores SIGTERM (cluster/local/server_signals.py):
    # an agent ends on it, as multiprocessing's exit handler expects of a daemon child.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    secret = DeploymentSecret.from_hex(secret_hex) if secret_hex is not None else None
    t = create_transport(transport, name, TransportConfig(timeout_s=timeout_s, cancel_grace_s=grace_s,
                                                          secret=secret))
    cache = t.allocate_kv_cache(cache_shape(block_size=block_size), getattr(torch, dtype), "cpu")
    fill(cache, seed)
    t.register_kv_cache(cache, "test-model")
    conn.send_bytes(t.metadata())
    while True:
        cmd = msgpack.unpackb(conn.recv_bytes(), raw=False)
        op, reply = cmd.pop("op"), {}
        if op == "exit":
            t.close()
            return
        try:
            if op == "add_peer":
                reply["peer"] = t.add_peer(cmd["meta"])
                if cmd.get("warm"):
                    t.warm_up(reply["peer"])
            elif op == "write":
                reply["xfer"] = t.write(cmd["peer"], cmd["req"], cmd["epoch"], cmd["src"], cmd["dst"],
                                        cmd["deadline"], cmd.get("layers"))
            elif op == "expect":
                t.expect(**{"sender": "prefill", **cmd})
            elif op == "abort":
                t.abort(cmd["req"])
            elif op == "poll":
                events, end = [], time.monotonic() + cmd["seconds"]
                while True:
                    events += [event_dict(e) for e in t.poll()]
                    if time.monotonic() >= end:
                        break
                    time.sleep(0.002)
                reply.update(events=events, stats=t.stats)
            elif op == "blocks":
                reply["data"] = t.kv_cache[cmd["ids"]].numpy().tobytes()
        except Exception as exc:  # reported to the test, which asserts on it
            reply["error"] = f"{type(exc).__name__}: {exc}"
        conn.send_bytes(msgpack.packb(reply, use_bin_type=True))
