"""Random schedules under speculative decoding, against the engine without it.

    .venv/bin/python -m tests.fuzz.spec --seeds 0:400     # the long run

Each seed draws an engine (k in 1..6, prompt_lookup_min/max, a KV pool small enough
to preempt, a token budget small enough to chunk prompts and cut drafts short, prefix
caching, max_num_seqs, sometimes a short context or a low-acceptance fallback), a
proposer (the real n-gram one, or an oracle that knows each greedy request's tokens
and drafts them right, wrong, half right or at random: tests/fuzz/spec_oracle.py) and
up to 8 requests: prompts that repeat a pattern (so n-grams hit) or not, max_tokens
from 1, stop tokens with min_tokens, penalties, logit_bias, bad words,
allowed_token_ids, logprobs, prompt logprobs, greedy groups of n > 1, a few sampled
requests. Most seeds step an EngineCore by hand, with arrivals and aborts at random
steps; the others run LLM.generate, with stop strings.

Every greedy request (each sequence of a group) must end as it does alone in a roomy
engine without speculation: the same tokens, finish reason, text (LLM) and logprobs
(within 1e-4); an aborted one's tokens so far must be a prefix of those. Sampled
requests (their draws differ with drafts) must keep to their params. Nothing may raise
or hang, and once everything ended every KV block is free.
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
from tests.fuzz.cases import STOP_STRINGS, _fits, _max_tokens
from tests.fuzz.common import VOCAB, ReqSpec, spec_params
from tests.fuzz.spec_oracle import EOS, Proposer, SpecOracle, check_constraint, check_greedy, check_sampled
from tests.fuzz.structured import draw_constraint

FINISH = {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length"}


@dataclass
class SeedResult:
    seed: int
    problems: list[str] = field(default_factory=list)
    stats: Counter = field(default_factory=Counter)


# ----------------------------------------------------------------------------- a seed's case

def _prompt(rng: random.Random, shared: list[int], earlier: list[list[int]]) -> list[int]:
    r = rng.random()
    if earlier and r < 0.15:
        return list(rng.choice(earlier))  # identical: a prefix hit up to its last block
    if r < 0.6:  # a pattern repeated, perhaps after a shared start and before a tail
        pattern = [rng.randrange(2, VOCAB) for _ in range(rng.randint(1, 5))]
        head = shared[:rng.randint(0, len(shared))] if rng.random() < 0.4 else []
        tail = [rng.randrange(2, VOCAB) for _ in range(rng.choice((0, 0, 1, 3)))]
        return (head + pattern * rng.randint(2, 8) + tail)[:60]
    if r < 0.8:
        return shared[:rng.randint(1, len(shared))] + [rng.randrange(2, VOCAB) for _ in range(rng.randint(0, 6))]
    return [rng.randrange(2, VOCAB) for _ in range(rng.randint(1, 40))]


def _params(rng: random.Random, max_tokens: int, plain: list[int], text: str, llm: bool) -> dict[str, Any]:
    """Params besides greedy; `plain` (`text`) is the request's plain greedy output,
    from which stop tokens, stop strings, bad words and biases are drawn so they bite."""
    out: dict[str, Any] = {}
    seen = plain or [rng.randrange(2, VOCAB)]
    for _ in range(rng.choice((0, 0, 1, 1, 2))):
        kind = rng.randrange(9)
        if kind == 0:
            out["stop_token_ids"] = sorted({rng.choice(seen), *rng.sample(range(2, VOCAB), rng.randint(0, 20))})
            out["min_tokens"] = rng.randint(0, max_tokens)
            out["ignore_eos"] = rng.random() < 0.5
        elif kind == 1:
            out["repetition_penalty"] = rng.choice((0.7, 1.3, 2.0))
        elif kind == 2:
            out.update(presence_penalty=rng.choice((-0.5, 0.8)), frequency_penalty=rng.choice((-0.3, 0.0, 0.6)))
        elif kind == 3:  # ban a token it would take, favour another, sometimes EOS
            bias = {rng.choice(seen): -100.0, rng.randrange(2, VOCAB): rng.choice((2.0, 5.0))}
            if rng.random() < 0.3:
                bias[EOS] = 4.0
                out["ignore_eos"] = False
            out["logit_bias"] = bias
        elif kind == 4:  # a word of 1..3 tokens of its own output, and a random one
            start = rng.randrange(len(seen))
            out["bad_words_token_ids"] = [seen[start:start + rng.randint(1, 3)], [rng.randrange(2, VOCAB)]]
        elif kind == 5:
            out["allowed_token_ids"] = sorted(set(rng.sample(range(VOCAB), rng.randint(1, 30))) | {seen[0]})
        elif kind == 6:
            out["prompt_logprobs"] = rng.choice((0, 2))
        elif kind == 7 and llm:  # a piece of its own text, or a common one
            start = rng.randrange(max(1, len(text)))
            piece = text[start:start + rng.randint(1, 3)] if text.strip() else ""
            out["stop"] = [piece] if piece.strip() else rng.sample(STOP_STRINGS, 2)
            out["include_stop_str_in_output"] = rng.random() < 0.5
        else:
            out["logprobs"] = rng.choice((0, 1, 3))
    return out


def _sampled(rng: random.Random) -> dict[str, Any]:
    out: dict[str, Any] = dict(temperature=rng.choice((0.5, 1.0, 1.5)), top_k=rng.choice((-1, 3, 20)),
                               top_p=rng.choice((1.0, 0.8)))
    if rng.random() < 0.7:
        out["seed"] = rng.randrange(2**31)
    if rng.random() < 0.3:
        out["logprobs"] = 1
    return out


def _constrain(seed: int, specs: list[ReqSpec], fraction: float) -> None:
    """Give about `fraction` of the greedy requests a structured_outputs constraint,
    from a stream of their own (the seed's schedule stays the same at any fraction);
    token controls go (with a grammar they could leave nothing to sample)."""
    rng = random.Random(f"spec-structured-{seed}")
    for s in specs:
        if rng.random() < fraction and s.params.get("temperature", 0.0) == 0.0:
            for key in ("allowed_token_ids", "logit_bias", "bad_words_token_ids"):
                s.params.pop(key, None)
            s.params["structured_outputs"] = draw_constraint(rng)
            s.max_tokens = max(s.max_tokens, rng.choice((s.max_tokens, 24)))  # room to reach the grammar's end


def draw_case(seed: int, oracle: SpecOracle, structured: float = 0.0
              ) -> tuple[dict[str, Any], str, str, list[ReqSpec]]:
    """(engine options, mode "core" or "llm", proposer kind, requests): a pure function
    of the seed (the oracle's plain outputs are fixed by the prompts); `structured`:
    the fraction of greedy requests constrained (_constrain)."""
    rng = random.Random(f"spec-{seed}")
    mode = "llm" if rng.random() < 0.25 else "core"
    bs = rng.choice((8, 16))
    lookup_min = rng.randint(1, 3)
    spec: dict[str, Any] = dict(num_speculative_tokens=rng.randint(1, 6), prompt_lookup_min=lookup_min,
                                prompt_lookup_max=lookup_min + rng.randint(0, 3))
    if rng.random() < 0.5:  # else the default fallback; sometimes one that trips at once
        spec.update(min_acceptance_rate=rng.choice((0.0, 0.6)), acceptance_window=rng.choice((2, 8, 32)))
    shared = [rng.randrange(2, VOCAB) for _ in range(rng.randint(8, 40))]
    requests: list[ReqSpec] = []
    arrive = 0
    for i in range(rng.randint(1, 8)):
        prompt = _prompt(rng, shared, [s.prompt for s in requests])
        max_tokens = _max_tokens(rng) if rng.random() < 0.85 else rng.choice((1, 2))
        arrive += rng.choice((0, 0, 1, 2, 5))
        r = rng.random()
        if r < 0.12:
            params = dict(_sampled(rng), n=rng.choice((1, 1, 2, 3)))
        else:
            plain = oracle.expect(prompt, spec_params(ReqSpec("", prompt, max_tokens)))
            params = _params(rng, max_tokens, plain.token_ids, plain.text, mode == "llm")
            if r < 0.25 and "prompt_logprobs" not in params:  # refused with n > 1
                params["n"] = rng.randint(2, 3)
        abort = arrive + rng.randint(0, len(prompt) // 4 + max_tokens + 2) if rng.random() < 0.2 else None
        requests.append(ReqSpec(f"r{i}", prompt, max_tokens, rng.choice((0, 0, 0, 1, -1)), arrive, abort,
                                params=params))
    _constrain(seed, requests, structured)
    lengths = [len(s.prompt) + s.max_tokens for s in requests]
    need = max(-(-n // bs) for n in lengths)
    total = sum(-(-n // bs) for n in lengths)
    r = rng.random()
    blocks = need + rng.randint(0, 1) if r < 0.35 else need + rng.randint(1, max(1, total // 2)) if r < 0.7 \
        else total + rng.randint(0, 8)
    if rng.random() < 0.05:
        blocks = max(1, need - 1)  # the largest is refused
    chunked = rng.random() < 0.85
    budget = rng.choice((1, 2, 3, 4, 5, 7, 8, 16, 64, 512))
    if not chunked:
        budget = max(budget, max(len(s.prompt) for s in requests))
    engine = dict(block_size=bs, num_kv_blocks=blocks, max_num_batched_tokens=budget,
                  max_num_seqs=rng.choice((1, 2, 4, 64)), enable_chunked_prefill=chunked,
                  enable_prefix_caching=rng.random() < 0.7, async_scheduling=rng.random() < 0.3,
                  speculative_config=spec)
    if rng.random() < 0.15:  # a short context: room for drafts ends at it
        engine["max_model_len"] = max(2, max(lengths) - rng.choice((0, 0, 1)))
    extra = random.Random(f"spec-engine-{seed}")  # a stream of its own: the draws above stay as they were
    if extra.random() < 0.1:  # the most drafts a step verifies: 17 rows of one sequence
        spec["num_speculative_tokens"] = extra.choice((8, 16))
    # the torch backend's decode rows: the C kernel, or (no kernel) the blocked torch path;
    # or the reference backend
    engine["attention_backend"] = extra.choice(("auto", "auto", "auto", "no_kernel", "reference"))
    return engine, mode, rng.choice(("ngram", "oracle", "oracle")), requests


def _fits_engine(engine: dict[str, Any], s: ReqSpec) -> bool:
    return _fits(len(s.prompt), s.max_tokens, engine["block_size"], engine["num_kv_blocks"],
                 engine["max_num_batched_tokens"], engine["enable_chunked_prefill"], engine.get("max_model_len"))


# ----------------------------------------------------------------------------- a run

def run_seed(model: str | Path, seed: int, oracle: SpecOracle, structured: float = 0.0,
             wall_limit_s: float = 60.0, device: str = "cpu") -> SeedResult:
    """Run the seed's case under speculation; its problems are empty when it passed."""
    res = SeedResult(seed)
    engine, mode, kind, specs = draw_case(seed, oracle, structured)
    engine["device"] = device
    proposer = Proposer(kind, random.Random(f"spec-proposer-{seed}"))
    for s in specs:  # the oracle's outputs first, so that nothing patched below runs them
        params = spec_params(s)
        if params.greedy:
            for j in range(params.n):
                out = oracle.expect(s.prompt, params.child(j))
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
        offered = sum(len(r.spec_token_ids) for r in core.scheduler.running)
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
        if params.greedy:
            prompt_logprobs = [None, *request.prompt_logprobs] if params.prompt_logprobs is not None else None
            res.problems += check_greedy(what, tokens, finish, logprobs, oracle.expect(spec.prompt, params),
                                         aborted, prompt_logprobs=prompt_logprobs)
            res.problems += check_constraint(what, spec.params, tokens, finish, oracle)
            res.stats["grammar_stops"] += "structured_outputs" in spec.params and finish == "stop"
        elif not aborted:
            res.problems += check_sampled(what, tokens, finish, params, logprobs)
        res.stats["checked"] += 1

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
            if child.greedy:
                res.problems += check_greedy(what, seq.token_ids, seq.finish_reason, seq.logprobs,
                                             oracle.expect(s.prompt, child), text=seq.text,
                                             prompt_logprobs=seq.prompt_logprobs)
                res.problems += check_constraint(what, s.params, seq.token_ids, seq.finish_reason, oracle)
                res.stats["grammar_stops"] += "structured_outputs" in s.params and seq.finish_reason == "stop"
            else:
                res.problems += check_sampled(what, seq.token_ids, seq.finish_reason, child, seq.logprobs)
            res.stats["checked"] += 1
            res.stats["stop_strings"] += bool(child.stop) and seq.finish_reason == "stop"
        res.stats["groups"] += p.n > 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0:100", help="START:END")
    parser.add_argument("--structured", type=float, default=0.0,
                        help="fraction of greedy requests under a structured_outputs constraint")
    parser.add_argument("--device", default="cpu", help="the engines' device (the oracle's too)")
    args = parser.parse_args()
    start, stop = map(int, args.seeds.split(":"))
    import torch

    torch.set_num_threads(1)  # the tiny model's steps are all overhead
    from tests.tiny_models import build_tiny_model

    model = build_tiny_model("llama", Path(tempfile.mkdtemp()) / "llama")
    oracle = SpecOracle(model, args.device)
    t0 = time.monotonic()
    problems, totals = [], Counter()
    for seed in range(start, stop):
        res = run_seed(model, seed, oracle, args.structured, device=args.device)
        problems += res.problems
        totals.update(res.stats)
        for p in res.problems:
            print(p[:3000], flush=True)
    print(f"seeds {start}..{stop - 1} (structured {args.structured:g}) in {time.monotonic() - t0:.0f} s: {len(problems)} problems; "
          f"{json.dumps(dict(sorted(totals.items())))}")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
