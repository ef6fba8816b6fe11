"""A KV transport's settings (torch-free: the cluster config validates them where no
torch is loaded)."""

from __future__ import annotations

from dataclasses import dataclass, field

from security import DeploymentSecret


@dataclass(frozen=True)
class TransportConfig:
    timeout_s: float = 10.0  # a write not acknowledged within this fails
    # How long a write started just before its reservation's deadline may keep moving
    # bytes: shm stops a copy still running at deadline + cancel_grace_s / 2 (between
    # chunks), so that a receiver that gave up on the reservation gets its cancel_ack
    # soon. A latency bound only: the receiver frees those blocks on the cancel_ack or
    # the sender's exit, never on a timer (receiver.py).
    cancel_grace_s: float = 10.0
    host: str = "127.0.0.1"  # where this agent's control socket listens
    # nixl: drive UCX from a background thread. Off, progress happens in poll(): the
    # thread takes a whole core, which small CPU hosts cannot spare
    # (docs/benchmarks/2026-11-29-kv-transfer.md).
    progress_thread: bool = False
    # The deployment's secret (security/): the control plane's sockets are CURVE, the
    # handshake carries a tag proving it, and peers without it are refused. None only
    # for transports made in tests and benchmarks of this package alone; every launched
    # worker has one.
    secret: DeploymentSecret | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if not self.cancel_grace_s > 0:
            raise ValueError(f"cancel_grace_s must be > 0, got {self.cancel_grace_s}")
