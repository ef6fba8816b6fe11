"""Small checks shared by the validated request-side dataclasses (SamplingParams,
StructuredOutputsParams)."""

from __future__ import annotations

from typing import Any


def encodable(text: str) -> bool:
    """Valid Unicode: JSON may carry lone UTF-16 surrogates, which nothing downstream
    (tokenizer, msgpack) can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def show(value: Any, limit: int = 60) -> str:
    """repr of a user's value, cut short (it is echoed in an HTTP error)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
