"""Which wire nixl's KV crosses between hosts (kv_transfer/fabric.py): TCP without an
RDMA device or with UCX_TLS leaving RDMA out, said once in the log at start, and
reported in the worker's stats."""

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


def test_no_rdma_device_is_tcp_and_says_where_it_looked(tmp_path: Path) -> None:
    assert ucx_fabric({}, devices(tmp_path)) == ("tcp", f"no RDMA device ({tmp_path}/infiniband is empty or missing)")
    assert ucx_fabric({}, tmp_path / "absent")[0] == "tcp"


@pytest.mark.parametrize("tls, fabric", [
    (None, "rdma"), ("all", "rdma"), ("rc,sm", "rdma"), ("rc_mlx5,cuda_copy", "rdma"), ("ud_v", "rdma"),
    ("dc_x,tcp", "rdma"), ("^tcp", "rdma"), ("^rc", "rdma"), ("^rc_mlx5,ud", "rdma"),
    ("tcp", "tcp"), ("tcp,sm,self", "tcp"), ("^ib", "tcp"), ("^rc,ud,dc", "tcp"), ("^rc_v,ud_x,dc_mlx5", "tcp"),
])
def test_ucx_tls_decides_where_a_device_exists(tmp_path: Path, tls: str | None, fabric: str) -> None:
    env = {} if tls is None else {"UCX_TLS": tls}
    got, why = ucx_fabric(env, devices(tmp_path, "mlx5_0", "mlx5_1"))
    assert got == fabric
    assert "mlx5_0, mlx5_1" in why and (fabric == "rdma" or f"UCX_TLS={tls} leaves out" in why)


def test_nixl_says_once_at_start_that_it_runs_over_tcp(caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("nixl")
    from kv_transfer.nixl import NixlTransport

    if ucx_fabric()[0] != "tcp":
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
