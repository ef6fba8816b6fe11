"""Type checks of config dataclass fields, driven by the fields' annotations.

Values come from YAML files and keyword options, where `"512"` or `"false"` is easy to
write by mistake and Python would carry it on (`"false"` is true). One checker reads
each field's annotation, so a new field is checked the day it is added. Supported:
bool, int, float, str, Any, `X | None`, `dict[str, X]`; a field annotated with a
dataclass is a nested section that checks itself. Any other annotation is a
programming error (TypeError), so that no field goes unchecked by accident.

bool is not an int here (YAML's `true` is not a block count), while an int is a valid
float (`timeout_s: 5`).
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Mapping
from typing import Any

_SCALARS: dict[type, str] = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


class FieldTypeError(ValueError):
    """A value whose type does not match its field's annotation. `path` names it from
    the dataclass down ("max_num_seqs", "resources.gpu_node"), `message` says what was
    expected and what came ("must be an integer, got '512'")."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path
        self.message = message


def check_field_types(cls: type, values: Mapping[str, Any]) -> None:
    """Raise FieldTypeError for the first of `values` (field name -> value) whose type
    does not match dataclass cls's annotation of that field. Names that are not fields
    of cls are the caller's to refuse."""
    hints = _field_hints(cls)
    for name, value in values.items():
        if name in hints:
            _check(hints[name], value, name)


def check_instance_types(obj: Any) -> None:
    """check_field_types for every field of a dataclass instance (from __post_init__)."""
    check_field_types(type(obj), {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)})


@functools.cache
def _field_hints(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _check(annotation: Any, value: Any, path: str) -> None:
    if annotation is Any or (isinstance(annotation, type) and dataclasses.is_dataclass(annotation)):
        return
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        if len(options) != 1 or len(args) != 2:
            raise TypeError(f"{path}: unsupported annotation {annotation!r} (only X | None)")
        if value is not None:  # null is valid; a wrong value is told the type alone
            _check(options[0], value, path)
        return
    if origin is dict or annotation is dict:
        key_type, value_type = args or (str, Any)
        if key_type is not str:
            raise TypeError(f"{path}: unsupported annotation {annotation!r} (only string keys)")
        if not isinstance(value, dict):
            raise FieldTypeError(path, f"must be a mapping, got {value!r}")
        for key, item in value.items():
            if not isinstance(key, str):
                raise FieldTypeError(path, f"keys must be strings, got {key!r}")
            _check(value_type, item, f"{path}.{key}")
        return
    if annotation not in _SCALARS:
        raise TypeError(f"{path}: unsupported annotation {annotation!r}")
    if not _is_instance(value, annotation):
        raise FieldTypeError(path, f"must be {_SCALARS[annotation]}, got {value!r}")


def _is_instance(value: Any, scalar: type) -> bool:
    if scalar in (int, float) and isinstance(value, bool):
        return False
    return isinstance(value, (int, float) if scalar is float else scalar)
