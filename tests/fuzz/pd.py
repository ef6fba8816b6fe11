"""The P/D fuzzer: a decode core and a prefill core over a real transport, joined by
a simulated control channel, with slow copies, deadlines, lost messages and aborts."""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine.config import EngineConfig
from engine.engine_core import EngineCore, StepOutput
from engine.request import Request, RequestStatus
from tests.fuzz import shared_store
from tests.fuzz.cases import _fits, fit_tiers
from tests.fuzz.common import (
    Failure,
    Oracle,
    PDCase,
    ReqSpec,
    SeedResult,
    _check_tokens,
    _classify_hang,
    _exc_failure,
    _sched_state,
    lora_spec,
    spec_params,
)
from tests.fuzz.offline import _check_quiescent

# ----------------------------------------------------------------------------- P/D

def _slow_data_plane(transport: Any, rng: random.Random, p: float, max_s: float, grace_s: float,
                     late: list[tuple[str, float]], copy_bound_s: float = 0.0) -> Callable[[], None]:
    """Hold back a fraction of the writes' bytes by a random delay; returns the undo.

    shm: either the copy job waits in the transport's own copy pool before it runs (a
    busy pool or host: whatever the transport checks when the copy starts still runs), or
    its first chunk copies slowly (kv_transfer.shm._copy_chunk, where the transport has
    it: the copy started in time but lands late). Both in the transport's own pool, so
    close() waits for them. tcp: the data, sent with the notification, goes out late.
    `late` collects the writes whose bytes landed after deadline + cancel_grace_s (when
    D may have released their blocks: the window of F3)."""
    if p <= 0:
        return lambda: None
    if transport.name != "shm":
        ready: dict[int, float] = {}
        original = transport._progress

        def progress(write):
            at = ready.setdefault(write.xfer, time.monotonic() + (rng.uniform(0, max_s) if rng.random() < p else 0.0))
            if time.monotonic() < at:
                return False
            ready.pop(write.xfer, None)
            return original(write)

        transport._progress = progress
        return lambda: None

    import kv_transfer.shm as shm_module

    chunked = hasattr(shm_module, "_copy_chunk")
    local = threading.local()  # the copy thread's pending slowness
    current: dict[str, Any] = {}  # the write whose _start is submitting its copy
    original_start, pool = transport._start, transport._pool
    real_submit = pool.submit

    def start(peer, write):
        current["write"] = write
        try:
            original_start(peer, write)
        finally:
            current.pop("write", None)

    def submit(fn, *args, **kwargs):
        write = current.get("write")
        if write is None or rng.random() >= p:
            return real_submit(fn, *args, **kwargs)
        delay = rng.uniform(0, max_s)
        in_copy = chunked and rng.random() < 0.5
        if in_copy and copy_bound_s:
            delay = min(delay, copy_bound_s)

        def job():
            if in_copy:
                local.delay = delay
            else:
                time.sleep(delay)
            try:
                out = fn(*args, **kwargs)
            finally:
                local.delay = 0.0
            if time.time() > write.deadline + grace_s:
                late.append((write.req, round(time.time() - write.deadline, 3)))
            return out

        return real_submit(job)

    transport._start, pool.submit = start, submit
    if not chunked:
        return lambda: None
    original_chunk = shm_module._copy_chunk

    def slow_chunk(to, frm):
        delay = getattr(local, "delay", 0.0)
        if delay:
            local.delay = 0.0
            time.sleep(delay)
        return original_chunk(to, frm)

    shm_module._copy_chunk = slow_chunk
    return lambda: setattr(shm_module, "_copy_chunk", original_chunk)


def run_pd(case: PDCase, model_dir: str | Path, oracle: Oracle, wall_limit: float = 30.0,
           stall_ticks: int = 300) -> SeedResult:
    """Run one P/D case; never raises."""
    from kv_transfer import TransportConfig, create_transport

    t0 = time.monotonic()
    res = SeedResult(case.seed)
    transports = []
    engines: list[EngineCore] = []
    undo: list[Callable[[], None]] = []
    try:
        oracle.prefetch(case.requests)
        t0 = time.monotonic()
        config = TransportConfig(timeout_s=case.timeout_s, cancel_grace_s=case.grace_s, stream=case.stream,
                                 stream_min_tokens=case.stream_min_tokens, stream_layers=case.stream_layers)
        t_dec = create_transport(case.transport, "decode", config)
        transports.append(t_dec)
        t_pre = create_transport(case.transport, "prefill", config)
        transports.insert(0, t_pre)  # closed first: its copy threads write into D's cache
        _pd(case, str(model_dir), oracle, res, wall_limit, stall_ticks, t_dec, t_pre, engines, undo)
    except Exception as exc:
        res.failures.append(_exc_failure(case.seed, "run", exc))
    finally:
        files = [f for e in engines for f in e.kv_cache_files]
        for closable in [*transports, *engines]:  # engines last: the transports map their caches
            try:
                closable.close()
            except Exception as exc:
                res.failures.append(Failure(case.seed, "exception", f"close: {type(exc).__name__}: {exc}"))
        left = [f for f in files if os.path.exists(f)]
        if left:
            res.failures.append(Failure(case.seed, "invariant", f"rank cache files left after close: {left}"))
        for u in undo:  # once the copy pools are shut down
            u()
    res.seconds = time.monotonic() - t0
    return res


def _engine(model_dir: str, options: dict[str, Any], transport: Any, engines: list[EngineCore],
            shared: bool, seed: int) -> EngineCore:
    """A worker's engine with its caches registered, as workers.start makes it: at TP > 1
    each rank's cache is a file (kept while shm peers map it by name); appended to
    `engines` at once, so that its follower processes are stopped whatever happens next."""
    from workers.start import register_caches

    engine = EngineCore(EngineConfig(model=model_dir, **fit_tiers(options, model_dir)), transport.allocate_kv_cache,
                        keep_cache_files=transport.name == "shm",
                        shared_kv=shared_store.client(seed) if shared and "kv_offload_gib" in options else None)
    engines.append(engine)
    register_caches(transport, engine, "tiny-llama")
    return engine


def _pd(case: PDCase, model_dir: str, oracle: Oracle, res: SeedResult, wall_limit: float, stall_ticks: int,
        t_dec: Any, t_pre: Any, engines: list[EngineCore], undo: list[Callable[[], None]]) -> None:
    from decode_worker.remote_kv import DecodeWorkerCore
    from prefill_worker.remote_prefill import PrefillWorkerCore

    rng = random.Random(f"pd-run-{case.transport}-{case.seed}")
    dec_engine = _engine(model_dir, case.dec, t_dec, engines, case.shared_store, case.seed)
    pre_engine = _engine(model_dir, case.pre, t_pre, engines, case.shared_store, case.seed)
    t0 = time.monotonic()  # the wall-time bound is the workers' alone, once up (TP groups start slowly)
    p_name = t_pre.agent_name
    t_pre.add_peer(t_dec.metadata())
    dec = DecodeWorkerCore(dec_engine, t_dec, case.deadline_s)
    pre = PrefillWorkerCore(pre_engine, t_pre)
    late: list[tuple[str, float]] = []
    undo.append(_slow_data_plane(t_pre, random.Random(f"pd-copies-{case.transport}-{case.seed}"), case.slow_copy_p,
                                 case.slow_copy_max_s, case.grace_s, late, case.copy_bound_s))

    # Requests are tracked by their index in `specs`: an id may be reused once free.
    specs = sorted(case.requests, key=lambda s: s.arrive)
    current: dict[str, int] = {}  # request id -> the spec it belongs to now
    objs: dict[int, Request] = {}
    finished: set[int] = set()
    aborted: set[int] = set()
    sent_remote: set[int] = set()
    to_p: list[tuple[int, str, Any]] = []  # (due tick, kind, payload), FIFO
    to_d: list[tuple[int, str, Any]] = []
    actions: list[tuple[int, str, int]] = []  # (tick, what, spec index)
    for k, s in enumerate(specs):
        if s.abort is not None:
            actions.append((s.abort, "abort", k))

    def send(queue: list, tick: int, kind: str, payload: Any) -> None:
        due = tick + rng.randint(0, case.msg_delay_max)
        if queue:
            due = max(due, queue[-1][0])  # FIFO, like one ZMQ connection
        queue.append((due, kind, payload))

    def d_fits(spec: ReqSpec) -> bool:
        d = case.dec
        return _fits(len(spec.prompt), spec.max_tokens, d["block_size"], d["num_kv_blocks"],
                     d["max_num_batched_tokens"], d["enable_chunked_prefill"], d.get("max_model_len"),
                     dec_engine.kv.sliding_window)

    def state() -> str:
        return (f"D: {_sched_state(dec_engine)} waiting_for_kv={sorted(dec.waiting_for_kv)} "
                f"quarantine={list(t_dec.receiving.quarantine)} | P: jobs={list(pre.jobs)} held={len(pre._held)} "
                f"{_sched_state(pre_engine)} | msgs to_p={[(d, k) for d, k, _ in to_p]} "
                f"to_d={[(d, k) for d, k, _ in to_d]} late_landings={late}")

    def fingerprint() -> tuple:
        d = dec_engine.scheduler
        p = pre_engine.scheduler
        return (len(finished), len(aborted), sum(r.num_computed_tokens + len(r.output_token_ids) for r in d.requests.values()),
                len(d.requests), sum(r.num_computed_tokens for r in p.requests.values()), len(p.requests),
                len(pre.jobs), len(dec.waiting_for_kv), len(t_dec.receiving.quarantine), len(to_p), len(to_d),
                tuple(sorted(t_pre.stats.items())), tuple(sorted(t_dec.stats.items())), tuple(sorted(dec.stats.items())))

    tick = 0
    i = 0
    last_fp, last_change_tick, last_change_t = None, 0, time.monotonic()

    def resolved() -> bool:
        # A given-up reservation's blocks stay held by D (fenced) until D's next poll
        # after the transport released them: that must come too.
        return (i >= len(specs) and not dec_engine.has_unfinished() and not pre.jobs
                and not pre_engine.has_unfinished() and not t_dec.receiving.quarantine
                and not dec.quarantined_blocks() and not to_p and not to_d)

    while not resolved():
        # client side: aborts and scheduled fates
        for a in [a for a in actions if a[0] <= tick]:
            actions.remove(a)
            _, what, k = a
            if k not in objs or k in finished or k in aborted:
                continue
            rid = specs[k].rid
            if what == "abort":
                if k in sent_remote:
                    send(to_p, tick, "abort", rid)
                dec.abort(rid)
                aborted.add(k)
                _check_tokens(case.seed, rid, objs[k], specs[k], oracle, True, res.failures)
            elif what == "prefill_failed":  # as if P reported an error (lost, or spurious)
                dec.prefill_failed(rid)
            elif what == "p_error":  # P fails the job itself; its result reports the error
                pre.abort(rid)
        while i < len(specs) and specs[i].arrive <= tick:
            k, spec = i, specs[i]
            i += 1
            expect = d_fits(spec)
            if spec.rid in dec_engine.scheduler.requests:  # reused too early: still in use
                expect = False
            try:
                rp = dec.add_request(spec.rid, spec.prompt, spec_params(spec), spec.remote,
                                     spec.priority, sender=p_name if spec.sender else None, queue_tag=spec.queue_tag,
                                     lora=lora_spec(spec.lora))
            except ValueError as exc:
                if expect:
                    res.failures.append(Failure(case.seed, "rejection", f"D refused {spec.rid} though it fits: {exc}"))
                continue
            if not expect:
                res.failures.append(Failure(case.seed, "rejection", f"D accepted {spec.rid} though it can never run "
                                            "(or its id is still in use)"))
            res.requests += 1
            current[spec.rid] = k
            objs[k] = dec_engine.scheduler.requests[spec.rid]
            if rp is None:
                continue
            sent_remote.add(k)
            if spec.fate == "lost":
                if spec.fate_at >= 0:
                    actions.append((tick + spec.fate_at, "prefill_failed", k))
            else:
                send(to_p, tick, "prefill", rp)
                if spec.fate == "perror":
                    actions.append((tick + spec.fate_at, "p_error", k))
                elif spec.fate == "spurious":
                    actions.append((tick + spec.fate_at, "prefill_failed", k))
        # the message channel
        while to_p and to_p[0][0] <= tick:
            _, kind, payload = to_p.pop(0)
            if kind == "prefill":
                try:
                    pre.submit(payload)
                except ValueError as exc:  # P refuses it: prefill_done with the error
                    send(to_d, tick, "done", (payload.request_id, str(exc)))
            else:
                pre.abort(payload)
        while to_d and to_d[0][0] <= tick:
            _, kind, (rid, error) = to_d.pop(0)
            if error and rid in dec.waiting_for_kv:
                dec.prefill_failed(rid)
        # the workers
        try:
            if rng.random() >= case.p_skip:
                for r in pre.step():
                    send(to_d, tick, "done", (r.request_id, r.error))
        except Exception as exc:
            res.failures.append(_exc_failure(case.seed, f"P step, tick {tick}", exc, state()))
            return
        try:
            out = dec.step() if not case.d_skip or rng.random() >= case.d_skip else StepOutput()
        except Exception as exc:
            res.failures.append(_exc_failure(case.seed, f"D step, tick {tick}", exc, state()))
            return
        # Requests the decode core failed itself: a late KV write overwrote blocks they
        # held (detected, F3's fix). Legitimate, but reported: the client gets an error.
        corrupted = getattr(dec, "corrupted", None)
        if corrupted:
            for rid in list(corrupted):
                k = current.get(rid, -1)
                if k in objs and k not in finished and k not in aborted:
                    aborted.add(k)
                    request, spec = objs[k], specs[k]
                    ref = oracle.expect(spec)[0]
                    got = list(request.output_token_ids)
                    res.failures.append(Failure(case.seed, "error_finish", f"{rid} failed by D: a late KV write "
                                                f"overwrote its blocks (tick {tick}, {len(got)} tokens out, "
                                                f"{'a prefix of' if got == ref[:len(got)] else 'NOT a prefix of'} "
                                                f"the oracle's); late landings {late}", "F3-detected"))
            corrupted.clear()
        for request in out.finished:
            rid = request.request_id
            k = current.get(rid, -1)
            if objs.get(k) is not request or k in finished or k in aborted:
                if k in aborted and request.status == RequestStatus.FINISHED_ABORTED:
                    continue
                res.failures.append(Failure(case.seed, "invariant", f"tick {tick}: unexpected finish of {rid} "
                                            f"({request.status.value})"))
                continue
            finished.add(k)
            known = "F3" if late else ""
            _check_tokens(case.seed, rid, request, specs[k], oracle, False, res.failures, known)
        if case.jitter_s and rng.random() < 0.3:
            time.sleep(rng.uniform(0, case.jitter_s))
        tick += 1
        fp = fingerprint()
        now = time.monotonic()
        if fp != last_fp:
            last_fp, last_change_tick, last_change_t = fp, tick, now
        else:
            time.sleep(0.0005)  # idle: let copies land and time pass
        timers = bool(dec.waiting_for_kv or t_dec.receiving.quarantine or pre.jobs or t_pre.sending.writes)
        stall_s = (case.deadline_s + case.grace_s + case.timeout_s + 1.0 + case.slow_copy_max_s) if timers else 0.5
        stalled = tick - last_change_tick > stall_ticks and now - last_change_t > stall_s
        if stalled or now - t0 > wall_limit:
            why = f"no progress for {tick - last_change_tick} ticks / {now - last_change_t:.1f} s" if stalled \
                else f"wall time {now - t0:.1f} s"
            res.failures.append(Failure(case.seed, "hang", f"tick {tick}, {why}: {state()}", _classify_hang(dec_engine)))
            return
    for k in objs:
        if k not in finished and k not in aborted:
            res.failures.append(Failure(case.seed, "invariant", f"{specs[k].rid} (#{k}) never finished"))
    _check_quiescent(case.seed, dec_engine, res.failures, "D ")
    _check_quiescent(case.seed, pre_engine, res.failures, "P ")
    if pre._held:
        res.failures.append(Failure(case.seed, "invariant", f"P still holds source blocks of {len(pre._held)} writes"))
    if t_dec.stats.get("overwritten_in_use"):  # the fence broke: bytes landed in blocks D had let go of
        res.failures.append(Failure(case.seed, "invariant", f"{t_dec.stats['overwritten_in_use']} writes landed in "
                                                            "released blocks", "F3"))
    res.stats.update(fallbacks=dec.stats["fallbacks"], remote=dec.stats["remote"],
                     late_writes_dropped=t_dec.stats["late_writes_dropped"], expired=t_dec.stats["expired"],
                     p_failed=pre.stats["failed"], preemptions=dec_engine.scheduler.num_preemptions,
                     late_landings=len(late), overwritten=t_dec.stats.get("overwritten", 0),
                     overwritten_in_use=t_dec.stats.get("overwritten_in_use", 0),
                     tier_loads=sum(e.kv.tiers.stats().loads for e in (dec_engine, pre_engine) if e.kv.tiers is not None))
