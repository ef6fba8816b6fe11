"""Structured outputs with speculative decoding: greedy constrained outputs equal the
plain engine's token for token and obey their grammar, whatever the drafts (n-grams,
always right, always wrong, a stop token); drafts the grammar refuses are cut before
the step (GrammarState.num_valid) and never verified; the row after a draft is masked
as if the draft were accepted (GrammarState.after); sampled constrained outputs stay
valid."""

from __future__ import annotations

from collections import Counter
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import LLM, SamplingParams
from engine.speculative import speculator as speculator_module
from engine.structured.compiler import GrammarCompiler
from engine.structured.matcher import GrammarState
from engine.structured.params import StructuredOutputsParams as P
from tests.fuzz.structured import violation

EOS = 1  # tests/tiny_models.py's "</s>"
ITEMS = {"type": "object", "properties": {"items": {"type": "array", "maxItems": 6, "items": {
    "type": "object", "properties": {"id": {"type": "integer"}, "tag": {"enum": ["red", "green"]}},
    "required": ["id", "tag"], "additionalProperties": False}}}, "required": ["items"], "additionalProperties": False}
# Wire forms (violation() reads them); on the tiny random model these repeat themselves,
# so n-grams find drafts, and most end on their grammar within MAX_TOKENS.
CONSTRAINTS: list[dict[str, Any]] = [
    {"json": ITEMS}, {"json": {"type": "array", "items": {"type": "integer"}}}, {"json": {"type": "string", "maxLength": 30}},
    {"regex": r"[a-c]{5,40}"}, {"regex": r"(ab|cd)+x"}, {"choice": ["yes yes yes", "no"]},
    {"grammar": 'root ::= ("a" | "b") ("a" | "b")? "."'},
]
PROMPTS = [[7, 8, 9, 10, 11] * 4, [3, 4] * 8 + [5], list(range(20, 40))]
MAX_TOKENS = 48
CASES = [(p, c) for c in CONSTRAINTS for p in PROMPTS]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def greedy(constraint: dict[str, Any]) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, structured_outputs=constraint)


def generate(model: LLM, cases=CASES) -> list:
    return model.generate([p for p, _ in cases], [greedy(c) for _, c in cases], use_tqdm=False)


@pytest.fixture(scope="module")
def reference(llama_dir: Path) -> list:
    return generate(LLM(str(llama_dir), num_kv_blocks=128))


def spec_llm(model: Path, k: int = 4, **options) -> LLM:
    return LLM(str(model), speculative_config={"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1,
                                               "prompt_lookup_max": 3, "min_acceptance_rate": 0.0},
               **{"num_kv_blocks": 128, **options})


class Watch:
    """Records the drafts each step schedules, checking every one against its request's
    grammar at that moment (a refused draft must have been cut before the step), and
    how often num_valid cut a proposal short."""

    def __init__(self, model: LLM, monkeypatch) -> None:
        self.scheduled: Counter = Counter()
        self.refused: list[tuple[str, list[int]]] = []
        self.cut = 0
        scheduler = model.core.scheduler
        schedule = scheduler.schedule

        def watched():
            out = schedule()
            for s in out.scheduled:
                if s.draft_token_ids:
                    drafts = list(s.draft_token_ids)
                    self.scheduled.update(drafts)
                    if s.request.grammar.num_valid(drafts) != len(drafts):
                        self.refused.append((s.request.request_id, drafts))
            return out

        scheduler.schedule = watched
        num_valid = GrammarState.num_valid

        def counted(state, drafts):
            valid = num_valid(state, drafts)
            self.cut += valid < len(drafts)
            return valid

        monkeypatch.setattr(GrammarState, "num_valid", counted)


def _check(outs: list, reference: list, text_of) -> None:
    for (prompt, constraint), got, want in zip(CASES, outs, reference):
        assert (got.token_ids, got.finish_reason) == (want.token_ids, want.finish_reason), (constraint, prompt)
        if got.finish_reason == "stop":
            assert violation({"structured_outputs": constraint}, got.token_ids, text_of) == "", constraint


@pytest.mark.parametrize("options", [{}, {"max_num_batched_tokens": 8, "num_kv_blocks": 24, "block_size": 8}],
                         ids=["roomy", "budget8-preempting"])
def test_ngram_drafts_give_the_plain_engines_constrained_tokens(llama_dir: Path, reference: list, monkeypatch,
                                                                options: dict) -> None:
    model = spec_llm(llama_dir, **options)
    watch = Watch(model, monkeypatch)
    _check(generate(model), reference, model.tokenizer.decode)
    stats = model.core.speculator.stats
    assert stats.num_accepted_tokens > 0 and stats.num_draft_tokens > stats.num_accepted_tokens
    assert watch.cut > 0 and watch.refused == []
    assert sum(o.finish_reason == "stop" for o in reference) > len(CASES) // 2  # most were checked for validity
    if options:
        # Whether a grammar has compiled by the first step decides the order of admission,
        # so the first run may or may not preempt. A second run finds every grammar in the
        # compile cache: its schedule is the same each time, and it preempts.
        before = model.core.scheduler.num_preemptions
        _check(generate(model), reference, model.tokenizer.decode)
        assert model.core.scheduler.num_preemptions > before


def _oracle(cases: list, outputs: list, how: str):
    """A proposer that knows each case's plain output (its grammar's stop token last;
    one case per prompt): drafts it right, each token off by one ("wrong"), or only the
    stop token ("stop")."""
    known = {tuple(p): o.token_ids for (p, _), o in zip(cases, outputs)}

    def propose(tokens, room, *_):
        if how == "stop":
            return [EOS] * room  # the grammar keeps the first where it may end, and nothing after
        for prompt, out in known.items():
            n = len(prompt)
            if tuple(tokens[:n]) == prompt and tokens[n:] == out[:len(tokens) - n]:
                ahead = out[len(tokens) - n:][:room]
                return ahead if how == "right" else [(t + 1) % 384 for t in ahead]
        raise AssertionError("a sequence no case makes")
    return propose


@pytest.mark.parametrize("how", ["right", "wrong", "stop"])
def test_oracle_drafts_under_a_grammar(llama_dir: Path, reference: list, monkeypatch, how: str) -> None:
    """Acceptance 1 (the stop token itself accepted as a draft), acceptance 0 (most
    drafts refused by the grammar and cut), and drafts that are the stop token."""
    model = spec_llm(llama_dir, k=5)
    watch = Watch(model, monkeypatch)
    # One case per prompt at a time: the oracle tells the prompts' continuations apart.
    for constraint in CONSTRAINTS:
        cases = [(p, c) for p, c in CASES if c == constraint]
        want = [o for (_, c), o in zip(CASES, reference) if c == constraint]
        monkeypatch.setattr(speculator_module, "propose_ngram", _oracle(cases, want, how))
        for (prompt, _), got, ref in zip(cases, generate(model, cases), want):
            assert (got.token_ids, got.finish_reason) == (ref.token_ids, ref.finish_reason), (constraint, prompt)
    stats = model.core.speculator.stats
    assert watch.refused == [] and stats.num_draft_tokens > 0
    if how == "right":  # every draft accepted, stop tokens among them
        assert stats.num_accepted_tokens == stats.num_draft_tokens and watch.scheduled[EOS] > 0
    elif how == "wrong":
        assert stats.num_accepted_tokens == 0 and watch.cut > 0
    else:  # the stop token drafted wherever the grammar may end: accepted where the model ends there
        assert set(watch.scheduled) == {EOS} and 0 < stats.num_accepted_tokens < stats.num_draft_tokens


def test_sampled_constrained_outputs_with_drafts_obey_their_grammar(llama_dir: Path) -> None:
    model = spec_llm(llama_dir)
    cases = [(p, c) for p in PROMPTS[:2] for c in CONSTRAINTS]
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=i, structured_outputs=c)
              for i, (_, c) in enumerate(cases)]
    outs = model.generate([p for p, _ in cases], params, use_tqdm=False)
    stopped = [(c, o) for (_, c), o in zip(cases, outs) if o.finish_reason == "stop"]
    assert len(stopped) > len(cases) // 2
    for constraint, out in stopped:
        assert violation({"structured_outputs": constraint}, out.token_ids, model.tokenizer.decode) == "", constraint
    assert model.core.speculator.stats.num_accepted_tokens > 0


# ----------------------------------------------------------------------------- GrammarState

@pytest.fixture(scope="module")
def yes_no(llama_dir: Path) -> tuple[GrammarState, Future, list[int]]:
    """A matcher at the start of choice ["yes", "no"], its compiled grammar, and the
    tokens of "yes" (more than one)."""
    from engine.tokenizer import load_tokenizer

    compiled = GrammarCompiler(str(llama_dir), 384, [EOS]).compile(P(choice=["yes", "no"]))
    compiled.result(timeout=30)
    state = GrammarState(compiled)
    assert state.ready()
    return state, compiled, load_tokenizer(str(llama_dir)).encode("yes", add_special_tokens=False)


def mask(state: GrammarState) -> torch.Tensor:
    bits = torch.zeros(1, 12, dtype=torch.int32)  # 384 tokens
    state.fill(bits, 0)
    return bits


def test_num_valid_counts_drafts_up_to_a_refused_one_or_the_stop_token(yes_no) -> None:
    state, _, yes = yes_no
    before = mask(state)
    assert len(yes) > 1
    assert state.num_valid(yes + [EOS, 5]) == len(yes) + 1  # the stop token counts; nothing after it
    assert state.num_valid(yes[:1] + [77, *yes[1:]]) == 1
    assert state.num_valid([77]) == 0
    assert torch.equal(mask(state), before) and not state.terminated  # left where it was


def test_the_row_after_drafts_is_masked_as_if_they_were_accepted(yes_no) -> None:
    state, compiled, yes = yes_no
    before = mask(state)
    accepted = GrammarState(compiled)
    assert accepted.ready() and accepted.accept(yes[0])
    assert torch.equal(mask(state.after(yes[:1])), mask(accepted))
    assert not torch.equal(mask(accepted), before)  # the draft does change the mask
    assert (mask(state.after(yes + [EOS])) == -1).all()  # past the grammar's end: never reached, unmasked
    assert torch.equal(mask(state), before)
