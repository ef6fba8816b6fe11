"""Structured outputs for the fuzzers: a catalog of constraints (JSON schemas, regexes,
choices, small EBNF grammars) that can end within a few tokens, and the check that a
request its grammar ended obeys it (tests/fuzz/cases.py's add_structured draws them onto
a case's requests).

A constraint travels in ReqSpec.params["structured_outputs"] as its wire form (a dict,
JSON-serialisable, so a dumped case replays); every description here is ASCII, which the
tiny model's byte-level vocabulary can always express.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from typing import Any

EOS_TOKEN_IDS = frozenset({1})  # tests/tiny_models.py's "</s>": the one token a completed grammar allows

_OBJECT = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                            "b": {"enum": ["x", "yy"]}},
           "required": ["a", "b"], "additionalProperties": False}
_NESTED = {"type": "object", "properties": {"o": {"type": "object", "properties": {"k": {"type": "boolean"}},
                                                  "required": ["k"], "additionalProperties": False},
                                            "n": {"type": "array", "items": {"type": "integer"}, "maxItems": 2}},
           "required": ["o"], "additionalProperties": False}

# Each a wire-form structured_outputs dict. The json ones keep their schema as a dict.
JSON_SCHEMAS: list[dict[str, Any]] = [
    {"type": "boolean"},
    {"type": "integer", "minimum": -20, "maximum": 300},
    {"type": "number", "minimum": 0, "maximum": 1},
    {"enum": ["red", "green", "blue", 7, None]},
    {"type": "string", "maxLength": 3},  # the engine's minLength/maxLength workaround
    {"type": "string", "enum": ["on", "off"]},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3},
    _OBJECT,
    _NESTED,
    {"type": "object", "properties": {"s": {"type": "string", "minLength": 1, "maxLength": 2}}, "required": ["s"]},
]
REGEXES = [r"(yes|no)", r"[a-d]{1,3}", r"[0-9]{2}-[xyz]", r"(ab)+c?", r"-?[1-9][0-9]?", r"[A-Z][a-z]{0,2}\.",
           r"(true|false|null)"]
CHOICES = [["yes", "no"], ["a", "bb", "ccc"], [" the", "quick brown fox", "{}"], ["1", "12", "123"]]
# EBNF (xgrammar's dialect) -> an equivalent Python regular expression, to check its output.
GRAMMARS: dict[str, str] = {
    'root ::= "(" num ("," num)? ")"\nnum ::= [0-9] | [1-9] [0-9]': r"\((?:[0-9]|[1-9][0-9])(?:,(?:[0-9]|[1-9][0-9]))?\)",
    'root ::= ("a" | "b") ("a" | "b")? "."': r"[ab][ab]?\.",
    'root ::= word (" " word)?\nword ::= "hi" | "yo" | [x-z]': r"(?:hi|yo|[x-z])(?: (?:hi|yo|[x-z]))?",
}


def draw_constraint(rng: random.Random) -> dict[str, Any]:
    """One structured_outputs dict (its wire form)."""
    kind = rng.choice(("json", "json", "json", "regex", "regex", "choice", "grammar", "json_object"))
    if kind == "json":
        return {"json": rng.choice(JSON_SCHEMAS)}
    if kind == "regex":
        return {"regex": rng.choice(REGEXES)}
    if kind == "choice":
        return {"choice": list(rng.choice(CHOICES))}
    if kind == "grammar":
        return {"grammar": rng.choice(sorted(GRAMMARS))}
    return {"json_object": True}


# ----------------------------------------------------------------------------- checks

def violation(params: dict[str, Any], tokens: list[int], text_of: Callable[[list[int]], str]) -> str:
    """Why a request that finished "stop" breaks its constraint ("" when it does not).

    Only a stop its grammar made is checked in full: such a stop ends on an EOS token
    (the one token a completed grammar allows), and the text before it must obey the
    constraint. A stop on one of the request's stop tokens or stop strings ends it
    anywhere (as in vLLM); any other stop is a violation."""
    so = params.get("structured_outputs")
    if so is None:
        return ""
    if not tokens or tokens[-1] not in EOS_TOKEN_IDS:
        if (tokens and tokens[-1] in params.get("stop_token_ids", ())) or params.get("stop"):
            return ""
        return f"finished stop without its grammar's end (last token {tokens[-1] if tokens else None})"
    if EOS_TOKEN_IDS & set(tokens[:-1]):
        return "an EOS token inside its output"
    text = text_of(tokens[:-1])
    kind, want = next(iter(so.items()))
    if kind == "json" or kind == "json_object":
        try:
            value = json.loads(text)
        except ValueError as exc:
            return f"{text!r} is not JSON: {exc}"
        if kind == "json_object":
            return "" if isinstance(value, dict) else f"{text!r} is not a JSON object"
        import jsonschema

        try:
            jsonschema.validate(value, want if isinstance(want, dict) else json.loads(want))
        except jsonschema.ValidationError as exc:
            return f"{text!r} does not validate: {exc.message}"
        return ""
    if kind == "regex":
        return "" if re.fullmatch(want, text) else f"{text!r} does not fullmatch {want!r}"
    if kind == "choice":
        return "" if text in want else f"{text!r} is not one of {want}"
    if kind == "grammar":
        pattern = GRAMMARS.get(want)
        if pattern is None:
            return ""  # a grammar of a hand-written case: no regular equivalent to check with
        return "" if re.fullmatch(pattern, text) else f"{text!r} does not follow {want!r}"
    return ""
