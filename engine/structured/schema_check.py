"""JSON-schema keywords xgrammar 0.2.9 accepts but does not enforce: a schema that uses
one is refused, naming it and where, rather than served with output that may break it
(vLLM's xgrammar backend refuses such schemas too)."""

from __future__ import annotations

from typing import Any

# Each: a way to tell whether this use of the keyword would go unenforced.
_UNENFORCED = {
    "not": lambda v: True, "if": lambda v: True, "then": lambda v: True, "else": lambda v: True,
    "dependentRequired": lambda v: bool(v), "dependentSchemas": lambda v: bool(v),
    "dependencies": lambda v: bool(v), "uniqueItems": lambda v: v is True, "contains": lambda v: True,
    "minContains": lambda v: True, "maxContains": lambda v: True,
    "allOf": lambda v: isinstance(v, list) and len(v) > 1,
}
# Keys whose values map names to schemas (the names are not keywords).
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
# Keys whose values are data, not schemas.
_DATA = ("enum", "const", "default", "examples")


def unenforced_keyword(schema: Any, where: str = "#") -> str | None:
    """'`keyword` at <JSON pointer>' for the first keyword xgrammar would not enforce; None if
    there is none."""
    if isinstance(schema, list):
        for i, item in enumerate(schema):
            found = unenforced_keyword(item, f"{where}/{i}")
            if found:
                return found
        return None
    if not isinstance(schema, dict):
        return None
    for key, value in schema.items():
        if key in _UNENFORCED and _UNENFORCED[key](value):
            return f"`{key}` at {where}"
    for key, value in schema.items():
        if key in _DATA or key in _UNENFORCED:
            continue
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            found = next((f for name, sub in value.items()
                          if (f := unenforced_keyword(sub, f"{where}/{key}/{name}"))), None)
        else:
            found = unenforced_keyword(value, f"{where}/{key}")
        if found:
            return found
    return None
