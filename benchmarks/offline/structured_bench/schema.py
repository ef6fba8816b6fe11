"""The benchmark's JSON schema (20 fields: mixed types, a nested object, enums, bounds)
and one document valid against it, whose tokens put matchers at real positions."""

from __future__ import annotations

import json
from typing import Any

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 1000000},
        "name": {"type": "string", "minLength": 1, "maxLength": 40},
        "email": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "height_m": {"type": "number", "minimum": 0.3, "maximum": 2.7},
        "active": {"type": "boolean"},
        "role": {"enum": ["admin", "editor", "viewer", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "scores": {"type": "array", "items": {"type": "number"}, "minItems": 1, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                "country": {"enum": ["US", "DE", "FR", "JP"]},
            },
            "required": ["street", "city", "zip", "country"],
            "additionalProperties": False,
        },
        "phone": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
        "notes": {"type": "string", "maxLength": 200},
        "manager_id": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
        "priority": {"enum": ["low", "medium", "high"]},
        "verified": {"type": "boolean"},
        "balance": {"type": "number"},
        "language": {"type": "string", "enum": ["en", "de", "fr"]},
        "joined": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
        "metadata": {
            "type": "object",
            "properties": {"source": {"type": "string"}, "version": {"type": "integer"}},
            "required": ["source", "version"],
        },
    },
    "additionalProperties": False,
}
SCHEMA["required"] = list(SCHEMA["properties"])

DOCUMENT: dict[str, Any] = {
    "id": 4711, "name": "Ada Lovelace", "email": "ada@example.org", "age": 36, "height_m": 1.65,
    "active": True, "role": "editor", "tags": ["math", "engines"], "scores": [9.5, 8.25],
    "address": {"street": "12 St James's Square", "city": "London", "zip": "12345", "country": "DE"},
    "phone": None, "rating": 5, "notes": "Wrote the first published program for the Analytical Engine.",
    "manager_id": 12, "priority": "high", "verified": False, "balance": -12.5, "language": "en",
    "joined": "1843-07-01", "metadata": {"source": "archive", "version": 3},
}


def schema_text() -> str:
    return json.dumps(SCHEMA)


def document_text() -> str:
    """The document as xgrammar's JSON-schema grammar accepts it (its default separators)."""
    return json.dumps(DOCUMENT, separators=(", ", ": "))
