"""A KV transport's settings (torch-free: the cluster config validates them where no
torch is loaded)."""

from __future__ import annotations

from dataclasses import dataclass, field

from security import DeploymentSecret

STREAM_MODES = ("off", "chunk", "layer")


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
    # When a prefill worker writes a prompt's KV (prefill_worker/remote_prefill.py):
    # "chunk" writes each block as soon as a step has computed it, so a chunked prefill's
    # earlier chunks move while the later ones compute; "off" writes every block once the
    # whole prompt is computed; "layer" writes each step's newly full blocks from inside
    # the step, stream_layers layers at a time as the forward computes them (the prefill
    # pool at TP 1). Prompts under stream_min_tokens are written whole.
    stream: str = "chunk"
    stream_min_tokens: int = 0
    stream_layers: int = 1
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
        if self.stream not in STREAM_MODES:
            raise ValueError(f"stream must be one of {STREAM_MODES}, got {self.stream!r}")
        if isinstance(self.stream_min_tokens, bool) or not (isinstance(self.stream_min_tokens, int)
                                                             and self.stream_min_tokens >= 0):
            raise ValueError(f"stream_min_tokens must be an integer >= 0, got {self.stream_min_tokens!r}")
        if isinstance(self.stream_layers, bool) or not (isinstance(self.stream_layers, int)
                                                         and self.stream_layers >= 1):
            raise ValueError(f"stream_layers must be an integer >= 1, got {self.stream_layers!r}")
