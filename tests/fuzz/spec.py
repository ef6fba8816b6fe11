"""Random schedules under speculative decoding, against the engine without it.

    .venv/bin/python -m tests.fuzz.spec --seeds 0:400     # the long run

Each seed (tests/fuzz/spec_cases.py) draws an engine (k in 1..6, now and then 8 or 16,
prompt_lookup_min/max, a KV pool small enough to preempt, a token budget small enough
to chunk prompts and cut drafts short, prefix caching, max_num_seqs, sometimes a short
context or a low-acceptance fallback, the C decode kernel or not), a proposer (the real
n-gram one; an oracle that knows each greedy request's tokens and drafts them right,
wrong, half right or at random, tests/fuzz/spec_oracle.py; or a draft model: the target
itself or its first layer alone) and up to 8 requests: prompts that repeat a pattern
(so n-grams hit) or not, max_tokens from 1, stop tokens with min_tokens, penalties,
logit_bias, bad words, allowed_token_ids, logprobs, prompt logprobs, greedy groups of
n > 1, some sampled requests (seeded or not; n > 1 too), structured outputs
(--structured). Most seeds step an EngineCore by hand, with arrivals and aborts at
random steps; the others run LLM.generate, with stop strings.

Every greedy request (each sequence of a group) must end as it does alone in a roomy
engine without speculation: the same tokens, finish reason, text (LLM) and logprobs
(within 1e-4); an aborted one's tokens so far must be a prefix of those. A seeded
sampled request must end as it does alone in a roomy engine that speculates (its draws
are keyed on its output position, so its drafts do not matter); an unseeded one must
keep to its params. A constrained request its grammar ended must obey it. Nothing may
raise or hang, and once everything ended every KV block is free.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

from engine import LLM
from engine.attention import cpu_decode
from engine.config import EngineConfig
from engine.engine_core import EngineCore
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.speculative import speculator as speculator_module
from tests.fuzz.common import ReqSpec, spec_params
from tests.fuzz.spec_cases import _fits_engine, draw_case
from tests.fuzz.spec_oracle import Proposer, SpecOracle, check_constraint, check_greedy, check_sampled

FINISH = {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length"}


@dataclass
class SeedResult:
    seed: int
    problems: list[str] = field(default_factory=list)
    stats: Counter = field(default_factory=Counter)


# ----------------------------------------------------------------------------- a run

def run_seed(model: str | Path, seed: int, oracle: SpecOracle, structured: float = 0.0,
             draft_models: Sequence[str | Path] = (), wall_limit_s: float = 60.0, device: str = "cpu") -> SeedResult:
    """Run the seed's case under speculation; its problems are empty when it passed.
    `draft_models`: directories some seeds draft with (draft_models())."""
    res = SeedResult(seed)
    engine, mode, kind, specs = draw_case(seed, oracle, structured, [str(d) for d in draft_models])
    engine["device"] = device
    proposer = Proposer(kind, random.Random(f"spec-proposer-{seed}"))
    for s in specs:  # the oracle's outputs first, so that nothing patched below runs them
        params = spec_params(s)
        if params.greedy or params.seed is not None:
            for j in range(params.n):
                out = oracle.expect(s.prompt, params.child(j))
            if params.greedy:
                proposer.refs.append((tuple(s.prompt), out.token_ids))
    core = None
    no_kernel = engine["attention_backend"] == "no_kernel"
    if no_kernel:
        engine = dict(engine, attention_backend="auto")
    with mock.patch.object(speculator_module, "propose_ngram", proposer), \
            (mock.patch.object(cpu_decode, "load", lambda: None) if no_kernel else contextlib.nullcontext()):
        try:
            if mode == "llm":
                llm = LLM(str(model), **engine)
                core = llm.core
                _run_llm(llm, engine, specs, oracle, res, time.monotonic() + wall_limit_s)
            else:
                core = EngineCore(EngineConfig(model=str(model), **engine))
                _run_core(core, engine, specs, oracle, res, time.monotonic() + wall_limit_s)
            _check_quiet(core, res)
        except Exception as exc:  # noqa: BLE001 - any escape is the finding
            res.problems.append(f"{type(exc).__name__}: {exc}")
        finally:
            if core is not None:
                core.close()
    if core is not None:
        stats = core.speculator.stats
        res.stats.update(draft_tokens=stats.num_draft_tokens, accepted=stats.num_accepted_tokens,
                         rejected=stats.num_draft_tokens - stats.num_accepted_tokens, disabled=stats.num_disabled,
                         preemptions=core.scheduler.num_preemptions, cache_hits=core.kv.pool.num_cache_hits,
                         oracle_known=proposer.counts["known"], no_kernel=no_kernel,
                         draft_model_seeds=kind == "draft_model",
                         reference_backend=engine["attention_backend"] == "reference",
                         k_over_6=core.speculator.config.num_speculative_tokens > 6)
    res.problems = [f"seed {seed}: {p} | {mode} engine {engine}{' no C kernel' if no_kernel else ''} proposer {kind}"
                    for p in res.problems]
    return res


def _check_quiet(core: EngineCore, res: SeedResult) -> None:
    kv, s = core.kv, core.scheduler
    if kv.num_free_blocks != kv.pool.num_blocks or kv.req_blocks or s.requests or s.running or s.num_waiting:
        res.problems.append(f"{kv.pool.num_blocks - kv.num_free_blocks} blocks still held "
                            f"({ {k: len(v) for k, v in kv.req_blocks.items()} }), requests {list(s.requests)}")


def _count_cut_drafts(core: EngineCore, res: SeedResult) -> None:
    """Count drafts proposed but not scheduled: cut short by the budget (or their
    request not scheduled this step)."""
    schedule = core.scheduler.schedule

    def counted():
        offered = sum(len(r.spec.token_ids) for r in core.scheduler.running if r.spec is not None)
        out = schedule()
        res.stats["drafts_cut"] += offered - out.num_draft_tokens
        return out

    core.scheduler.schedule = counted


def _run_core(core: EngineCore, engine: dict[str, Any], specs: list[ReqSpec], oracle: SpecOracle,
              res: SeedResult, deadline: float) -> None:
    live: dict[str, Request] = {}
    expected: dict[str, tuple[ReqSpec, SamplingParams]] = {}  # sequence id -> its spec and params
    aborts: dict[int, list[str]] = {}
    _count_cut_drafts(core, res)
    max_steps = 40 * sum(len(s.prompt) + s.max_tokens for s in specs) + 200
    step = i = 0

    def finished(request: Request, aborted: bool) -> None:
        if request.prefill_only:  # a group's prompt, ended by its sequences' aborts
            return
        if live.pop(request.request_id, None) is not request:
            res.problems.append(f"{request.request_id} finished ({request.status.value}) but was not live")
            return
        spec, params = expected[request.request_id]
        what = f"{request.request_id} prompt {len(spec.prompt)} max_tokens {spec.max_tokens} params {spec.params}"
        tokens, finish = list(request.output_token_ids), FINISH.get(request.status, request.status.value)
        logprobs = request.output_logprobs if params.logprobs is not None else None
        if params.greedy or params.seed is not None:
            prompt_logprobs = [None, *request.prompt_logprobs.entries] if request.prompt_logprobs is not None else None
            res.problems += check_greedy(what, tokens, finish, logprobs, oracle.expect(spec.prompt, params),
                                         aborted, prompt_logprobs=prompt_logprobs)
            res.problems += check_constraint(what, spec.params, tokens, finish, oracle)
            res.stats["grammar_stops"] += "structured_outputs" in spec.params and finish == "stop"
        elif not aborted:
            res.problems += check_sampled(what, tokens, finish, params, logprobs)
        res.stats["checked"] += 1
        res.stats["seeded_sampled"] += not params.greedy and params.seed is not None

    while i < len(specs) or core.has_unfinished():
        while i < len(specs) and specs[i].arrive <= step:
            s = specs[i]
            i += 1
            params = spec_params(s)
            fits = _fits_engine(engine, s)
            try:
                request = core.add_request(s.rid, s.prompt, params, s.priority)
            except ValueError as exc:
                if fits:
                    res.problems.append(f"{s.rid} refused though it fits: {exc}")
                continue
            if not fits:
                res.problems.append(f"{s.rid} accepted though it can never run")
            sequences = request.sequences if request.sequences is not None else [request]
            for j, sequence in enumerate(sequences):
                live[sequence.request_id] = sequence
                expected[sequence.request_id] = (s, params.child(j) if params.n > 1 else params)
            res.stats["groups"] += params.n > 1
            if s.abort is not None:
                victim = random.Random(s.rid).choice(sequences).request_id
                aborts.setdefault(max(s.abort, step + 1), []).append(victim)
        for rid in aborts.pop(step, []):
            if rid in live:
                res.stats["aborts"] += 1
                for request in core.abort([rid]):
                    finished(request, aborted=True)
        for request in core.step().finished:
            finished(request, aborted=False)
        step += 1
        if time.monotonic() > deadline or step > max_steps:
            running = [(r.request_id, r.num_computed_tokens, r.num_tokens) for r in core.scheduler.running]
            res.problems.append(f"no end after {step} steps: running {running}, waiting {core.scheduler.num_waiting}")
            return
    if live:
        res.problems.append(f"never finished: {sorted(live)}")


def _run_llm(llm: LLM, engine: dict[str, Any], specs: list[ReqSpec], oracle: SpecOracle, res: SeedResult,
             deadline: float) -> None:
    """All requests that fit through LLM.generate (stop strings are the front end's)."""
    core = llm.core
    _count_cut_drafts(core, res)
    step = core.step

    def bounded_step():
        if time.monotonic() > deadline:
            raise TimeoutError("LLM.generate did not end in time")
        return step()

    core.step = bounded_step
    ok = [s for s in specs if _fits_engine(engine, s)]
    params = [spec_params(s) for s in ok]
    outs = llm.generate([s.prompt for s in ok], params, use_tqdm=False, priority=[s.priority for s in ok])
    for s, p, out in zip(ok, params, outs):
        for j, seq in enumerate(out.sequences or [out]):
            child = p.child(j) if p.n > 1 else p
            what = f"{seq.request_id} prompt {len(s.prompt)} max_tokens {s.max_tokens} params {s.params}"
            if child.greedy or child.seed is not None:
                res.problems += check_greedy(what, seq.token_ids, seq.finish_reason, seq.logprobs,
                                             oracle.expect(s.prompt, child), text=seq.text,
                                             prompt_logprobs=seq.prompt_logprobs)
                res.problems += check_constraint(what, s.params, seq.token_ids, seq.finish_reason, oracle)
                res.stats["grammar_stops"] += "structured_outputs" in s.params and seq.finish_reason == "stop"
            else:
                res.problems += check_sampled(what, seq.token_ids, seq.finish_reason, child, seq.logprobs)
            res.stats["checked"] += 1
            res.stats["seeded_sampled"] += not child.greedy and child.seed is not None
            res.stats["stop_strings"] += bool(child.stop) and seq.finish_reason == "stop"
        res.stats["groups"] += p.n > 1


def draft_models(target: Path, root: Path) -> list[Path]:
    """Draft models for the fuzzer: the target itself (greedy drafts always right) and
    its first layer alone (right now and then)."""
    from tests.unit.test_spec_draft_model import derived_model

    return [target, derived_model(target, root / "one_layer", num_layers=1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0:100", help="START:END")
    parser.add_argument("--structured", type=float, default=0.0,
                        help="fraction of greedy requests under a structured_outputs constraint")
    parser.add_argument("--device", default="cpu", help="the engines' device (the oracle's too)")
    parser.add_argument("--no-draft-models", action="store_true", help="n-gram and oracle drafts only")
    args = parser.parse_args()
    start, stop = map(int, args.seeds.split(":"))
    import torch

    torch.set_num_threads(1)  # the tiny model's steps are all overhead
    from tests.tiny_models import build_tiny_model

    root = Path(tempfile.mkdtemp())
    model = build_tiny_model("llama", root / "llama")
    drafts = [] if args.no_draft_models else draft_models(model, root)
    oracle = SpecOracle(model, args.device)
    t0 = time.monotonic()
    problems, totals = [], Counter()
    for seed in range(start, stop):
        res = run_seed(model, seed, oracle, args.structured, drafts, device=args.device)
        problems += res.problems
        totals.update(res.stats)
        for p in res.problems:
            print(p[:3000], flush=True)
    print(f"seeds {start}..{stop - 1} (structured {args.structured:g}) in {time.monotonic() - t0:.0f} s: {len(problems)} problems; "
          f"{json.dumps(dict(sorted(totals.items())))}")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
