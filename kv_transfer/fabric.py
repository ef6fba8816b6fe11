"""Which wire a transport's KV crosses between hosts: its "fabric", reported in every
worker's stats and as a label on the transfer metrics (router/metrics.py).

    tcp    the tcp transport; or nixl, when UCX cannot use RDMA (below)
    rdma   nixl, where this host has an RDMA device UCX may use (InfiniBand or RoCE)
    host   shm, cuda_ipc: one host's memory (they refuse pools on different hosts)
    nccl   nccl: NCCL picks its own network (NCCL_NET, NCCL_IB_*)

UCX falls back to TCP without a word when it finds no RDMA device, or when UCX_TLS
leaves out its RDMA transports: NIXL then moves KV at a fraction of what the hardware
was bought for. The nixl transport logs which it is once at start (ucx_fabric()).
What this reads is what UCX *can* use, from the host's devices and UCX_TLS; UCX
chooses per endpoint among them, preferring RDMA where the peer has it too.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

RDMA_DEVICES = Path("/sys/class/infiniband")  # RDMA devices of either kind, InfiniBand or RoCE
# UCX_TLS names that mean RDMA (ib: all of them; rc/ud/dc and their variants: one each).
_RDMA_TLS = ("ib", "rc", "ud", "dc")


def ucx_fabric(env: Mapping[str, str] | None = None, devices: Path = RDMA_DEVICES) -> tuple[str, str]:
    """("rdma" | "tcp", why): what UCX can move KV over between hosts here."""
    env = os.environ if env is None else env
    found = sorted(p.name for p in devices.iterdir()) if devices.is_dir() else []
    if not found:
        return "tcp", f"no RDMA device ({devices} is empty or missing)"
    tls = env.get("UCX_TLS", "").strip()
    if tls and not _allows_rdma(tls):
        return "tcp", f"UCX_TLS={tls} leaves out UCX's RDMA transports (devices: {', '.join(found)})"
    return "rdma", f"RDMA devices {', '.join(found)}" + (f", UCX_TLS={tls}" if tls else "")


def _allows_rdma(tls: str) -> bool:
    """Whether a UCX_TLS value lets UCX use some RDMA transport: "^a,b" excludes a and
    b (RDMA stays unless ib, or each of rc, ud and dc, is excluded); otherwise it lists
    what is allowed ("all" allows everything)."""
    names = {n.strip().lower() for n in tls.removeprefix("^").split(",") if n.strip()}
    families = {tl for n in names for tl in _RDMA_TLS if n == tl or n.startswith(f"{tl}_")}  # rc_mlx5, ud_v, ...
    if tls.startswith("^"):
        return "ib" not in families and not {"rc", "ud", "dc"} <= families
    return "all" in names or bool(families)
