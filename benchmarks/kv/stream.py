"""Remote-prefill TTFT by streaming mode (transport_options.stream), against the prefill's
own compute time, measured in the same run.

    .venv/bin/python -m benchmarks.kv stream                         # shm and tcp+curve here
    .venv/bin/python -m benchmarks.kv stream --link 1gbit --transports tcp+curve
    .venv/bin/python -m benchmarks.kv stream --tokens 256,1024 --modes off,chunk,layer --repeats 3
    .venv/bin/python -m benchmarks.kv stream --modes off,layer --stream-layers 5

A decode worker (DecodeWorkerCore: its own process) and a prefill worker
(PrefillWorkerCore: this process) serve the demo model in float32, 1P1D (the GPU check's
stream section: its model on the GPU, benchmarks/gpu/streaming.py). Each sample is one
request with a fresh random prompt, the same in every mode (prefix caching off on both
sides), and max_tokens 1; the modes' first tokens must agree (`mismatches`):

- compute: the prefill engine alone computing the prompt (no transport), in this process;
- remote TTFT: the decode worker reserving blocks, the prefill worker computing and
  writing them, the decode worker computing the last token and sampling: from the
  request to its first token;
- where it went: reserve (the decode worker's reply), P compute (PrefillDone.compute_s:
  submit to computed, on the prefill worker), exposed (PrefillDone.transfer_s: computed
  to the last write acknowledged), and D's last step (the KV complete on the decode
  worker to its first token: the last prompt token's step and sampling), the data
  plane's descriptors for the request (transport stats), and the regions they coalesce
  (one per block, head and layer);
- overlap: the share of `off`'s exposed transfer that a mode hid behind compute,
  1 - exposed(mode) / exposed(off), in the same run. (P polls its writes between steps
  only, so it cannot time a write that lands mid-step itself.)

Each worker computes on a core of its own with one torch thread (--shared-cores: not), as
if on two hosts: on a 2-core machine a decode worker's 1 ms wait loop otherwise lands on
a core the prefill's matmuls use, and slows them by 5-15% in both modes, which is no
transfer's cost. The prefill worker's transport threads (ZMQ's I/O and CURVE, shm's
copies) may run on either core, as a host's spare cores would move its KV.

With --link RATE both sides run on hosts of the namespace test bed
(benchmarks/netns_cluster/bed.py), the decode host's link limited to RATE; only tcp
crosses it. Samples interleave the modes so that the machine's noise hits them alike;
the table gives medians of --repeats.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import msgpack
import torch

_REPO_ROOT = Path(__file__).resolve().parents[2]
if str(_REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(_REPO_ROOT))

from benchmarks.kv.transfer import Placement  # noqa: E402
from benchmarks.netns_cluster.bed import NetnsCluster, rate_bits  # noqa: E402
from benchmarks.offline.tp_cpu import DEMO  # noqa: E402
from decode_worker.remote_kv import DecodeWorkerCore  # noqa: E402
from engine import SamplingParams  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.engine_core import EngineCore  # noqa: E402
from kv_transfer import KVTransport, TransportConfig, create_transport  # noqa: E402
from prefill_worker.remote_prefill import PrefillWorkerCore  # noqa: E402
from protocol import WORKER_MESSAGES, PrefillDone, encode  # noqa: E402
from security import DeploymentSecret  # noqa: E402
from workers.loop import IDLE_POLL_MS, WAIT_POLL_MS  # noqa: E402

SENDER, RECEIVER = 1, 2
BLOCK = 16
FIRST_TOKEN = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
TIMEOUT_S = 300.0
ALL_CPUS = os.sched_getaffinity(0)  # at import: before pin()


@dataclass(frozen=True)
class Setup:
    """The engines' model and where they run."""

    model: str = str(DEMO)
    dtype: str = "float32"
    device: str = "cpu"


def engine_config(max_tokens: int, setup: Setup = Setup()) -> EngineConfig:
    blocks = 2 * (max_tokens // BLOCK + 2)
    return EngineConfig(model=setup.model, dtype=setup.dtype, device=setup.device, block_size=BLOCK,
                        num_kv_blocks=blocks, max_model_len=max_tokens + 8, enable_prefix_caching=False)


def make_worker(transport: str, name: str, config: TransportConfig, max_tokens: int,
                setup: Setup) -> tuple[EngineCore, KVTransport]:
    t = create_transport(transport, name, config)
    try:
        engine = EngineCore(engine_config(max_tokens, setup), t.allocate_kv_cache,
                            keep_cache_files=transport == "shm")
        t.register_kv_cache(engine.kv_cache, "demo", kv_scales=engine.kv_scales)
    except BaseException:
        t.close()
        raise
    return engine, t


def pin(cpu: int | None) -> None:
    """The calling thread (and threads it starts later) on one core, with one torch
    thread: the two workers' compute as if on two hosts (on a 2-core machine they would
    otherwise take each other's cores mid-matmul)."""
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
        torch.set_num_threads(1)


def free_helpers() -> None:
    """Threads this process started since pin() (shm's copy pool starts its threads on
    first use) back on every core: only the computing thread stays pinned."""
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and thread.native_id is not None:
            os.sched_setaffinity(thread.native_id, ALL_CPUS)


def decode_side(conn: Connection, transport: str, secret: DeploymentSecret | None, host: str,
                max_tokens: int, cpu: int | None, setup: Setup) -> None:
    """The decode worker: reserves on request, steps, and reports each first token and its time."""
    pin(cpu)
    engine, t = make_worker(transport, "decode", TransportConfig(timeout_s=TIMEOUT_S, cancel_grace_s=5.0,
                                                                  secret=secret, host=host), max_tokens, setup)
    core = DecodeWorkerCore(engine, t, TIMEOUT_S)
    conn.send_bytes(t.metadata())
    try:
        while True:
            for r in core.step().finished:
                conn.send_bytes(msgpack.packb({"id": r.request_id, "t": time.monotonic(),
                                               "ready": core.kv_ready_at(r.request_id),
                                               "n": len(r.output_token_ids), "token": r.output_token_ids[0]}))
            # Waits as the served decode worker's loop does (workers/loop.py: poll_ms): a
            # wait for pushed KV spinning here would take a core from the prefill worker.
            if engine.has_runnable():
                wait_ms = 0
            elif engine.has_unfinished() or t.holds_reservations():
                wait_ms = WAIT_POLL_MS
            else:
                wait_ms = IDLE_POLL_MS
            if not conn.poll(wait_ms / 1000):
                continue
            cmd = msgpack.unpackb(conn.recv_bytes(), raw=False)
            if cmd["op"] == "exit":
                return
            rp = core.add_request(cmd["id"], cmd["prompt"], FIRST_TOKEN, remote=True, sender=cmd["sender"])
            conn.send_bytes(encode(rp) if rp is not None else b"")
    finally:
        t.close()
        engine.close()


def local_compute(engine: EngineCore, request_id: str, prompt: list[int]) -> float:
    """Seconds for the prefill engine to compute the prompt's KV, as a remote prefill
    would (every token but the last), with no transport."""
    start = time.monotonic()
    engine.add_prefill_request(request_id, prompt[:-1])
    while not engine.is_prefilled(request_id):
        engine.step()
    elapsed = time.monotonic() - start
    engine.release_prefilled(request_id)
    return elapsed


def remote_ttft(conn: Connection, prefill: PrefillWorkerCore, request_id: str,
                prompt: list[int]) -> tuple[dict[str, float], PrefillDone]:
    """The request's TTFT and where it went (seconds): reserve (D's reply), then P's
    compute and exposed writes (PrefillDone), then D's last step: its KV complete to
    the first token."""
    start = time.monotonic()
    conn.send_bytes(msgpack.packb({"op": "request", "id": request_id, "prompt": prompt,
                                   "sender": prefill.transport.agent_name}))
    reply = conn.recv_bytes()
    if not reply:
        raise RuntimeError(f"{request_id}: the decode worker did not reserve blocks for a remote prefill")
    submitted = time.monotonic()
    descriptors, regions = prefill.transport.stats["descriptors"], prefill.transport.stats["regions"]
    prefill.submit(WORKER_MESSAGES.decode(reply))
    done: PrefillDone | None = None
    end = start + TIMEOUT_S
    while done is None:
        if time.monotonic() > end:
            raise TimeoutError(f"{request_id}: the remote prefill did not end")
        for result in prefill.step():
            if result.error is not None:
                raise RuntimeError(f"{request_id}: {result.error}")
            done = result
    if not conn.poll(TIMEOUT_S):
        raise TimeoutError(f"{request_id}: no first token")
    first = msgpack.unpackb(conn.recv_bytes(), raw=False)
    assert first["id"] == request_id and first["n"] == 1, first
    last = first["t"] - first["ready"] if first["ready"] is not None else float("nan")
    return dict(token=first["token"], ttft=first["t"] - start, reserve=submitted - start, last=last,
                descriptors=prefill.transport.stats["descriptors"] - descriptors,
                regions=prefill.transport.stats["regions"] - regions), done


def run_transport(label: str, tokens: list[int], modes: list[str], min_tokens: int, stream_layers: int,
                  repeats: int, placement: Placement, rng: random.Random, cpus: tuple[int, int] | None,
                  setup: Setup = Setup()) -> tuple[dict[tuple[int, str], dict[str, float]], int]:
    """Medians by (tokens, mode), and how many prompts' first tokens differed between modes."""
    name, _, curve = label.partition("+")
    secret = DeploymentSecret.new() if curve else None
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=decode_side, args=(child, name, secret, placement.receiver_host, max(tokens),
                                                 cpus[1] if cpus else None, setup), daemon=True)
    with placement.receiver():
        proc.start()
    prefills: dict[str, PrefillWorkerCore] = {}
    samples: dict[tuple[int, str], list[dict[str, float]]] = {}
    mismatches = 0
    try:
        if not conn.poll(TIMEOUT_S):
            raise TimeoutError("the decode worker did not start")
        metadata = conn.recv_bytes()
        with placement.sender():
            for mode in modes:
                config = TransportConfig(timeout_s=TIMEOUT_S, cancel_grace_s=5.0, secret=secret,
                                         host=placement.sender_host, stream=mode, stream_min_tokens=min_tokens,
                                         stream_layers=stream_layers)
                engine, t = make_worker(name, f"prefill-{mode}", config, max(tokens), setup)
                prefills[mode] = PrefillWorkerCore(engine, t)
                t.add_peer(metadata)
            # Only the computing thread: the transports' threads (ZMQ's I/O, shm's copies),
            # started above, stay free to take the other core, as a host's spare cores
            # (or a GPU host's copy engines) would move KV beside the compute.
            pin(cpus[0] if cpus else None)
            vocab = next(iter(prefills.values())).engine.model_config.vocab_size
            for rep in range(-1, repeats):  # -1: an untimed warm-up, of the shortest prompt only
                for n in tokens if rep >= 0 else tokens[:1]:
                    prompt = [rng.randrange(vocab) for _ in range(n)]
                    compute = local_compute(prefills[modes[0]].engine, f"local-{n}-{rep}", prompt)
                    first_tokens = set()
                    for mode in modes:
                        if cpus:
                            free_helpers()
                        times, done = remote_ttft(conn, prefills[mode], f"{mode}-{n}-{rep}", prompt)
                        first_tokens.add(times.pop("token"))
                        sample = dict(compute=compute, **times, ratio=times["ttft"] / compute,
                                      remote_compute=done.compute_s, exposed=done.transfer_s)
                        print(f"  {label} {mode:5s} {n:5d} tokens: "
                              + "  ".join(f"{k} {v:.3f}" for k, v in sample.items()), flush=True)
                        if rep >= 0:
                            samples.setdefault((n, mode), []).append(sample)
                    if len(first_tokens) > 1:
                        mismatches += 1
                        print(f"  MISMATCH: the modes' first tokens for one {n}-token prompt: {first_tokens}")
        conn.send_bytes(msgpack.packb({"op": "exit"}))
        proc.join(30)
    finally:
        for p in prefills.values():
            p.transport.close()
            p.engine.close()
        if proc.is_alive():
            proc.kill()
    return {key: {field: statistics.median(s[field] for s in rows) for field in rows[0]}
            for key, rows in samples.items()}, mismatches


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--transports", default="shm,tcp+curve")
    p.add_argument("--tokens", default="256,1024,4096")
    p.add_argument("--modes", default="off,chunk,layer")
    p.add_argument("--min-tokens", type=int, default=0, help="transport_options.stream_min_tokens")
    p.add_argument("--stream-layers", type=int, default=1, help="transport_options.stream_layers (layer mode)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--link", default=None, help="a rate (e.g. 1gbit): run across the bed's limited link")
    p.add_argument("--name", default="pdnetst", help="the bed's name (a bed of that name is replaced)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shared-cores", action="store_true",
                   help="let both workers use every core (default: each pinned to its own, one torch thread)")
    args = p.parse_args()
    tokens = [int(n) for n in args.tokens.split(",")]
    modes = args.modes.split(",")
    rng = random.Random(args.seed)
    cpus = None
    if not args.shared_cores:
        available = sorted(os.sched_getaffinity(0))
        if len(available) < 2:
            raise SystemExit("two cores are needed to give each worker its own (or pass --shared-cores)")
        cpus = (available[0], available[1])
    bed = None
    placement = Placement()
    if args.link is not None:
        rate_bits(args.link)
        bed = NetnsCluster(args.name, 2, owner=os.getpid()).up()
        bed.limit(RECEIVER, args.link)
        placement = Placement(lambda: bed.inside(SENDER), lambda: bed.inside(RECEIVER),
                              bed.address(SENDER), bed.address(RECEIVER))
    results = {}
    try:
        for label in args.transports.split(","):
            print(f"[{label}{' across ' + args.link if args.link else ''}]", flush=True)
            results[label], mismatches = run_transport(label, tokens, modes, args.min_tokens, args.stream_layers,
                                                       args.repeats, placement, rng, cpus)
            if mismatches:
                print(f"{label}: {mismatches} prompts' first tokens differed between modes", flush=True)
    finally:
        if bed is not None:
            bed.down()
    link = f", across a {args.link} link" if args.link else ""
    link += ", each worker on its own core" if cpus else ", both workers on every core"
    print(f"\nseconds, median of {args.repeats}{link}; ratio: remote TTFT / the prefill's own compute\n")
    print("| transport | tokens | mode | compute | remote TTFT | ratio | reserve | P compute | exposed | overlap "
          "| D's last step | descriptors | regions |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for label, rows in results.items():
        for (n, mode), m in sorted(rows.items()):
            off = rows.get((n, "off"))
            # One chunk: chunk mode writes once, as off does; layer mode still streams.
            streams = mode == "layer" or n - 1 > engine_config(n).max_num_batched_tokens
            overlap = f"{1 - m['exposed'] / off['exposed']:.0%}" if off and mode != "off" and streams else "-"
            print(f"| {label} | {n} | {mode} | {m['compute']:.3f} | {m['ttft']:.3f} | {m['ratio']:.2f}x | "
                  f"{m['reserve']:.3f} | {m['remote_compute']:.3f} | {m['exposed']:.3f} | {overlap} | "
                  f"{m['last']:.3f} | {m['descriptors']:.0f} | {m['regions']:.0f} |")


if __name__ == "__main__":
    main()
