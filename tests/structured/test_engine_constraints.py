"""Structured outputs in the engine: validity of sampled output, greedy tokens untouched
where the grammar allows them, and the interplay with preemption, chunked prefill,
prefix caching, async scheduling, penalties, logprobs, stop strings, failover and
grammars that are slow or fail to compile."""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import Future
from pathlib import Path

import jsonschema
import pytest
import xgrammar as xgr

from cluster.demo_model import DEMO_MODELS, default_models_dir
from engine import LLM, SamplingParams
from engine.engine_core import EngineCore
from engine.errors import RequestsFailed
from engine.structured.compiler import GrammarCompiler
from engine.structured.params import StructuredOutputsParams as P

MODEL_DIR = default_models_dir() / DEMO_MODELS["smollm2"].dir_name
demo = pytest.mark.skipif(not (MODEL_DIR / "config.json").is_file(), reason="demo model not prepared (make model)")

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "minLength": 1, "maxLength": 16},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "height_m": {"type": "number", "minimum": 0.5, "maximum": 2.5},
    "role": {"enum": ["admin", "user", "guest"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"], "additionalProperties": False}},
    "required": ["name", "age", "role", "address"], "additionalProperties": False}
REGEX = r"(yes|no), because [a-z ]{3,30}\."
CHOICES = ["Paris", "London", "Berlin", "Madrid"]
EBNF = 'root ::= "The answer is " number "."\nnumber ::= [1-9] [0-9]{0,2}'
EBNF_RE = r"The answer is [1-9][0-9]{0,2}\."


def is_valid(kind: str, text: str) -> bool:
    try:
        if kind == "json":
            jsonschema.validate(json.loads(text), PERSON)
            return True
        if kind == "json_object":
            return isinstance(json.loads(text), dict)
    except (ValueError, jsonschema.ValidationError):
        return False
    pattern = {"regex": REGEX, "choice": "|".join(map(re.escape, CHOICES)), "grammar": EBNF_RE}[kind]
    return re.fullmatch(pattern, text) is not None


KINDS = {"json": P(json=PERSON), "json_object": P(json_object=True), "regex": P(regex=REGEX),
         "choice": P(choice=CHOICES), "grammar": P(grammar=EBNF)}
QUESTIONS = {"json": "Describe a person as JSON.", "json_object": "Give me a JSON object about a cat.",
             "regex": "Is the sky blue? Answer yes or no and why.", "choice": "Name a European capital.",
             "grammar": "What is 6 times 7?"}


def sampled(llm: LLM, specs: dict[str, P], n: int, max_tokens: int, chat: bool) -> dict[str, list]:
    """n seeded requests per kind at temperature 1, all in one batch; their outputs by kind."""
    prompts, params, kinds = [], [], []
    for kind, spec in specs.items():
        for seed in range(n):
            prompts.append([{"role": "user", "content": QUESTIONS[kind]}] if chat
                           else [2 + (seed * 5 + j) % 300 for j in range(12)])
            params.append(SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, structured_outputs=spec))
            kinds.append(kind)
    outs = llm.chat(prompts, params, use_tqdm=False) if chat else llm.generate(prompts, params, use_tqdm=False)
    return {kind: [o for o, k in zip(outs, kinds) if k == kind] for kind in specs}


def check_valid(by_kind: dict[str, list], min_stopped: int) -> None:
    for kind, outs in by_kind.items():
        stopped = [o for o in outs if o.finish_reason == "stop"]
        bad = [o.text for o in stopped if not is_valid(kind, o.text)]
        assert not bad, f"{kind}: {len(bad)} invalid, e.g. {bad[0]!r}"
        assert len(stopped) >= min_stopped, f"{kind}: only {len(stopped)}/{len(outs)} ended by their grammar"


def test_sampled_outputs_of_a_random_model_follow_their_grammar(llama_dir: Path) -> None:
    """50 requests per kind at temperature 1, seeded, from a random tiny model (it takes
    any path its grammar allows): every one that ends by its grammar (not by max_tokens)
    is valid, and most end so. Its JSON is compact: free whitespace would let a random
    model wander for hundreds of tokens."""
    specs = {**KINDS, "json": P(json=PERSON, disable_any_whitespace=True),
             "json_object": P(json_object=True, disable_any_whitespace=True)}
    check_valid(sampled(LLM(str(llama_dir), max_num_seqs=256, seed=0), specs, 50, 160, chat=False), 30)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(str(MODEL_DIR), dtype="float32", max_num_seqs=64, max_num_batched_tokens=2048, seed=0)


@demo
def test_sampled_outputs_of_the_demo_model_follow_their_grammar(llm: LLM) -> None:
    """The same on the demo model (any whitespace allowed), asked for each format: fewer
    requests, as its steps cost more on CPU (benchmarks/offline/structured.py --only validity runs
    50 per kind)."""
    check_valid(sampled(llm, {k: v for k, v in KINDS.items() if k != "json_object"}, 6, 80, chat=True), 3)


def _allowed_prefix(spec: P, tokens: list[int], llm: LLM) -> int:
    """How many of `tokens` the grammar accepts, in order."""
    cfg = llm.core.model_config
    compiled = GrammarCompiler(llm.config.model, cfg.vocab_size, cfg.eos_token_ids).compile(spec).result(timeout=60)
    matcher = xgr.GrammarMatcher(compiled)
    for i, t in enumerate(tokens):
        if not matcher.accept_token(t):
            return i
    return len(tokens)


RECORDS = 'Records:\n{"name": "Alice", "age": 30},\n{"name": "Bob", "age": 41},\n'


@demo
@pytest.mark.parametrize("kind, prompt, spec", [
    ("json_object", RECORDS, P(json_object=True)),
    ("json", RECORDS, P(json={"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                              "required": ["name", "age"]})),
    ("regex", "Q: What is the capital of France?\nA:", P(regex=r" The capital[a-zA-Z ]*(\.|!)")),
])
def test_greedy_tokens_are_untouched_where_the_grammar_allows_them(llm: LLM, kind: str, prompt: str,
                                                                     spec: P) -> None:
    """Constrained greedy output equals the unconstrained one up to the first token the
    grammar forbids, and differs there; logprobs (of the raw distribution) agree too."""
    free = llm.generate([prompt], SamplingParams(max_tokens=40, temperature=0, logprobs=2), use_tqdm=False)[0]
    held = llm.generate([prompt], SamplingParams(max_tokens=40, temperature=0, logprobs=2, structured_outputs=spec),
                        use_tqdm=False)[0]
    k = _allowed_prefix(spec, free.token_ids, llm)
    assert k >= 5, f"{kind}: the prompt should let the model's own tokens through for a while ({k})"
    assert held.token_ids[:k] == free.token_ids[:k]
    assert [lp.top for lp in held.logprobs[:k]] == [lp.top for lp in free.logprobs[:k]]
    assert k < len(free.token_ids) and held.token_ids[k:k + 1] != free.token_ids[k:k + 1]


def test_a_grammar_that_ends_finishes_with_stop(llama_dir: Path) -> None:
    llm = LLM(str(llama_dir))
    outs = llm.generate(["The quick"] * 3, [
        SamplingParams(max_tokens=50, temperature=0, structured_outputs=P(choice=["fox", "dog"])),
        SamplingParams(max_tokens=50, temperature=0, ignore_eos=True, structured_outputs=P(choice=["fox"])),
        SamplingParams(max_tokens=50, temperature=0, min_tokens=10, structured_outputs=P(regex="ab"))],
        use_tqdm=False)
    assert outs[0].text in ("fox", "dog") and outs[0].finish_reason == "stop"
    assert outs[1].text == "fox" and outs[1].finish_reason == "stop"  # ignore_eos: the grammar still ends it
    assert outs[2].text == "ab" and outs[2].finish_reason == "stop"  # min_tokens does not outlast the grammar


def _mixed_requests(n: int) -> tuple[list[list[int]], list[SamplingParams]]:
    prompts, params = [], []
    specs = [P(regex="[a-z ]{5,40}"), P(json={"type": "object", "properties": {"a": {"type": "integer"}}}),
             P(choice=["alpha beta gamma", "delta"]), None]
    for i in range(n):
        prompts.append([2 + (i * 7 + j) % 300 for j in range(20 + 13 * (i % 5))])
        params.append(SamplingParams(max_tokens=24, temperature=0 if i % 2 else 0.8, seed=i,
                                     structured_outputs=specs[i % len(specs)],
                                     repetition_penalty=1.2 if i % 3 == 0 else 1.0,
                                     logprobs=1 if i % 4 == 1 else None))
    return prompts, params


def test_constrained_tokens_are_the_same_through_preemption_chunks_prefix_hits_and_async(
        llama_dir: Path) -> None:
    prompts, params = _mixed_requests(12)
    alone = [LLM(str(llama_dir)).generate([p], [sp], use_tqdm=False)[0] for p, sp in zip(prompts, params)]
    for options in ({"num_kv_blocks": 14, "block_size": 8, "max_num_batched_tokens": 32},
                    {"async_scheduling": True, "num_kv_blocks": 14, "block_size": 8},
                    {"async_scheduling": True, "max_num_batched_tokens": 16}):
        llm = LLM(str(llama_dir), **options)
        llm.generate(prompts[:3], params[:3], use_tqdm=False)  # warm the prefix cache
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.token_ids for o in outs] == [a.token_ids for a in alone], options
        assert [o.finish_reason for o in outs] == [a.finish_reason for a in alone]
        if "num_kv_blocks" in options:
            assert llm.core.scheduler.num_preemptions > 0
        assert sum(o.num_cached_tokens for o in outs) > 0


def test_stop_strings_and_logprobs_on_constrained_output(llama_dir: Path) -> None:
    llm = LLM(str(llama_dir))
    spec = P(regex="[abc]{8,30}")
    full = llm.generate(["The"], SamplingParams(max_tokens=12, temperature=0, structured_outputs=spec,
                                                logprobs=3), use_tqdm=False)[0]
    assert re.fullmatch("[abc]{8,30}", full.text) and full.finish_reason == "length"
    assert len(full.logprobs) == len(full.token_ids) and all(len(lp.top) == 3 for lp in full.logprobs)
    stop = full.text[3:5]
    cut = llm.generate(["The"], SamplingParams(max_tokens=12, temperature=0, structured_outputs=spec,
                                               stop=[stop]), use_tqdm=False)[0]
    assert cut.text == full.text[:full.text.index(stop)] and cut.finish_reason == "stop"


def test_a_failed_over_request_goes_on_in_its_grammar(llama_dir: Path) -> None:
    """The router resubmits prompt + output so far, with `resumed`: the grammar goes on
    where it was, and greedy output continues token for token."""
    prompt = [5, 6, 7, 8, 9]
    spec = P(json={"type": "object", "properties": {"word": {"type": "string", "maxLength": 30}},
                   "required": ["word"]})
    params = SamplingParams(max_tokens=30, temperature=0, structured_outputs=spec)
    whole = LLM(str(llama_dir)).generate([prompt], params, use_tqdm=False)[0]
    assert len(whole.token_ids) > 6
    done = whole.token_ids[:6]
    core = LLM(str(llama_dir)).core
    core.add_request("again", prompt + done, SamplingParams(max_tokens=24, temperature=0,
                                                            structured_outputs=spec), resumed=len(done))
    tokens = []
    while core.has_unfinished():
        for r in core.step().finished:
            tokens = r.output_token_ids
    assert done + tokens == whole.token_ids


def test_a_request_waits_for_its_grammar_without_holding_up_others(llama_dir: Path, monkeypatch) -> None:
    core = LLM(str(llama_dir)).core
    core.add_request("warm", [3, 4], SamplingParams(max_tokens=1, structured_outputs=P(regex="a")))
    slow: Future = Future()
    monkeypatch.setattr(core._resources.grammars, "compile", lambda params: slow)
    core.add_request("held", [3, 4, 5], SamplingParams(max_tokens=4, temperature=0,
                                                       structured_outputs=P(regex="[a-z]+")))
    core.add_request("free", [3, 4, 6], SamplingParams(max_tokens=4, temperature=0))
    finished = set()
    for _ in range(8):
        finished |= {r.request_id for r in core.step().finished}
    assert "free" in finished and "held" not in finished
    assert core.scheduler.requests["held"].num_computed_tokens == 0
    monkeypatch.undo()
    slow.set_result(core._resources.grammars.compile(P(regex="[a-z]+")).result(timeout=30))
    for _ in range(10):
        finished |= {r.request_id for r in core.step().finished}
    assert "held" in finished


def test_a_grammar_that_compiles_too_long_fails_its_request_at_its_own_fault(llama_dir: Path, monkeypatch) -> None:
    """A schema whose grammar takes longer than engine.grammar_compile_timeout_s to
    compile fails its request (a 400 to its client), and it never counts as work a step
    could advance (a worker waiting for it is not stalled)."""
    core: EngineCore = LLM(str(llama_dir), grammar_compile_timeout_s=0.3).core
    core.add_request("warm", [3, 4], SamplingParams(max_tokens=1, structured_outputs=P(regex="a")))
    while core.has_unfinished():
        core.step()
    never: Future = Future()
    monkeypatch.setattr(core._resources.grammars, "compile", lambda params: never)
    core.add_request("huge", [3, 4], SamplingParams(max_tokens=4, structured_outputs=P(regex="x")))
    assert core.stats().waiting == core.stats().compiling == 1
    core.step()  # within the deadline: it waits
    time.sleep(0.35)
    with pytest.raises(RequestsFailed) as err:
        core.step()
    assert err.value.at_fault and err.value.request_ids == ["huge"] and err.value.param == "structured_outputs"
    assert "did not compile within 0.3 s (engine.grammar_compile_timeout_s)" in str(err.value)
    assert core.stats().compiling == 0
    core.abort(["huge"])
    assert not core.has_unfinished()


def _failing(core: EngineCore, monkeypatch, message: str, param: str) -> Future:
    """The next grammar compile's Future, failed only when the test says so."""
    from engine.structured.params import StructuredOutputsError

    future: Future = Future()
    monkeypatch.setattr(core._resources.grammars, "compile", lambda params: future)
    return future, StructuredOutputsError(param, message)


def test_a_grammar_that_fails_to_compile_fails_its_request_only(llama_dir: Path, monkeypatch) -> None:
    """Each failed compile is reported alone, with its own message and parameter; the
    request stays queued (never admitted) until its caller ends it, as a worker ends
    any failed request; the others go on."""
    core: EngineCore = LLM(str(llama_dir)).core
    core.add_request("warm", [3, 4], SamplingParams(max_tokens=1, structured_outputs=P(regex="a")))
    futures = {}
    for rid, param in (("bad-regex", "structured_outputs.regex"), ("bad-json", "structured_outputs.json")):
        futures[rid] = _failing(core, monkeypatch, f"is bad for {rid}", param)
        core.add_request(rid, [3, 4], SamplingParams(max_tokens=4, structured_outputs=P(regex="x")))
    core.add_request("good", [3, 5], SamplingParams(max_tokens=4, temperature=0))
    for future, error in futures.values():
        future.set_exception(error)
    reported = {}
    for _ in range(2):
        with pytest.raises(RequestsFailed) as err:
            core.step()
        assert err.value.at_fault and len(err.value.request_ids) == 1
        reported[err.value.request_ids[0]] = (err.value.param, str(err.value))
    assert reported == {"bad-regex": ("structured_outputs.regex", "structured_outputs.regex is bad for bad-regex"),
                        "bad-json": ("structured_outputs.json", "structured_outputs.json is bad for bad-json")}
    assert core.scheduler.requests["bad-regex"].num_computed_tokens == 0
    core.abort(list(reported))
    done = set()
    while core.has_unfinished():
        done |= {r.request_id for r in core.step().finished}
    assert done == {"warm", "good"} and not core.scheduler.requests


def test_a_compile_already_failed_is_refused_before_queueing(llama_dir: Path, monkeypatch) -> None:
    core: EngineCore = LLM(str(llama_dir)).core
    core.add_request("warm", [3, 4], SamplingParams(max_tokens=1, structured_outputs=P(regex="a")))
    future, error = _failing(core, monkeypatch, "cannot be compiled: no", "structured_outputs.regex")
    future.set_exception(error)
    with pytest.raises(ValueError, match="structured_outputs.regex cannot be compiled: no"):
        core.add_request("bad", [3, 4], SamplingParams(max_tokens=4, structured_outputs=P(regex="x")))
    assert "bad" not in core.scheduler.requests


def test_resumed_tokens_off_the_grammar_are_refused_before_queueing(llama_dir: Path) -> None:
    core: EngineCore = LLM(str(llama_dir)).core
    spec = P(choice=["The quick"])
    core.add_request("warm", [3, 4], SamplingParams(max_tokens=1, structured_outputs=spec))
    core._resources.grammars.compile(spec).result(timeout=30)  # compiled: judged at once
    with pytest.raises(ValueError, match="does not follow the request's grammar"):
        core.add_request("again", [3, 4, 5, 6], SamplingParams(max_tokens=4, structured_outputs=spec), resumed=2)
    assert "again" not in core.scheduler.requests


def test_the_offline_api_refuses_a_bad_grammar_before_running(llama_dir: Path) -> None:
    llm = LLM(str(llama_dir))
    with pytest.raises(ValueError, match=r"structured_outputs.json cannot be compiled: Unsupported type"):
        llm.generate(["hi", "there"], [SamplingParams(), SamplingParams(structured_outputs=P(json={"type": "x"}))])
    assert not llm.core.has_unfinished()
