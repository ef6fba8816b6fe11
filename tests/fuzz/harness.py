"""Randomised schedule fuzzers, with the colocated engine's tokens as the oracle.

Two fuzzers, each a pure function of a seed for its *choices* (what runs when); the P/D
one also meets wall-clock timing (deadlines, slow copies), so its outcomes may vary from
run to run while its schedule of events does not.

offline  One EngineCore stepped by hand (or LLM.generate, one to three calls) with a
         random config: block size (8/16/32: the engine refuses 4), KV pool tiny to roomy
         (a few requests that can never fit: refused), token budget 1..512,
         max_num_seqs, chunked prefill, prefix caching, async scheduling, a small
         max_model_len; prompts with shared prefixes (on and off block boundaries) and
         identical copies, random max_tokens and priorities, arrivals and aborts at
         random step offsets, ids of aborted requests reused at once. Most requests are
         greedy; some use penalties, min_tokens + stop tokens / EOS, seeded sampling,
         logprobs, or (LLM only) stop strings.
pd       A decode core (DecodeWorkerCore) and a prefill core (PrefillWorkerCore) in one
         process over a real transport (shm or tcp), joined by a simulated control
         channel (FIFO each way, random delays) as the workers' servers use it; tiny
         pools on both sides, slow / late copies, a slow P and a slow D, short deadlines
         expiring mid-write, lost prefill messages, prefill errors (from P, or spurious on
         D while P goes on), client aborts at any tick, local requests mixed in, reused
         request ids, prefix caching and async scheduling on or off on each side.

Either fuzzer's case may have structured outputs added (add_structured: a fraction of
its requests constrained by a JSON schema, json_object, a regex, a choice or a small EBNF
grammar, tests/fuzz/structured.py; the engine config, prompts, arrivals and aborts
unchanged), and either
fuzzer may run its engines tensor-parallel (make_*_case's tp: the schedule is
the seed's at any TP; the oracle stays TP 1); each engine is closed at the end of its
seed whatever happened, so no follower process outlives it (live_followers).

Oracle (Oracle): each request alone in a roomy colocated engine, same prompt and sampling
params. Every request that is not aborted must end "length" or "stop" exactly as there,
with exactly its tokens; an aborted one's tokens so far must be a prefix of them.
Nothing may hang (bounded by steps and wall time, a hang reported with the engines'
state), no exception may escape, and once everything ended every KV block is free. A
constrained request that finishes "stop" must obey its constraint (its detokenized text,
checked with jsonschema, re.fullmatch, ...: kind "constraint").

Used by tests/fuzz/test_fuzz_schedules.py (a short seeded run) and
benchmarks/fuzz/schedules.py (many seeds; --replay/--shrink a dumped failing case).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.fuzz.cases import TP_PAIRS, add_structured, draw_tp_pair, make_offline_case, make_pd_case
from tests.fuzz.common import (
    VOCAB,
    Failure,
    Hang,
    OfflineCase,
    Oracle,
    PDCase,
    ReqSpec,
    SeedResult,
    case_dict,
    hf_agreement,
    live_followers,
)
from tests.fuzz.offline import run_offline
from tests.fuzz.pd import run_pd
from tests.fuzz.structured import violation
from tests.fuzz.tiers import make_tier_case

__all__ = ["TP_PAIRS", "VOCAB", "Failure", "Hang", "OfflineCase", "Oracle", "PDCase", "ReqSpec", "SeedResult",
           "add_structured", "case_dict", "case_from_dict", "draw_tp_pair", "hf_agreement", "live_followers",
           "make_offline_case", "make_pd_case", "make_tier_case", "run_case", "run_offline", "run_pd", "shrink", "violation"]


# ----------------------------------------------------------------------------- shrinking

def case_from_dict(d: dict[str, Any]) -> OfflineCase | PDCase:
    """The inverse of case_dict (a dumped failing case, replayed)."""
    d = dict(d)
    d["requests"] = [ReqSpec(**r) for r in d["requests"]]
    return PDCase(**d) if "transport" in d else OfflineCase(**d)


def run_case(case: OfflineCase | PDCase, model_dir: str | Path, oracle: Oracle, **kw: Any) -> SeedResult:
    if isinstance(case, PDCase):
        return run_pd(case, model_dir, oracle, **kw)
    return run_offline(case, model_dir, oracle, **kw)


def shrink(case: OfflineCase | PDCase, model_dir: str | Path, oracle: Oracle, kind: str,
           tries: int = 1, **kw: Any) -> OfflineCase | PDCase:
    """Drop requests (and aborts) one at a time while a failure of `kind` persists
    (`tries` runs each: P/D outcomes depend on timing). Returns the smallest case found."""
    import copy

    def fails(c: OfflineCase | PDCase) -> bool:
        return any(any(f.kind == kind for f in run_case(c, model_dir, oracle, **kw).failures) for _ in range(tries))

    best = copy.deepcopy(case)
    changed = True
    while changed:
        changed = False
        for i in range(len(best.requests)):
            trial = copy.deepcopy(best)
            del trial.requests[i]
            if trial.requests and fails(trial):
                best, changed = trial, True
                break
        if changed:
            continue
        for i, r in enumerate(best.requests):
            if r.abort is not None:
                trial = copy.deepcopy(best)
                trial.requests[i].abort = None
                if fails(trial):
                    best, changed = trial, True
                    break
    return best
