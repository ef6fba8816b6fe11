"""A StructuredOutputsParams as an xgrammar Grammar (no tokenizer needed yet).

Workaround (xgrammar 0.2.9): a JSON-schema string with minLength or maxLength is
converted to a character class `[^"\\\r\n]`, which admits raw control characters such
as a tab, so the output could fail json.loads (JSON forbids them unescaped). Such a
class is rewritten to exclude every control character before the grammar is built;
inside length-bounded strings that also means no escape sequences, which keeps the
output valid JSON at the cost of never producing an escaped character there.
"""

from __future__ import annotations

import json
from typing import Any

import xgrammar as xgr

from engine.structured.params import StructuredOutputsError, StructuredOutputsParams
from engine.structured.schema_check import unenforced_keyword

_LOOSE_CHARS = '[^\\"\\\\\\r\\n]'  # as the converter writes it in EBNF
_STRICT_CHARS = '[^\\0-\\x1f\\"\\\\]'


def build_grammar(params: StructuredOutputsParams) -> xgr.Grammar:
    """Raises StructuredOutputsError naming structured_outputs.<kind> when xgrammar
    refuses the description (an unsupported schema, a bad regex or EBNF)."""
    kind = params.kind
    # The one field set, as the params' construction left it: JSON text for json and
    # structural_tag (dicts are dumped), a string for regex and grammar, strings for choice.
    value: Any = getattr(params, kind)
    try:
        compact = bool(params.disable_any_whitespace)
        if kind == "json":
            return json_schema_grammar(value, compact)
        if kind == "json_object":  # an object, not any JSON value (xgrammar's builtin JSON grammar)
            return json_schema_grammar('{"type": "object"}', compact)
        if kind == "regex":
            return xgr.Grammar.from_regex(value)
        if kind == "choice":
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(map(ebnf_literal, value)))
        if kind == "grammar":
            return xgr.Grammar.from_ebnf(value)
        return structural_tag_grammar(value)
    except StructuredOutputsError:
        raise
    except (RuntimeError, ValueError, TypeError, KeyError) as exc:
        raise StructuredOutputsError(f"structured_outputs.{kind}", f"cannot be compiled: {_reason(exc)}") from None


def json_schema_grammar(schema: str, compact: bool = False) -> xgr.Grammar:
    """compact: one space after `,` and `:`, none elsewhere."""
    try:
        parsed = json.loads(schema)
    except ValueError as exc:
        raise StructuredOutputsError("structured_outputs.json", f"is not valid JSON: {exc}") from None
    if not isinstance(parsed, (dict, bool)):
        raise StructuredOutputsError("structured_outputs.json", f"must be a JSON schema (an object), "
                                                                f"got {type(parsed).__name__}")
    unenforced = unenforced_keyword(parsed)
    if unenforced:
        raise StructuredOutputsError("structured_outputs.json", f"uses {unenforced}, which pdserve's grammar "
                                                                "engine (xgrammar) cannot enforce")
    grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=not compact)
    ebnf = str(grammar)
    if _LOOSE_CHARS not in ebnf:
        return grammar
    return xgr.Grammar.from_ebnf(ebnf.replace(_LOOSE_CHARS, _STRICT_CHARS))


def structural_tag_grammar(tag: str) -> xgr.Grammar:
    """xgrammar's structural tag; also vLLM's older form {"structures": [{"begin",
    "schema", "end"}], "triggers": [...]}."""
    try:
        parsed = json.loads(tag)
    except ValueError as exc:
        raise StructuredOutputsError("structured_outputs.structural_tag", f"is not valid JSON: {exc}") from None
    if isinstance(parsed, dict) and "structures" in parsed:
        for i, s in enumerate(parsed["structures"]):
            unenforced = unenforced_keyword(s.get("schema", {}), f"#/structures/{i}/schema")
            if unenforced:
                raise StructuredOutputsError("structured_outputs.structural_tag",
                                             f"uses {unenforced}, which xgrammar cannot enforce")
        items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s.get("schema", {})), end=s["end"])
                 for s in parsed["structures"]]
        return xgr.Grammar.from_structural_tag(items, list(parsed.get("triggers", [])))
    return xgr.Grammar.from_structural_tag(tag)


def ebnf_literal(text: str) -> str:
    """A quoted EBNF string matching exactly `text`."""
    out = []
    for ch in text:
        code = ord(ch)
        if ch in '"\\' or code < 0x20 or code > 0x7E:
            out.append(f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _reason(exc: Exception) -> str:
    """xgrammar's message without its C++ source location prefix."""
    text = str(exc).strip()
    if text.startswith("[") and ": " in text:
        parts = text.split(": ", 1)
        if "/" in parts[0] or ".cc" in parts[0]:
            text = parts[1]
    return text.splitlines()[0] if text else type(exc).__name__
