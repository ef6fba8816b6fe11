"""shm segments: created 0600 whatever the umask (the transport's and a TP engine's), and
a peer's announced segment mapped only if it is a pdserve segment under /dev/shm that
only this user can reach; anything else is refused naming the path, and unlink_segment
never removes another file."""

from __future__ import annotations

import os
import stat
import time
import uuid
from collections.abc import Iterator

import msgpack
import pytest
import torch

from engine.distributed import shared_cache
from kv_transfer import IncompatiblePeerError, KVTransport, create_transport
from kv_transfer.shm_segments import SHM_DIR, segment_name_problem, unlink_segment
from tests.kv_transfer.agent import cpu_agent


def mode(path: str) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.mark.parametrize("umask", [0o000, 0o022, 0o277], ids=lambda u: f"umask-{u:03o}")
def test_segments_are_created_0600_whatever_the_umask(umask: int) -> None:
    old = os.umask(umask)
    try:
        t = cpu_agent("shm", "decode")
        paths, _ = shared_cache.create_rank_caches((4, 8), torch.float32, 2)
    finally:
        os.umask(old)
    try:
        [segment] = msgpack.unpackb(t.metadata(), raw=False)["data"]["paths"]
        assert [mode(p) for p in [segment, *paths]] == [0o600] * 3
    finally:
        t.close()
        shared_cache.unlink(paths)


@pytest.fixture
def pair() -> Iterator[tuple[KVTransport, KVTransport, list[str]]]:
    """(receiver, sender, files to remove after the test)."""
    receiver, sender, made = cpu_agent("shm", "decode"), cpu_agent("shm", "prefill"), []
    yield receiver, sender, made
    sender.close()
    receiver.close()
    for path in made:
        if os.path.isdir(path) and not os.path.islink(path):
            os.rmdir(path)
        elif os.path.lexists(path):
            os.unlink(path)


def announcing(receiver: KVTransport, path: object = None, size: object = None, paths: object = None) -> bytes:
    meta = msgpack.unpackb(receiver.metadata(), raw=False)
    if paths is not None:
        meta["data"]["paths"] = paths
    if path is not None:
        meta["data"]["paths"] = [path]
    if size is not None:
        meta["data"]["bytes"] = [size]
    return msgpack.packb(meta, use_bin_type=True)


def scratch(made: list[str], kind: str = "file", name: str = "pdserve-kv-test", size: int = 0) -> str:
    path = os.path.join(SHM_DIR, f"{name}-{uuid.uuid4().hex}")
    made.append(path)
    if kind == "dir":
        os.mkdir(path)
    elif kind == "fifo":
        os.mkfifo(path, 0o600)
    else:
        with open(path, "wb") as f:
            f.truncate(size)
        os.chmod(path, 0o600)
    return path


def test_a_peers_segment_is_refused_unless_it_is_a_private_pdserve_segment(pair, monkeypatch) -> None:
    receiver, sender, made = pair
    [segment] = msgpack.unpackb(receiver.metadata(), raw=False)["data"]["paths"]
    size = receiver.kv_cache.numel() * 4
    link = os.path.join(SHM_DIR, f"pdserve-kv-test-link-{uuid.uuid4().hex}")
    os.symlink(segment, link)
    made.append(link)
    open_to_all = scratch(made, size=size)
    os.chmod(open_to_all, 0o644)
    other_name = scratch(made, name="other", size=size)
    refused = [
        (announcing(receiver, path=f"/tmp/{os.path.basename(segment)}"), "is not a file directly under /dev/shm"),
        (announcing(receiver, path=f"{SHM_DIR}/../{SHM_DIR}/{os.path.basename(segment)}"), "directly under"),
        (announcing(receiver, path=f"{SHM_DIR}/pdserve-kv-../../etc/passwd"), "directly under"),
        (announcing(receiver, path=other_name), "named pdserve-kv-"),
        (announcing(receiver, path=link), "it is a symbolic link"),
        (announcing(receiver, path=scratch(made, "fifo")), "it is not a regular file"),
        (announcing(receiver, path=scratch(made, "dir")), "Is a directory"),
        (announcing(receiver, path=open_to_all), r"others than its owner can reach it \(mode 644\)"),
        (announcing(receiver, size=size * 2), f"it holds {size} bytes, the peer announced {size * 2}"),
        (announcing(receiver, path=os.path.join(SHM_DIR, f"pdserve-kv-gone-{uuid.uuid4().hex}")),
         "No such file or directory"),
        (announcing(receiver, paths="/dev/shm/pdserve-kv-x"), "announced cache files '/dev/shm/pdserve-kv-x'"),
        (announcing(receiver, path=7), "7 is not a path"),
    ]
    for metadata, reason in refused:
        with pytest.raises(IncompatiblePeerError, match=reason):
            sender.add_peer(metadata)
    euid = os.geteuid()
    monkeypatch.setattr(os, "geteuid", lambda: euid + 1)  # as if the segment were another user's
    with pytest.raises(IncompatiblePeerError, match=f"{segment!r}: it belongs to uid {euid}, not to this user"):
        sender.add_peer(receiver.metadata())
    monkeypatch.undo()
    assert not sender.control.peers
    # The receiver's own announcement passes every check, and a write lands.
    assert sender.add_peer(receiver.metadata()) == "decode"
    sender.kv_cache[3] = 5.0
    receiver.expect("a", 1, [7], deadline=time.time() + 60, sender="prefill")
    sender.write("decode", "a", 1, [3], [7], deadline=time.time() + 60)
    end = time.monotonic() + 10
    while not (receiver.kv_cache[7] == 5.0).all() or not any(type(e).__name__ == "WriteDone" for e in sender.poll()):
        assert time.monotonic() < end, "the write to the well-announced segment never landed"
        receiver.poll()
        time.sleep(0.005)


def test_a_registered_rank_cache_file_must_be_named_as_a_segment(pair) -> None:
    _, _, made = pair
    path = scratch(made, name="other", size=4 * 8 * 4)
    t = create_transport("shm", "decode2")
    try:
        cache = torch.zeros(1, 1, 1, 2, 4, 4)
        with pytest.raises(ValueError, match=f"rank 0's cache file: '{path}' is not a file directly under"):
            t.register_kv_cache([cache], "test-model", 1, [(0, 1)], [path])
    finally:
        t.close()


def test_unlink_segment_removes_only_pdserve_segments(pair) -> None:
    _, _, made = pair
    victim = scratch(made, name="victim")
    hop = scratch(made, "dir")  # /dev/shm/pdserve-kv-test-<hex>/, a name of the right shape
    segment = scratch(made)
    for path in [f"{hop}/../{os.path.basename(victim)}", victim]:
        unlink_segment(msgpack.packb({"transport": "shm", "data": {"paths": [path]}}))
    assert os.path.exists(victim)
    unlink_segment(msgpack.packb({"transport": "shm", "data": {"paths": [segment]}}))
    assert not os.path.exists(segment)


@pytest.mark.parametrize("path", ["/dev/shm/pdserve-kv-abc", "/dev/shm/pdserve-kv-tp12-0af-rank1"])
def test_segment_names_of_both_makers_are_accepted(path: str) -> None:
    assert segment_name_problem(path) is None


@pytest.mark.parametrize("path", ["/dev/shm/pdserve-kv-abc\n", "/dev/shm/pdserve-kv-", "/dev/shm/pdserve-kv-a/b",
                                  "/dev/shm/pdserve-kv-a.b", "/tmp/pdserve-kv-abc", "/dev/shm/other-kv-abc"])
def test_other_names_are_refused(path: str) -> None:
    assert segment_name_problem(path) is not None
