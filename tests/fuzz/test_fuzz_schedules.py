"""A short seeded run of the schedule fuzzers (tests/fuzz/harness.py): random engine
configs and request schedules, offline and disaggregated over shm and tcp, whose tokens
(greedy mostly) must equal each request's alone in a roomy colocated engine; nothing may
hang, raise, or leak a KV block. The seeds fix the fuzzers' choices; the P/D runs also
meet real wall-clock timing (deadlines, slow copies), kept within the transports' bounds
here (bounded_copies), so every outcome must be exact. Many more seeds, and copies
slowed without bound: benchmarks/fuzz_schedules.py."""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

import pytest
import torch

from tests.fuzz import harness as H

OFFLINE_SEEDS = range(0, 100)
PD_SEEDS = range(0, 50)


@pytest.fixture(scope="module")
def oracle(llama_dir: Path) -> H.Oracle:
    return H.Oracle(llama_dir)


@pytest.fixture(autouse=True)
def quiet_single_thread():
    # Dropped late writes and fallbacks are expected here; their warnings are noise.
    # One torch thread: the tiny model's steps are all overhead, and two threads on a
    # shared 2-core machine only contend.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    logging.disable(logging.ERROR)
    yield
    logging.disable(logging.NOTSET)
    torch.set_num_threads(threads)


def report(results: list[H.SeedResult]) -> str:
    return "\n".join(f.line()[:3000] for r in results for f in r.failures)


@pytest.mark.timeout(120)
def test_oracle_agrees_with_transformers(llama_dir: Path, oracle: H.Oracle) -> None:
    prompts = [s.prompt for s in H.make_offline_case(3).requests[:2]] + [[7], list(range(2, 40))]
    assert H.hf_agreement(llama_dir, oracle, prompts, max_tokens=10) == []


@pytest.mark.timeout(60)
def test_fuzzer_reports_a_wrong_token(llama_dir: Path, oracle: H.Oracle) -> None:
    """The harness is not vacuous: an oracle off by one token is a mismatch."""
    case = H.OfflineCase(0, dict(block_size=8, num_kv_blocks=16, max_num_batched_tokens=8, max_num_seqs=4,
                                 enable_chunked_prefill=True, enable_prefix_caching=True, async_scheduling=True),
                         "core", [H.ReqSpec("a", list(range(2, 20)), 4), H.ReqSpec("b", list(range(2, 12)), 3, arrive=2)])

    class Skewed(H.Oracle):
        def __init__(self) -> None:
            self.__dict__.update(oracle.__dict__)

        def expect(self, spec):
            out, status = oracle.expect(spec)
            return out[:-1] + [(out[-1] + 1) % H.VOCAB], status

    res = H.run_offline(case, llama_dir, Skewed())
    assert res.requests and any(f.kind == "mismatch" for f in res.failures)


@pytest.mark.timeout(120)
def test_offline_schedules_match_the_oracle(llama_dir: Path, oracle: H.Oracle) -> None:
    results = [H.run_offline(H.make_offline_case(seed), llama_dir, oracle) for seed in OFFLINE_SEEDS]
    assert report(results) == ""
    exercised = Counter()
    for r in results:
        exercised.update(r.stats)
    # the seeds do reach the interesting paths
    assert exercised["preemptions"] > 0 and exercised["cache_hits"] > 0, exercised


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_pd_schedules_match_the_oracle(llama_dir: Path, oracle: H.Oracle, transport: str) -> None:
    results = [H.run_pd(H.make_pd_case(seed, transport, bounded_copies=True), llama_dir, oracle) for seed in PD_SEEDS]
    assert report(results) == ""
    exercised = Counter()
    for r in results:
        exercised.update(r.stats)
    assert exercised["remote"] > 0 and exercised["fallbacks"] > 0, exercised


# Tensor parallelism: a few seeds only (each engine starts a follower process per rank).
# The seeds' schedules are those of TP 1; the oracle stays TP 1.
OFFLINE_TP_SEEDS = (6, 9)
PD_TP_SEEDS = ((1, "shm", (1, 2)), (0, "tcp", (2, 1)))


@pytest.mark.timeout(180)
def test_tp_schedules_match_the_oracle(llama_dir: Path, oracle: H.Oracle) -> None:
    results = []
    for seed in OFFLINE_TP_SEEDS:
        case = H.make_offline_case(seed, tp=2)
        assert case.engine["tensor_parallel_size"] == 2
        results.append(H.run_offline(case, llama_dir, oracle))
        assert H.live_followers() == [], f"offline seed {seed} left its follower processes"
    offline = Counter()
    for r in results:
        offline.update(r.stats)
    for seed, transport, (p, d) in PD_TP_SEEDS:
        case = H.make_pd_case(seed, transport, bounded_copies=True, tp=(p, d))
        assert case.pre.get("tensor_parallel_size", 1) == p and case.dec.get("tensor_parallel_size", 1) == d
        results.append(H.run_pd(case, llama_dir, oracle))
        assert H.live_followers() == [], f"pd seed {seed} at TP {p},{d} left its follower processes"
    assert report(results) == ""
    pd = Counter()
    for r in results[len(OFFLINE_TP_SEEDS):]:
        pd.update(r.stats)
    assert offline["preemptions"] > 0 and offline["cache_hits"] > 0, offline
    assert pd["remote"] > 0, pd
