"""Which wire a transport's KV crosses between hosts: its "fabric", reported in every
worker's stats and as a label on the transfer metrics (router/metrics.py).

    tcp    the tcp transport; or nixl, when UCX cannot use RDMA (below)
    rdma   nixl, where UCX can use an RDMA device of this host (InfiniBand or RoCE)
    host   shm, cuda_ipc: one host's memory (they refuse pools on different hosts)
    nccl   nccl: NCCL picks its own network (NCCL_NET, NCCL_IB_*)

UCX falls back to TCP without a word when it finds no usable RDMA device (none in
sysfs, or no /dev/infiniband/uverbs* to open: a container not given them), when
UCX_NET_DEVICES names none, or when UCX_TLS leaves out its RDMA transports: NIXL then
moves KV at a fraction of what the hardware was bought for. The nixl transport logs
which it is once at start (ucx_fabric()). What this reads is what UCX *can* use; UCX
chooses per endpoint among it, preferring RDMA where the peer has it too.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

RDMA_DEVICES = Path("/sys/class/infiniband")  # RDMA devices of either kind, InfiniBand or RoCE
VERBS_DEVICES = Path("/dev/infiniband")  # uverbsN: what a process opens to use one

# UCX's RDMA transports, and the UCX_TLS names that stand for them (UCX's aliases:
# "ib" all of them, "rc" both rc transports, "rc_x" the mlx5 one, "rc_v" the verbs one...).
RDMA_TRANSPORTS = frozenset({"rc_verbs", "rc_mlx5", "ud_verbs", "ud_mlx5", "dc_mlx5"})
_ALIASES = {
    "all": RDMA_TRANSPORTS, "ib": RDMA_TRANSPORTS,
    "rc": {"rc_verbs", "rc_mlx5"}, "ud": {"ud_verbs", "ud_mlx5"}, "dc": {"dc_mlx5"},
    "rc_v": {"rc_verbs"}, "rc_x": {"rc_mlx5"}, "ud_v": {"ud_verbs"}, "ud_x": {"ud_mlx5"}, "dc_x": {"dc_mlx5"},
}


def ucx_fabric(env: Mapping[str, str] | None = None, devices: Path = RDMA_DEVICES,
               verbs: Path = VERBS_DEVICES) -> tuple[str, str]:
    """("rdma" | "tcp", why): what UCX can move KV over between hosts here."""
    env = os.environ if env is None else env
    found = sorted(p.name for p in devices.iterdir()) if devices.is_dir() else []
    if not found:
        return "tcp", f"no RDMA device ({devices} is empty or missing)"
    if not (verbs.is_dir() and any(p.name.startswith("uverbs") for p in verbs.iterdir())):
        return "tcp", f"RDMA devices {', '.join(found)}, but no {verbs}/uverbs* to open (not passed in?)"
    named = [d.strip().split(":")[0] for d in env.get("UCX_NET_DEVICES", "").split(",") if d.strip()]
    if named and "all" not in named and not set(named) & set(found):
        return "tcp", f"UCX_NET_DEVICES={env['UCX_NET_DEVICES']} names none of the RDMA devices {', '.join(found)}"
    tls = env.get("UCX_TLS", "").strip()
    if tls and not rdma_transports(tls):
        return "tcp", f"UCX_TLS={tls} leaves out UCX's RDMA transports (devices: {', '.join(found)})"
    return "rdma", f"RDMA devices {', '.join(found)}" + (f", UCX_TLS={tls}" if tls else "")


def rdma_transports(tls: str) -> frozenset[str]:
    """The RDMA transports a UCX_TLS value lets UCX use: "^a,b" all but those a and b
    stand for; otherwise those the listed names stand for."""
    names = [n.strip().lower() for n in tls.removeprefix("^").split(",") if n.strip()]
    named = frozenset().union(*(_ALIASES.get(n, {n} & RDMA_TRANSPORTS) for n in names))
    return RDMA_TRANSPORTS - named if tls.startswith("^") else named
