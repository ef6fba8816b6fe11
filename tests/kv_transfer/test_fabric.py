"""Which wire nixl's KV crosses between hosts (kv_transfer/fabric.py): TCP without an
RDMA device this process can open, with UCX_NET_DEVICES naming none, or with UCX_TLS
leaving every RDMA transport out (UCX's aliases); said once in the log at start."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kv_transfer.fabric import ucx_fabric


def devices(tmp_path: Path, *names: str) -> Path:
    root = tmp_path / "infiniband"
    root.mkdir()
    for name in names:
        (root / name).mkdir()
    return root


def verbs(tmp_path: Path, present: bool = True) -> Path:
    root = tmp_path / "dev-infiniband"
    root.mkdir()
    if present:
        (root / "uverbs0").touch()
    return root


def test_no_rdma_device_is_tcp_and_says_where_it_looked(tmp_path: Path) -> None:
    assert ucx_fabric({}, devices(tmp_path)) == ("tcp", f"no RDMA device ({tmp_path}/infiniband is empty or missing)")
    assert ucx_fabric({}, tmp_path / "absent")[0] == "tcp"


def test_a_device_this_process_cannot_open_is_tcp(tmp_path: Path) -> None:
    """A container given the host's sysfs but not /dev/infiniband: UCX finds no device."""
    got, why = ucx_fabric({}, devices(tmp_path, "mlx5_0"), verbs(tmp_path, present=False))
    assert got == "tcp" and "no " in why and "uverbs* to open" in why


@pytest.mark.parametrize("net_devices, fabric", [
    ("eth0", "tcp"), ("eth0,lo", "tcp"), ("mlx5_0:1", "rdma"), ("eth0,mlx5_1:1", "rdma"), ("all", "rdma"),
])
def test_ucx_net_devices_must_name_an_rdma_device(tmp_path: Path, net_devices: str, fabric: str) -> None:
    got, why = ucx_fabric({"UCX_NET_DEVICES": net_devices}, devices(tmp_path, "mlx5_0", "mlx5_1"), verbs(tmp_path))
    assert got == fabric, why
    assert fabric == "rdma" or f"UCX_NET_DEVICES={net_devices} names none" in why


@pytest.mark.parametrize("tls, fabric", [
    (None, "rdma"), ("all", "rdma"), ("rc,sm", "rdma"), ("rc_mlx5,cuda_copy", "rdma"), ("ud_v", "rdma"),
    ("dc_x,tcp", "rdma"), ("^tcp", "rdma"), ("^rc", "rdma"), ("^rc_mlx5,ud", "rdma"),
    ("^rc_x,ud_x,dc", "rdma"),  # rc_x and ud_x are the mlx5 ones: rc_verbs and ud_verbs stay
    ("^rc_v,ud_x,dc_mlx5", "rdma"),  # rc_mlx5 and ud_verbs stay
    ("tcp", "tcp"), ("tcp,sm,self", "tcp"), ("^ib", "tcp"), ("^rc,ud,dc", "tcp"), ("^all", "tcp"),
    ("^rc_verbs,rc_mlx5,ud_v,ud_x,dc_x", "tcp"),
])
def test_ucx_tls_decides_where_a_device_exists(tmp_path: Path, tls: str | None, fabric: str) -> None:
    env = {} if tls is None else {"UCX_TLS": tls}
    got, why = ucx_fabric(env, devices(tmp_path, "mlx5_0", "mlx5_1"), verbs(tmp_path))
    assert got == fabric
    assert "mlx5_0, mlx5_1" in why and (fabric == "rdma" or f"UCX_TLS={tls} leaves out" in why)


def test_nixl_says_once_at_start_that_it_runs_over_tcp(caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("nixl")
    from kv_transfer.nixl import NixlTransport

    if not ucx_fabric()[1].startswith("no RDMA device"):
        pytest.skip("this host has RDMA devices")
    with caplog.at_level(logging.INFO, logger="kv_transfer.nixl"):
        transport = NixlTransport("fabric-probe")
    try:
        lines = [r.getMessage() for r in caplog.records if "nixl moves KV between hosts" in r.getMessage()]
        assert lines == ["fabric-probe: nixl moves KV between hosts over TCP, not RDMA: no RDMA device "
                         "(/sys/class/infiniband is empty or missing)"]
        assert transport.fabric == "tcp"
    finally:
        transport.close()
