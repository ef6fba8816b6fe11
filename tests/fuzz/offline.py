"""The offline fuzzer: one EngineCore (or LLM) with a random config and schedule."""

from __future__ import annotations

import random
import time
from pathlib import Path

from engine import LLM
from engine.config import EngineConfig
from engine.engine_core import EngineCore
from engine.request import Request
from tests.fuzz import shared_store
from tests.fuzz.cases import _fits, fit_tiers
from tests.fuzz.common import (
    Failure,
    Hang,
    OfflineCase,
    Oracle,
    ReqSpec,
    SeedResult,
    _check_tokens,
    _classify_hang,
    _exc_failure,
    _sched_state,
    check_constraint,
    lora_request_of,
    spec_params,
)

# ----------------------------------------------------------------------------- offline

def run_offline(case: OfflineCase, model_dir: str | Path, oracle: Oracle, wall_limit: float = 30.0,
                stall_steps: int = 300) -> SeedResult:
    """Run one offline case; never raises (everything is reported in the result)."""
    t0 = time.monotonic()
    res = SeedResult(case.seed)
    try:
        oracle.prefetch(case.requests)
        t0 = time.monotonic()  # the wall-time bound is the engine's alone (from when it is up)
        if case.mode == "llm":
            _offline_llm(case, str(model_dir), oracle, res, wall_limit, stall_steps)
        else:
            _offline_core(case, str(model_dir), oracle, res, wall_limit, stall_steps)
    except Exception as exc:  # the harness's own failure, or the engine's from construction
        res.failures.append(_exc_failure(case.seed, "run", exc))
    res.seconds = time.monotonic() - t0
    return res


def _expect_fit(case: OfflineCase, spec: ReqSpec, core: EngineCore) -> bool:
    e = case.engine
    return _fits(len(spec.prompt), spec.max_tokens, e["block_size"], e["num_kv_blocks"],
                 e["max_num_batched_tokens"], e["enable_chunked_prefill"], e.get("max_model_len"),
                 core.kv.sliding_window)


def _offline_core(case: OfflineCase, model_dir: str, oracle: Oracle, res: SeedResult,
                  wall_limit: float, stall_steps: int) -> None:
    shared = shared_store.client(case.seed) if case.shared_store else None
    core = EngineCore(EngineConfig(model=model_dir, **fit_tiers(case.engine, model_dir)), shared_kv=shared)
    try:  # a TP engine's followers are processes: stopped whatever happens
        _drive_core(case, core, oracle, res, time.monotonic(), wall_limit, stall_steps)
    finally:
        core.close()


def _drive_core(case: OfflineCase, core: EngineCore, oracle: Oracle, res: SeedResult, t0: float,
                wall_limit: float, stall_steps: int) -> None:
    """Step the schedule; t0: when the engine was up (a TP group takes long to start)."""
    live: dict[str, tuple[Request, ReqSpec]] = {}  # request id -> its current request
    done: set[int] = set()  # id() of finished requests
    keep: list[Request] = []  # ... kept alive, so that no id() is reused
    specs = list(case.requests)
    aborts: dict[int, list[str]] = {}
    for s in specs:
        if s.abort is not None:
            aborts.setdefault(s.abort, []).append(s.rid)
    step = stall = 0
    max_steps = 40 * sum(len(s.prompt) + s.max_tokens for s in specs) + 200
    i = 0
    while i < len(specs) or core.has_unfinished():
        if step == case.store_restart:
            shared_store.restart()
        for rid in aborts.pop(step, []):
            entry = live.pop(rid, None)
            if entry is None:
                continue
            request, spec = entry
            if id(request) in done:
                continue
            core.abort([rid])
            _check_tokens(case.seed, rid, request, spec, oracle, True, res.failures)
            done.add(id(request))
        while i < len(specs) and specs[i].arrive <= step:
            spec = specs[i]
            i += 1
            expect = _expect_fit(case, spec, core)
            prev = live.get(spec.rid)
            if prev is not None and id(prev[0]) not in done:  # still running: its reuse waits (not the test's point)
                continue
            try:
                request = core.add_request(spec.rid, spec.prompt, spec_params(spec), spec.priority,
                                           queue_tag=spec.queue_tag, lora_request=lora_request_of(spec.lora))
            except ValueError as exc:
                if expect:
                    res.failures.append(Failure(case.seed, "rejection", f"{spec.rid} refused though it fits "
                                                f"(prompt {len(spec.prompt)}, max_tokens {spec.max_tokens}): {exc}"))
                continue
            if not expect:
                res.failures.append(Failure(case.seed, "rejection", f"{spec.rid} accepted though it can never run "
                                            f"(prompt {len(spec.prompt)}, max_tokens {spec.max_tokens})"))
            res.requests += 1
            live[spec.rid] = (request, spec)
            keep.append(request)
        try:
            out = core.step()
        except Exception as exc:
            res.failures.append(_exc_failure(case.seed, f"step {step}", exc, _sched_state(core)))
            return
        for request in out.finished:
            entry = live.get(request.request_id)
            if entry is None or entry[0] is not request:
                res.failures.append(Failure(case.seed, "invariant", f"step {step}: finished request "
                                            f"{request.request_id} ({request.status.value}) is not a live one"))
                continue
            if id(request) in done:
                res.failures.append(Failure(case.seed, "invariant", f"{request.request_id} finished twice"))
                continue
            done.add(id(request))
            _check_tokens(case.seed, request.request_id, request, entry[1], oracle, False, res.failures)
        stall = 0 if (out.num_tokens or out.finished or not core.has_unfinished()) else stall + 1
        step += 1
        over = time.monotonic() - t0 > wall_limit
        if stall > stall_steps or step > max_steps or over:
            why = f"no progress for {stall} steps" if stall > stall_steps else (
                "wall time" if over else f"{step} steps")
            res.failures.append(Failure(case.seed, "hang", f"{why}: {_sched_state(core)}", _classify_hang(core)))
            return
    _check_quiescent(case.seed, core, res.failures)
    res.stats["preemptions"] = core.scheduler.num_preemptions
    res.stats["cache_hits"] = core.kv.pool.num_cache_hits
    if core.kv.tiers is not None:
        stats = core.kv.tiers.stats()
        res.stats["tier_loads"] = stats.loads
        res.stats["shared_hits"] = sum(t.hits for t in stats.tiers if t.name == "shared")
        res.stats["failed_loads"] = stats.failed_loads


def _check_quiescent(seed: int, core: EngineCore, failures: list[Failure], who: str = "") -> None:
    s = core.scheduler
    problems = []
    if core.has_unfinished():
        problems.append("has_unfinished")
    if s.running or s.waiting or s.requests or s.remote.prefilled:
        problems.append(f"leftover requests {list(s.requests)} running={len(s.running)} waiting={len(s.waiting)}")
    if getattr(s, "_free_after_step", None):
        problems.append(f"_free_after_step holds {len(s._free_after_step)}")
    if any(s.loras.users):
        problems.append(f"LoRA slots still held: {s.loras.users}")
    if s.loads.busy or s.loads.loading:
        problems.append(f"tier loads still in flight: {list(s.loads.loading)}")
    problems += _tier_leaks(core)
    if core.kv.num_free_blocks != core.kv.pool.num_blocks:
        problems.append(f"free blocks {core.kv.num_free_blocks}/{core.kv.pool.num_blocks} "
                        f"(held by {dict((k, len(v)) for k, v in core.kv.req_blocks.items())})")
    if problems:
        failures.append(Failure(seed, "invariant", f"{who}after all requests ended: " + "; ".join(problems)))


def _tier_leaks(core: EngineCore) -> list[str]:
    """Once its seals are done, every tier slot is an entry's, and no entry is pinned."""
    tiers = core.kv.tiers
    if tiers is None:
        return []
    deadline = time.monotonic() + 10
    while tiers.io.pending and time.monotonic() < deadline:
        tiers.poll(0.05)
    problems = [f"{tiers.io.pending} tier jobs unfinished"] if tiers.io.pending else []
    for index in tiers.indexes:
        pinned = [e.slot for e in index.entries.values() if e.pins]
        if pinned or index.num_used != len(index.entries):
            problems.append(f"{index.name} tier: {index.num_used} slots used by {len(index.entries)} entries, "
                            f"slots {pinned} pinned")
    return problems


def _offline_llm(case: OfflineCase, model_dir: str, oracle: Oracle, res: SeedResult,
                 wall_limit: float, stall_steps: int) -> None:
    llm = LLM(model_dir, **fit_tiers(case.engine, model_dir))
    try:
        _drive_llm(case, llm, oracle, res, time.monotonic(), wall_limit, stall_steps)
    finally:
        llm.core.close()


def _drive_llm(case: OfflineCase, llm: LLM, oracle: Oracle, res: SeedResult, t0: float,
               wall_limit: float, stall_steps: int) -> None:
    core = llm.core
    ok = [s for s in case.requests if _expect_fit(case, s, core)]
    bad = [s for s in case.requests if not _expect_fit(case, s, core)]
    for s in bad[:1]:  # the engine refuses it, and stays usable
        try:
            llm.generate([s.prompt], spec_params(s), use_tqdm=False, lora_request=lora_request_of(s.lora))
            res.failures.append(Failure(case.seed, "rejection", f"{s.rid} accepted though it can never run"))
        except ValueError:
            pass
    if not ok:
        return
    original = core.step
    state = {"steps": 0, "stall": 0}
    max_steps = 40 * sum(len(s.prompt) + s.max_tokens for s in ok) + 200

    def bounded_step():
        out = original()
        state["steps"] += 1
        state["stall"] = 0 if (out.num_tokens or out.finished) else state["stall"] + 1
        if state["stall"] > stall_steps or state["steps"] > max_steps or time.monotonic() - t0 > wall_limit:
            raise Hang(f"after {state['steps']} steps (stall {state['stall']})", _classify_hang(core))
        return out

    core.step = bounded_step
    res.requests += len(ok)
    # one to three generate() calls in a row: later ones meet the prefix cache the earlier left
    rng = random.Random(f"offline-llm-{case.seed}")
    cuts = sorted(rng.sample(range(1, len(ok)), min(len(ok) - 1, rng.randint(0, 2)))) if len(ok) > 1 else []
    outs = []
    try:
        for a, b in zip([0] + cuts, cuts + [len(ok)]):
            part = ok[a:b]
            outs += llm.generate([s.prompt for s in part], [spec_params(s) for s in part], use_tqdm=False,
                                 priority=[s.priority for s in part], lora_request=[lora_request_of(s.lora) for s in part])
    except Exception as exc:
        res.failures.append(_exc_failure(case.seed, "LLM.generate", exc, _sched_state(core)))
        return
    for s, o in zip(ok, outs):
        ref, status = oracle.expect(s)
        if o.token_ids != ref or o.finish_reason != status:
            res.failures.append(Failure(case.seed, "mismatch", f"{s.rid} prompt_len={len(s.prompt)} "
                                        f"params={s.params} got {o.token_ids} ({o.finish_reason}) oracle {ref} ({status})"))
        if o.finish_reason == "stop":
            check_constraint(case.seed, f"{s.rid} params={s.params}", s.params, o.token_ids, oracle, res.failures)
    _check_quiescent(case.seed, core, res.failures)
    res.stats["preemptions"] = core.scheduler.num_preemptions
