"""StructuredOutputsParams, grammar building (with the minLength workaround), the compile
pool and its cache, and the bitmask kernels."""

from __future__ import annotations

import json
import threading
from concurrent.futures import Future

import pytest
import torch
import xgrammar as xgr

from engine.sampling_params import SamplingParams, SamplingParamsError
from engine.structured.bitmask import BitmaskBuffer
from engine.structured.compiler import GrammarCompiler
from engine.structured.grammar import build_grammar, ebnf_literal
from engine.structured.matcher import GrammarState
from engine.structured.params import StructuredOutputsError
from engine.structured.params import StructuredOutputsParams as P
from protocol.sampling import from_wire, to_wire
from protocol.wire import encode
from protocol.worker import WORKER_MESSAGES, Generate


@pytest.mark.parametrize("value, param, problem", [
    ({}, "structured_outputs", "must set exactly one of json, regex, choice, grammar, json_object, "
                               "structural_tag; got none"),
    ({"regex": "a", "json": {}}, "structured_outputs", "got json, regex"),
    ({"regex": ""}, "structured_outputs.regex", "must be a non-empty string"),
    ({"choice": ["a", 1]}, "structured_outputs.choice", "must be a non-empty list of non-empty strings"),
    ({"json": 5}, "structured_outputs.json", "must be an object or its JSON text"),
    ({"json_object": "yes"}, "structured_outputs.json_object", "must be a boolean"),
    ({"grammar": "root ::= \"\ud800\""}, "structured_outputs.grammar", "is not valid Unicode"),
    ({"guided_json": {}}, "structured_outputs.guided_json", "is not supported"),
    ("json", "structured_outputs", "must be an object with one of"),
])
def test_bad_descriptions_name_their_key(value, param: str, problem: str) -> None:
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams(structured_outputs=value)
    assert err.value.param == param and problem in err.value.problem


def test_a_description_crosses_the_wire_as_it_is() -> None:
    for spec in (P(json={"type": "object", "properties": {"b": {}, "a": {}}}), P(regex="[0-9]+"),
                 P(choice=["x", "y"]), P(grammar='root ::= "a"'), P(json_object=True),
                 P(json_object=True, disable_any_whitespace=True),
                 P(structural_tag={"type": "structural_tag", "format": {"type": "const_string", "value": "x"}})):
        params = SamplingParams(structured_outputs=spec)
        msg = WORKER_MESSAGES.decode(encode(Generate(request_id="r", prompt=[1], params=to_wire(params),
                                                     remote=False, resumed=0)))
        assert from_wire(msg.params).structured_outputs == spec
    # Property order is the schema's: it decides the order of the generated keys.
    assert list(json.loads(P(json={"b": 1, "a": 2}).json)) == ["b", "a"]


@pytest.mark.parametrize("spec, key", [
    (P(regex="a(b"), "structured_outputs.regex"),
    (P(json={"type": "foo"}), "structured_outputs.json"),
    (P(json="{not json"), "structured_outputs.json"),
    (P(grammar="root ::= missing"), "structured_outputs.grammar"),
    (P(structural_tag={"type": "nope"}), "structured_outputs.structural_tag"),
])
def test_what_xgrammar_refuses_is_an_error_naming_the_key(spec: P, key: str) -> None:
    with pytest.raises(StructuredOutputsError) as err:
        build_grammar(spec)
    assert err.value.param == key and "cc:" not in str(err.value)  # no C++ source location


def _matches(grammar: xgr.Grammar, text: str) -> bool:
    """Does the grammar accept exactly `text` (byte-level, no tokenizer)?"""
    info = xgr.TokenizerInfo([chr(c) for c in range(32, 127)] + ["\t", "\n", "\x01"])
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_grammar(grammar),
                                 terminate_without_stop_token=True)
    return matcher.accept_string(text) and matcher.is_completed()


def test_length_bounded_strings_admit_no_raw_control_character() -> None:
    """xgrammar 0.2.9 lets a tab into a string with minLength/maxLength, which json.loads
    refuses; build_grammar closes that (ENVIRONMENT.md)."""
    schema = {"type": "object", "properties": {"s": {"type": "string", "minLength": 2, "maxLength": 5}},
              "required": ["s"]}
    loose = xgr.Grammar.from_json_schema(json.dumps(schema))
    assert _matches(loose, '{"s": "a\tb"}')  # the upstream bug, still there: else drop the workaround
    fixed = build_grammar(P(json=schema))
    assert not _matches(fixed, '{"s": "a\tb"}') and not _matches(fixed, '{"s": "a\x01b"}')
    assert _matches(fixed, '{"s": "ab"}') and not _matches(fixed, '{"s": "a"}')
    assert not _matches(fixed, '{"s": "abcdef"}')


def test_json_object_means_an_object_and_compact_json_has_no_free_whitespace() -> None:
    assert _matches(build_grammar(P(json_object=True)), '{ "a" :\n [1, {"b": null}] }')
    assert not _matches(build_grammar(P(json_object=True)), "[1, 2]")
    compact = build_grammar(P(json={"type": "object", "properties": {"a": {"type": "integer"}}},
                              disable_any_whitespace=True))
    assert _matches(compact, '{"a": 1}') and not _matches(compact, '{ "a": 1}')
    assert P(json_object=True).key != P(json_object=True, disable_any_whitespace=True).key


def test_choices_and_regexes_match_exactly_their_strings() -> None:
    choices = ['say "hi"', "back\\slash", "tab\there", "é", "🙂"]
    grammar = build_grammar(P(choice=choices))
    for c in choices:
        assert _matches(grammar, c) or not c.isascii()  # the test vocabulary is ASCII
    assert not _matches(grammar, "say hi") and not _matches(grammar, "")
    assert ebnf_literal('a"\\') == '"a\\u0022\\u005c"'
    regex = build_grammar(P(regex=r"(yes|no)[0-9]{2}"))
    assert _matches(regex, "yes42") and not _matches(regex, "yes4") and not _matches(regex, "maybe")


def test_legacy_structural_tags_are_understood() -> None:
    tag = {"type": "structural_tag", "triggers": ["<f="],
           "structures": [{"begin": "<f=add>", "schema": {"type": "object", "properties": {"a": {"type": "integer"}},
                                                         "required": ["a"]}, "end": "</f>"}]}
    grammar = build_grammar(P(structural_tag=tag))
    assert _matches(grammar, 'free text <f=add>{"a": 1}</f> more')
    assert not _matches(grammar, 'free text <f=add>{"a": "x"}</f>')


@pytest.fixture(scope="module")
def compiler(llama_dir) -> GrammarCompiler:
    return GrammarCompiler(str(llama_dir), 384, [1])


def test_the_compile_cache_shares_one_future_per_grammar(compiler: GrammarCompiler) -> None:
    a = compiler.compile(P(regex="[ab]+"))
    assert compiler.compile(P(regex="[ab]+")) is a
    assert compiler.compile(P(regex="[abc]+")) is not a
    assert isinstance(a.result(timeout=30), xgr.CompiledGrammar)


def test_a_failed_compile_is_not_cached(compiler: GrammarCompiler) -> None:
    bad = compiler.compile(P(regex="a(b"))
    assert isinstance(bad.exception(timeout=30), StructuredOutputsError)
    assert compiler.compile(P(regex="a(b")) is not bad


def test_compiles_run_off_the_calling_thread(compiler: GrammarCompiler, monkeypatch) -> None:
    started, release = threading.Event(), threading.Event()
    real = compiler._compile

    def slow(params):
        started.set()
        release.wait(30)
        return real(params)
    monkeypatch.setattr(compiler, "_compile", slow)
    future = compiler.compile(P(regex="slow[0-9]"))  # returns at once
    assert started.wait(30) and not future.done()
    release.set()
    assert future.result(timeout=30) is not None


def test_resumed_tokens_are_accepted_before_anything_is_masked(compiler: GrammarCompiler, llama_dir) -> None:
    from engine.tokenizer import load_tokenizer

    tok = load_tokenizer(str(llama_dir))
    done: Future = compiler.compile(P(regex="abc[0-9]"))
    state = GrammarState(done, tok.encode("ab", add_special_tokens=False))
    done.result(timeout=30)
    assert state.ready() and not state.matcher.is_completed()
    assert state.accept(tok.encode("c", add_special_tokens=False)[0])
    bad = GrammarState(done, tok.encode("x", add_special_tokens=False))
    with pytest.raises(ValueError, match="does not follow the request's grammar"):
        bad.ready()


def _random_masks(batch: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    words = (vocab + 31) // 32
    return torch.randint(-2**31, 2**31 - 1, (batch, words), generator=g, dtype=torch.int64).to(torch.int32)


def _expected(logits: torch.Tensor, masks: torch.Tensor, rows: list[int]) -> torch.Tensor:
    out = logits.clone()
    vocab = logits.shape[1]
    bits = (masks.to(torch.int64).unsqueeze(-1) >> torch.arange(32)) & 1
    allowed = bits.flatten(1)[:, :vocab].bool()
    for r in rows:
        out[r][~allowed[r]] = float("-inf")
    return out


@pytest.mark.parametrize("vocab", [100, 1024, 1500])
def test_the_triton_kernel_masks_exactly_the_forbidden_tokens(vocab: int) -> None:
    from engine.kernels.bitmask import apply_bitmask_triton

    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(vocab))
    masks = _random_masks(5, vocab, vocab)
    rows = [0, 3, 4]
    got = logits.clone()
    apply_bitmask_triton(got, masks, torch.tensor(rows))
    assert torch.equal(got, _expected(logits, masks, rows))
    cpu = logits.clone()  # and xgrammar's CPU kernel, which the CPU path uses, agrees
    xgr.apply_token_bitmask_inplace(cpu, masks, vocab_size=vocab, indices=rows)
    assert torch.equal(cpu, got)


class _Fixed:
    """A GrammarState stand-in whose mask is a fixed allowed set."""

    def __init__(self, allowed: list[int]) -> None:
        self.allowed = allowed

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = 0
        for t in self.allowed:
            word = int(bitmask[row, t // 32]) | (1 << (t % 32))
            bitmask[row, t // 32] = word - 2**32 if word >= 2**31 else word


def test_the_buffer_masks_only_the_constrained_rows_and_grows() -> None:
    buffer = BitmaskBuffer()
    for batch in (2, 20):
        logits = torch.zeros(batch, 70)
        buffer.apply(logits, [_Fixed([1, 31, 63, 69])], [1])
        assert torch.isfinite(logits[0]).all()
        assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [1, 31, 63, 69]


@pytest.mark.parametrize("schema, where", [
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "`uniqueItems` at #"),
    ({"type": "array", "contains": {"const": 7}}, "`contains` at #"),
    ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "`not` at #/properties/a"),
    ({"type": "object", "if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]}}, "`if` at #"),
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, "`dependentRequired` at #"),
    ({"$defs": {"X": {"allOf": [{"type": "integer"}, {"minimum": 3}]}}, "$ref": "#/$defs/X"}, "`allOf` at #/$defs/X"),
])
def test_keywords_xgrammar_would_not_enforce_are_refused_by_name(schema: dict, where: str) -> None:
    """xgrammar 0.2.9 compiles these but lets output that breaks them through."""
    with pytest.raises(StructuredOutputsError) as err:
        build_grammar(P(json=schema))
    assert err.value.param == "structured_outputs.json" and where in str(err.value)


def test_keyword_names_as_property_names_or_data_are_fine() -> None:
    schema = {"type": "object", "properties": {"not": {"type": "string"}, "if": {"enum": [{"not": 1}]},
                                               "one": {"allOf": [{"type": "integer"}]}},
              "required": ["not"]}
    assert _matches(build_grammar(P(json=schema)), '{"not": "x"}')
