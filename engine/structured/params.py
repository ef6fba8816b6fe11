"""What a request's output must follow: vLLM's StructuredOutputsParams (its field names),
checked at construction. Pure Python: the router and the wire use it without xgrammar."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from engine.user_values import encodable, show

# The keys, in the order a description names the one that is set.
KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


class StructuredOutputsError(ValueError):
    """A bad structured-outputs description; `param` names the key
    ("structured_outputs.regex"). Message: f"{param} {problem}", as SamplingParamsError."""

    def __init__(self, param: str, problem: str) -> None:
        super().__init__(f"{param} {problem}")
        self.param, self.problem = param, problem


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one constraint:

    - json: a JSON schema (a dict, or its JSON text); the output is one JSON value valid
      against it.
    - regex: the whole output matches this regular expression.
    - choice: the output is exactly one of these strings.
    - grammar: an EBNF grammar (xgrammar's dialect, GBNF-like, start rule `root`).
    - json_object: True: any JSON object (OpenAI's response_format json_object).
    - structural_tag: xgrammar's structural tag (a dict or its JSON text): free text in
      which, after a trigger, tagged segments follow their schemas.

    disable_any_whitespace (json, json_object): JSON with no whitespace beyond one space
    after each `,` and `:` (else any amount is allowed between tokens, as JSON allows).

    Dicts are kept as their JSON text, so the description is hashable and crosses the
    wire as it is. Whether the grammar compiles is found when it is built
    (engine/structured/grammar.py), not here.
    """

    json: str | dict | bool | None = None
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        set_keys = [k for k in KINDS if getattr(self, k) is not None and not (k == "json_object"
                                                                             and getattr(self, k) is False)]
        if len(set_keys) != 1:
            got = ", ".join(set_keys) if set_keys else "none"
            raise StructuredOutputsError("structured_outputs", f"must set exactly one of {', '.join(KINDS)}; "
                                                               f"got {got}")
        for key in ("json", "structural_tag"):
            value = getattr(self, key)
            if isinstance(value, dict) or (key == "json" and isinstance(value, bool)):  # true: any JSON value
                object.__setattr__(self, key, _dumps(key, value))
            elif value is not None and not isinstance(value, str):
                raise StructuredOutputsError(f"structured_outputs.{key}",
                                             f"must be an object or its JSON text, got {show(value)}")
        for key in ("regex", "grammar"):
            value = getattr(self, key)
            if value is not None and not (isinstance(value, str) and value):
                raise StructuredOutputsError(f"structured_outputs.{key}", f"must be a non-empty string, "
                                                                          f"got {show(value)}")
        if self.choice is not None:
            ok = (isinstance(self.choice, (list, tuple)) and self.choice
                  and all(isinstance(c, str) and c for c in self.choice))
            if not ok:
                raise StructuredOutputsError("structured_outputs.choice",
                                             f"must be a non-empty list of non-empty strings, got {show(self.choice)}")
            object.__setattr__(self, "choice", tuple(self.choice))
        for key in ("json_object", "disable_any_whitespace"):
            if getattr(self, key) not in (None, True, False):
                raise StructuredOutputsError(f"structured_outputs.{key}",
                                             f"must be a boolean, got {show(getattr(self, key))}")
        for key in KINDS:
            value = getattr(self, key)
            texts = value if isinstance(value, tuple) else [value]
            if any(isinstance(t, str) and not encodable(t) for t in texts):
                raise StructuredOutputsError(f"structured_outputs.{key}",
                                             "is not valid Unicode (it has a lone surrogate)")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) is not None and getattr(self, k) is not False)

    @property
    def key(self) -> tuple[str, str, bool]:
        """What identifies the compiled grammar (the compile cache's key)."""
        value = getattr(self, self.kind)
        if isinstance(value, tuple):
            value = json.dumps(list(value))
        return self.kind, "" if value is True else value, bool(self.disable_any_whitespace)

    @classmethod
    def of(cls, value: Any) -> StructuredOutputsParams:
        """From an instance, or a dict of its fields (its wire and HTTP form); unknown
        keys are refused by name."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise StructuredOutputsError("structured_outputs", f"must be an object with one of "
                                                               f"{', '.join(KINDS)}, got {show(value)}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(k for k in value if k not in known)
        if unknown:
            raise StructuredOutputsError(f"structured_outputs.{unknown[0]}",
                                         f"is not supported (known keys: {', '.join(KINDS)})")
        return cls(**{k: v for k, v in value.items() if v is not None})

    def to_dict(self) -> dict[str, Any]:
        """The wire form: the one key that is set."""
        value = getattr(self, self.kind)
        out = {self.kind: list(value) if isinstance(value, tuple) else value}
        if self.disable_any_whitespace:
            out["disable_any_whitespace"] = True
        return out


def _dumps(key: str, value: dict | bool) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError) as exc:
        raise StructuredOutputsError(f"structured_outputs.{key}", f"is not JSON-serialisable: {exc}") from None
