"""Hosts on one machine: each a network namespace with its own address, all joined by
veth pairs to one bridge, which lives in a namespace of its own. Nothing is added to the
machine's own network stack, so no address outside the bed is ever used.

    bridge namespace {name}-br:  bridge br0, ports p1..pN
    host namespace   {name}-hI:  lo, eth0 = 10.88.0.I/24 (the other end of pI)

A link may be rate-limited (the bridge port's htb line class toward the host, a tbf on
the host's own end). A partition between two hosts drops,
at the bridge, what each sends the other: packets vanish, as on a cut cable, and
every other path stays (the kernel here has no netem, nftables, iptables or tc actions:
see _shape_port).

Cleanup: the bed writes its state (what /dev/shm held, its owner) to BEDS_DIR/{name}/
before it creates anything (atomically, under a lock that sweeps take too). `down`
kills every process in its namespaces, removes them (their veths go with them), the
/dev/shm files that appeared while it was up and that its own processes held when they
were killed (not other programs' files: /dev/shm is the machine's), and its state
directory. `up` first tears down a bed of the same name, and any bed whose owner
process died.

A port's shaping is built once, with the bed; a partition, heal or limit changes it in
place (a filter added or deleted, a class's rate changed), so it is never unshaped.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from kv_transfer.liveness import process_id

BEDS_DIR = Path("/run/pdnet")  # root's, not world-writable /tmp: a sweep acts on what it finds here
BED_PREFIXES = ("pdnet", "pdt")  # namespaces of beds (pdt: the tests'); a sweep adopts state-less ones
SUBNET = "10.88.0"  # inside the bed's namespaces only
SHM_DIR = Path("/dev/shm")
UNLIMITED = "100gbit"  # an htb line class's rate when the link has no limit (beyond a veth's speed)
_CLONE_NEWNET = 0x40000000


class BedUnavailable(RuntimeError):
    """This machine cannot build a bed (not root, no iproute2, no namespaces)."""


@dataclass(frozen=True)
class BedState:
    name: str
    hosts: int
    owner: int | None  # the pid whose exit ends the bed; None: until `down`
    shm_before: list[str]


def check_available() -> None:
    """Raise BedUnavailable naming why a bed cannot be built here."""
    if os.geteuid() != 0:
        raise BedUnavailable("network namespaces need root (CAP_SYS_ADMIN and CAP_NET_ADMIN); run as root")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise BedUnavailable(f"`{tool}` (iproute2) is not installed")
    probe = f"pdnet-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        raise BedUnavailable(f"cannot create a network namespace: {made.stderr.strip()}")
    subprocess.run(["ip", "netns", "delete", probe], capture_output=True)


class NetnsCluster:
    def __init__(self, name: str = "pdnet", hosts: int = 3, rate: str | None = None,
                 owner: int | None = None) -> None:
        """`hosts` namespaces named {name}-h1..N; `rate`: a tc rate ("1gbit", "100mbit")
        for every link, None for none; `owner`: the pid whose exit lets the next bed
        sweep this one (None: only `down` removes it)."""
        if not 1 <= hosts <= 200:
            raise ValueError(f"hosts must be 1-200, got {hosts}")
        check_name(name)
        if rate is not None:
            rate_bits(rate)
        self.name, self.hosts, self.rate, self.owner = name, hosts, rate, owner

    # -- names --------------------------------------------------------------------
    @property
    def bridge(self) -> str:
        return f"{self.name}-br"

    def namespace(self, host: int) -> str:
        self._check_host(host)
        return f"{self.name}-h{host}"

    def address(self, host: int) -> str:
        self._check_host(host)
        return f"{SUBNET}.{host}"

    @property
    def namespaces(self) -> list[str]:
        return [self.bridge, *(self.namespace(h) for h in range(1, self.hosts + 1))]

    @property
    def state_dir(self) -> Path:
        return BEDS_DIR / self.name

    def host_dir(self, host: int) -> Path:
        """A directory of this host's own (Ray's temp dir, logs), removed with the bed."""
        path = self.state_dir / f"h{host}"
        path.mkdir(parents=True, exist_ok=True)
        return path

    # -- up and down ----------------------------------------------------------------
    def up(self) -> NetnsCluster:
        check_available()
        with _locked():
            _sweep(also=self.name)
            self.state_dir.mkdir(parents=True, exist_ok=True)
            state = BedState(self.name, self.hosts, self.owner, sorted(p.name for p in SHM_DIR.iterdir()))
            temporary = self.state_dir / "state.json.new"
            temporary.write_text(json.dumps(asdict(state)))
            os.replace(temporary, self.state_dir / "state.json")
        try:
            self._build()
        except BaseException:  # Ctrl-C or a failed command: leave nothing half-made
            teardown(self.name)
            raise
        return self

    def down(self) -> None:
        teardown(self.name)

    def __enter__(self) -> NetnsCluster:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()

    def _build(self) -> None:
        _ip("netns", "add", self.bridge)
        _ip("-n", self.bridge, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.bridge, "link", "set", "br0", "up")
        for host in range(1, self.hosts + 1):
            ns, port = self.namespace(host), f"p{host}"
            _ip("netns", "add", ns)
            _ip("-n", self.bridge, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("-n", self.bridge, "link", "set", port, "master", "br0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "addr", "add", f"{self.address(host)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            self._shape_port(host)
            if self.rate:
                self.limit(host, self.rate)

    # -- links --------------------------------------------------------------------
    def limit(self, host: int, rate: str | None) -> None:
        """Rate-limit host's link both ways (a tbf on the host's end, the bridge port's
        line class on the other); None removes it. Changed in place: never a moment
        unshaped, and a partition on the port stays."""
        if rate is not None:
            rate_bits(rate)
        tc = ["tc", "-n", self.namespace(host), "qdisc"]
        if rate is None:
            subprocess.run([*tc, "del", "dev", "eth0", "root"], capture_output=True)
        else:
            _run(*tc, "replace", "dev", "eth0", "root", "tbf", "rate", rate, "burst", _burst(rate), "latency", "50ms")
        line = rate or UNLIMITED
        _run("tc", "-n", self.bridge, "class", "change", "dev", f"p{host}", "parent", "1:", "classid", "1:1",
             "htb", "rate", line, "ceil", line, "burst", _burst(line), "cburst", _burst(line))

    def partition(self, a: int, b: int) -> None:
        """Cut hosts a and b apart: the bridge drops what either sends the other,
        silently (a connection waits for its timeouts, as over a cut cable)."""
        for to, source in ((a, b), (b, a)):
            if not self._cut(to, source):
                _run(*self._filter(to, source, "add"), "u32", "match", "ip", "src", f"{self.address(source)}/32",
                     "flowid", "1:2")

    def heal(self, a: int, b: int) -> None:
        for to, source in ((a, b), (b, a)):
            if self._cut(to, source):
                _run(*self._filter(to, source, "del"))

    def bytes_to(self, host: int) -> int:
        """Bytes the bridge has passed toward host so far (what reached its link; a
        partition's dropped packets are not counted): a transfer's progress, read
        without asking either end."""
        self._check_host(host)
        out = subprocess.run(["ip", "-n", self.bridge, "-j", "-s", "link", "show", f"p{host}"],
                             capture_output=True, text=True, check=True).stdout
        return int(json.loads(out)[0]["stats64"]["tx"]["bytes"])

    def set_link(self, host: int, up: bool) -> None:
        """Take host's cable out (or put it back): it reaches no other host."""
        _ip("-n", self.bridge, "link", "set", f"p{host}", "up" if up else "down")

    def _shape_port(self, host: int) -> None:
        """The bridge's port to `host` (what the host receives), shaped once for the
        bed's life: an htb whose default class is the line (its rate: the link's limit,
        or UNLIMITED), and a class whose qdisc is a blackhole. A partition is one u32
        filter per source, at priority = the source's host number, that sends its
        packets to the blackhole (this kernel has no tc actions, netem or nftables)."""
        tc, dev, line = ["tc", "-n", self.bridge], f"p{host}", UNLIMITED
        _run(*tc, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "1")
        _run(*tc, "class", "add", "dev", dev, "parent", "1:", "classid", "1:1", "htb", "rate", line, "ceil", line,
             "burst", _burst(line), "cburst", _burst(line))
        _run(*tc, "class", "add", "dev", dev, "parent", "1:", "classid", "1:2", "htb", "rate", "8kbit")
        _run(*tc, "qdisc", "add", "dev", dev, "parent", "1:2", "handle", "20:", "blackhole")

    def _filter(self, to: int, source: int, verb: str) -> list[str]:
        """tc's filter verb on the port to `to`, at the priority of `source`."""
        self._check_host(to)
        self._check_host(source)
        return ["tc", "-n", self.bridge, "filter", verb, "dev", f"p{to}", "parent", "1:", "protocol", "ip",
                "prio", str(source)]

    def _cut(self, to: int, source: int) -> bool:
        """Whether what `source` sends `to` is dropped (read from the bridge, so any
        NetnsCluster of this bed, a CLI's too, sees the same)."""
        return bool(subprocess.run(self._filter(to, source, "show"), capture_output=True, text=True).stdout.strip())

    # -- processes ------------------------------------------------------------------
    def popen(self, host: int, argv: Sequence[str], **kwargs: object) -> subprocess.Popen:
        """Start argv in host's namespace (a new session: its own process group)."""
        return subprocess.Popen(["ip", "netns", "exec", self.namespace(host), *argv],  # type: ignore[call-overload]
                                start_new_session=True, **kwargs)

    def run(self, host: int, argv: Sequence[str], timeout: float = 120.0,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", self.namespace(host), *argv], capture_output=True,
                              text=True, timeout=timeout, env=env)

    def pids(self, host: int) -> set[int]:
        return _pids(self.namespace(host))

    def kill_host(self, host: int) -> None:
        """Every process in host's namespace, SIGKILLed: the machine lost its power."""
        _kill_all(self.namespace(host))

    @contextlib.contextmanager
    def inside(self, host: int) -> Iterator[None]:
        """Run this thread in host's namespace: sockets made meanwhile are the host's
        (and stay so after). Other threads are not moved."""
        with _in_namespace(self.namespace(host)):
            yield

    def _check_host(self, host: int) -> None:
        if not 1 <= host <= self.hosts:
            raise ValueError(f"host must be 1-{self.hosts}, got {host}")


def check_name(name: str) -> None:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9-]{0,19}", name):
        raise ValueError(f"name must be letters, digits and '-', at most 20, got {name!r}")


def teardown(name: str) -> None:
    """Remove bed `name`: processes, namespaces, the /dev/shm files its processes
    held, its state. Every step is tried, whatever failed before it."""
    check_name(name)
    with _locked():
        _teardown(name)


def _teardown(name: str) -> None:
    state_dir = BEDS_DIR / name
    state = _read_state(state_dir)
    own = re.compile(rf"{re.escape(name)}-(br|h[0-9]+)")
    namespaces = [ns for ns in _namespaces() if own.fullmatch(ns)]
    held = set().union(*(_held_shm(_pids(ns)) for ns in namespaces))
    errors = []
    for ns in namespaces:
        try:
            _kill_all(ns)
        except RuntimeError as e:
            errors.append(str(e))
    for ns in namespaces:
        subprocess.run(["ip", "netns", "delete", ns], capture_output=True, timeout=30)
    if state is not None:
        for leftover in held - set(state.shm_before):
            with contextlib.suppress(FileNotFoundError, IsADirectoryError):
                (SHM_DIR / leftover).unlink()
    if state_dir.parent == BEDS_DIR:
        shutil.rmtree(state_dir, ignore_errors=True)
    if errors:
        raise RuntimeError("; ".join(errors))


def sweep(also: str | None = None) -> list[str]:
    """Tear down every bed whose owner died (and bed `also` whatever its owner), and
    namespaces named like a bed's that have no state: what a crash left. Returns the
    beds removed."""
    with _locked():
        return _sweep(also)


def _sweep(also: str | None) -> list[str]:
    removed = []
    names = {p.name for p in BEDS_DIR.iterdir() if p.is_dir()} if BEDS_DIR.is_dir() else set()
    bed_namespace = re.compile(rf"((?:{'|'.join(BED_PREFIXES)})[A-Za-z0-9-]*)-(?:br|h[0-9]+)")
    names |= {m.group(1) for ns in _namespaces() if (m := bed_namespace.fullmatch(ns))}
    for name in sorted(names):
        state = _read_state(BEDS_DIR / name)
        if name == also or state is None or (state.owner is not None and process_id(state.owner) is None):
            _teardown(name)
            removed.append(name)
    return removed


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    """One bed operation at a time on this machine (beds of parallel test processes:
    a sweep must not see another bed half-written)."""
    BEDS_DIR.mkdir(mode=0o700, parents=True, exist_ok=True)
    with open(BEDS_DIR / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _read_state(state_dir: Path) -> BedState | None:
    try:
        return BedState(**json.loads((state_dir / "state.json").read_text()))
    except (OSError, ValueError, TypeError):
        return None


def _namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _pids(ns: str) -> set[int]:
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
    return {int(p) for p in out.split()}


def _kill_all(ns: str, timeout: float = 10.0) -> None:
    """SIGKILL every process in ns until none is left (a dying daemon may fork)."""
    end = time.monotonic() + timeout
    while (pids := _pids(ns) - {os.getpid()}) and time.monotonic() < end:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
    if _pids(ns) - {os.getpid()}:
        raise RuntimeError(f"processes in {ns} outlived SIGKILL for {timeout} s: {sorted(_pids(ns))}")


def _held_shm(pids: set[int]) -> set[str]:
    """The /dev/shm files these processes have open or mapped."""
    paths = []
    for pid in pids:
        proc = Path(f"/proc/{pid}")
        with contextlib.suppress(OSError):
            for fd in (proc / "fd").iterdir():
                with contextlib.suppress(OSError):
                    paths.append(os.readlink(fd))
        with contextlib.suppress(OSError):
            for line in (proc / "maps").read_text().splitlines():
                parts = line.split(maxsplit=5)
                paths += parts[5:]  # an anonymous mapping has no path
    prefix = f"{SHM_DIR}/"
    return {path[len(prefix):].removesuffix(" (deleted)") for path in paths if path.startswith(prefix)}


_LIBC = ctypes.CDLL(None, use_errno=True)


@contextlib.contextmanager
def _in_namespace(ns: str) -> Iterator[None]:
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        target = os.open(f"/run/netns/{ns}", os.O_RDONLY)
    except OSError:
        os.close(own)
        raise
    try:
        if _LIBC.setns(target, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {ns}: {os.strerror(ctypes.get_errno())}")
        try:
            yield
        finally:
            if _LIBC.setns(own, _CLONE_NEWNET) != 0:  # a thread left in the bed would be a leak
                raise OSError(ctypes.get_errno(), "setns back to this thread's namespace failed")
    finally:
        os.close(target)
        os.close(own)


def _burst(rate: str) -> str:
    bits = rate_bits(rate)
    return str(max(32 * 1024, bits // 8 // 100))  # bytes: 10 ms at the rate, at least 32 KiB


def rate_bits(rate: str) -> int:
    units = {"kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "bit": 1}
    for unit, scale in units.items():
        if rate.endswith(unit):
            return int(float(rate[: -len(unit)]) * scale)
    raise ValueError(f"rate must end in bit, kbit, mbit or gbit (tc's units), got {rate!r}")


def _ip(*args: str) -> None:
    _run("ip", *args)


def _run(*argv: str) -> None:
    done = subprocess.run(list(argv), capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed: {done.stderr.strip()}")
