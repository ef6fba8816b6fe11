"""A short seeded run of the schedule fuzzers (tests/fuzz/harness.py): random engine
configs and request schedules, offline and disaggregated over shm and tcp, whose tokens
(greedy mostly) must equal each request's alone in a roomy colocated engine; nothing may
hang, raise, or leak a KV block. The seeds fix the fuzzers' choices; the P/D runs also
meet real wall-clock timing (deadlines, slow copies), kept within the transports' bounds
here (bounded_copies), so every outcome must be exact. The same seeds again with about
half their requests under structured outputs, which must also obey their constraints.
And 20 seeds over shm with copies slowed without bound. Many more seeds:
benchmarks/fuzz/schedules.py."""

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
    cases = [H.make_pd_case(seed, transport, bounded_copies=True) for seed in PD_SEEDS]
    assert {case.stream for case in cases} == {"chunk", "layer", "off"}  # every way of posting a prompt's blocks
    results = [H.run_pd(case, llama_dir, oracle) for case in cases]
    assert report(results) == ""
    exercised = Counter()
    for r in results:
        exercised.update(r.stats)
    assert exercised["remote"] > 0 and exercised["fallbacks"] > 0 and exercised["tier_loads"] > 0, exercised


TIER_SEEDS = range(0, 100)


@pytest.mark.timeout(120)
def test_tier_schedules_match_the_oracle(llama_dir: Path, oracle: H.Oracle) -> None:
    """KV offload tiers under tiny pools (tests/fuzz/tiers.py), half the seeds over a
    shared KV store: the tokens are exact, and no tier slot or pin leaks. More seeds: benchmarks/fuzz/schedules.py --fuzzer tiers."""
    results = [H.run_offline(H.make_tier_case(seed), llama_dir, oracle) for seed in TIER_SEEDS]
    assert report(results) == ""
    exercised = Counter()
    for r in results:
        exercised.update(r.stats)
    assert exercised["tier_loads"] > 50 and exercised["shared_hits"] > 0, exercised


UNBOUNDED_PD_SEEDS = range(0, 20)


@pytest.mark.timeout(120)
def test_pd_schedules_with_copies_slowed_without_bound_match_the_oracle(llama_dir: Path, oracle: H.Oracle) -> None:
    """shm copies slowed past the transport's own bounds: a write's bytes may land after
    its reservation was given up, always into blocks still fenced (issue 34), so every
    outcome is still exact. More seeds: benchmarks/fuzz/schedules.py."""
    results = [H.run_pd(H.make_pd_case(seed, "shm"), llama_dir, oracle) for seed in UNBOUNDED_PD_SEEDS]
    assert report(results) == ""
    exercised = Counter()
    for r in results:
        exercised.update(r.stats)
    assert exercised["overwritten"] > 0, exercised  # landings after a give-up did happen, fenced


# Tensor parallelism: a few seeds only (each engine starts a follower process per rank).
# The seeds' schedules are those of TP 1; the oracle stays TP 1.
OFFLINE_TP_SEEDS = (6, 9)
TIER_TP_SEED = 4  # loads back into both ranks' caches
PD_TP_SEEDS = ((1, "shm", (1, 2)), (0, "tcp", (2, 1)))


@pytest.mark.timeout(180)
def test_tp_schedules_match_the_oracle(llama_dir: Path, oracle: H.Oracle) -> None:
    results = []
    for seed in OFFLINE_TP_SEEDS:
        case = H.make_offline_case(seed, tp=2)
        assert case.engine["tensor_parallel_size"] == 2
        results.append(H.run_offline(case, llama_dir, oracle))
        assert H.live_followers() == [], f"offline seed {seed} left its follower processes"
    results.append(H.run_offline(H.make_tier_case(TIER_TP_SEED, tp=2), llama_dir, oracle))
    assert H.live_followers() == [], f"tier seed {TIER_TP_SEED} left its follower processes"
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
    for r in results[len(OFFLINE_TP_SEEDS) + 1:]:
        pd.update(r.stats)
    assert offline["preemptions"] > 0 and offline["cache_hits"] > 0 and offline["tier_loads"] > 0, offline
    assert pd["remote"] > 0, pd


# Structured outputs (tests/fuzz/structured.py): the same seeds' schedules, about half
# their requests constrained (JSON schemas, json_object, regexes, choices, EBNF; greedy
# and seeded-sampled). Tokens must equal the oracle's, and a request its grammar ended
# must obey it.
STRUCTURED = 0.5
STRUCTURED_OFFLINE_SEEDS = list(range(32))  # 5 and 17 found S1: a json_object output that was an array
STRUCTURED_PD_SEEDS = range(12)  # each over shm and tcp


def _structured_stops(oracle: H.Oracle, cases: list) -> Counter:
    """Constrained requests the oracle ends "stop", by kind (what the constraint check saw)."""
    kinds: Counter = Counter()
    for case in cases:
        for s in case.requests:
            so = s.params.get("structured_outputs")
            if so is not None and oracle.expect(s)[1] == "stop":
                kinds[next(iter(so))] += 1
    return kinds


def test_constraint_check_is_not_vacuous(llama_dir: Path, oracle: H.Oracle) -> None:
    """violation() passes what obeys a constraint and names what does not; a stop that
    is not its grammar's end (no EOS last) passes only after a stop token or string."""
    def toks(text: str) -> list[int]:
        return oracle.llm.tokenizer.encode(text, add_special_tokens=False) + [1]

    obj = {"json": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}
    grammar = 'root ::= ("a" | "b") ("a" | "b")? "."'
    good = [(obj, '{"a": 3}'), ({"json_object": True}, "{}"), ({"regex": "[0-9]{2}-[xyz]"}, "42-y"),
            ({"choice": ["yes", "no"]}, "no"), ({"grammar": grammar}, "ab.")]
    bad = [(obj, '{"b": 3}'), (obj, '{"a": 3'), ({"json_object": True}, "[1]"), ({"regex": "[0-9]{2}-[xyz]"}, "42-w"),
           ({"choice": ["yes", "no"]}, "noo"), ({"grammar": grammar}, "abb.")]
    for so, text in good:
        assert H.violation({"structured_outputs": so}, toks(text), oracle.text) == "", (so, text)
    for so, text in bad:
        assert H.violation({"structured_outputs": so}, toks(text), oracle.text) != "", (so, text)
    no_eos = toks("no")[:-1]
    choice = {"structured_outputs": {"choice": ["yes", "no"]}}
    assert "without its grammar's end" in H.violation(choice, no_eos, oracle.text)
    assert H.violation(dict(choice, stop_token_ids=[no_eos[-1]]), no_eos, oracle.text) == ""
    assert H.violation({}, toks("anything"), oracle.text) == ""


@pytest.mark.timeout(60)
def test_fuzzer_reports_a_broken_constraint(llama_dir: Path, oracle: H.Oracle) -> None:
    """The harness checks every grammar-ended request: text that breaks it is a failure."""
    case = H.OfflineCase(0, dict(block_size=8, num_kv_blocks=16, max_num_batched_tokens=8, max_num_seqs=4,
                                 enable_chunked_prefill=True, enable_prefix_caching=True, async_scheduling=True),
                         "core", [H.ReqSpec("a", list(range(2, 20)), 8, params={"structured_outputs":
                                                                                {"choice": ["yes", "no"]}})])

    class Garbled(H.Oracle):
        def __init__(self) -> None:
            self.__dict__.update(oracle.__dict__)

        def text(self, token_ids):
            return oracle.text(token_ids) + "!"

    assert report([H.run_offline(case, llama_dir, oracle)]) == ""
    res = H.run_offline(case, llama_dir, Garbled())
    assert [f.kind for f in res.failures] == ["constraint"], report([res])


@pytest.mark.timeout(120)
def test_structured_schedules_match_the_oracle(llama_dir: Path, oracle: H.Oracle) -> None:
    cases = [H.add_structured(H.make_offline_case(seed), STRUCTURED) for seed in STRUCTURED_OFFLINE_SEEDS]
    results = [H.run_offline(case, llama_dir, oracle) for case in cases]
    offline = Counter()
    for r in results:
        offline.update(r.stats)
    pd = Counter()
    for transport in ("shm", "tcp"):
        for seed in STRUCTURED_PD_SEEDS:
            cases.append(H.add_structured(H.make_pd_case(seed, transport, bounded_copies=True), STRUCTURED))
            results.append(H.run_pd(cases[-1], llama_dir, oracle))
            pd.update(results[-1].stats)
    assert report(results) == ""
    # every kind ended on its grammar (and was checked), under preemption, prefix hits
    # and remote prefill
    stops = _structured_stops(oracle, cases)
    assert set(stops) == {"json", "json_object", "regex", "choice", "grammar"}, stops
    assert offline["preemptions"] > 0 and offline["cache_hits"] > 0, offline
    assert pd["remote"] > 0 and pd["fallbacks"] > 0, pd


def test_structured_changes_only_the_requests_params() -> None:
    """--structured 0 is today's cases exactly; at any fraction a seed keeps its engine
    config, prompts, arrivals and aborts (only params and some max_tokens change)."""
    def schedule(case) -> tuple:
        d = H.case_dict(case)
        reqs = [(r["rid"], r["prompt"], r["arrive"], r["abort"], r["fate"]) for r in d.pop("requests")]
        return d, reqs

    constrained = 0
    for seed in range(20):
        for make in (lambda seed=seed: H.make_offline_case(seed), lambda seed=seed: H.make_pd_case(seed, "shm")):
            assert H.case_dict(H.add_structured(make(), 0.0)) == H.case_dict(make())
            case = H.add_structured(make(), STRUCTURED)
            assert schedule(case) == schedule(make())
            constrained += sum("structured_outputs" in s.params for s in case.requests)
    assert constrained > 0


@pytest.mark.timeout(120)
def test_parallel_sampling_groups_fuzz(llama_dir: Path) -> None:
    """A short run of tests/fuzz/groups.py (the long one: its docstring's command)."""
    from tests.fuzz.groups import run_seed

    assert [p for seed in range(24) for p in run_seed(llama_dir, seed)] == []


# Speculative decoding (tests/fuzz/spec.py; the long run: --seeds 0:400): schedules with
# n-gram, oracle and draft-model drafts against the engine without speculation; a third
# of the seeds with structured outputs.
SPEC_SEEDS, SPEC_STRUCTURED_SEEDS = range(48), range(48, 72)


@pytest.fixture(scope="module")
def spec_oracle(llama_dir: Path):
    from tests.fuzz.spec import SpecOracle

    return SpecOracle(llama_dir)


@pytest.mark.timeout(120)
def test_speculative_decoding_fuzz(llama_dir: Path, spec_oracle, tmp_path: Path) -> None:
    from tests.fuzz.spec import draft_models, run_seed

    drafts = draft_models(llama_dir, tmp_path)
    results = [run_seed(llama_dir, seed, spec_oracle, draft_models=drafts) for seed in SPEC_SEEDS]
    results += [run_seed(llama_dir, seed, spec_oracle, structured=0.5, draft_models=drafts)
                for seed in SPEC_STRUCTURED_SEEDS]
    assert [p[:3000] for r in results for p in r.problems] == []
    totals: Counter = Counter()
    for r in results:
        totals.update(r.stats)
    # the seeds reach what they are for
    for key in ("accepted", "rejected", "drafts_cut", "disabled", "preemptions", "cache_hits", "aborts", "groups",
                "stop_strings", "grammar_stops", "seeded_sampled", "draft_model_seeds", "no_kernel"):
        assert totals[key] > 0, (key, totals)


@pytest.mark.timeout(60)
def test_speculative_fuzz_reports_a_wrongly_accepted_draft(llama_dir: Path, spec_oracle, monkeypatch) -> None:
    """The speculative fuzzer is not vacuous: drafts taken as accepted when they were
    not give tokens that differ from the oracle's."""
    from engine.speculative.speculator import Speculator
    from tests.fuzz.spec import run_seed

    accepted = Speculator.accepted

    def all_accepted(self, out, sampled):
        tokens, _, logprobs = accepted(self, out, sampled)
        return tokens, [len(s.draft_token_ids) for s in out.scheduled if s.samples], logprobs

    monkeypatch.setattr(Speculator, "accepted", all_accepted)
    assert any(" alone " in p for seed in range(4) for p in run_seed(llama_dir, seed, spec_oracle).problems)


MOE_SEEDS = range(0, 20)


@pytest.mark.timeout(180)
def test_moe_schedules_match_the_oracle(moe_models: dict[str, Path]) -> None:
    """Offline and P/D schedules of a mixture of experts with latent attention (the tiny
    DeepSeek-V3: 576 bytes of latent per token, near the tiny Llama's 512, so the
    fuzzers' tier sizes of a block or more stay a block or more) against its own
    oracle; the long runs: benchmarks.fuzz.schedules --model-dir."""
    model = moe_models["deepseek_v3"]
    oracle = H.Oracle(model)
    results = [H.run_offline(H.make_offline_case(seed), model, oracle) for seed in MOE_SEEDS]
    results += [H.run_pd(H.make_pd_case(seed, "shm", bounded_copies=True), model, oracle) for seed in MOE_SEEDS]
    assert report(results) == ""
    exercised = Counter()
    for r in results:
        exercised.update(r.stats)
    assert exercised["preemptions"] > 0 and exercised["remote"] > 0, exercised


@pytest.mark.timeout(180)
def test_fp8_schedules_match_the_fp8_oracle(llama_dir: Path) -> None:
    """An fp8 KV cache and fp8 weights on every engine, the oracle's too: each schedule
    (chunks, prefix hits, preemption, P/D with fallbacks) gives the colocated fp8
    engine's tokens, since the model rounds K/V before any store. More seeds:
    benchmarks/fuzz/schedules.py --kv-cache-dtype fp8 --quantization fp8."""
    from tests.fuzz.common import ENGINE_OPTIONS

    ENGINE_OPTIONS.update(kv_cache_dtype="fp8", quantization="fp8")
    try:
        fp8_oracle = H.Oracle(llama_dir)
        assert fp8_oracle.llm.core.kv_cache.dtype == torch.float8_e4m3fn
        results = [H.run_offline(H.make_offline_case(seed), llama_dir, fp8_oracle) for seed in range(30)]
        results += [H.run_pd(H.make_pd_case(seed, "shm", bounded_copies=True), llama_dir, fp8_oracle)
                    for seed in range(15)]
    finally:
        ENGINE_OPTIONS.clear()
    assert report(results) == ""
    exercised = Counter()
    for r in results:
        exercised.update(r.stats)
    assert exercised["preemptions"] > 0 and exercised["cache_hits"] > 0 and exercised["remote"] > 0, exercised


def run_with_loras(llama_dir: Path, tmp_path: Path, cases: list, run) -> tuple[int, Counter]:
    """The cases with half their requests naming one of three LoRA adapters (tests/fuzz/
    lora.py), run against an oracle that serves them: (requests naming one, what ran)."""
    from tests.fuzz import lora
    from tests.fuzz.common import ENGINE_OPTIONS, LORA_ADAPTERS

    lora.use(llama_dir, tmp_path)
    try:
        lora_oracle = H.Oracle(llama_dir)
        for case in cases:
            lora.add_loras(case, 0.5)
        results = [run(case, llama_dir, lora_oracle) for case in cases]
    finally:
        ENGINE_OPTIONS.clear()
        LORA_ADAPTERS.clear()
    assert report(results) == ""
    exercised: Counter = Counter()
    for r in results:
        exercised.update(r.stats)
    return sum(s.lora is not None for case in cases for s in case.requests), exercised


@pytest.mark.timeout(180)
def test_lora_schedules_match_the_oracle(llama_dir: Path, tmp_path: Path) -> None:
    """Half the requests name one of three LoRA adapters, in engines of one to three
    slots: each gets what it gets alone with its adapter (preemption, prefix hits, slots
    waited for), and every slot is let go. More seeds: benchmarks/fuzz/schedules.py --lora 0.5."""
    named, exercised = run_with_loras(llama_dir, tmp_path, [H.make_offline_case(seed) for seed in range(30)],
                                      H.run_offline)
    assert named > 20 and exercised["preemptions"] > 0 and exercised["cache_hits"] > 0, (named, exercised)


@pytest.mark.timeout(180)
def test_lora_pd_schedules_match_the_oracle(llama_dir: Path, tmp_path: Path) -> None:
    """P/D with adapters: the decode worker names each request's adapter in its remote
    prefill and the prefill worker computes the KV with it, under the pd fuzzer's faults
    (deadlines, lost and failed prefills, late writes). More seeds:
    benchmarks/fuzz/schedules.py --fuzzer pd --lora 0.5."""
    cases = [H.make_pd_case(seed, "shm", bounded_copies=True) for seed in range(12)]
    named, exercised = run_with_loras(llama_dir, tmp_path, cases, H.run_pd)
    assert named > 10 and exercised["remote"] > 10, (named, exercised)
